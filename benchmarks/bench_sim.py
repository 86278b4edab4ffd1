"""Simulator benchmarks: the issue-5 targets, the strategy table, the issue-11 scenarios.

    python benchmarks/bench_sim.py [--quick] [--only NAME ...]
    python benchmarks/bench_sim.py --scenarios [--only NAME ...]

Runs each (scenario, strategies) case below through the simulator, prints one
table row per run and writes every report to ``benchmarks/results/sim.json``.
``--quick`` swaps the 10k fleet for a 1k one (same shape) for a smoke run.

``--scenarios`` runs the issue-11 scenarios (``SCENARIOS``: the emulated WAN as
in round 1 and with 256 KiB blocks, a slow direct link, an upload-bound region,
long lossy links, a partition that heals) and writes
``benchmarks/results/sim_scenarios.json``: per run the simulated time, the flow
bound, their ratio, what binds, the explanatory figures and the wall time.
Re-run it after a protocol change; it takes well under a minute.

``--scenarios --versions N --seeds S ...`` publishes N versions in a row on each of
those scenarios (one long-running origin, as in RL post-training: the origin keeps
what it measured, its uplink window above all) for every seed, and writes
``benchmarks/results/sim_versions.json``: each version's p100 per seed and its mean
over seeds. The first version is the cold start; the later ones are the steady state.
``--swarm KNOB=VALUE`` (repeatable) sets a protocol knob in every scenario, as a
scenario's ``[protocol]`` would, and ``--against FILE`` (an earlier such JSON, e.g. of
the shipped defaults) adds each mean's change against it: a knob's A/B over the
scenarios and seeds in two commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulations.report import format_table  # noqa: E402
from simulations.runner import run_strategy  # noqa: E402
from simulations.scenario import load_scenario  # noqa: E402
from swarm.errors import ConfigError  # noqa: E402
from swarm.protocol.config import KNOB_RANGES, check_knobs  # noqa: E402
from swarm.protocol.stripes import AUTO_LANES  # noqa: E402

CASES = [
    ("fleet-10k", ("patchswarm",)),
    ("churn", ("patchswarm",)),
    ("churn-baseline", ("patchswarm",)),  # the churn scenario without churn: the cost of churn
    ("libtorrent-3x4", ("patchswarm", "per-region", "direct", "flat")),
    ("strategies-500", ("patchswarm", "per-region", "direct", "flat", "full")),
    ("loopback-2x4", ("patchswarm",)),
]


# (label, scenario file stem, field overrides): the issue-11 table of docs/simulation.md
SCENARIOS = [
    ("wan-3x4", "wan-3x4", {}),
    ("wan-3x4 round-1 driver", "wan-3x4", {"interleave_block_bytes": 0}),
    ("slow-direct", "slow-direct", {}),
    ("upload-bound", "upload-bound", {}),
    ("lossy-long", "lossy-long", {}),
    ("lossy-long-bbr", "lossy-long-bbr", {}),
    ("partition-heal", "partition-heal", {}),
]


def run_scenarios(only: list[str] | None, out: Path) -> int:
    """The issue-11 scenarios: sim time, bound, ratio per run -> ``out`` (JSON)."""
    results = json.loads(out.read_text()) if out.exists() else {}
    rows = []
    for label, stem, over in SCENARIOS:
        if only and label not in only and stem not in only:
            continue
        sc = load_scenario(ROOT / "configs" / "sim" / f"{stem}.toml")
        if over:
            sc = dataclasses.replace(sc, **over)
        for strategy in sc.strategies:
            t0 = time.perf_counter()
            _, fig = run_strategy(sc, strategy)
            key = label if strategy == sc.strategies[0] else f"{label} ({strategy})"
            row = {
                "scenario": stem,
                "strategy": strategy,
                "overrides": over,
                "t_p50_s": fig["t_p50_s"],
                "t_p100_s": fig["t_p100_s"],
                "t_applied_p100_s": fig["t_applied_p100_s"],
                "encode_s": fig["encode_s"],
                "lower_bound_s": fig["lower_bound_s"],
                "t_p100_over_bound": fig["t_p100_over_bound"],
                "bound_binding": fig["bound_binding"],
                "bound_info": fig["bound_info"],
                "per_region_p100_s": {r: v["t_p100_s"] for r, v in fig["per_region"].items()},
                "from_trainer_copies": {
                    r: round(v["from_trainer_bytes"] / fig["payload_bytes"], 3)
                    for r, v in fig["per_region"].items()
                },
                "cross_region_ratio": fig["cross_region_ratio"],
                "control_hol": fig["control_hol"],
                "cpu_busy_s": fig["cpu_busy_s"],
                "logs": fig["logs"],
                "events": fig["events"],
                "wall_s": round(time.perf_counter() - t0, 2),
            }
            results[key] = row
            rows.append((key, row))
            print(f"{key}: p100 {row['t_p100_s']} s (applied {row['t_applied_p100_s']}), bound "
                  f"{row['lower_bound_s']} s [{row['bound_binding']}], ratio {row['t_p100_over_bound']}, "
                  f"wall {row['wall_s']} s", flush=True)
    print()
    print(f"| {'scenario':<28} | p100 s | bound s | ratio | binding | wall s |")
    for key, row in rows:
        print(f"| {key:<28} | {row['t_p100_s']} | {row['lower_bound_s']} | {row['t_p100_over_bound']} | "
              f"{row['bound_binding']} | {row['wall_s']} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out)
    return 0


def parse_knobs(items: list[str]) -> dict[str, object]:
    """``KNOB=VALUE`` strings (VALUE in JSON; a bare word is a string) -> checked knobs.
    An unknown knob, a wrong type or a value out of its range is a ``ConfigError`` naming
    ``swarm.KNOB``, before anything runs."""
    knobs: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--swarm: expected KNOB=VALUE, got {item!r}")
        try:
            knobs[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            knobs[key.strip()] = raw
    knobs = check_knobs(knobs, "swarm")
    for key, value in knobs.items():
        lo, hi = KNOB_RANGES.get(key, (None, None))
        if lo is not None and not lo <= value <= hi:  # NaN fails too
            raise ConfigError(f"swarm.{key}: must be a number in {lo}..{hi}, got {value!r}")
    return knobs


def load_against(path: Path) -> dict[str, dict]:
    """An earlier ``--scenarios --versions`` result (``--against``); ``ConfigError`` naming
    the file if it is missing or not such a result."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--against: cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("mean_t_p100_s"), list) for v in data.values()):
        raise ConfigError(f"--against: {path} is not a bench_sim.py --scenarios --versions result")
    return data


