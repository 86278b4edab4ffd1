"""End-to-end runs of the real protocol core in the simulator.

These drive ``swarm.protocol.core.NodeCore`` (no stand-in) over small fleets and
check what must hold whatever the protocol's quality: every live node gets the
payload, no run beats the flow lower bound, each remote region takes in at
least one copy, same seed gives the same report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.report import deterministic_view
from simulations.runner import run_strategy
from simulations.scenario import STRATEGIES, parse_scenario

pytest.importorskip("swarm.protocol.core", reason="protocol core not built yet")

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"


def tiny(**over):
    doc = {
        "name": "tiny",
        "seed": 3,
        "payload": {"patch": "4 MiB", "chunk": "256 KiB", "full": "8 MiB", "start_s": 1.0},
        "trainer": {"uplink_mbps": 1000},
        "defaults": {"uplink_mbps": 500, "downlink_mbps": 500, "latency_ms": 0.5},
        "regions": [{"name": "a", "nodes": 6}, {"name": "b", "nodes": 6}, {"name": "c", "nodes": 4}],
        "links": {"mbps": 1000, "latency_ms": 20},
        "max_time_s": 300,
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(doc.get(k), dict):
            doc[k] = {**doc[k], **v}
        else:
            doc[k] = v
    return parse_scenario(doc)


def check_invariants(sc, fig):
    """What holds for any protocol; the trainer's own region takes in nothing from outside."""
    assert fig["incomplete_nodes"] == 0, fig["per_version"]
    assert fig["t_p100_s"] is not None
    # no schedule beats the flow bound (the bound is a true lower bound)
    assert fig["t_p100_s"] >= fig["lower_bound_s"] * 0.999
    assert fig["t_p50_s"] <= fig["t_p90_s"] <= fig["t_p99_s"] <= fig["t_p100_s"]
    F = fig["payload_bytes"] * sc.versions
    # every region outside the trainer's site takes in at least one copy
    assert fig["cross_region_ratio"] >= 0.999
    for name, r in fig["per_region"].items():
        if name != sc.trainer_region:
            assert r["inflow_bytes"] >= F * 0.999
    assert fig["trainer_egress_bytes"] >= F


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_delivers_to_every_node(strategy):
    sc = tiny()
    _, fig = run_strategy(sc, strategy)
    check_invariants(sc, fig)
    assert fig["strategy"] == strategy
    if strategy == "full":
        assert fig["payload_bytes"] == sc.full_bytes


def test_same_seed_same_report_other_seed_other_report():
    sc = tiny(faults={"churn": 0.2, "churn_window_s": [1.0, 1.2], "downtime_s": 0.3})
    a = run_strategy(sc, "patchswarm", seed=5)[1]
    b = run_strategy(sc, "patchswarm", seed=5)[1]
    c = run_strategy(sc, "patchswarm", seed=6)[1]
    assert json.dumps(deterministic_view(a)) == json.dumps(deterministic_view(b))
    assert deterministic_view(a) != deterministic_view(c)


def test_same_seed_same_report_across_processes(tmp_path):
    """String hashing differs per process (PYTHONHASHSEED); the report must not."""
    import os
    import subprocess
    import sys

    reports = []
    for hashseed in ("1", "2"):
        out = tmp_path / hashseed
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        subprocess.run([sys.executable, "-m", "patchswarm", "sim", str(CONFIGS / "loopback-2x4.toml"),
                        "--out", str(out), "--quiet", "--no-plots"], check=True, env=env,
                       cwd=CONFIGS.parent.parent, capture_output=True, timeout=120)
        reports.append(deterministic_view(json.loads((out / "report.json").read_text())))
    assert reports[0] == reports[1]


def test_churn_every_live_node_completes():
    sc = tiny(faults={"churn": 0.25, "churn_window_s": [1.0, 1.1], "downtime_s": 0.2})
    run, fig = run_strategy(sc, "patchswarm")
    assert run.churn["left"] == round(0.25 * sc.nodes)
    assert run.churn["rejoined"] == run.churn["left"]
    check_invariants(sc, fig)


