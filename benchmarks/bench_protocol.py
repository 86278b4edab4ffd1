"""In-memory protocol bench: events/second of NodeCore at fleet scale.

Zero-cost network (swarm/protocol/testing.py: fixed latency, uploads at full rate),
so the time measured is the protocol core plus a trivial heap driver. Prints a
table and writes benchmarks/results/protocol.json.

    python benchmarks/bench_protocol.py [--nodes 2000] [--regions 5] [--chunks 120]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from swarm.protocol import events as ev
from swarm.protocol.testing import Net, Signer

ROOT = Path(__file__).resolve().parents[1]


def run(nodes: int, regions: int, chunks: int, knobs: dict) -> dict:
    s = Signer()
    net = Net(s, latency=0.002, rate=1e6)
    base = s.manifest(1, 4, kind="full")
    o = net.add("origin", "trainer", role="origin", active_version=1, **knobs)
    net.start(o)
    per = nodes // regions
    hosts = []
    for r in range(regions):
        for k in range(per):
            boot = (o.addr, *tuple(f"r{r}n{j}:1" for j in range(max(0, k - 3), k)))
            hosts.append(net.add(f"r{r}n{k}", f"reg{r}", bootstrap=boot, active_version=1, **knobs))
    for h in hosts:
        net.start(h)
        net.deliver(h, ev.LocalChunks(net.now, base, tuple(range(4))))
    net.run(3.0)
    e0, t0, w0 = net.events, net.now, time.perf_counter()
    net.deliver(o, ev.Publish(net.now, s.manifest(2, chunks)))
    net.run(t0 + 600, stop=lambda: all(2 in h.applied for h in hosts))
    wall = time.perf_counter() - w0
    events = net.events - e0
    cross: Counter = Counter()
    for a, b, _v, _i in net.sent_chunks:
        ra, rb = net.host(a).region, net.host(b).region
        if ra != rb:
            cross[rb] += 1
    # flow bound of this toy network: each node downloads at most one chunk per
    # chunk-time per upload, so chunks x 1 ms is a floor on anyone's completion
    return {
        "nodes": len(hosts), "regions": regions, "chunks": chunks, "knobs": knobs,
        "converged": sum(2 in h.applied for h in hosts), "virtual_s": round(net.now - t0, 4),
        "events": events, "wall_s": round(wall, 2), "events_per_s": round(events / wall),
        "us_per_chunk_delivered": round(wall / (len(hosts) * chunks) * 1e6, 1),
        "cross_region_ratio": round(sum(cross.values()) / (regions * chunks), 4),
        "origin_chunks_sent": sum(o.core.counters.sent_chunks.values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--regions", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=120)
    a = ap.parse_args()
    rows = [run(a.nodes, a.regions, a.chunks, k) for k in ({}, {"relay": False})]
    cols = ["knobs", "nodes", "converged", "events", "wall_s", "events_per_s",
            "us_per_chunk_delivered", "cross_region_ratio", "origin_chunks_sent"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    out = ROOT / "benchmarks" / "results" / "protocol.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
