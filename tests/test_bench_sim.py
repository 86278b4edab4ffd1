"""``benchmarks/bench_sim.py --scenarios --versions``: knob overrides (``--swarm``) and the
comparison against an earlier result (``--against``), on a real scenario run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_sim", ROOT / "benchmarks" / "bench_sim.py")
assert _spec is not None and _spec.loader is not None
bench_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_sim)


def test_parse_knobs_checks_names_and_types():
    assert bench_sim.parse_knobs(["uplink_window=24", "relay=false", "have_batch_s=0"]) == {
        "uplink_window": 24, "relay": False, "have_batch_s": 0.0}
    with pytest.raises(ConfigError, match=r"swarm\.nope: unknown protocol knob"):
        bench_sim.parse_knobs(["nope=1"])
    with pytest.raises(ConfigError, match=r"swarm\.uplink_window: expected int"):
        bench_sim.parse_knobs(["uplink_window=wide"])
    with pytest.raises(ConfigError, match="KNOB=VALUE"):
        bench_sim.parse_knobs(["uplink_window"])
    with pytest.raises(ConfigError, match=r"swarm\.uplink_window: must be a number in 1\.\.65536, got 0"):
        bench_sim.parse_knobs(["uplink_window=0"])
    with pytest.raises(ConfigError, match=r"swarm\.have_batch_s: must be a number"):
        bench_sim.parse_knobs(["have_batch_s=NaN"])


def test_against_must_be_an_earlier_result(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        bench_sim.load_against(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ConfigError, match="cannot read"):
        bench_sim.load_against(bad)
    bad.write_text('{"slow-direct": {"t_p100_s": 1}}')
    with pytest.raises(ConfigError, match=r"not a bench_sim\.py"):
        bench_sim.load_against(bad)
    good = tmp_path / "good.json"
    good.write_text('{"slow-direct": {"mean_t_p100_s": [2.0]}}')
    assert bench_sim.load_against(good) == {"slow-direct": {"mean_t_p100_s": [2.0]}}


def test_compare_gives_each_versions_change():
    before = {"a": {"mean_t_p100_s": [2.0, 4.0]}, "b": {"mean_t_p100_s": [1.0]}}
    after = {"a": {"mean_t_p100_s": [2.2, 3.0]}, "c": {"mean_t_p100_s": [9.0]}}
    assert bench_sim.compare(after, before) == {"a": [10.0, -25.0]}


def test_a_knob_ab_over_a_scenario(tmp_path, capsys):
    """The shipped window against a wide first window on ``slow-direct`` (round 19: the
    slow direct link takes its share of pushes before any is measured; at 24, eight go
    down it at once, before any push has left to show it slow: 5.8 s against 2.2)."""
    base, wide = tmp_path / "base.json", tmp_path / "wide.json"
    assert bench_sim.run_versions(["slow-direct"], 1, [21], base) == 0
    assert bench_sim.run_versions(["slow-direct"], 1, [21], wide, {"uplink_window": 24},
                                  bench_sim.load_against(base)) == 0
    b, w = json.loads(base.read_text()), json.loads(wide.read_text())
    assert b["slow-direct"]["knobs"] == {} and w["slow-direct"]["knobs"] == {"uplink_window": 24}
    t0, t1 = b["slow-direct"]["mean_t_p100_s"][0], w["slow-direct"]["mean_t_p100_s"][0]
    assert t1 > 1.5 * t0
    assert w["slow-direct"]["change_pct"] == [round(100 * (t1 / t0 - 1), 1)]
    assert "against" in capsys.readouterr().out


def test_cli_refuses_knobs_without_versions_and_bad_input_before_running(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_sim.py")]
    for extra in (["--swarm", "uplink_window=2"], ["--lanes", "4"]):
        out = subprocess.run([*cmd, *extra], capture_output=True, text=True)
        assert out.returncode == 2 and "--swarm, --lanes and --against go with" in out.stderr
    res = tmp_path / "out.json"
    for extra, msg in ((["--swarm", "uplink_window=0"], "swarm.uplink_window: must be"),
                       (["--lanes", "0"], "--lanes: a count in 1..64"),
                       (["--against", str(tmp_path / "none.json")], "--against: cannot read")):
        out = subprocess.run([*cmd, "--scenarios", "--versions", "2", "--out", str(res), *extra],
                             capture_output=True, text=True)
        assert out.returncode == 2 and msg in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and not res.exists()  # nothing ran