def test_leavers_that_never_return_do_not_block_completion():
    sc = tiny(faults={"churn": 0.2, "churn_window_s": [1.0, 1.1], "rejoin": False})
    _, fig = run_strategy(sc, "patchswarm")
    assert fig["live_nodes"] == sc.nodes - round(0.2 * sc.nodes)
    assert fig["incomplete_nodes"] == 0


def test_joiners_and_slow_nodes_complete():
    sc = tiny(faults={"joiners": 0.25, "churn_window_s": [1.0, 1.2],
                      "slow": {"fraction": 0.25, "factor": 0.1, "at_s": 1.0}})
    run, fig = run_strategy(sc, "patchswarm")
    assert run.churn["joined"] == 4
    assert fig["live_nodes"] == sc.nodes + 4
    check_invariants(sc, fig)


def test_loss_slows_the_fanout_but_everyone_completes():
    clean = run_strategy(tiny(), "patchswarm")[1]
    lossy = run_strategy(tiny(network={"loss": 0.02}), "patchswarm")[1]
    check_invariants(tiny(), lossy)
    assert lossy["t_p100_s"] > clean["t_p100_s"]


def test_region_cut_heals_and_completes():
    sc = tiny(faults={"cuts": [{"region": "b", "start_s": 1.0, "duration_s": 2.0}]})
    _, fig = run_strategy(sc, "patchswarm")
    assert fig["incomplete_nodes"] == 0
    # region b cannot finish before the cut heals at t=3 s (2 s after publication)
    assert fig["per_region"]["b"]["t_p100_s"] >= 2.0


def test_several_versions_in_sequence():
    sc = tiny(payload={"versions": 3})
    _, fig = run_strategy(sc, "patchswarm")
    assert [pv["completed"] for pv in fig["per_version"]] == [sc.nodes] * 3
    check_invariants(sc, fig)


