"""Scenario TOML validation and the flow lower bound."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from simulations.bounds import kumar_ross, lower_bound
from simulations.network import mathis_cap, mbps
from simulations.scenario import STRATEGIES, load_scenario, parse_scenario, parse_size
from swarm.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "sim"

BASE = {
    "payload": {"patch": "8 MiB", "chunk": "1 MiB"},
    "regions": [{"name": "a", "nodes": 4}, {"name": "b", "nodes": 4}],
}


def doc(**changes):
    d = copy.deepcopy(BASE)
    for path, value in changes.items():
        keys = path.split("__")
        cur = d
        for k in keys[:-1]:
            cur = cur.setdefault(k, {}) if not k.isdigit() else cur[int(k)]
        last = keys[-1]
        if last.isdigit():
            cur[int(last)] = value
        else:
            cur[last] = value
    return d


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_scenarios_load(path):
    sc = load_scenario(path)
    assert sc.nodes > 0
    assert set(sc.strategies) <= set(STRATEGIES)


def test_defaults():
    sc = parse_scenario(doc())
    assert sc.patch_bytes == 8 * 2**20
    assert sc.chunk_bytes == 2**20
    assert sc.full_bytes == sc.patch_bytes
    assert sc.sites == ("trainer", "a", "b")
    assert sc.link("trainer", "a").mbps == math.inf
    assert sc.strategies == ("patchswarm",)


def test_link_pairs_are_symmetric_by_default():
    sc = parse_scenario(doc(links={"mbps": 100, "pairs": [{"from": "a", "to": "b", "mbps": 5, "latency_ms": 7}]}))
    assert sc.link("a", "b").mbps == 5 and sc.link("b", "a").latency_ms == 7
    assert sc.link("trainer", "b").mbps == 100


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nodes_total": 1}, "nodes_total: unknown key"),
        ({"payload__patch": "12 parsecs"}, "payload.patch: not a size"),
        ({"payload__patch": 0}, "payload.patch: must be > 0"),
        ({"payload__versions": 0}, "payload.versions: must be in"),
        ({"regions__0__nodes": 0}, "regions[0].nodes: must be in"),
        ({"regions__0__nodes": "many"}, "regions[0].nodes: must be an integer"),
        ({"regions__1__name": "a"}, "regions[1].name: duplicate region"),
        ({"regions__1__name": "trainer"}, "reserved"),
        ({"regions__0__uplink_mbps": -5}, "regions[0].uplink_mbps: must be > 0"),
        ({"regions__0__uplink_mbps": {"dist": "pareto"}}, "regions[0].uplink_mbps.dist: must be fixed"),
        ({"regions__0__uplink_mbps": {"dist": "uniform", "low": 10, "high": 5}}, "high: must be >= 10"),
        ({"regions__0__stragglers": {"fraction": 2}}, "stragglers.fraction: must be <= 1"),
        ({"trainer": {"region": "mars"}}, "trainer.region: unknown region 'mars'"),
        ({"links": {"pairs": [{"from": "a", "to": "mars"}]}}, "links.pairs[0].to: unknown site 'mars'"),
        ({"links": {"pairs": [{"from": "a", "to": "a"}]}}, "same site"),
        ({"network": {"loss": 0.9}}, "network.loss: must be <= 0.5"),
        ({"strategies": ["bittorrent"]}, "unknown strategy 'bittorrent'"),
        ({"faults": {"churn": 0.2}}, "faults.churn_window_s"),
        ({"faults": {"churn_window_s": [3, 1]}}, "faults.churn_window_s"),
        ({"faults": {"cuts": [{"region": "zz", "start_s": 1, "duration_s": 1}]}}, "faults.cuts[0].region"),
        ({"protocol": {"mesh_degree": [1]}}, "protocol.mesh_degree"),
        ({"regions": []}, "at least one"),
        ({"seed": -1}, "seed: must be in"),
        # issue 11: the link classes, the per-connection stream, the CPU
        ({"links": {"loss": 0.7}}, "links.loss: must be <= 0.5"),
        ({"links": {"rtt_ms": 100, "latency_ms": 50}}, "links.rtt_ms: give latency_ms"),
        ({"links": {"pairs": [{"from": "a", "to": "b", "loss": -1}]}}, "links.pairs[0].loss: must be >= 0"),
        ({"regions__0__loss": "some"}, "regions[0].loss: must be a number"),
        ({"regions__0__queue_ms": -5}, "regions[0].queue_ms: must be >= 0"),
        ({"network": {"interleave_block_bytes": "big"}}, "network.interleave_block_bytes: not a size"),
        ({"network": {"slow_start": "yes"}}, "network.slow_start: must be true or false"),
        ({"network": {"initial_window": 0}}, "network.initial_window: must be in"),
        ({"network": {"origin_warm_up_kib": -1}}, "network.origin_warm_up_kib: must be in"),
        ({"network": {"warm_up_kib": "lots"}}, "network.warm_up_kib"),
        ({"network": {"congestion": "vegas"}}, "network.congestion: must be one of"),
        ({"cpu": {"hash_mb_s": 0}}, "cpu.hash_mb_s: must be > 0"),
        ({"cpu": {"cores": 0}}, "cpu.cores: must be in"),
        ({"cpu": {"sha_rate": 1}}, "cpu.sha_rate: unknown key"),
        ({"regions__1__cpu": {"apply_mb_s": -1}}, "regions[1].cpu.apply_mb_s: must be > 0"),
        ({"regions__1__cpu": {"host_cores": 2}}, "regions[1].cpu.host_cores: unknown key"),
        ({"trainer": {"encode_s": -1}}, "trainer.encode_s: must be >= 0"),
        ({"trainer": {"encode_mb_s": 0}}, "trainer.encode_mb_s: must be > 0"),
    ],
)
def test_validation_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        parse_scenario(doc(**change))


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_scenario(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError):
        load_scenario(binary)


def test_parse_size_units():
    assert parse_size("4 MiB") == 4 * 2**20
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5 KiB") == 1536
    assert parse_size(42) == 42
    for bad in ("4 MiBs", "", True, [1], "-3 MB"):
        with pytest.raises(ConfigError):
            parse_size(bad)


# ----------------------------------------------------------------------- bounds


def caps(sc):
    ups = {r.name: [mbps(r.uplink.value)] * r.nodes for r in sc.regions}
    downs = {r.name: [mbps(r.downlink.value)] * r.nodes for r in sc.regions}
    return ups, downs


def test_bound_reduces_to_kumar_ross_in_one_region():
    sc = parse_scenario({
        "payload": {"patch": "100 MB"},
        "trainer": {"region": "a", "uplink_mbps": 100},
        "defaults": {"uplink_mbps": 50, "downlink_mbps": 400, "latency_ms": 0},
        "regions": [{"name": "a", "nodes": 20}],
    })
    b = lower_bound(sc, sc.patch_bytes, *caps(sc))
    F = 100e6
    expected = kumar_ross(F, mbps(100), [mbps(50)] * 20, mbps(400))
    assert b.seconds == pytest.approx(expected)
    # here N F / (u_s + sum u) = 20 F / (100 + 1000 Mbit/s) beats F/u_s
    assert b.binding in ("region_upload[a]", "fleet_upload")


def test_bound_of_the_libtorrent_anchor_is_about_5_5_s():
    sc = load_scenario(CONFIGS / "libtorrent-3x4.toml")
    b = lower_bound(sc, sc.patch_bytes, *caps(sc))
    # each remote region takes in 64 MiB through a 100 Mbit/s uplink: 5.37 s
    assert b.binding.startswith("inflow[")
    assert b.seconds == pytest.approx(64 * 2**20 / mbps(100) + 0.0001, rel=1e-3)
    assert 5.3 < b.seconds < 5.6


def test_bound_region_inflow_sums_links():
    sc = parse_scenario({
        "payload": {"patch": "100 MB"},
        "trainer": {"uplink_mbps": 10_000},
        "defaults": {"uplink_mbps": 10_000, "downlink_mbps": 10_000, "latency_ms": 0},
        "regions": [{"name": "a", "nodes": 2}, {"name": "b", "nodes": 2}],
        "links": {"mbps": 100, "latency_ms": 0},
    })
    b = lower_bound(sc, sc.patch_bytes, *caps(sc))
    # region a can take in from the trainer (100) and from b (100): F / 200 Mbit/s
    assert b.terms["inflow[a]"] == pytest.approx(100e6 / mbps(200))
    assert b.seconds == pytest.approx(100e6 / mbps(200))


def test_link_classes_cpu_and_stream_knobs():
    sc = parse_scenario(doc(
        network={"loss": 0.001, "mss": 1448, "interleave_block_bytes": "64 KiB", "slow_start": True},
        defaults={"rtt_ms": 2},
        links={"rtt_ms": 150, "pairs": [{"from": "a", "to": "b", "latency_ms": 10, "loss": 0.0}]},
        cpu={"hash_mb_s": 1500, "cores": 4, "host_cores": 2},
        regions__1__cpu={"hash_mb_s": 300},
        trainer={"encode_s": 1.0, "encode_mb_s": 8.388608},
    ))
    assert sc.interleave_block_bytes == 64 * 1024 and sc.slow_start and sc.mss == 1448
    assert sc.region("a").latency_ms == 1.0 and sc.region("a").loss == 0.001  # network.loss default
    assert sc.link("trainer", "a").latency_ms == 75.0 and sc.link("trainer", "a").loss == 0.001
    assert sc.link("b", "a").latency_ms == 10 and sc.link("b", "a").loss == 0.0
    assert sc.region("a").cpu.hash_mb_s == 1500 and sc.region("a").cpu.cores == 4
    assert sc.region("b").cpu.hash_mb_s == 300 and sc.region("b").cpu.cores == 4
    assert sc.host_cores == 2
    assert sc.encode_s == pytest.approx(1.0 + 1.0)  # 8 MiB at 8.39 MB/s + 1 s


def test_old_scenarios_keep_their_meaning():
    """No new key given: no CPU cost, no loss, no slow start; chunks in 256 KiB blocks."""
    sc = parse_scenario(doc())
    assert sc.region("a").cpu.free and sc.host_cores == 0 and sc.encode_s == 0
    assert not sc.slow_start and sc.interleave_block_bytes == 256 * 1024
    assert sc.link("a", "b").loss == 0 and sc.region("a").loss == 0


@pytest.mark.parametrize("name", ["wan-3x4", "slow-direct", "upload-bound", "lossy-long",
                                  "lossy-long-bbr", "partition-heal"])
def test_issue_11_scenarios_bounds(name):
    sc = load_scenario(CONFIGS / f"{name}.toml")
    b = lower_bound(sc, sc.patch_bytes, *caps(sc))
    assert b.seconds > 0
    if name == "wan-3x4":
        # 64 MiB through a 100 Mbit/s region uplink after 0.37 s of encode, then the last
        # 4 MiB chunk is hashed and stored (BLAKE3 8 GB/s, io 110 MB/s, 1 ms)
        assert b.binding.startswith("inflow[")
        tail = 4 * 2**20 / 8000e6 + 4 * 2**20 / 110e6 + 0.001
        assert b.seconds == pytest.approx(0.37 + 64 * 2**20 / mbps(100) + 0.001 + tail, rel=1e-6)
    if name == "lossy-long":
        assert b.info["inflow_8_flows[us]"] > 5 * b.seconds  # the border flows alone crawl
        # whole chunks over single flows: 4 MiB at the 3 Mbit/s Mathis ceiling. The bound
        # spreads 16 chunks' bytes over the trainer's 48 flows; a chunk on one flow takes 3x
        cap = mathis_cap(1460, 0.15, 0.001)
        assert b.info["chunk_one_flow[us]"] == pytest.approx(4 * 2**20 / cap)
        assert b.info["chunk_one_flow[us]"] == pytest.approx(3 * b.terms["trainer_uplink"])
    if name == "lossy-long-bbr":
        # BBR: no per-flow ceiling, so neither the bound nor the border flows crawl
        assert "inflow_8_flows[us]" not in b.info and b.seconds < 1.0
        assert "chunk_one_flow[us]" not in b.info
        # a first version's chunk over a fresh 150 ms connection: 9 slow-start rounds
        assert b.info["cold_chunk[us]"] == pytest.approx(8 * 0.150 + 0.075)
    if name == "partition-heal":
        assert b.info["after_heal[cut]"] > 3.5
    if name == "upload-bound":
        assert b.binding == "region_upload[edge]"
