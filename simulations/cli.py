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
from typing import Any


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
    parser.add_argument(
        "--timeline", type=int, default=None, metavar="K",
        help="record the K-th version published (1 = the first) under the first strategy: "
             "every chunk transfer, the origin's decisions and each node's apply, into "
             "DIR/timeline.json, and print each region's downlink use over time",
    )
    parser.add_argument("--bin", type=float, default=0.1, metavar="S",
                        help="with --timeline: the downlink-use table's time bin (default 0.1 s)")


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
    timeline = _timeline_arg(args, sc)
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

        result, fig = run_strategy(sc, strategy, seed=seed, progress=progress,
                                   timeline=timeline if not runs else None)
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
    if timeline is not None:
        print(_write_timeline(out, sc, runs[0], timeline, args.bin, not args.no_plots))
    return 0


def _timeline_arg(args: argparse.Namespace, sc: Any) -> Any:
    from simulations.driver import BASE_VERSION
    from simulations.timeline import Timeline
    from swarm.errors import ConfigError

    if args.timeline is None:
        return None
    if not 1 <= args.timeline <= sc.versions:
        raise ConfigError(f"--timeline: the scenario publishes {sc.versions} version(s), "
                          f"so K must be in 1..{sc.versions}, not {args.timeline}")
    if not args.bin > 0:
        raise ConfigError(f"--bin: must be > 0 seconds, not {args.bin}")
    return Timeline(BASE_VERSION + args.timeline)


def _write_timeline(out: Path, sc: Any, run: Any, timeline: Any, bin_s: float,
                    plots: bool) -> str:
    """DIR/timeline.json (rows and each region's downlink use), DIR/timeline.png, and
    the tables as text."""
    import json

    from simulations.timeline import downlink_use, format_ramp, format_use, plot_use, ramp

    rows = timeline.result()
    use, ramps, text = {}, {}, []
    for r in sc.regions:
        cap = 8 * sum(down for _up, down in run.capacities[r.name])  # bytes/s -> bits/s
        use[r.name] = downlink_use(rows, r.name, cap, bin_s)
        if use[r.name]:
            ramps[r.name] = ramp(rows, r.name, use[r.name], bin_s)
            text.append(format_use(r.name, use[r.name]))
    text.extend(format_ramp(name, summary) for name, summary in ramps.items())
    path = out / "timeline.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": timeline.version, "bin_s": bin_s, "rows": rows,
                                "downlink_use": use, "ramp": ramps}, indent=1) + "\n",
                    encoding="utf-8")
    text.append(f"timeline: {path} ({len(rows)} rows)")
    if plots:
        png = plot_use(out / "timeline.png", f"{sc.name}: version {timeline.version}, "
                       f"into each region per {bin_s:g} s", use)
        text.append(f"plot: {png}")
    return "\n".join(text)


def _compare(fig: dict, demo_path: str) -> dict:
    import json

    from simulations.report import compare_with_demo
    from swarm.errors import ConfigError

    try:
        demo = json.loads(Path(demo_path).read_text(encoding="utf-8"))
        return compare_with_demo(fig, demo)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--compare-demo {demo_path}: not a usable demo JSON ({exc})") from exc