def test_cli_writes_report_and_plots(tmp_path):
    from patchswarm.cli import main

    out = tmp_path / "out"
    rc = main(["sim", str(CONFIGS / "loopback-2x4.toml"), "--out", str(out), "--quiet",
               "--strategies", "patchswarm", "direct"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    for key in ("nodes", "regions", "patch_bytes", "chunk_bytes", "strategy", "t_p50_s", "t_p90_s",
                "t_p99_s", "t_p100_s", "lower_bound_s", "t_p100_over_bound", "cross_region_bytes",
                "cross_region_ratio", "trainer_egress_bytes", "per_region", "wall_s", "events"):
        assert key in rep, key
    assert set(rep["strategies"]) == {"patchswarm", "direct"}
    assert (out / "cdf.png").stat().st_size > 1000
    assert (out / "patchswarm.png").stat().st_size > 1000


def test_cli_rejects_bad_scenario(tmp_path, capsys):
    from patchswarm.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text('[payload]\npatch = "1 MiB"\n[[regions]]\nname = "a"\nnodes = -1\n')
    assert main(["sim", str(bad), "--out", str(tmp_path / "o")]) == 1
    assert "regions[0].nodes" in capsys.readouterr().err


# ------------------------------------------------- issue 11: what made reality slower


@pytest.mark.parametrize("name", ["wan-3x4", "slow-direct", "upload-bound", "lossy-long",
                                  "lossy-long-bbr", "partition-heal"])
def test_issue_11_scenarios_complete_above_their_bound(name):
    from simulations.scenario import load_scenario

    sc = load_scenario(CONFIGS / f"{name}.toml")
    _, fig = run_strategy(sc, sc.strategies[0])
    check_invariants(sc, fig)
    assert fig["t_applied_p100_s"] >= fig["t_p100_s"]
    if name == "wan-3x4":
        # the round-2 driver: control frames wait for one 256 KiB block, not a 4 MiB chunk
        assert fig["control_hol"]["max_s"] < 0.5
        assert fig["cpu_busy_s"] > 0 and fig["encode_s"] == 0.37


def test_blocks_shorten_head_of_line_waits():
    import dataclasses

    from simulations.scenario import load_scenario

    sc = load_scenario(CONFIGS / "wan-3x4.toml")
    whole = run_strategy(dataclasses.replace(sc, interleave_block_bytes=0), "patchswarm")[1]["control_hol"]
    blocks = run_strategy(dataclasses.replace(sc, interleave_block_bytes=256 * 1024), "patchswarm")[1]
    assert blocks["control_hol"]["max_s"] < 0.5 < whole["max_s"]
    assert blocks["control_hol"]["mean_ms"] * 10 < whole["mean_ms"]


def test_cpu_and_encode_make_the_fanout_slower():
    clean = run_strategy(tiny(), "patchswarm")[1]
    slow = run_strategy(tiny(cpu={"hash_mb_s": 50, "apply_mb_s": 20}, trainer={"encode_s": 0.5}),
                        "patchswarm")[1]
    check_invariants(tiny(), slow)
    # from the publish call: 0.5 s of encode, then every node hashes 4 MiB at 50 MB/s
    assert slow["t_p100_s"] > clean["t_p100_s"] + 0.5
    assert slow["t_p100_s"] > 0.5 + 4 * 2**20 / 50e6
    assert slow["bound_terms"]["node_cpu[a]"] == pytest.approx(4 * 2**20 / 50e6, rel=1e-4)
    # applying 4 MiB at 20 MB/s after holding it
    assert slow["t_applied_p100_s"] >= slow["t_p100_s"] + 4 * 2**20 / 20e6 * 0.99


def test_long_lossy_links_slow_the_fanout_with_slow_start():
    base = tiny(links={"mbps": 1000, "latency_ms": 75})
    lossy = tiny(links={"mbps": 1000, "latency_ms": 75, "loss": 0.001}, network={"slow_start": True})
    a = run_strategy(base, "patchswarm")[1]
    b = run_strategy(lossy, "patchswarm")[1]
    check_invariants(lossy, b)
    assert b["t_p100_s"] > 2 * a["t_p100_s"]


def test_a_thin_uplink_s_later_versions_are_no_slower_than_its_first():
    # The origin keeps its uplink window across versions. The first version's start-up
    # once doubled the window in a round that closed with two chunks left to cross, and
    # the second version started with eight pushes at once on the 100 Mbit uplink, all
    # late together: 8.07 s against 7.58 for the first (now 7.66 / 7.42)
    import dataclasses

    from simulations.scenario import load_scenario

    sc = dataclasses.replace(load_scenario(CONFIGS / "wan-3x4.toml"), versions=3)
    fig = run_strategy(sc, "patchswarm")[1]
    check_invariants(sc, fig)
    first, *later = [pv["t_p100_s"] for pv in fig["per_version"]]
    assert all(pv["completed"] == pv["of"] for pv in fig["per_version"])
    assert max(later) <= first * 1.03, (first, later)


def _upload_bound_small(slow_relay_factor: float, seed: int) -> dict:
    """``upload-bound`` at 8 nodes a region and 64 MiB, three versions: the edge
    region's hosts send at 100 Mbit/s, the core regions' at 1 Gbit/s. Without
    ``clear_startup`` (its default): with it the 10 Gbit/s trainer's pushes show no
    queue, its window stops limiting them, and the edge relays 8 chunks out whatever the
    per-path rule."""
    import dataclasses

    from simulations.scenario import load_scenario

    sc = load_scenario(CONFIGS / "upload-bound.toml")
    sc = dataclasses.replace(
        sc, patch_bytes=64 << 20, versions=3,
        regions=tuple(dataclasses.replace(r, nodes=8) for r in sc.regions),
        protocol={**sc.protocol, "slow_relay_factor": slow_relay_factor, "clear_startup": False})
    fig = run_strategy(sc, "patchswarm", seed=seed)[1]
    check_invariants(sc, fig)
    assert all(pv["completed"] == pv["of"] for pv in fig["per_version"])
    return fig


def test_a_region_that_relays_out_slowly_is_no_source_once_measured():
    # Routing compared a region's pushes with its relays from any region: the core
    # regions kept taking chunks from the edge region (100 Mbit/s hosts, a relay
    # ~15x a push from the 10 Gbit trainer) because relays between the two core regions
    # were fast. Measured per path (three relays at least), the edge relays until its
    # paths are measured and the core regions then take those chunks by push or from
    # each other: 10 chunks out of the edge against 15 on every seed. Versions 2-3 gain
    # 4-13 % a seed (one seed of six none); over seeds 1, 22, 2 and 3 together 54.3 s
    # against 59.3 s (round 28: 55.6 against 60.2 before answers were stopped on CANCEL,
    # which sped up the unmeasured arm more), so the sum is what is checked. Round 34's
    # start-up on departures sped both arms up and the unmeasured one more: 47.4 s
    # against 48.7 (the edge's bytes as before). Round 43's (one more in flight per
    # departure) again: 44.43 against 44.72 s. Round 49's start-up that triples a push
    # time (`fast_startup_step = 2`) made every first version 2-4 % faster and the later
    # ones 44.47 against 43.97 s: the rule's third versions now lose (5.45-5.79 s against
    # 5.45-5.49), its second ones are the same as without it. So what is checked is the
    # bytes, and that the rule costs the later versions under 3 %
    later = [0.0, 0.0]
    for seed in (1, 22, 2, 3):
        on, off = _upload_bound_small(5.0, seed), _upload_bound_small(0.0, seed)
        out_of_edge = [sum(v for k, v in f["pair_bytes"].items()
                           if k.startswith("edge->core")) >> 22 for f in (on, off)]
        assert out_of_edge[0] <= 10 < out_of_edge[1], (seed, out_of_edge)
        assert on["cross_region_ratio"] == off["cross_region_ratio"] == 1.0
        for k, f in enumerate((on, off)):
            later[k] += sum(pv["t_p100_s"] for pv in f["per_version"][1:])
    assert later[0] < 1.03 * later[1], later


def test_a_relay_whose_bytes_are_acknowledged_is_not_sent_twice(monkeypatch):
    """1 % loss over 150 ms on one flow: a 4 MiB relay takes longer than its deadline.
    The simulated border reports it alive while it runs (``ev.Acked`` every
    ``ACK_WATCH_S`` -> RELAY_ALIVE, as the node's driver does), so each region takes in
    one copy; without the reports the origin times relays out and sends chunks twice."""
    import simulations.driver as sim_driver

    def lossy():
        return tiny(payload={"patch": "16 MiB", "chunk": "4 MiB", "full": "32 MiB", "start_s": 1.0},
                    links={"mbps": 1000, "latency_ms": 75, "loss": 0.01},
                    network={"lanes": 1, "congestion": "cubic", "slow_start": True},
                    max_time_s=2000)

    sc = lossy()
    alive = run_strategy(sc, "patchswarm")[1]
    check_invariants(sc, alive)
    assert alive["cross_region_ratio"] == pytest.approx(1.0, abs=1e-3)
    monkeypatch.setattr(sim_driver, "ACK_WATCH_S", float("inf"))  # a driver that never looks
    silent = run_strategy(lossy(), "patchswarm")[1]
    assert silent["cross_region_ratio"] > 1.2


def _fat_fleet(**protocol) -> dict:
    """``fleet-10k`` at 24 nodes a region and 128 MB: a 10 Gbit/s trainer, 1 Gbit/s
    hosts, 30-60 ms between sites."""
    import dataclasses

    from simulations.scenario import load_scenario

    sc = load_scenario(CONFIGS / "fleet-10k.toml")
    sc = dataclasses.replace(
        sc, patch_bytes=128_000_000,
        regions=tuple(dataclasses.replace(r, nodes=24) for r in sc.regions),
        protocol={**sc.protocol, **protocol})
    fig = run_strategy(sc, "patchswarm")[1]
    check_invariants(sc, fig)
    return fig


def test_a_fat_uplink_s_start_up_grows_on_departures():
    # The window's start-up timed by HAVEs doubles once a round trip (~0.15 s here);
    # on the pushes' departures it opens by one a departure, so it doubles every 34 ms
    # while they leave at their borders' 1 Gbit/s. Measured: 1.54 s against 1.71 (bound
    # 1.02; 1.62 when it doubled once a round of departures, round 34 to 42)
    on, off = _fat_fleet(), _fat_fleet(fast_startup_s=0.0)
    assert on["t_p100_s"] < off["t_p100_s"] * 0.97, (on["t_p100_s"], off["t_p100_s"])
    assert on["cross_region_ratio"] == off["cross_region_ratio"] == 1.0


def test_a_thin_uplink_never_starts_up_on_departures():
    # wan-3x4: every push takes 0.4 s or more to leave the 100 Mbit/s uplink, so the
    # first departure ends it and the run is the same to the last digit
    from simulations.scenario import load_scenario

    sc = load_scenario(CONFIGS / "wan-3x4.toml")
    import dataclasses

    off = dataclasses.replace(sc, protocol={**sc.protocol, "fast_startup_s": 0.0})
    assert (deterministic_view(run_strategy(sc, "patchswarm")[1])
            == deterministic_view(run_strategy(off, "patchswarm")[1]))


def _long_lossy(clear: bool) -> dict:
    """A 10 Gbit/s trainer feeding three regions over 150 ms round trips with 0.1 % loss
    (CUBIC: each flow held near its Mathis ceiling; no queue anywhere)."""
    sc = tiny(payload={"patch": "32 MiB", "chunk": "4 MiB", "full": "64 MiB", "start_s": 1.0},
              trainer={"uplink_mbps": 10000},
              defaults={"uplink_mbps": 1000, "downlink_mbps": 1000, "latency_ms": 0.25},
              regions=[{"name": n, "nodes": 4} for n in ("a", "b", "c")],
              links={"mbps": 10000, "latency_ms": 75, "loss": 0.001},
              network={"lanes": 1, "congestion": "cubic", "slow_start": True},
              protocol={"clear_startup": clear}, max_time_s=600)
    fig = run_strategy(sc, "patchswarm")[1]
    check_invariants(sc, fig)
    return fig


def test_pushes_over_paths_with_no_queue_lift_the_uplink_window():
    # Every push is slow (a flow's loss ceiling over 150 ms), so the uplink window's
    # start-ups never grew: two or three pushes at a time. With ``clear_startup`` the
    # pushes' samples show no queue, once their windows stopped opening, for six round
    # trips: the window no longer limits pushes. Measured: 25.3 s against 45.0 s
    on, off = _long_lossy(True), _long_lossy(False)
    assert on["t_p100_s"] < 0.75 * off["t_p100_s"], (on["t_p100_s"], off["t_p100_s"])
    assert on["cross_region_ratio"] == off["cross_region_ratio"] == 1.0


def test_a_thin_uplink_s_queue_lifts_the_window_never():
    # wan-3x4: the first pushes' windows open until the 100 Mbit/s uplink is full, and
    # its queue then shows on every push: no clear run, the same to the last digit
    import dataclasses

    from simulations.scenario import load_scenario

    sc = load_scenario(CONFIGS / "wan-3x4.toml")
    on = dataclasses.replace(sc, protocol={**sc.protocol, "clear_startup": True})
    views = [deterministic_view(run_strategy(x, "patchswarm")[1]) for x in (sc, on)]
    for v in views:
        v.pop("events")  # the samples are events of their own
    assert views[0] == views[1]