def compare(results: dict[str, dict], before: dict[str, dict]) -> dict[str, list[float | None]]:
    """Per scenario in both: each version's mean p100 change against ``before``, in %."""
    out: dict[str, list[float | None]] = {}
    for stem, row in results.items():
        old = before.get(stem, {}).get("mean_t_p100_s")
        if not old:
            continue
        out[stem] = [round(100 * (m / o - 1), 1) if o else None
                     for m, o in zip(row["mean_t_p100_s"], old, strict=False)]
    return out


def run_versions(only: list[str] | None, versions: int, seeds: list[int], out: Path,
                 knobs: dict[str, object] | None = None,
                 before: dict[str, dict] | None = None, lanes: int | str | None = None) -> int:
    """Each issue-11 scenario, ``versions`` versions in a row, per seed -> ``out`` (JSON),
    with ``knobs`` set in each (``--swarm``); ``before``: an earlier such result to compare
    with (``load_against``); ``lanes``: striped links (``Scenario.lanes``, the node's ``[network] lanes``)."""
    from statistics import mean

    results: dict[str, dict] = {}
    for label, stem, over in SCENARIOS:
        if over or (only and label not in only and stem not in only):
            continue
        sc = dataclasses.replace(load_scenario(ROOT / "configs" / "sim" / f"{stem}.toml"),
                                 versions=versions)
        if knobs:
            sc = dataclasses.replace(sc, protocol={**sc.protocol, **knobs})
        if lanes == "auto":
            sc = dataclasses.replace(sc, lanes=AUTO_LANES, lanes_auto=True)
        elif lanes is not None:
            sc = dataclasses.replace(sc, lanes=int(lanes), lanes_auto=False)
        per_seed = {}
        for seed in seeds or [sc.seed]:
            _, fig = run_strategy(sc, sc.strategies[0], seed=seed)
            per_seed[seed] = [pv["t_p100_s"] for pv in fig["per_version"]]
            print(f"{stem} seed {seed}: " + " ".join(f"{t:.2f}" for t in per_seed[seed]), flush=True)
        means = [round(mean(ts[v] for ts in per_seed.values()), 3) for v in range(versions)]
        results[stem] = {"versions": versions, "seeds": list(per_seed), "knobs": knobs or {},
                         "lanes": lanes,
                         "lower_bound_s": fig["lower_bound_s"],
                         "t_p100_s": {str(k): v for k, v in per_seed.items()},
                         "mean_t_p100_s": means,
                         "mean_over_bound": [round(m / fig["lower_bound_s"], 3) for m in means]}
    print()
    print(f"| {'scenario':<16} | bound s | " + " | ".join(f"v{v + 1} s (x bound)" for v in range(versions)) + " |")
    changes = compare(results, before) if before is not None else {}
    for stem, row in results.items():
        cells = " | ".join(f"{m:.2f} ({r:.2f})" for m, r in zip(row["mean_t_p100_s"], row["mean_over_bound"], strict=True))
        print(f"| {stem:<16} | {row['lower_bound_s']:.2f} | {cells} |")
        if stem in changes:
            row["change_pct"] = changes[stem]
            print(f"| {'':<16} | against | " + " | ".join(
                "n/a" if c is None else f"{c:+.1f} %" for c in changes[stem]) + " |")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out)
    return 0


