"""A node's CPU while it moves nothing: real ``patchswarm node`` processes on loopback.

Starts a ``lab.fleet.LoopbackFleet`` (``--regions`` x ``--nodes`` real node processes,
mutual TLS as shipped, and the trainer), publishes one version so every link is up and
the mesh settled, then reads each node's CPU (utime + stime, ``/proc/<pid>/stat``) over
``--seconds`` of:

- ``idle``: nothing asked of the nodes (heartbeats, timers, the mesh's upkeep);
- ``polled``: ``/status`` read from every node every ``--poll-s`` seconds, as
  ``benchmarks/bench_wan.py`` reads the nodes it waits for during a version;
- ``idle`` again, to see the first was not a start-up tail.

Why it matters: ``bench_wan.py``'s node CPU per GB counts a node's CPU over a whole
version's window, ~6.5 s on the emulated WAN, and region 0's nodes are done in ~1 s of
it. Prints a table and writes ``benchmarks/results/node_idle.json``.

    python benchmarks/bench_node_idle.py                   # 3 regions x 4 nodes, 20 s each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.fleet import LoopbackFleet  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def measure(fleet: LoopbackFleet, seconds: float, poll_s: float | None) -> dict[str, float]:
    """Each node's CPU, milliseconds per second, over ``seconds`` (with ``/status`` polls
    every ``poll_s`` when given)."""
    pids = {n.name: n.proc.pid for n in fleet.nodes if n.proc is not None}
    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if poll_s:
            for n in fleet.nodes:
                fleet.status(n)
            time.sleep(poll_s)
        else:
            time.sleep(0.5)
    dt = time.monotonic() - t0
    return {k: round(1000 * (cpu_seconds(p) - c0[k]) / dt, 2) for k, p in pids.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regions", type=int, default=3, help="regions (default 3)")
    ap.add_argument("--nodes", type=int, default=4, help="nodes per region (default 4)")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="length of each measured phase (default 20)")
    ap.add_argument("--poll-s", type=float, default=0.5,
                    help="seconds between /status polls in the polled phase (default 0.5)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "node_idle.json"),
                    help="JSON results (default benchmarks/results/node_idle.json)")
    args = ap.parse_args()
    phases: dict[str, dict[str, float]] = {}
    with LoopbackFleet(regions=args.regions, nodes_per_region=args.nodes) as fleet:
        fleet.start()
        fleet.publish_converged()
        time.sleep(5.0)  # the version's reports and the applies settle
        phases["idle"] = measure(fleet, args.seconds, None)
        phases["polled"] = measure(fleet, args.seconds, args.poll_s)
        phases["idle_again"] = measure(fleet, args.seconds, None)
    rows = {k: {"median_ms_per_s": statistics.median(v.values()), "min": min(v.values()),
                "max": max(v.values()), "nodes": v} for k, v in phases.items()}
    print(f"{args.regions} regions x {args.nodes} nodes, {args.seconds:.0f} s a phase")
    print("phase       | node CPU, ms per s: median (min-max)")
    for k, r in rows.items():
        print(f"{k:11s} | {r['median_ms_per_s']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    out = {"bench": "node_idle", "regions": args.regions, "nodes_per_region": args.nodes,
           "seconds": args.seconds, "poll_s": args.poll_s, "phases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
