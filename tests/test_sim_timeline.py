"""The simulator's timeline (``simulations.timeline``, ``patchswarm sim --timeline``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from simulations.driver import BASE_VERSION
from simulations.runner import run_strategy
from simulations.scenario import load_scenario
from simulations.timeline import Timeline, downlink_use, format_ramp, ramp

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "sim"


def test_downlink_use_spreads_each_transfer_over_its_bins():
    # 1.25 MB over 0.1 s is 100 Mbit/s; a region of two 100 Mbit downlinks
    rows = [
        {"kind": "sent", "from_region": "a", "to_region": "b", "bytes": 1_250_000,
         "start": 0.0, "end": 0.1},
        {"kind": "sent", "from_region": "b", "to_region": "b", "bytes": 1_250_000,
         "start": 0.05, "end": 0.15},
        {"kind": "sent", "from_region": "b", "to_region": "a", "bytes": 9_999_999,
         "start": 0.0, "end": 0.1},  # into another region: not counted
        {"kind": "push", "start": 0.0},
    ]
    use = downlink_use(rows, "b", 200e6, bin_s=0.1)
    assert use == [
        {"t": 0.0, "use": 0.75, "mbps": 150.0, "outside_mbps": 100.0},
        {"t": 0.1, "use": 0.25, "mbps": 50.0, "outside_mbps": 0.0},
    ]
    assert downlink_use(rows, "c", 200e6) == []


def test_ramp_sums_up_the_start_and_the_tail():
    # a region of one 100 Mbit downlink: 10 %, 50 %, 100 %, 100 %, 40 % of it per 0.1 s bin
    def sent(start, end, mbit, ct=False):
        return {"kind": "sent", "from_region": "x", "to_region": "b", "cut_through": ct,
                "bytes": round(mbit * 1e6 / 8 * (end - start)), "start": start, "end": end}

    rows = [sent(1.0, 1.1, 10, ct=True), sent(1.1, 1.2, 50), sent(1.2, 1.4, 100),
            sent(1.4, 1.5, 40)]
    use = downlink_use(rows, "b", 100e6, bin_s=0.1)
    assert [u["use"] for u in use] == [0.1, 0.5, 1.0, 1.0, 0.4]
    got = ramp(rows, "b", use, 0.1)
    assert got["first_byte_s"] == 1.0
    assert got["to_half_s"] == pytest.approx(0.1) and got["to_busy_s"] == pytest.approx(0.2)
    assert got["ramp_lost_s"] == pytest.approx(0.9 * 0.1 + 0.5 * 0.1)
    assert got["tail_s"] == pytest.approx(0.1) and got["tail_lost_s"] == pytest.approx(0.06)
    # the two transfers that started before the region was busy: 10 and 50 Mbit/s
    assert got["early_mbps"] == pytest.approx(50, abs=0.1)
    assert got["early_cut_through"] == 0.5
    assert got["early_cut_through_mbps"] == pytest.approx(10, abs=0.1)
    line = format_ramp("b", got)
    assert "90 % after 0.20 s" in line and "50 % cut-through at 10 Mbit/s" in line
    # never busy: the whole table is ramp
    slow = ramp(rows[:2], "b", downlink_use(rows[:2], "b", 100e6, bin_s=0.1), 0.1)
    assert slow["to_busy_s"] is None and slow["tail_s"] == 0
    assert "90 % after never" in format_ramp("b", slow)
    assert ramp([], "b", [], 0.1) == {} and "no transfer" in format_ramp("b", {})
    # a bin nothing came in is a bin lost, not skipped: 100 %, then 0.2 s of nothing, 100 %
    gap = [sent(2.0, 2.1, 100), sent(2.3, 2.4, 100)]
    g = ramp(gap, "b", downlink_use(gap, "b", 100e6, bin_s=0.1), 0.1, busy=0.5)
    assert g["to_busy_s"] == 0 and g["ramp_lost_s"] == 0 and g["tail_s"] == 0
    assert "50 % after 0.00 s" in format_ramp("b", g)
    lagging = [sent(2.0, 2.1, 10), sent(2.3, 2.4, 100)]
    lg = ramp(lagging, "b", downlink_use(lagging, "b", 100e6, bin_s=0.1), 0.1)
    assert lg["to_busy_s"] == pytest.approx(0.3)
    assert lg["ramp_lost_s"] == pytest.approx(0.9 * 0.1 + 2 * 0.1)


def test_a_simulated_version_timeline_adds_up():
    sc = dataclasses.replace(load_scenario(CONFIGS / "wan-3x4.toml"), versions=2)
    tl = Timeline(BASE_VERSION + 2)  # the second version: a steady-state one
    _, fig = run_strategy(sc, "patchswarm", timeline=tl)
    rows = tl.result()
    kinds = [r["kind"] for r in rows]
    assert kinds[0] == "published" and rows[0]["start"] == 0.0
    handed = next(r for r in rows if r["kind"] == "handed_off")
    assert handed["start"] == pytest.approx(sc.encode_s, abs=1e-6)
    first_push = next(r for r in rows if r["kind"] == "push")
    assert first_push["start"] >= handed["start"]
    # every node but the trainer serves it once; the last one is the version's p100
    applied = [r for r in rows if r["kind"] == "applied"]
    assert sorted(r["node"] for r in applied) == sorted(
        f"{r.name}-{i}" for r in sc.regions for i in range(r.nodes))
    p100 = fig["per_version"][1]["t_p100_s"]
    assert max(r["start"] for r in applied) == pytest.approx(p100, abs=1e-3)
    # one copy of the payload into each remote region, carried by transfers
    payload = fig["patch_bytes"]
    for region in ("r1", "r2"):
        inbound = sum(r["bytes"] for r in rows if r["kind"] == "sent"
                      and r["to_region"] == region and r["from_region"] != region)
        assert payload <= inbound <= 1.1 * payload, region
    # what its origin decided: one region_delivered per chunk per remote region at least
    chunks = -(-payload // sc.chunk_bytes)
    for region in ("r1", "r2"):
        got = {r["index"] for r in rows if r["kind"] == "region_delivered"
               and r["region"] == region}
        assert got == set(range(chunks)), region
    for r in rows:
        if r["kind"] == "sent":
            assert 0.0 <= r["start"] <= r["end"]


def test_cli_writes_the_timeline(tmp_path, capsys):
    from patchswarm.cli import main

    out = tmp_path / "out"
    rc = main(["sim", str(CONFIGS / "wan-3x4.toml"), "--out", str(out), "--quiet",
               "--timeline", "1", "--bin", "0.5"])
    assert rc == 0
    assert (out / "timeline.png").stat().st_size > 1000
    data = json.loads((out / "timeline.json").read_text())
    assert data["version"] == BASE_VERSION + 1 and data["bin_s"] == 0.5
    assert set(data["downlink_use"]) == {"r0", "r1", "r2"}
    # a 100 Mbit/s shaped region ingress, averaged over half-second bins
    outside = [b["outside_mbps"] for b in data["downlink_use"]["r1"]]
    assert max(outside) < 130 and sum(outside) * 0.5 > 0.9 * 64 * 8.39
    text = capsys.readouterr().out
    assert "region r1:" in text and "timeline.json" in text and "timeline.png" in text


def test_cli_rejects_a_version_the_scenario_does_not_publish(tmp_path, capsys):
    from patchswarm.cli import main

    rc = main(["sim", str(CONFIGS / "wan-3x4.toml"), "--out", str(tmp_path / "o"),
               "--quiet", "--timeline", "2"])
    assert rc == 1
    assert "--timeline" in capsys.readouterr().err
