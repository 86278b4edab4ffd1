"""Publish a new version from the trainer: diff, sign, seed every region.

``patchswarm publish --config configs/trainer.toml NEW.safetensors`` runs the
origin node (also the swarm's tracker) for one version:

1. the origin starts *first*, so nodes can find it while the rest happens. A
   node finds a restarted origin at its next redial of the bootstrap list: within
   about 1.5 x ``redial_s`` + ``heartbeat_s`` (5 s and 1 s by default: ~8.5 s);
2. meanwhile NEW is loaded and encoded (on a worker thread), and the command
   waits for peers: until ``--regions N`` regions and ``--nodes N`` nodes have
   connected (every region counts, the origin's own included), else until every
   region and node the previous run met has (``regions.json`` in the trainer's
   store), else for the whole ``--wait-peers-s`` bound (default: that redial
   time), so that a version is never published into an empty swarm unawares;
3. the version is stored and handed to the swarm (after ``[publish] max_lag``
   allows it; an anchor follows when ``[publish] anchor_every`` says so), and the
   command waits until, in every expected region, every node that reports to the
   origin is active on the version (verified on its truth; a region none of whose
   nodes reports: until it holds every chunk), with a progress bar per region on
   a terminal; then it stays ``--linger`` seconds as the tracker for late nodes.

``--full`` publishes NEW as a full checkpoint (an anchor) instead of a patch.
FP32 tensors in NEW are taken as masters and turned into the served view
(``publish.served_dtype``); BF16/FP8 tensors are published as they are.
``--json`` prints one JSON object at the end (version, bytes, and the timings:
origin up, peers, encode, hand-off and per-region completion, in seconds from
the start of the command). Logs (``--log-level``, ``--log-json``) go to stderr.
For training loops, ``trainer.publisher.Publisher`` keeps the origin running.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

log = logging.getLogger("patchswarm.publish")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="NEW.safetensors", help="the new weights")
    parser.add_argument("--config", required=True, metavar="FILE", help="trainer TOML config")
    parser.add_argument("--full", action="store_true",
                        help="publish a full checkpoint (an anchor for joiners), not a patch")
    parser.add_argument("--regions", type=int, metavar="N",
                        help="regions to wait for, the origin's own included (default: those "
                             "the last run met)")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="nodes to wait for before handing the version over")
    parser.add_argument("--wait-peers-s", "--wait-peers", dest="wait_peers", type=float,
                        metavar="S",
                        help="longest wait for peers before the hand-off (default: the nodes' "
                             "redial time, 1.5 x redial_s + heartbeat_s + 1)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="give up waiting for the regions after this many seconds "
                             "(default 600)")
    parser.add_argument("--linger", type=float, default=2.0, metavar="S",
                        help="stay up this long afterwards as the tracker for nodes that "
                             "redial late (default 2)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the result and timings")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        help="log level (default: the config's log.level)")
    parser.add_argument("--log-json", action="store_true",
                        help="logs as one JSON object per line (default: log.format)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def mark(self, name: str) -> float:
        self.marks[name] = self.now()
        return self.marks[name]


def redial_bound(cfg: Any) -> float:
    """Seconds within which every node that lost the origin dials it again."""
    core = cfg.core_config()
    return 1.5 * core.redial_s + core.heartbeat_s + 1.0


def one_version(cfg: Any) -> Any:
    """``cfg`` with what a long-running origin sets up for later versions cut to a node's
    defaults, as this process publishes one version:

    - the warm heap (``DEFAULT_ORIGIN_WARM_MEMORY_MIB``): touching it would only delay the
      origin's start (~0.35 s per 256 MiB on the VM of docs/benchmarks.md);
    - the warm-up of its links to other regions' borders (``[network] warm_up_kib``,
      ``DEFAULT_ORIGIN_WARM_UP_KIB``): each call would pay its padding again (3.5-4 MiB
      across the emulated WAN's uplinks, 0.03 copies into each region of a 64 MiB patch),
      and the version leaves before most of it is sent."""
    import dataclasses

    from node.config import DEFAULT_WARM_MEMORY_MIB, DEFAULT_WARM_UP_KIB

    return dataclasses.replace(cfg, warm_memory_mib=min(cfg.warm_memory_mib,
                                                        DEFAULT_WARM_MEMORY_MIB),
                               warm_up_kib=min(cfg.warm_up_kib, DEFAULT_WARM_UP_KIB))


def run(args: argparse.Namespace) -> int:
    from node.config import load_config
    from node.logs import setup_logging
    from swarm.errors import ConfigError
    from trainer.publisher import Publisher

    clock = _Clock()
    cfg = load_config(args.config)
    setup_logging(cfg.node_id, args.log_level or cfg.log_level,
                  "json" if args.log_json else cfg.log_format)
    for name in ("regions", "nodes"):
        n = getattr(args, name)
        if n is not None and n < 0:
            raise ConfigError(f"--{name}: must be >= 0")
    wait_peers = args.wait_peers if args.wait_peers is not None else redial_bound(cfg)
    pub = Publisher(one_version(cfg))
    pub.start()
    log.info("origin up at %s after %.2f s", cfg.advertise, clock.mark("origin_up_s"))
    try:
        new = _load(args.checkpoint)
        clock.mark("loaded_s")
        return _publish(args, pub, new, clock, wait_peers)
    finally:
        pub.close()


def _load(path: str) -> dict:
    from safetensors.torch import load_file

    from swarm.errors import ConfigError, PatchswarmError

    try:
        return load_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except Exception as exc:
        raise PatchswarmError(f"{path}: not a readable safetensors file: {exc}") from None


def _wait_for_peers(args: argparse.Namespace, pub: Any, clock: _Clock, bound: float,
                    expected: set[str], expected_nodes: set[str]) -> None:
    """Block (on the publish worker, after the encode) until the peers we expect are here."""
    deadline = clock.t0 + bound
    want_regions = args.regions
    want_nodes = args.nodes
    told = want_regions is not None or want_nodes is not None
    if not told and (expected or expected_nodes):
        log.info("waiting up to %.1f s for the %d region(s) and %d node(s) the last run met",
                 max(0.0, deadline - time.monotonic()), len(expected), len(expected_nodes))
    elif told:
        log.info("waiting up to %.1f s for %s", max(0.0, deadline - time.monotonic()),
                 " and ".join(filter(None, [
                     f"{want_regions} region(s)" if want_regions is not None else "",
                     f"{want_nodes} node(s)" if want_nodes is not None else ""])))
    else:
        log.info("no --regions/--nodes and nothing remembered: letting nodes find the origin "
                 "for %.1f s (their redial time)", max(0.0, deadline - time.monotonic()))
    regions: list[str] = []
    nodes: dict[str, str] = {}
    ok = False
    while True:
        regions, nodes = pub.regions(), pub.nodes()
        if told:
            ok = ((want_regions is None or len(regions) >= want_regions)
                  and (want_nodes is None or len(nodes) >= want_nodes))
        elif expected or expected_nodes:
            ok = expected <= set(regions) and expected_nodes <= set(nodes)
        if ok or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    t = clock.mark("peers_s")
    if not regions:
        log.warning("peers: no node connected within %.1f s; handing the version over into "
                    "an empty swarm (nodes fetch it when they find the origin)", t)
    elif (told or expected or expected_nodes) and not ok:
        missing = sorted(expected - set(regions)) + sorted(expected_nodes - set(nodes))[:20]
        log.warning("peers: after %.1f s, %d region(s) %s and %d node(s) connected, not all "
                    "expected%s; handing the version over anyway", t, len(regions), regions,
                    len(nodes), f" (missing {missing})" if missing else "")
    else:
        log.info("peers: %d region(s) %s, %d node(s) after %.2f s", len(regions), regions,
                 len(nodes), t)


def _region_state(pub: Any, versions: list[tuple[int, int]], region: str,
                  fleet: Any) -> tuple[int, int, bool]:
    """(done, total, complete) for ``region``: chunks of ``versions`` known to be there,
    plus its reporting nodes active on the last of them. Complete when every node of
    it that reports to the origin is active on that version — verified on its truth:
    whether its engine took it is the node's business (``/healthz``, ``patchswarm
    fleet``), not the hand-off's — or, none reporting, when the region holds every
    chunk."""
    chunks = sum(c for _, c in versions)
    held = sum(min(c, pub.progress(v).get(region, 0)) for v, c in versions)
    last = versions[-1][0]
    nodes = fleet.nodes(region)
    active = sum(1 for e in nodes if (e.active or -1) >= last)
    if nodes and active == len(nodes):
        held = chunks  # a region whose nodes all hold it holds it, whatever we saw
    complete = active == len(nodes) if nodes else held >= chunks
    return held + active, chunks + len(nodes), complete


def _publish(args: argparse.Namespace, pub: Any, new: dict, clock: _Clock,
             wait_peers: float) -> int:
    import torch
    from tqdm.contrib.logging import logging_redirect_tqdm

    expected = set(pub.remembered_regions())
    expected_nodes = set(pub.remembered_nodes())
    fp32 = any(t.dtype == torch.float32 and not k.endswith(".scale") for k, t in new.items())
    handle = pub.publish_async(new, full=args.full, served_dtype="config" if fp32 else None,
                               gate=lambda: _wait_for_peers(args, pub, clock, wait_peers,
                                                            expected, expected_nodes))
    with logging_redirect_tqdm():  # log lines above the bars, not through them
        return _seed(args, pub, handle, clock, expected)


def _seed(args: argparse.Namespace, pub: Any, handle: Any, clock: _Clock,
          expected: set[str]) -> int:
    from tqdm import tqdm

    r = handle.result()
    handoff = clock.mark("handoff_s")
    log.info("version %d (%s) handed to the swarm at %.2f s: %d bytes in %d chunks, encoded "
             "in %.3f s", r.version, r.kind, handoff, r.patch_bytes, r.chunks, r.encode_s)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else (
        lambda text: print(text, flush=True))
    what = "full checkpoint" if r.kind == "full" else "patch"
    say(f"version {r.version}: {what} of {r.patch_bytes:,} bytes in {r.chunks} chunks, "
        f"{r.changed:,} of {r.elements:,} values changed")
    versions = [(r.version, r.chunks)]
    if r.anchor is not None:
        versions.append((r.anchor.version, r.anchor.chunks))
        say(f"version {r.anchor.version}: anchor (full checkpoint of version {r.version}) of "
            f"{r.anchor.patch_bytes:,} bytes in {r.anchor.chunks} chunks")
    want = set(expected) | set(pub.regions())
    bars: dict[str, Any] = {}
    done_at: dict[str, float] = {}
    deadline = time.monotonic() + args.timeout
    complete = False
    while True:
        fleet = pub.fleet()
        want |= set(pub.regions())
        for region in sorted(want):
            n, total, finished = _region_state(pub, versions, region, fleet)
            if not args.no_progress:
                bar = bars.get(region)
                if bar is None:
                    bar = bars[region] = tqdm(total=total, desc=region, unit="step",
                                              position=len(bars), file=sys.stderr, leave=True,
                                              disable=None)  # none when stderr is no tty
                if bar.total != total:
                    bar.total = total
                bar.n = min(n, total)
                bar.refresh()
            if finished and region not in done_at:
                done_at[region] = clock.now()
                log.info("region %s: version %d there after %.2f s (%.2f s after the hand-off)",
                         region, versions[-1][0], done_at[region], done_at[region] - handoff)
        need = max(1, args.regions or 0)
        complete = len(done_at) >= need and want <= set(done_at)
        if complete or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for bar in bars.values():
        bar.close()
    missing = sorted(want - set(done_at))
    if args.regions is not None and len(want) < args.regions:
        missing.append(f"{args.regions - len(want)} region(s) never connected")
    ok = complete
    clock.mark("done_s")
    if ok:
        say(f"version {versions[-1][0]} seeded into {len(done_at)} region(s) in "
            f"{clock.marks['done_s'] - handoff:.2f} s after the hand-off")
        time.sleep(max(0.0, args.linger))
    else:
        log.warning("timeout: after %.0f s, not every region holds version %d: %s",
                    args.timeout, versions[-1][0], missing)
        print(f"version {versions[-1][0]} did not reach every region within "
              f"{args.timeout:.0f} s: {', '.join(missing)}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "ok": ok, "version": r.version, "kind": r.kind, "bytes": r.patch_bytes,
            "chunks": r.chunks, "changed": r.changed, "elements": r.elements,
            "anchor": None if r.anchor is None else {"version": r.anchor.version,
                                                     "bytes": r.anchor.patch_bytes,
                                                     "chunks": r.anchor.chunks},
            "encode_s": round(r.encode_s, 4), "lag_wait_s": round(r.lag_wait_s, 3),
            "timings": {**clock.marks, "regions": done_at},
            "regions_expected": sorted(want), "missing": missing,
        }, sort_keys=True), flush=True)
    return 0 if ok else 1
