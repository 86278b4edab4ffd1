"""``benchmarks/wan_timeline.py`` on logs written the way the bench keeps them: the nodes'
and the origin's records through ``node.logs.TextFormatter``, fields as the driver and the
origin core emit them (``chunk_sent``, ``chunk_received``, ``push``, ``relay_ordered``,
``region_delivered``)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from node.logs import TextFormatter

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("wan_timeline", ROOT / "benchmarks" / "wan_timeline.py")
assert _spec is not None and _spec.loader is not None
wan_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wan_timeline)

T0 = 1_796_194_300.0  # a wall time on a whole second
ORIGIN = "10.213.0.4"


def _line(node: str, at: float, event: str, **fields: object) -> str:
    rec = logging.LogRecord("patchswarm.node", logging.DEBUG, __file__, 1, event, None, None)
    rec.created, rec.msecs = at, (at % 1) * 1000
    rec.fields = fields  # type: ignore[attr-defined]
    return TextFormatter(node).format(rec)


def test_the_origins_decisions_and_the_transfers_come_out_in_time_order(tmp_path: Path) -> None:
    (tmp_path / "origin.log").write_text("\n".join([
        _line("origin", T0, "push", version=2, index=3, region="region-1", border="n1-1",
              uplink_window=2, cold=True),
        _line("origin", T0 + 0.9, "chunk_sent", peer="10.213.1.2:7400", version=2, index=3,
              started_at=T0 + 0.001, s=0.9, cut_through=False),
        _line("origin", T0 + 1.2, "region_delivered", version=2, index=3, region="region-1",
              border="n1-1", via="push", s=1.2),
        _line("origin", T0 + 1.25, "relay_ordered", version=2, index=3, region="region-2",
              border="n1-1", target="n2-0", on_arrival=False),
        _line("origin", T0 + 2.0, "push", version=3, index=0, region="region-1", border="n1-1",
              uplink_window=2, cold=False),  # another version: left out
        "a line of something else",
    ]) + "\n")
    (tmp_path / "n2-0.log").write_text(_line(
        "n2-0", T0 + 2.0, "chunk_received", peer="10.213.1.2:7400", version=2, index=3,
        state="stored", first_block_at=T0 + 1.3, s=0.7, relays=0) + "\n")
    rows = wan_timeline.timeline(tmp_path, 2, ORIGIN)
    assert [(r["kind"], r["index"]) for r in rows] == [
        ("push", 3), ("sent", 3), ("region_delivered", 3), ("relay_ordered", 3), ("received", 3)]
    assert [r["start"] for r in rows] == [0.0, 0.001, 1.2, 1.25, 1.3]
    push, sent, delivered, relay, received = rows
    assert (sent["from"], sent["to"], sent["end"]) == ("origin", "n1-1", 0.901)
    assert (received["from"], received["to"], received["end"]) == ("n1-1", "n2-0", 2.0)
    assert "window 2, cold link" in wan_timeline.row_text(push)
    assert "region region-1 has it (push, 1.2 s" in wan_timeline.row_text(delivered)
    assert "n1-1 -> n2-0" in wan_timeline.row_text(relay)
    assert "(on arrival)" not in wan_timeline.row_text(relay)


def test_wall_times_round_trip_through_the_text_formatter() -> None:
    line = _line("origin", T0 + 0.25, "push", version=2, index=0)
    stamp = line.split("Z ", 1)[0]
    assert wan_timeline.wall_time(stamp) == T0 + 0.25


def test_inlet_use_spreads_each_received_chunk_over_its_transfer() -> None:
    """One 4 MiB chunk into region 2 over 0.5 s (67 Mbit/s), one inside region 2 (left
    out), one into region 1 from the origin over the first 0.25 s: each inlet's share per
    0.25 s slice, of 100 Mbit/s."""
    mib4 = 4 * 2**20
    rows = [
        {"kind": "received", "from": "n1-0", "to": "n2-0", "start": 0.25, "end": 0.75},
        {"kind": "received", "from": "n2-0", "to": "n2-1", "start": 0.0, "end": 0.1},
        {"kind": "received", "from": "origin", "to": "n1-2", "start": 0.0, "end": 0.25},
        {"kind": "sent", "from": "origin", "to": "n1-2", "start": 0.0, "end": 0.25},
    ]
    use = wan_timeline.inlet_use(rows, 0.25, mib4, 100e6)
    half = mib4 / 2 * 8 / (0.25 * 100e6)
    assert use["2"] == [0.0, round(half, 3), round(half, 3)]
    assert use["1"] == [round(2 * half, 3)]
    assert set(use) == {"1", "2"}


def test_relay_lags_time_each_relay_from_when_it_could_have_begun() -> None:
    rows = [
        {"kind": "relay_ordered", "start": 0.0, "end": 0.0, "index": 1, "border": "n2-2",
         "target": "n1-0"},  # ordered ahead: the chunk's first block is the limit
        {"kind": "received", "from": "origin", "to": "n2-2", "index": 1, "start": 0.5, "end": 1.1},
        {"kind": "sent", "from": "n2-2", "to": "n1-0", "index": 1, "start": 0.5, "end": 1.1},
        {"kind": "received", "from": "origin", "to": "n2-2", "index": 2, "start": 1.1, "end": 1.7},
        {"kind": "relay_ordered", "start": 1.2, "end": 1.2, "index": 2, "border": "n2-2",
         "target": "n1-0"},  # ordered while it arrives: the order's trip is the limit
        {"kind": "sent", "from": "n2-2", "to": "n1-0", "index": 2, "start": 1.65, "end": 1.9},
        {"kind": "relay_ordered", "start": 1.3, "end": 1.3, "index": 3, "border": "n2-2",
         "target": "n1-0"},  # never carried out: left out
    ]
    lags = wan_timeline.relay_lags(rows)
    assert [(x["index"], x["lag"]) for x in lags] == [(1, 0.0), (2, 0.405)]
    assert lags[1]["first_block"] == 1.1 and lags[1]["began"] == 1.65


def test_last_inflow_names_each_regions_last_chunk_and_its_relays_lag() -> None:
    rows = [
        {"kind": "received", "from": "origin", "to": "n2-1", "index": 14, "start": 5.0, "end": 5.8},
        {"kind": "received", "from": "origin", "to": "n1-2", "index": 15, "start": 5.2, "end": 6.0},
        {"kind": "received", "from": "n1-2", "to": "n2-2", "index": 15, "start": 5.3, "end": 6.4},
        {"kind": "received", "from": "n2-1", "to": "n1-0", "index": 14, "start": 5.1, "end": 5.9},
        {"kind": "received", "from": "origin", "to": "n0-1", "index": 15, "start": 5.0, "end": 7.0},
    ]
    last = wan_timeline.last_inflow(rows)
    assert set(last) == {"1", "2"}  # region 0 is the origin's
    assert last["2"]["via"] == "relay" and last["2"]["lag"] == 0.4 and last["2"]["index"] == 15
    assert last["1"]["via"] == "push" and last["1"]["lag"] is None and last["1"]["end"] == 6.0


def test_last_chunk_waits_time_the_short_chunk_against_each_nodes_other_chunks(
        tmp_path: Path) -> None:
    """n1-0 stored the version's last chunk (index 2 of 3) 0.08 s after its last other one
    and was complete then; n1-1 had it first; a node of another version is left out."""
    def node(name: str, *lines: str) -> None:
        (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")

    def got(name: str, at: float, index: int, version: int = 2) -> str:
        return _line(name, at, "chunk_received", peer="10.213.1.2:7400", version=version,
                     index=index, state="stored", first_block_at=at, s=0.0, relays=0)

    node("n1-0",
         _line("n1-0", T0, "manifest_accepted", version=2, kind="patch", chunks=3),
         got("n1-0", T0 + 1.0, 0), got("n1-0", T0 + 1.5, 1), got("n1-0", T0 + 1.58, 2),
         _line("n1-0", T0 + 1.58, "version_complete", version=2))
    node("n1-1",
         _line("n1-1", T0, "manifest_accepted", version=2, kind="patch", chunks=3),
         got("n1-1", T0 + 0.1, 2), got("n1-1", T0 + 1.0, 1), got("n1-1", T0 + 1.4, 0),
         _line("n1-1", T0 + 1.4, "version_complete", version=2))
    node("n2-0",
         _line("n2-0", T0, "manifest_accepted", version=3, kind="patch", chunks=3),
         got("n2-0", T0 + 0.1, 2, version=3), got("n2-0", T0 + 0.2, 1, version=3))
    waits = wan_timeline.last_chunk_waits(tmp_path, 2)
    ms = pytest.approx  # the formatter keeps whole milliseconds
    assert waits == {"n1-0": {"chunks": 3, "last": ms(0.08, abs=2e-3), "complete": ms(0.08, abs=2e-3)},
                     "n1-1": {"chunks": 3, "last": ms(-1.3, abs=2e-3), "complete": 0.0}}
