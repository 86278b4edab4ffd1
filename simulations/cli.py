"""Simulate a fanout over a modelled network, driving the real protocol core.

Reads a scenario TOML (see configs/sim/ and docs/simulation.md), runs every
requested strategy with the same seed, and writes DIR/report.json (the first
strategy's figures at top level, all strategies under "strategies"), a
completion-CDF plot and a per-strategy plot (CDF per region, upload per node).
Same scenario, same seed: same numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO.toml", help="scenario file")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument(
        "--strategies",
        nargs="+",
        metavar="NAME",
        default=None,
        help="strategies to compare: patchswarm per-region direct flat full (default: the scenario's)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--compare-demo", metavar="DEMO.json", default=None,
        help="a `patchswarm demo --json` result to compare bytes per region and sender kind with",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from simulations.report import format_table, plot, write_report
    from simulations.runner import run_strategy
    from simulations.scenario import load_scenario, validate_strategies

    sc = load_scenario(args.scenario)
    strategies = validate_strategies(args.strategies) if args.strategies else sc.strategies
    seed = sc.seed if args.seed is None else args.seed
    if seed < 0:
        from swarm.errors import ConfigError

        raise ConfigError("--seed: must be >= 0")
    out = Path(args.out)
    results, runs = [], []
    for strategy in strategies:
        total = sc.nodes * sc.versions
        bar = tqdm(
            total=total,
            desc=f"{strategy:>10}",
            unit="node",
            disable=args.quiet,
            file=sys.stderr,
            dynamic_ncols=True,
        )

        def progress(done: int, events: int, now: float, bar: tqdm = bar) -> None:
            bar.n = min(done, bar.total)
            bar.set_postfix_str(f"t={now:.2f}s events={events}", refresh=False)
            bar.refresh()

        result, fig = run_strategy(sc, strategy, seed=seed, progress=progress)
        bar.n = min(sum(len(d) for d in result.done.values()), total)
        bar.close()
        results.append(fig)
        runs.append(result)
    if args.compare_demo:
        results[0]["loopback_comparison"] = _compare(results[0], args.compare_demo)
    path = write_report(out, sc, seed, results)
    if not args.no_plots:
        plot(out, sc, runs)
    print(format_table(results))
    if args.compare_demo:
        cmp = results[0]["loopback_comparison"]
        print("\nbytes received, in payload copies: region  kind  simulated  loopback")
        for row in cmp["rows"]:
            print(f"  {row['region']:>8} {row['kind']:>13} {row['sim_copies']:>9} {row['demo_copies']:>9}")
        print(f"  fanout: simulated p100 {cmp['fanout_s']['sim_p100']} s, loopback {cmp['fanout_s']['demo']} s")
    print(f"report: {path}")
    return 0


def _compare(fig: dict, demo_path: str) -> dict:
    import json

    from simulations.report import compare_with_demo
    from swarm.errors import ConfigError

    try:
        demo = json.loads(Path(demo_path).read_text(encoding="utf-8"))
        return compare_with_demo(fig, demo)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--compare-demo {demo_path}: not a usable demo JSON ({exc})") from exc
