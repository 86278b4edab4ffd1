"""Simulator benchmarks: the issue-5 targets and the strategy table.

    python benchmarks/bench_sim.py [--quick] [--only NAME ...]

Runs each (scenario, strategies) case below through the simulator, prints one
table row per run and writes every report to ``benchmarks/results/sim.json``.
``--quick`` swaps the 10k fleet for a 1k one (same shape) for a smoke run.
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

CASES = [
    ("fleet-10k", ("patchswarm",)),
    ("churn", ("patchswarm",)),
    ("churn-baseline", ("patchswarm",)),  # the churn scenario without churn: the cost of churn
    ("libtorrent-3x4", ("patchswarm", "per-region", "direct", "flat")),
    ("strategies-500", ("patchswarm", "per-region", "direct", "flat", "full")),
    ("loopback-2x4", ("patchswarm",)),
]


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
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim.json"))
    args = ap.parse_args()
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
