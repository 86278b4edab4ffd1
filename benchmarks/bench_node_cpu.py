"""Node CPU per GB received: real ``patchswarm node`` processes on loopback, TLS on.

Starts ``--nodes`` real node processes in one region (``lab.fleet.LoopbackFleet``,
mutual TLS as shipped, in-process engine on CPU) and runs the origin in this
process (``trainer.publisher.Publisher``). Each version is a *dense* patch of a
``--mib`` MiB BF16 view in which every value changed to a random finite BF16
(``bench_wan.dense_pair``), so the patch barely compresses and is about as large
as the view. Per version and per node it measures:

- CPU-seconds per GB received: utime + stime of the node process
  (``/proc/<pid>/stat``) from the publish until every node is active, divided by
  the chunk bytes that node received (``/status`` bytes.received). The node also
  uploads to its peers, hashes, stores and applies: all of it is in the numerator;
- the same split by thread (``/proc/<pid>/task/*``): the event-loop thread (TLS,
  websockets, the core, the driver), the worker threads (``asyncio.to_thread``:
  hash + store of received chunks, reads of chunks to upload, stage + commit of
  the patch) and the rest (torch's threads, threads that exited);
- each node's resident memory after the version and at its peak so far
  (``/proc/<pid>/status`` VmRSS, VmHWM);
- with ``--perf`` (Linux ``perf``, root) one node is sampled during the last
  version (``perf record``, every thread, kernel included) and the samples are
  sorted by symbol into ``perfstat.PERF_GROUPS`` (fresh pages, kernel page-cache copies, kernel socket
  I/O, TLS, user-space memcpy, hashing, codec, the interpreter, ...);
- with ``--py-spy PATH`` (a py-spy binary; not a project dependency) one node is
  sampled during the last version (``py-spy record --native``, all threads, idle
  samples left out) and the samples are sorted into stages by their Python
  stack (TLS, websocket framing, hashing, store, decode + apply, ...; ``STAGES``).
  py-spy pauses the process for every sample: that node's own CPU figure is
  inflated, the shares are what to read.

Prints a table and writes ``benchmarks/results/node_cpu.json``.

    python benchmarks/bench_node_cpu.py                      # 4 nodes, 128 MiB, 3 versions
    python benchmarks/bench_node_cpu.py --mib 64 --versions 2 --py-spy "$(which py-spy)"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import perfstat  # noqa: E402  (benchmarks/perfstat.py: perf record, stop, group)

from node.config import DEFAULT_WARM_MEMORY_MIB  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")

# (stage, substrings of a frame) in priority order: a sample goes to the first stage
# one of whose markers appears in any of its frames, scanning from the leaf up. The
# stages of native work come first (a hash under the driver's frames is the hash's);
# then a sample whose leaf is a libc frame (a system call, a copy) goes to
# ``SYSCALLS`` before the Python stages (``PYTHON_FROM``), so the kernel's send under the
# driver's writer is not counted as the driver's Python (round 57).
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("hash (BLAKE3)", ("blake3",)),
    ("decode + apply (codec)", ("swarm/codec", "zstd", "ZSTD", "xxh", "XXH", "torch", "libtorch",
                                "inprocess.py", "at::", "c10::")),
    ("store write", ("_atomic_write", "put_manifest")),
    ("store read", ("read_chunk", "read_bytes", "iter_payload")),
    ("TLS (OpenSSL)", ("libssl", "libcrypto", "SSL_", "ssl_", "_ssl", "sslproto", "aes", "gcm",
                       "chacha", "ossl_", "EVP_")),
    ("websocket framing", ("_websocket", "websocket_mask", "http_websocket", "web_ws",
                           "client_ws")),
    ("msgpack", ("msgpack",)),
    ("block reassembly (wire)", ("wire.py",)),
    ("protocol core", ("swarm/protocol",)),
    ("status API / metrics", ("node/api.py", "metrics", "web_protocol", "http_parser",
                              "web_response")),
    ("driver (Python)", ("node/driver.py",)),
    ("event loop / syscalls", ("uvloop", "asyncio", "epoll", "libc", "libpthread", "memcpy",
                               "memmove", "__libc", "syscall", "sock", "recv", "send")),
]


def proc_cpu(pid: int) -> float:
    """utime + stime of one process (threads that exited included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_detail(pid: int) -> dict[str, float]:
    """user and system CPU-seconds and minor page faults of one process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"user_s": int(fields[11]) / CLK_TCK, "sys_s": int(fields[12]) / CLK_TCK,
            "minflt": int(fields[7])}


def proc_memory(pid: int) -> dict[str, float]:
    """Resident memory now and at its peak (VmRSS, VmHWM), MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss_mib" if key == "VmRSS" else "peak_rss_mib"] = round(
                    int(rest.split()[0]) / 1024, 1)
    return out


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, utime + stime) for every live thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def split_threads(pid: int, t0: dict, t1: dict, total: float) -> dict[str, float]:
    """CPU of a process between two ``thread_cpu`` snapshots: the event-loop (main)
    thread and every other thread (Python does not name OS threads, so the
    ``asyncio.to_thread`` workers and torch's threads are one figure)."""
    loop = 0.0
    if pid in t1:
        loop = t1[pid][1] - t0.get(pid, ("", 0.0))[1]
    return {"loop": loop, "threads": max(0.0, total - loop)}


