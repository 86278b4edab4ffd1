"""The trainer's fleet view, the origin's publish-to-active times, and the [publish]
control keys, from constructed version reports (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from node.api import FleetTimes
from node.config import parse_config
from swarm.errors import ConfigError
from swarm.protocol.fleet import FleetEntry
from trainer.fleet import FleetView, StalenessTimeout


def entry(node: str, region: str, active: int | None, served: int | None = None,
          at: float = 100.0, connected: bool = True) -> FleetEntry:
    return FleetEntry(node, region, active, served, at, connected)


FLEET = [
    entry("a0", "region-a", 5), entry("a1", "region-a", 5), entry("a2", "region-a", 4),
    entry("b0", "region-b", 5, served=3, at=90.0), entry("b1", "region-b", None, at=50.0,
                                                         connected=False),
]


def test_regions_count_each_version_served_engine_first() -> None:
    view = FleetView(FLEET, latest=5, now=100.0)
    assert view.regions() == {"region-a": {5: 2, 4: 1}, "region-b": {3: 1, None: 1}}
    assert view.versions() == [None, 3, 4, 5]
    assert view.served_fraction(5) == pytest.approx(2 / 5)
    assert view.served_fraction(4) == pytest.approx(3 / 5)
    assert view.served_fraction(4, "region-a") == 1.0
    assert view.served_fraction(1, "nowhere") == 1.0  # nobody is behind
    assert sorted(view.lags()) == [0, 0, 1, 2]


def test_laggards_most_behind_first_with_lag_and_age() -> None:
    lags = FleetView(FLEET, latest=5, now=100.0).laggards()
    assert [(lg.node_id, lg.serving, lg.lag) for lg in lags] == [
        ("b1", None, None), ("b0", 3, 2), ("a2", 4, 1)]
    assert lags[0].age_s == 50.0 and not lags[0].connected
    assert "b0 (region-b) serves v3" in lags[1].describe()
    assert FleetView(FLEET, latest=5).laggards(4)[-1].node_id == "b0"


def test_staleness_timeout_names_the_laggards() -> None:
    view = FleetView(FLEET, latest=5, now=100.0)
    err = StalenessTimeout(5, 0.8, 30.0, view)
    msg = str(err)
    assert "version 5" in msg and "40%" in msg and "80% needed" in msg
    for node in ("a2 (region-a) serves v4", "b0 (region-b) serves v3",
                 "b1 (region-b) serves nothing, not linked"):
        assert node in msg
    assert [lg.node_id for lg in err.laggards] == ["b1", "b0", "a2"]


def test_json_round_trip_and_table() -> None:
    view = FleetView(FLEET, latest=5, now=100.0)
    doc = json.loads(json.dumps(view.to_json()))
    assert doc["regions"]["region-b"] == {"3": 1, "none": 1}
    again = FleetView.from_json(doc)
    assert again.regions() == view.regions()
    assert [lg.node_id for lg in again.laggards()] == ["b1", "b0", "a2"]
    assert again.laggards()[0].age_s == pytest.approx(50.0)
    table = view.table()
    lines = table.splitlines()
    assert lines[0].split() == ["region", "nodes", "-", "v3", "v4", "v5", "max", "lag",
                                "stragglers"]
    assert lines[1].split()[:2] == ["region-a", "3"] and lines[1].endswith("a2")
    assert "b1, b0" in lines[2] and "?" in lines[2]
    assert "40% serve the latest (v5)" in lines[-1]
    assert FleetView([]).table().startswith("no node has reported")


def test_from_json_refuses_garbage() -> None:
    from swarm.errors import PatchswarmError

    with pytest.raises(PatchswarmError, match="not a fleet document"):
        FleetView.from_json({"entries": [{"node_id": "x"}]})


def test_publish_to_active_times_p50_p100() -> None:
    times = FleetTimes(since=1000.0)
    manifests = {1: SimpleNamespace(created_at=900.0),   # before the origin started: untimed
                 2: SimpleNamespace(created_at=1010.0)}
    offset = 1000.0  # wall = core time + 1000
    fleet = [entry("n0", "r", 1, at=5.0), entry("n1", "r", 1, at=5.0)]
    times.observe(manifests, fleet, offset)
    assert times.done == {}
    fleet = [entry("n0", "r", 2, at=11.0), entry("n1", "r", 1, at=5.0)]
    times.observe(manifests, fleet, offset)
    assert times.done == {}
    fleet = [entry("n0", "r", 2, at=11.0), entry("n1", "r", 3, served=2, at=14.0)]
    times.observe(manifests, fleet, offset)
    assert times.done == {2: {"p50": pytest.approx(1.0), "p100": pytest.approx(4.0)}}
    assert times.as_dict() == {"2": {"p50": 1.0, "p100": 4.0}}


BASE = {
    "node": {"id": "trainer", "region": "trainer", "model": "m", "role": "origin"},
    "network": {"listen": "127.0.0.1:7400", "swarm_secret": "ab" * 16},
    "store": {"dir": "store"},
    "publish": {"signing_key": "k"},
}


def cfg_with(**publish: object) -> object:
    data = json.loads(json.dumps(BASE))
    data["publish"].update(publish)
    return parse_config(data, Path("/nonexistent"))


def test_publish_control_keys_parse() -> None:
    cfg = cfg_with(anchor_every=4, max_lag=2, max_lag_fraction=0.9, max_lag_timeout_s=30)
    assert (cfg.anchor_every, cfg.max_lag, cfg.max_lag_fraction, cfg.max_lag_timeout_s) == (
        4, 2, 0.9, 30.0)
    cfg = cfg_with()
    assert (cfg.anchor_every, cfg.max_lag) == (0, 0)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("anchor_every", -1, "publish.anchor_every: must be in 0..1000000"),
    ("anchor_every", True, "publish.anchor_every: expected an integer"),
    ("max_lag", -2, "publish.max_lag: must be in"),
    ("max_lag", 1.5, "publish.max_lag: expected int"),
    ("max_lag_fraction", 0, "publish.max_lag_fraction: must be a number in \\(0, 1\\]"),
    ("max_lag_fraction", 1.5, "publish.max_lag_fraction"),
    ("max_lag_timeout_s", 0, "publish.max_lag_timeout_s: must be"),
    ("max_lag_timeout_s", "10", "publish.max_lag_timeout_s: expected"),
])
def test_publish_control_keys_refused_by_name(key: str, value: object, match: str) -> None:
    extra = {"max_lag": 1} if key.startswith("max_lag_") else {}
    with pytest.raises(ConfigError, match=match):
        cfg_with(**{**extra, key: value})


def test_encode_threads_auto_or_a_count_named_in_errors() -> None:
    import os

    from node.config import encode_threads

    assert cfg_with().encode_threads == 0 and cfg_with(encode_threads="auto").encode_threads == 0
    assert cfg_with(encode_threads=6).encode_threads == 6
    assert encode_threads(6) == 6
    assert encode_threads(0) == max(1, min(8, len(os.sched_getaffinity(0))))
    for bad in (0, 257, "4", 2.0, True):
        with pytest.raises(ConfigError, match=r"publish\.encode_threads: \"auto\" or a number"):
            cfg_with(encode_threads=bad)


def test_max_lag_details_need_max_lag_and_an_origin() -> None:
    with pytest.raises(ConfigError, match=r"publish\.max_lag: max_lag_fraction and"):
        cfg_with(max_lag_fraction=0.5)
    data = json.loads(json.dumps(BASE))
    data["node"]["role"] = "node"
    data["trust"] = {"trainer_keys": ["k.pub"]}
    data["weights"] = {"base": "b.safetensors"}
    data["publish"] = {"anchor_every": 3}
    with pytest.raises(ConfigError, match=r"publish\.anchor_every: only the origin"):
        parse_config(data, Path("/nonexistent"))
    data["publish"] = {"encode_threads": 4}
    with pytest.raises(ConfigError, match=r"publish\.encode_threads: only the origin"):
        parse_config(data, Path("/nonexistent"))


def test_fleet_command_errors_in_one_line(capsys) -> None:
    from patchswarm.cli import main as cli

    assert cli(["fleet", "--api", "127.0.0.1:1", "--once"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("patchswarm fleet: error: cannot reach the origin's API at 127.0.0.1:1")
    assert len(err.strip().splitlines()) == 1
    assert cli(["fleet", "--api", "nowhere", "--once"]) == 1
    assert "--api: expected \"host:port\"" in capsys.readouterr().err
