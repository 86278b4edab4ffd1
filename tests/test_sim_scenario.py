"""Scenario TOML validation and the flow lower bound."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from simulations.bounds import kumar_ross, lower_bound
from simulations.network import mbps
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