# a sample whose stack holds one of these is a thread waiting, not running (py-spy's
# idle detection does not work with --native)
WAITING = ("PyThread_acquire_lock_timed", "pthread_cond_timedwait", "pthread_cond_wait",
           "epoll_pwait", "epoll_wait", "take_gil", "sem_wait", "sem_timedwait", "futex",
           "select (", "poll (")


PYTHON_FROM = "block reassembly (wire)"  # the first stage of Python code
SYSCALLS = "event loop / syscalls"
LIBC_LEAF = ("(libc.so", "(libpthread", "(ld-linux")


def classify(stack: list[str]) -> str:
    if any(w in frame for frame in stack[-4:] for w in WAITING):
        return "(waiting)"
    for stage, marks in STAGES:
        if stage == PYTHON_FROM and stack and any(m in stack[-1] for m in LIBC_LEAF):
            return SYSCALLS
        for frame in reversed(stack):
            if any(m in frame for m in marks):
                return stage
    return "other"


def read_pyspy(path: Path) -> dict[str, int]:
    """Samples per stage from a py-spy ``raw`` (collapsed stacks) file."""
    counts: collections.Counter = collections.Counter()
    if not path.exists():
        return {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        counts[classify(stack.split(";"))] += int(n)
    counts.pop("(waiting)", None)
    return dict(counts.most_common())


def pyspy_thread_names(path: Path) -> dict[int, str]:
    """tid -> Python thread name, from the ``thread (TID): NAME`` roots of py-spy's stacks."""
    out = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            root = line.split(";", 1)[0]
            if root.startswith("thread (") and "): " in root:
                tid, _, name = root[len("thread ("):].partition("): ")
                if tid.isdigit():
                    out[int(tid)] = name.strip()
    return out


def run(args: argparse.Namespace) -> dict:
    import torch
    from bench_wan import dense_next, dense_pair

    from lab.fleet import LoopbackFleet

    torch.set_num_threads(1)
    base, view = dense_pair(args.mib * 1024 * 1024, 0)
    rows: list[dict] = []
    profile: dict[str, int] = {}
    profile_threads: dict = {}
    perf_shares: dict[str, float] = {}
    env = dict(kv.split("=", 1) for kv in args.node_env)
    keep = Path(args.keep_logs) if args.keep_logs else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    with LoopbackFleet(1, args.nodes, chunk_size=args.chunk_size, tls=not args.no_tls,
                       workdir=keep, keep_workdir=keep is not None,
                       swarm={"redial_s": 1.0},
                       node_section={"warm_memory_mib": args.warm_mib},
                       node_env={f"n0-{i}": env for i in range(args.nodes)}) as fleet:
        fleet.start_nodes_only(base, timeout=args.timeout)
        pub = fleet.start_origin(base, regions=1)
        try:
            pids = {n.name: n.proc.pid for n in fleet.nodes if n.proc is not None}
            for k in range(args.versions):
                if k:
                    view = dense_next(view, k + 1)
                spy = None
                spy_out = fleet.workdir / f"pyspy-{k}.txt"
                perf_proc = None
                perf_out = fleet.workdir / "perf.data"
                if args.perf and k == args.versions - 1:
                    perf_proc = perfstat.record(args.perf, pids[fleet.nodes[-1].name], perf_out,
                                                call_graph=args.perf_call_graph)
                    time.sleep(1.0)
                if args.py_spy and k == args.versions - 1:
                    victim = pids[fleet.nodes[-1].name]
                    spy = subprocess.Popen(
                        [args.py_spy, "record", "-p", str(victim), "-r", str(args.rate), "-f",
                         "raw", "-o", str(spy_out), "--native", "--threads"],
                        stdout=subprocess.DEVNULL,
                        stderr=(fleet.workdir / "pyspy.log").open("wb"))
                    time.sleep(1.0)
                before = {n.name: fleet.status(n) for n in fleet.nodes}
                cpu0 = {n: proc_cpu(p) for n, p in pids.items()}
                det0 = {n: proc_detail(p) for n, p in pids.items()}
                thr0 = {n: thread_cpu(p) for n, p in pids.items()}
                t0 = time.monotonic()
                r = pub.publish_served(view)
                sts = fleet.wait_version(r.version, timeout=args.timeout)
                wall = time.monotonic() - t0
                cpu1 = {n: proc_cpu(p) for n, p in pids.items()}
                det1 = {n: proc_detail(p) for n, p in pids.items()}
                mem1 = {n: proc_memory(p) for n, p in pids.items()}
                thr1 = {n: thread_cpu(p) for n, p in pids.items()}
                if perf_proc is not None:
                    perfstat.interrupt(perf_proc)
                    perf_shares = perfstat.read_perf(args.perf, perf_out)
                    if args.keep_perf:
                        shutil.copyfile(perf_out, args.keep_perf)
                if spy is not None:
                    perfstat.interrupt(spy)
                    profile = read_pyspy(spy_out)
                    names = pyspy_thread_names(spy_out)
                    vp = pids[fleet.nodes[-1].name]
                    t0s, t1s = thr0[fleet.nodes[-1].name], thr1[fleet.nodes[-1].name]
                    per_tid = {f"{tid} {names.get(tid, nm)}": round(c - t0s.get(tid, (nm, 0.0))[1], 3)
                               for tid, (nm, c) in t1s.items()}
                    profile_threads = {"pid": vp, "cpu_s": dict(sorted(
                        per_tid.items(), key=lambda kv: -kv[1]))}
                    if args.keep_profile and spy_out.exists():
                        Path(args.keep_profile).write_bytes(spy_out.read_bytes())
                    if not profile:
                        print("py-spy: no samples;",
                              (fleet.workdir / "pyspy.log").read_text()[-500:], file=sys.stderr)
                thread_names = sorted({nm for t in thr1.values() for nm, _ in t.values()})
                nodes = {}
                for name, pid in pids.items():
                    got = (sum(sts[name]["bytes"]["received"].values())
                           - sum(before[name]["bytes"]["received"].values()))
                    cpu = cpu1[name] - cpu0[name]
                    split = split_threads(pid, thr0[name], thr1[name], cpu)
                    gb = got / 1e9
                    nodes[name] = {
                        "received_bytes": got, "cpu_s": round(cpu, 3),
                        **{k2: round(det1[name][k2] - det0[name][k2], 3) for k2 in det0[name]},
                        "cpu_s_per_gb": round(cpu / gb, 2) if got else None,
                        **mem1[name],
                        "by_thread_s_per_gb": {k2: round(v / gb, 2) for k2, v in split.items()}
                        if got else None,
                        # the apply after the last chunk (/status apply_split; cpu_s: its
                        # thread's CPU; what was decoded while downloading is not in it)
                        "apply": (sts[name].get("apply_split") or {}).get(str(r.version)),
                    }
                    for k2 in ("blocks_placed", "blocks_copied"):  # Link.place_with
                        nodes[name][k2] = (sts[name].get("transport", {}).get(k2, 0)
                                           - before[name].get("transport", {}).get(k2, 0))
                per_gb = [x["cpu_s_per_gb"] for x in nodes.values() if x["cpu_s_per_gb"]]
                placed = sum(x["blocks_placed"] for x in nodes.values())
                copied = sum(x["blocks_copied"] for x in nodes.values())
                rows.append({
                    "version": r.version, "patch_bytes": r.patch_bytes, "chunks": r.chunks,
                    "wall_s": round(wall, 2), "nodes": nodes, "thread_names": thread_names,
                    "cpu_s_per_gb_median": round(statistics.median(per_gb), 2),
                    "blocks_placed_share": round(placed / (placed + copied), 3)
                    if placed + copied else None,
                    "converged": all(st["active_digest"] == r.target_digest.hex()
                                     for st in sts.values()),
                })
                tails = [x["apply"]["cpu_s"] for x in nodes.values()
                         if x["apply"] and "cpu_s" in x["apply"]]
                tail = f", apply after the last chunk {statistics.median(tails):.3f} CPU-s" \
                    if tails else ""
                share = rows[-1]["blocks_placed_share"]
                placed_s = f", blocks placed {share:.0%}" if share is not None else ""
                peak = max(x["peak_rss_mib"] for x in nodes.values())
                print(f"version {r.version}: {r.patch_bytes / 1e6:.1f} MB patch, {wall:.1f} s, "
                      f"median {rows[-1]['cpu_s_per_gb_median']} CPU-s/GB{tail}{placed_s}, "
                      f"node peak RSS {peak:.0f} MiB",
                      flush=True)
        finally:
            pub.close()
    return {"rows": rows, "profile": profile, "profile_threads": profile_threads,
            "perf": perf_shares}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--mib", type=int, default=128, help="served view (and ~patch) size")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--no-tls", action="store_true")
    ap.add_argument("--py-spy", default=None, help="py-spy binary: profile one node")
    ap.add_argument("--perf", nargs="?", const="perf", default=None,
                    help="profile one node with Linux perf (optionally its path)")
    ap.add_argument("--keep-profile", default=None, help="copy py-spy's raw stacks here")
    ap.add_argument("--perf-call-graph", default=None, choices=["dwarf", "fp", "lbr"],
                    help="perf samples carry their stacks (for perf report -G)")
    ap.add_argument("--keep-perf", default=None, help="copy perf's data file here")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--node-env", action="append", default=[], metavar="K=V",
                    help="environment variable for every node process (A/B experiments)")
    ap.add_argument("--warm-mib", type=int, default=DEFAULT_WARM_MEMORY_MIB, metavar="MIB",
                    help=f"[node] warm_memory_mib of every node (0: off; default: the shipped "
                         f"{DEFAULT_WARM_MEMORY_MIB})")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="run the fleet in DIR and keep it (the nodes' logs, stores)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    res = run(args)
    rows, profile = res["rows"], res["profile"]
    print("ver | patch MB | wall s | CPU-s/GB per node (loop thread / other threads) | median | ok")
    for row in rows:
        per = ", ".join(
            f"{x['cpu_s_per_gb']} ({x['by_thread_s_per_gb']['loop']}/"
            f"{x['by_thread_s_per_gb']['threads']})"
            for x in row["nodes"].values() if x["cpu_s_per_gb"])
        print(f"{row['version']} | {row['patch_bytes'] / 1e6:.1f} | {row['wall_s']} | {per} | "
              f"{row['cpu_s_per_gb_median']} | {row['converged']}")
    # the first version also pays connection warm-up; the summary is over the rest when any
    steady = rows[1:] or rows
    med = statistics.median(x["cpu_s_per_gb"] for r in steady for x in r["nodes"].values()
                            if x["cpu_s_per_gb"])
    split = {k: round(statistics.median(x["by_thread_s_per_gb"][k] for r in steady
                                        for x in r["nodes"].values() if x["by_thread_s_per_gb"]), 2)
             for k in ("loop", "threads")}
    print(f"median CPU-s per GB received (versions {steady[0]['version']}..): {med:.2f}  "
          f"by thread: {split}")
    if res["perf"]:
        print("perf, one node, last version (share of samples, kernel included):")
        for group, pct in res["perf"].items():
            print(f"  {group:44s} {pct:5.1f}%  ~{med * pct / 100:.2f} CPU-s/GB")
    if profile:
        total = sum(profile.values())
        print("py-spy, one node, last version (share of on-CPU samples):")
        for stage, n in profile.items():
            print(f"  {stage:28s} {100 * n / total:5.1f}%  ~{med * n / total:.2f} CPU-s/GB")
        print("CPU-s by thread of that node:", res["profile_threads"].get("cpu_s"))
    result = {"bench": "node_cpu", "label": args.label, "nodes": args.nodes, "mib": args.mib,
              "warm_mib": args.warm_mib,
              "chunk_size": args.chunk_size, "tls": not args.no_tls, "cpus": os.cpu_count(),
              "load_avg": os.getloadavg(), "cpu_s_per_gb_median": round(med, 2),
              "by_thread_s_per_gb_median": split, "profile_samples": profile,
              "profile_threads": res["profile_threads"], "perf_shares_pct": res["perf"], "versions": rows}
    out = Path(args.out or ROOT / "benchmarks" / "results" / "node_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["converged"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