def scenario(name: str, quick: bool):
    if name == "churn-baseline":
        sc = load_scenario(ROOT / "configs" / "sim" / "churn.toml")
        return dataclasses.replace(sc, name="churn-baseline", faults=dataclasses.replace(sc.faults, churn=0.0))
    sc = load_scenario(ROOT / "configs" / "sim" / f"{name}.toml")
    if quick and name == "fleet-10k":
        regions = tuple(dataclasses.replace(r, nodes=r.nodes // 10) for r in sc.regions)
        sc = dataclasses.replace(sc, name="fleet-1k", regions=regions)
    return sc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--scenarios", action="store_true",
                    help="run the issue-11 scenarios into benchmarks/results/sim_scenarios.json")
    ap.add_argument("--versions", type=int, default=1, metavar="N",
                    help="with --scenarios: publish N versions in a row (per-version times)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S",
                    help="with --scenarios --versions: the seeds to run (default: each file's)")
    ap.add_argument("--swarm", action="append", default=[], metavar="KNOB=VALUE",
                    help="with --scenarios --versions: set a protocol knob in every scenario "
                         "(VALUE in JSON), e.g. --swarm uplink_window=24; repeatable")
    ap.add_argument("--lanes", type=lambda s: s if s == "auto" else int(s), default=None,
                    metavar="N|auto",
                    help="with --scenarios --versions: every cross-region link stripes each "
                         "chunk over N TCP connections (the node's [network] lanes; "
                         "network.lanes in a scenario file; auto: 4 on lossy links under "
                         "CUBIC/Reno, as a node with lanes = \"auto\"; default: each "
                         "file's, auto unless it says)")
    ap.add_argument("--against", type=Path, default=None, metavar="FILE",
                    help="with --scenarios --versions: an earlier result file; print and keep "
                         "each mean's change against it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if ((args.swarm or args.against or args.lanes is not None)
            and not (args.scenarios and (args.versions > 1 or args.seeds))):
        ap.error("--swarm, --lanes and --against go with --scenarios --versions N or --seeds")
    if args.lanes not in (None, "auto") and not 1 <= args.lanes <= 64:
        ap.error("--lanes: a count in 1..64, or auto")
    if args.scenarios and (args.versions > 1 or args.seeds):
        try:
            knobs = parse_knobs(args.swarm)
            before = load_against(args.against) if args.against is not None else None
        except ConfigError as e:
            ap.error(str(e))
        return run_versions(args.only, max(1, args.versions), args.seeds or [],
                            Path(args.out or ROOT / "benchmarks" / "results" / "sim_versions.json"),
                            knobs, before, args.lanes)
    if args.scenarios:
        return run_scenarios(args.only, Path(args.out or ROOT / "benchmarks" / "results" / "sim_scenarios.json"))
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "sim.json")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for name, strategies in CASES:
        if args.only and name not in args.only:
            continue
        sc = scenario(name, args.quick)
        rows = []
        for strategy in strategies:
            t0 = time.perf_counter()
            _, fig = run_strategy(sc, strategy)
            fig["bench_wall_s"] = round(time.perf_counter() - t0, 2)
            rows.append(fig)
            results.setdefault(sc.name, {})[strategy] = fig
            print(f"{sc.name} {strategy}: p100 {fig['t_p100_s']} s, bound {fig['lower_bound_s']} s, "
                  f"ratio {fig['t_p100_over_bound']}, xregion {fig['cross_region_ratio']}, "
                  f"wall {fig['wall_s']} s, events {fig['events']}", flush=True)
        print(f"\n== {sc.name}: {sc.nodes} nodes, {len(sc.regions)} regions")
        print(format_table(rows))
        print()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
