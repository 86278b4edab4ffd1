"""Loopback benchmark: real node processes on 127.0.x.x, a large synthetic patch.

Starts ``--regions x --nodes-per-region`` real ``patchswarm node`` processes
(``lab.fleet.LoopbackFleet``) from a synthetic BF16 base of ``--params``
values, runs the origin in this process (``trainer.publisher.Publisher``) and
publishes ``--versions`` versions made by moving every FP32 master by
``--step`` x N(0, 1), so most served values change and each patch is tens of MB.
Per version it measures:

- per-node throughput: patch bytes / (node active - published), apply included;
- swarm goodput: chunk bytes all nodes received / time until the last node is active;
- CPU-seconds per GB moved: utime + stime of every node process (``/proc/<pid>/stat``)
  over the version, divided by the chunk bytes the nodes received (each byte moved
  costs a send on one node and a receive, hash, store and apply on another);
- trainer egress: chunk bytes the origin sent, against regions x patch bytes
  (below 1 when regions relay to each other), and the bytes that entered the
  regions from outside (nodes' own accounting), against the same.

Prints a table and writes ``benchmarks/results/loopback.json``.

    python benchmarks/bench_loopback.py                       # 2 x 3 nodes, 2 versions
    python benchmarks/bench_loopback.py --params 8000000 --versions 1   # quick

With ``--netlab`` (root) the nodes run on emulated hosts instead of loopback:
network namespaces whose region uplinks are shaped with tbf to
``--uplink-mbit`` (``lab.netlab``), and the run is repeated with
region-to-region relaying on and off, to compare the two levels of seeding
against the trainer feeding every region itself. Writes
``benchmarks/results/netlab.json``.

    python benchmarks/bench_loopback.py --netlab --regions 3 --nodes-per-region 2 \
        --uplink-mbit 100 --params 8000000 --versions 2
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

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def synthetic_masters(params: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    per = 4_000_000
    out = {}
    for k in range(max(1, (params + per - 1) // per)):
        n = min(per, params - k * per)
        out[f"layer{k}.weight"] = torch.randn(n // 1000, 1000, generator=g) * 0.05
    return out


def run_fleet(args: argparse.Namespace, *, lab=None, relay: bool = True) -> tuple[list, float]:
    """Start the fleet, publish ``args.versions`` versions, measure each; -> (rows, setup_s)."""
    import torch

    from lab.fleet import LoopbackFleet
    from trainer.served import served_view

    torch.set_num_threads(1)
    masters = synthetic_masters(args.params, 0)
    base = served_view(masters, "bf16")
    rows = []
    with LoopbackFleet(args.regions, args.nodes_per_region, chunk_size=args.chunk_size,
                       swarm={"redial_s": 1.0, "relay": relay}, lab=lab,
                       tls=getattr(args, "tls", False)) as fleet:
        t0 = time.monotonic()
        fleet.start_nodes_only(base, timeout=args.timeout)
        pub = fleet.start_origin(base, regions=args.regions, settle_s=3.0)
        try:
            setup_s = time.monotonic() - t0
            core = pub.node.core
            pids = {n.name: n.proc.pid for n in fleet.nodes if n.proc is not None}
            for k in range(args.versions):
                g = torch.Generator().manual_seed(k + 1)
                masters = {n: v + args.step * torch.randn(v.shape, generator=g)
                           for n, v in masters.items()}
                before = {n: fleet.status(x) for n, x in zip(pids, fleet.nodes, strict=True)}
                cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
                sent0 = pub.node.driver.call(lambda: sum(core.counters.sent_bytes.values()))
                r = pub.publish(masters)
                sts = fleet.wait_version(r.version, timeout=args.timeout)
                cpu1 = {n: cpu_seconds(p) for n, p in pids.items()}
                sent1 = pub.node.driver.call(lambda: sum(core.counters.sent_bytes.values()))
                times = [st["activated_at"][str(r.version)] - r.published_at for st in sts.values()]
                recv = sum(sum(st["bytes"]["received"].values()) - sum(before[n]["bytes"]["received"].values())
                           for n, st in sts.items())
                def cross(st: dict) -> int:
                    got = st["bytes"]["received"]
                    return got["cross_region"] + got["from_trainer"]

                inflow = sum(cross(st) - cross(before[n]) for n, st in sts.items())
                cpu = sum(cpu1[n] - cpu0[n] for n in pids)
                egress = sent1 - sent0
                row = {
                    "version": r.version, "patch_bytes": r.patch_bytes, "chunks": r.chunks,
                    "changed_fraction": round(r.changed / r.elements, 4),
                    "encode_s": round(r.encode_s, 3),
                    "fanout_s": round(max(times), 3), "first_active_s": round(min(times), 3),
                    "node_mb_s": [round(r.patch_bytes / t / 1e6, 2) for t in times],
                    "node_mb_s_median": round(statistics.median(r.patch_bytes / t / 1e6 for t in times), 2),
                    "swarm_goodput_mb_s": round(recv / max(times) / 1e6, 2),
                    "nodes_received_bytes": recv,
                    "node_cpu_s": round(cpu, 2),
                    "cpu_s_per_gb": round(cpu / (recv / 1e9), 2) if recv else None,
                    "trainer_egress_bytes": egress,
                    "egress_ratio": round(egress / (args.regions * r.patch_bytes), 4),
                    "cross_region_ratio": round(inflow / (args.regions * r.patch_bytes), 4),
                    "converged": all(st["active_digest"] == r.target_digest.hex() for st in sts.values()),
                }
                rows.append(row)
        finally:
            pub.close()
    return rows, setup_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--nodes-per-region", type=int, default=3)
    ap.add_argument("--params", type=int, default=24_000_000, help="served values (BF16)")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--step", type=float, default=2e-3, help="master move per version, x N(0,1)")
    ap.add_argument("--chunk-size", type=int, default=1024 * 1024)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--netlab", action="store_true",
                    help="emulated hosts in network namespaces with shaped uplinks (root)")
    ap.add_argument("--uplink-mbit", type=float, default=100.0, help="with --netlab")
    ap.add_argument("--trainer-uplink-mbit", type=float, default=None, help="with --netlab")
    ap.add_argument("--tls", action="store_true",
                    help="mutual TLS between every process (certificates from a swarm CA)")
    ap.add_argument("--inner-lab", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if args.netlab and args.inner_lab is None:
        return outer_netlab(args, argv if argv is not None else sys.argv[1:])
    if args.inner_lab is not None:
        from lab.netlab import NetLab

        lab = NetLab(args.regions, args.nodes_per_region, tag=args.inner_lab)
        runs = {}
        for relay in (True, False):
            rows, setup_s = run_fleet(args, lab=lab, relay=relay)
            runs["relay" if relay else "per-region"] = {"setup_s": round(setup_s, 1), "versions": rows}
        result = {"bench": "netlab", "tls": args.tls, "regions": args.regions,
                  "nodes_per_region": args.nodes_per_region, "params": args.params,
                  "chunk_size": args.chunk_size, "uplink_mbit": args.uplink_mbit,
                  "trainer_uplink_mbit": args.trainer_uplink_mbit or args.uplink_mbit,
                  "runs": runs}
        print("strategy | ver | patch MB | fanout s | trainer egress / (R x patch) | cross-region / (R x patch) | ok")
        for name, run in runs.items():
            for row in run["versions"]:
                print(" | ".join(str(x) for x in (
                    name, row["version"], round(row["patch_bytes"] / 1e6, 1), row["fanout_s"],
                    row["egress_ratio"], row["cross_region_ratio"], row["converged"])))
        out = Path(args.out or ROOT / "benchmarks" / "results" / "netlab.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0 if all(r["converged"] for run in runs.values() for r in run["versions"]) else 1

    rows, setup_s = run_fleet(args)
    result = {"bench": "loopback", "regions": args.regions, "nodes_per_region": args.nodes_per_region,
              "nodes": args.regions * args.nodes_per_region, "params": args.params,
              "chunk_size": args.chunk_size, "step": args.step, "cpus": os.cpu_count(),
              "load_avg": os.getloadavg(), "setup_s": round(setup_s, 1), "versions": rows}
    hdr = ("ver", "patch MB", "changed", "fanout s", "node MB/s (median)", "swarm MB/s",
           "CPU-s/GB", "trainer egress / (R x patch)", "cross-region / (R x patch)", "ok")
    print(" | ".join(hdr))
    for row in rows:
        print(" | ".join(str(x) for x in (
            row["version"], round(row["patch_bytes"] / 1e6, 1), row["changed_fraction"],
            row["fanout_s"], row["node_mb_s_median"], row["swarm_goodput_mb_s"],
            row["cpu_s_per_gb"], row["egress_ratio"], row["cross_region_ratio"],
            row["converged"])))
    out = Path(args.out or ROOT / "benchmarks" / "results" / "loopback.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["converged"] for r in rows) else 1


def outer_netlab(args: argparse.Namespace, argv: list[str]) -> int:
    """Build the lab, run this script again inside the trainer's namespace, tear down."""
    import subprocess

    from lab.netlab import NetLab, available

    why = available()
    if why:
        print(f"--netlab: {why}", file=sys.stderr)
        return 2
    with NetLab(args.regions, args.nodes_per_region, uplink_mbit=args.uplink_mbit,
                trainer_uplink_mbit=args.trainer_uplink_mbit) as lab:
        cmd = [*lab.exec_prefix(lab.ns_trainer), sys.executable, str(Path(__file__).resolve()),
               *argv, "--inner-lab", lab.tag]
        return subprocess.run(cmd, check=False, timeout=args.timeout * 4 + 300).returncode


if __name__ == "__main__":
    sys.exit(main())
