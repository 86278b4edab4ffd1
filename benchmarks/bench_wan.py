"""patchswarm against libtorrent on an emulated WAN (issue #11).

Builds (root; ``scripts/wan_setup.sh`` installs what it needs) a ``lab.netlab``
WAN: ``--regions`` x ``--hosts-per-region`` hosts on 1 Gbit links, region
uplinks shaped with tbf to ``--uplink-mbit``, ``--delay-ms`` one way between
regions and ``--intra-delay-ms`` inside a region (NFQUEUE holders,
``lab.delay``), the trainer on the last host of region 0. Before each run it
checks the delay (TCP connect round trips). Then, per run and per system, with
fresh stores, a dense patch of ``--size-mib`` (a BF16 base in which every
value changes to a random finite BF16, so the patch barely compresses) goes
from the trainer host to the other hosts:

- ``patchswarm``: the long-running origin, ``trainer.publisher.Publisher`` in
  this process (in the trainer's namespace), nodes as real ``patchswarm node``
  processes (``lab.fleet.LoopbackFleet``), shipped defaults (4 MiB chunks,
  mutual TLS unless ``--no-tls``);
- ``oneshot``: the same fleet, ``patchswarm publish --config trainer.toml NEW``
  launched with its defaults once the nodes are up;
- ``libtorrent``: one ``benchmarks/wan_libtorrent.py`` process per host (seed
  on the trainer host), tuned settings, no tracker/DHT: ``connect_peer`` to the
  host's region, the seed and ``--lt-cross-peers`` hosts of other regions.

Reported per run and system: time until every host holds/serves the new
version (from the publish call or launch, and from the hand-off to the swarm),
per-region completion, bytes into each remote region through its uplink
(``ip -s link``, in copies of the payload; status polling is calibrated and
subtracted) and as the applications count them, CPU-seconds per GB received of
every node process, the delay holders' CPU and packets, the load average, and
the flow bound (payload / uplink rate + one-way delay), and per patchswarm node
the apply after the last chunk (``/status`` ``apply_split``). Prints a table and
writes ``benchmarks/results/wan.json``. It ends with the simulator's prediction for
the same network (``configs/sim/wan-3x4.toml``) calibrated to the run: the nodes'
CPU per GB, their apply CPU and the hand-off measured here (``simulations.emulated``;
this machine's speed varies, the network does not), against the emulated median.

    sudo .venv/bin/python benchmarks/bench_wan.py            # 64 MiB, 3 runs, all systems
    sudo .venv/bin/python benchmarks/bench_wan.py --quick    # 16 MiB, 1 run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node import cpu_account  # noqa: E402
from node.config import DEFAULT_ORIGIN_WARM_MEMORY_MIB, DEFAULT_WARM_MEMORY_MIB  # noqa: E402
from node.logs import TextFormatter  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = ("patchswarm", "oneshot", "libtorrent")
LT_SCRIPT = ROOT / "benchmarks" / "wan_libtorrent.py"


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def box_cpu() -> dict[str, int]:
    """The machine's CPU time since boot by kind, in ticks (``/proc/stat``). This kernel
    counts time by ticks without IRQ time accounting: a tick that lands in a softirq
    (packet processing: the emulated network's bridges, veths, tbf, NFQUEUE, for every
    host) goes to ``softirq`` here and to the system time of whichever process was on
    the CPU, so part of the nodes' system time is the emulation's."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq"), f,
                    strict=True))


def proc_counts(pid: int) -> dict[str, int]:
    """Read syscalls and bytes (``/proc/<pid>/io``) and context switches of one process."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            k, v = line.split(":")
            if k in ("syscr", "rchar", "syscw", "wchar"):
                out[k] = int(v)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out["user_ms"] = int(fields[11]) * 1000 // CLK_TCK  # user and system time apart
        out["system_ms"] = int(fields[12]) * 1000 // CLK_TCK
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                k, v = line.split(":")
                out[k.split("_")[0]] = int(v)
    except OSError:
        pass
    return out


def region_of_ip(ip: str) -> int | None:
    parts = ip.split(".")
    return int(parts[2]) if len(parts) == 4 and parts[:2] == ["10", "213"] else None


# ---------------------------------------------------------------- payloads


def dense_pair(size_bytes: int, seed: int) -> tuple[dict, dict]:
    """A BF16 base and a new view in which every value changed to a random finite BF16."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = size_bytes // 2
    per = 4 * 1024 * 1024
    base, new = {}, {}
    for k in range(max(1, (n + per - 1) // per)):
        m = min(per, n - k * per)
        b = (torch.randn(m, generator=g) * 0.05).to(torch.bfloat16)
        bits = torch.randint(-32768, 32768, (m,), generator=g, dtype=torch.int32).to(torch.int16)
        exp_all_ones = (bits & 0x7F80) == 0x7F80
        bits = torch.where(exp_all_ones, bits & ~0x0080, bits)  # no inf/NaN
        nb = bits.view(torch.bfloat16)
        same = nb.view(torch.int16) == b.view(torch.int16)
        nb = torch.where(same, (b.float() * 2 + 1).to(torch.bfloat16), nb)  # every value moves
        base[f"layer{k}.weight"] = b.reshape(-1, 1024) if m % 1024 == 0 else b
        new[f"layer{k}.weight"] = nb.reshape(base[f"layer{k}.weight"].shape)
    return base, new


def dense_next(prev: dict, seed: int) -> dict:
    """A view in which every value of ``prev`` moved to a random finite BF16."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, b in prev.items():
        m = b.numel()
        bits = torch.randint(-32768, 32768, (m,), generator=g, dtype=torch.int32).to(torch.int16)
        bits = torch.where((bits & 0x7F80) == 0x7F80, bits & ~0x0080, bits)  # no inf/NaN
        flat = b.reshape(-1)
        same = bits == flat.view(torch.int16)
        nb = torch.where(same, (flat.float() * 2 + 1).to(torch.bfloat16), bits.view(torch.bfloat16))
        out[name] = nb.reshape(b.shape)
    return out


# [network] knobs the bench can set on the trainer and every node: flag, key, type, metavar,
# what it is (docs/operations.md); unset, each node keeps the shipped value
NETWORK_KNOBS = (
    ("--unsent-limit-kib", "unsent_limit_kib", int, "KIB",
     "unsent bytes the kernel may hold per peer socket (0: the kernel's default)"),
    ("--congestion-restart-s", "congestion_restart_s", float, "S",
     "BBR starts over on a link whose chunk runs S seconds or starts after idle (0: never; "
     "shipped 1.0)"),
    ("--restart-idle-s", "congestion_restart_idle_s", float, "S",
     "BBR starts over on a link whose chunk starts after S seconds without one (0: never; "
     "shipped 0.2)"),
    ("--warm-up-kib", "warm_up_kib", int, "KIB",
     "padding that opens a long link's window before its first chunk, for the trainer and "
     "every node (0: off; shipped 512 on the origin, 0 on nodes)"),
    ("--read-coalesce-ms", "read_coalesce_ms", float, "MS",
     "the longest a peer link holds its socket to read a batch (2: round 12's fixed hold)"),
    ("--read-lowat-kib", "read_lowat_kib", int, "KIB",
     "bytes the kernel gathers before it wakes a link inside a chunk block (SO_RCVLOWAT; "
     "0: off; shipped 256)"),
    ("--lanes", "lanes", lambda s: s if s == "auto" else int(s), "N|auto",
     "connections per link to a peer in another region, chunks striped over them; auto: "
     "4 on a link found capped by random loss (docs/striped-links.md)"),
)


# ---------------------------------------------------------------- measurement helpers


class Meter:
    """Uplink bytes, holder costs and node CPU around one transfer."""

    def __init__(self, lab: Any, args: argparse.Namespace) -> None:
        self.lab, self.args = lab, args
        self.poll_into = self.poll_out = 0.0  # uplink bytes of one /status poll, per direction
        self.tracer: UplinkTrace | None = None
        self.last_trace: list[dict[str, Any]] | None = None

    def snapshot(self) -> dict[str, Any]:
        """Counters now. With ``--trace`` the first snapshot of a transfer starts sampling
        the uplinks and the second stops it (``last_trace``)."""
        if getattr(self.args, "trace", False):
            if self.tracer is None:
                self.tracer = UplinkTrace(self.lab)
                self.tracer.start(time.time())
            else:
                self.last_trace = self.tracer.stop()
                self.tracer = None
        return {"uplinks": self.lab.uplink_bytes(), "drops": self.lab.uplink_drops(),
                "holders": self.lab.delay_stats(), "t": time.monotonic(), "box": box_cpu()}

    def diff(self, a: dict[str, Any], b: dict[str, Any], payload: int, polls: dict[int, int]
             ) -> dict[str, Any]:
        lab = self.lab
        up = {}
        for r in range(lab.regions):
            into = b["uplinks"][r]["into"] - a["uplinks"][r]["into"]
            out = b["uplinks"][r]["out"] - a["uplinks"][r]["out"]
            c_in = polls.get(r, 0) * self.poll_into
            c_out = polls.get(r, 0) * self.poll_out
            up[str(r)] = {"into_bytes": into, "out_bytes": out,
                          "into_copies": round((into - c_in) / payload, 4),
                          "out_copies": round((out - c_out) / payload, 4),
                          "poll_bytes_subtracted": int(c_in + c_out),
                          "tbf_drops_into": b["drops"][r]["into"] - a["drops"][r]["into"],
                          "tbf_drops_out": b["drops"][r]["out"] - a["drops"][r]["out"]}
        hold = []
        for h0, h1 in zip(a["holders"], b["holders"], strict=True):
            hold.append({"ns": h1["ns"], "delay_ms": h1["delay_ms"],
                         "cpu_s": round((h1["cpu_s"] or 0) - (h0["cpu_s"] or 0), 3),
                         "packets": (h1.get("packets") or 0) - (h0.get("packets") or 0),
                         "kernel_dropped": (h1.get("kernel_dropped") or 0)
                         - (h0.get("kernel_dropped") or 0)})
        core = [h for h in hold if h["ns"] == lab.ns_core]
        box = {k: round((b["box"][k] - a["box"][k]) / CLK_TCK, 2) for k in b["box"]}
        return {"uplinks": up, "box_cpu_s": box, "holders": {
            "cpu_s": round(sum(h["cpu_s"] for h in hold), 3),
            "packets": sum(h["packets"] for h in hold),
            "kernel_dropped": sum(h["kernel_dropped"] for h in hold),
            "core_cpu_s": core[0]["cpu_s"] if core else 0.0,
            "core_packets": core[0]["packets"] if core else 0,
            "processes": len(hold)}}


class UplinkTrace:
    """Samples every region uplink's byte counters (one ``ip -s -j link`` in the core
    namespace) every ``period`` seconds in a thread: Mbit/s into and out of each region
    over time, to see whether the uplinks stay busy (``--trace``), and the machine's CPU
    busy share (``cpu``, % of all cores, ``/proc/stat``): every host and every delay
    holder share this machine's cores, so a CPU-bound moment slows the emulated
    network itself."""

    def __init__(self, lab: Any, period: float = 0.25) -> None:
        self.lab, self.period = lab, period
        self.samples: list[tuple[float, dict[int, tuple[int, int]], tuple[int, int]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[int, tuple[int, int]]:
        rows = json.loads(self.lab._run("ip", "-s", "-j", "link", ns=self.lab.ns_core))
        out = {}
        for row in rows:
            name = row.get("ifname", "")
            if name.startswith("r") and name[1:].isdigit():
                st = row.get("stats64") or row["stats"]
                # core side: tx = into the region, rx = out of it
                out[int(name[1:])] = (int(st["tx"]["bytes"]), int(st["rx"]["bytes"]))
        return out

    @staticmethod
    def _cpu() -> tuple[int, int]:
        """(busy, total) jiffies of all cores since boot."""
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return sum(f) - idle, sum(f)

    def start(self, t0: float) -> None:
        self.t0 = t0

        def loop() -> None:
            while not self._stop.is_set():
                self.samples.append((time.time() - self.t0, self._read(), self._cpu()))
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        rows = []
        for (ta, a, ca), (tb, b, cb) in zip(self.samples, self.samples[1:], strict=False):
            dt = tb - ta
            if dt <= 0:
                continue
            busy = round(100 * (cb[0] - ca[0]) / (cb[1] - ca[1]), 0) if cb[1] > ca[1] else 0.0
            rows.append({"t": round(tb, 2), **{
                f"{k}{r}": round((b[r][i] - a[r][i]) * 8 / dt / 1e6, 1)
                for r in sorted(b) if r in a for i, k in ((0, "in"), (1, "out"))}, "cpu": busy})
        return rows


class TcpTrace:
    """Samples every host's TCP connections (``ss -tinH`` in each host namespace: window,
    BBR's bandwidth estimate, pacing rate, round trip, retransmissions) every ``period``
    seconds in a thread (every host at once), into a text file ``benchmarks/wan_tcp.py``
    reads: a line ``@ <epoch s> <namespace>`` before each namespace's sockets
    (``--tcp-trace``). It is how round 22 found the slow relays' cause
    (docs/benchmarks.md); it costs ~0.2 of a core while on, so A/Bs leave it off."""

    def __init__(self, lab: Any, path: Path, period: float = 0.25) -> None:
        self.lab, self.path, self.period = lab, path, period
        self.hosts = [lab.ns_host(r, h) for r in range(lab.regions)
                      for h in range(lab.hosts_per_region)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        def loop() -> None:
            with self.path.open("a") as f:
                while not self._stop.is_set():
                    t = time.time()
                    # all hosts at once: one after another, a sweep took ~0.6 s
                    procs = []
                    for ns in self.hosts:
                        try:
                            procs.append((ns, subprocess.Popen(
                                [*self.lab.exec_prefix(ns), "ss", "-tinH", "state", "established"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)))
                        except OSError:
                            continue  # a lost sample, not a failed run
                    for ns, proc in procs:
                        try:
                            text, _ = proc.communicate(timeout=10)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.communicate()
                            continue
                        if proc.returncode == 0:
                            f.write(f"@ {t:.3f} {ns}\n{text}")
                    self._stop.wait(max(0.0, self.period - (time.time() - t)))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def verify_delay(lab: Any, args: argparse.Namespace) -> dict[str, float]:
    """TCP connect round trips across regions and inside one, against the configuration."""
    cross = lab.tcp_rtt_ms(lab.ns_trainer, lab.ip_host(1, 0))
    intra = lab.tcp_rtt_ms(lab.ns_host(1, 0), lab.ip_host(1, 1))
    want_cross = 2 * args.delay_ms  # the intra-region rule matches the host's own subnet only
    want_intra = 2 * args.intra_delay_ms
    ok = abs(cross - want_cross) <= max(3.0, 0.15 * want_cross) and \
        intra <= want_intra + 3.0 and intra >= want_intra * 0.9
    out = {"cross_rtt_ms": round(cross, 2), "intra_rtt_ms": round(intra, 2),
           "expected_cross_ms": want_cross, "expected_intra_ms": want_intra, "ok": ok}
    if not ok:
        raise SystemExit(f"bench_wan: the lab's delay is off: {out}")
    return out


# ---------------------------------------------------------------- patchswarm


def _fleet(lab: Any, args: argparse.Namespace, workdir: Path) -> Any:
    from lab.fleet import LoopbackFleet

    knobs = {}
    for kv in args.swarm or []:
        k, _, v = kv.partition("=")
        knobs[k.strip()] = json.loads(v)
    network = {key: getattr(args, key) for _f, key, *_ in NETWORK_KNOBS
               if getattr(args, key) is not None}
    if args.congestion is not None:
        network["congestion_control"] = args.congestion
    node = {"warm_memory_mib": args.warm_mib}
    fleet = LoopbackFleet(lab.regions, lab.hosts_per_region, chunk_size=args.chunk_size,
                          lab=lab, tls=args.tls, workdir=workdir, swarm=knobs, network=network,
                          node_section=node, trainer_warm_memory_mib=args.origin_warm_mib,
                          node_log_level="debug" if args.keep_logs else None)
    # the trainer occupies the last host of region 0: no node there
    fleet.nodes = [n for n in fleet.nodes
                   if (n.host, n.netns) != (lab.ip_trainer, lab.ns_trainer)]
    return fleet


def wait_linked(fleet: Any, pub: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the origin has a link to every node. A node that found the origin down
    redials on its back-off (``redial_s``), so the last one may link seconds after the
    others, and the origin then warms its link (round 59: a border linked ~7 s after the
    origin came up, 1.2 s before the first publish, and 512 KiB of padding crossed its
    region's uplink during the first version)."""
    names = {n.name for n in fleet.nodes}
    drv = pub.node.driver
    t0 = time.monotonic()
    while True:
        ids = drv.call(lambda: {p["id"] for p in drv.core.peer_list()})
        if names <= ids or time.monotonic() - t0 > timeout:
            return {"wait_s": round(time.monotonic() - t0, 2), "nodes": len(names & ids)}
        time.sleep(0.2)


def wait_warm(fleet: Any, pub: Any, timeout: float = 15.0) -> dict[str, Any]:
    """Wait until no node and not the origin is warming a link (node.warm_up: padding that
    opens a long link's TCP window before its first chunk). A real fleet's first version
    comes after minutes of training, long after its links were up and warmed; here the
    publish would otherwise land in the middle of the warm-ups (they end at its first chunk).

    A warm-up has ended once its padding is handed to the kernel, which may still hold it
    (up to the link's window and ``unsent_limit_kib``, and the tbf queue), so the wait goes
    on until the peers have taken in every padding byte sent. Padding that still arrives
    during a version is in its ``pad_received`` (it would count as copies into a region)."""
    t0 = time.monotonic()
    while True:
        sts = [((fleet.status(n) or {}).get("transport") or {}).get("warm_up") or {}
               for n in fleet.nodes]
        drv = pub.node.driver
        sts.append(drv.call(drv.warm_status))
        warming = sum(s.get("warming", 0) for s in sts)
        in_flight = (sum(s.get("pad_sent", 0) for s in sts)
                     - sum(s.get("pad_received", 0) for s in sts))
        if (not warming and in_flight <= 0) or time.monotonic() - t0 > timeout:
            return {"wait_s": round(time.monotonic() - t0, 2), "still_warming": warming,
                    "pad_in_flight": max(0, in_flight),
                    "links": sum(s.get("links", 0) for s in sts),
                    "pad_bytes": sum(s.get("pad_sent", 0) for s in sts),
                    "ended": {k: sum((s.get("ended") or {}).get(k, 0) for s in sts)
                              for k in sorted({k for s in sts for k in (s.get("ended") or {})})}}
        time.sleep(0.2)


def _poll_until(fleet: Any, version: int, timeout: float, polls: dict[int, int],
                poll_s: float, wait_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Each node's /status once it is active at ``version``. With ``wait_s`` each request
    blocks on the node until then (``/status?wait_active``, at most ``wait_s``): a node
    answers one or two requests a version instead of a poll every ``poll_s``."""
    deadline = time.monotonic() + timeout
    last: dict[str, dict[str, Any]] = {}
    while True:
        for n in fleet.nodes:
            if (last.get(n.name) or {}).get("active_version") == version:
                continue
            left = deadline - time.monotonic()
            if wait_s > 0 and left > 0.1:
                w = min(wait_s, left)
                st = fleet.http(n.api_addr, f"/status?wait_active={version}&timeout_s={w:.1f}",
                                timeout=w + 10)
            else:
                st = fleet.status(n)
            r = int(n.region.rsplit("-", 1)[1])
            polls[r] = polls.get(r, 0) + 1
            if st is not None:
                last[n.name] = st
        if all((last.get(n.name) or {}).get("active_version") == version for n in fleet.nodes):
            return last
        if time.monotonic() > deadline:
            done = sum(1 for s in last.values() if s.get("active_version") == version)
            raise RuntimeError(f"version {version}: {done}/{len(fleet.nodes)} nodes after "
                               f"{timeout:.0f} s")
        time.sleep(poll_s)


def calibrate_polls(fleet: Any, lab: Any, meter: Meter, k: int = 10) -> None:
    """Uplink bytes (into, out of its region) of one /status poll of one remote node, so
    that the polling during a transfer can be subtracted from the uplink counters."""
    remote = [n for n in fleet.nodes if n.region != "region-0"]
    a = lab.uplink_bytes()
    for _ in range(k):
        for n in remote:
            fleet.status(n)
    b = lab.uplink_bytes()
    polls = max(1, k * len(remote))
    meter.poll_into = sum(b[r]["into"] - a[r]["into"] for r in range(1, lab.regions)) / polls
    meter.poll_out = sum(b[r]["out"] - a[r]["out"] for r in range(1, lab.regions)) / polls


def run_patchswarm(lab: Any, args: argparse.Namespace, meter: Meter, oneshot: bool,
                   seed: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from node.config import load_config
    from trainer.publisher import Publisher

    torch.set_num_threads(1)
    base, new = dense_pair(args.size_mib << 20, seed)
    workdir = Path(tempfile.mkdtemp(prefix="patchswarm-wan-"))
    accounts = workdir / "cpu-account" if args.cpu_account else None
    if accounts is not None:  # the node processes inherit it (node.cpu_account)
        os.environ[cpu_account.ENV] = str(accounts)
    fleet = _fleet(lab, args, workdir)
    pub = None
    origin_log: logging.Handler | None = None
    tcp_trace: TcpTrace | None = None
    perf = None
    try:
        with fleet:
            fleet.start_nodes_only(base, timeout=args.timeout)
            calibrate_polls(fleet, lab, meter)
            pids = {n.name: n.proc.pid for n in fleet.nodes if n.proc is not None}
            polls: dict[int, int] = {}
            cli = None
            warm: dict[str, Any] | None = None
            if oneshot:
                new_path = workdir / "new.safetensors"
                save_file(new, str(new_path))
                time.sleep(2.0)
                before = {n.name: fleet.status(n) for n in fleet.nodes}
                cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
                io0 = {k: proc_counts(p) for k, p in pids.items()}
                perf = _perf_start(args, pids, workdir)
                m0 = meter.snapshot()
                t0 = time.time()
                cli = subprocess.Popen(
                    [*fleet.trainer_prefix, sys.executable, "-m", "patchswarm", "publish",
                     "--config", str(workdir / "trainer.toml"), str(new_path)],
                    cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
                assert cli.stdout is not None
                handoff, version, patch_bytes = None, None, None
                deadline = time.monotonic() + args.timeout
                for line in cli.stdout:  # "version N: patch of B bytes in C chunks, ..."
                    if line.startswith("version ") and "patch of" in line:
                        handoff = time.time()
                        version = int(line.split()[1].rstrip(":"))
                        patch_bytes = int(line.split("patch of ")[1].split()[0].replace(",", ""))
                        break
                    if time.monotonic() > deadline:
                        break
                if version is None:
                    raise RuntimeError("patchswarm publish printed no version line")
                # keep draining its output so it never blocks on a full pipe
                threading.Thread(target=lambda: [None for _ in cli.stdout], daemon=True).start()
            else:
                cfg = load_config(workdir / "trainer.toml")
                if args.keep_logs:
                    # the origin's own decisions (push, relay_ordered, region_delivered) and
                    # its chunk_sent lines, at debug, with their fields: wan_timeline.py
                    origin_log = logging.FileHandler(workdir / "origin.log")
                    origin_log.setFormatter(TextFormatter("origin"))
                    ps_log = logging.getLogger("patchswarm")
                    ps_log.addHandler(origin_log)
                    ps_log.setLevel(logging.DEBUG)
                pub = Publisher(cfg, base=base, persist_view=False)
                pub.start()
                if args.tcp_trace:
                    tcp_trace = TcpTrace(lab, workdir / "tcp-trace.txt")
                    tcp_trace.start()
                deadline = time.monotonic() + 60
                while len(pub.regions()) < lab.regions and time.monotonic() < deadline:
                    time.sleep(0.2)
                time.sleep(3.0)  # every node gets its region's peers from the tracker
                linked = wait_linked(fleet, pub)
                warm = wait_warm(fleet, pub)
                warm["linked"] = linked
                before = {n.name: fleet.status(n) for n in fleet.nodes}
                cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
                io0 = {k: proc_counts(p) for k, p in pids.items()}
                perf = _perf_start(args, pids, workdir)
                m0 = meter.snapshot()
                t0 = time.time()
                r = pub.publish_served(new)
                handoff, version, patch_bytes = r.published_at, r.version, r.patch_bytes
            sts = _poll_until(fleet, version, args.timeout, polls, args.poll_s, args.long_poll)
            perf_shares = _perf_stop(args, perf, workdir)
            cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
            io1 = {k: proc_counts(p) for k, p in pids.items()}
            m1 = meter.snapshot()
            if cli is not None:
                try:
                    cli.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    cli.kill()
                    cli.wait(5)
            out = _figures(fleet, meter, sts, before, (cpu0, cpu1), (io0, io1), (m0, m1),
                           polls, t0, handoff, version, patch_bytes)
            if warm is not None:
                out["warm_up"] = warm
            if pub is not None and args.versions > 1:
                # the steady state of RL post-training: one long-running origin publishes
                # version after version (it keeps what it measured, its uplink window
                # above all); every value moves again in each
                later = []
                view = new
                trace = meter.last_trace  # --trace: the first version's, printed with the run
                for nv in range(2, args.versions + 1):
                    view = dense_next(view, seed * 1000 + nv)
                    time.sleep(2.0)  # the last version's applies and reports settle
                    polls = {}
                    before = {n.name: fleet.status(n) for n in fleet.nodes}
                    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
                    io0 = {k: proc_counts(p) for k, p in pids.items()}
                    m0 = meter.snapshot()
                    t0 = time.time()
                    r = pub.publish_served(view)
                    sts = _poll_until(fleet, r.version, args.timeout, polls, args.poll_s,
                                      args.long_poll)
                    cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
                    io1 = {k: proc_counts(p) for k, p in pids.items()}
                    m1 = meter.snapshot()
                    fig = _figures(fleet, meter, sts, before, (cpu0, cpu1), (io0, io1),
                                   (m0, m1), polls, t0, r.published_at, r.version,
                                   r.patch_bytes)
                    if meter.last_trace is not None:  # --trace: each version's own samples
                        fig["trace"], meter.last_trace = meter.last_trace, None
                    later.append(fig)
                out["later_versions"] = later
                meter.last_trace = trace
    finally:
        if perf is not None and perf.poll() is None:  # the run failed with perf attached
            perf.kill()
            perf.wait()
        if tcp_trace is not None:
            tcp_trace.stop()
        if pub is not None:
            pub.close()
        if origin_log is not None:
            ps_log = logging.getLogger("patchswarm")
            ps_log.removeHandler(origin_log)
            ps_log.setLevel(logging.NOTSET)
            origin_log.close()
        if args.keep_logs:
            dest = Path(args.keep_logs) / f"run{seed}-{'oneshot' if oneshot else 'patchswarm'}"
            dest.mkdir(parents=True, exist_ok=True)
            for f in [*workdir.glob("*.log"), *workdir.glob("tcp-trace.txt")]:
                shutil.copy(f, dest / f.name)
        if accounts is not None:  # the nodes wrote theirs at exit, when the fleet stopped
            os.environ.pop(cpu_account.ENV, None)
            acct = cpu_account.summed(sorted(accounts.glob("*.json")))
        shutil.rmtree(workdir, ignore_errors=True)
    if perf_shares is not None:
        out["perf"] = perf_shares
    if accounts is not None:
        out["cpu_account"] = acct
        _print_accounts(acct)
    return out


def _print_accounts(acct: dict[str, Any]) -> None:
    """The stages of ``--cpu-account``, summed over the nodes and the run's versions."""
    total = acct["process_cpu_s"]
    print(f"  CPU by stage, {acct['nodes']} nodes, every version of the run (stages nest; "
          f"the nodes' whole CPU from start to exit: {total:.2f} s):")
    for name, (calls, cpu_s) in list(acct["stages"].items())[:16]:
        print(f"    {name:36s} {cpu_s:7.3f} s {calls:8d} calls "
              f"{1e6 * cpu_s / max(1, calls):9.1f} us/call")


def _per_gb_moved(cpu: float, recv: int, sent: int) -> dict[str, float | None]:
    """CPU per GB a node moved, received and sent (payload bytes), beside the issue's
    figure per GB received. A border relays two to three times what it takes in, and
    the figure per GB received charges those uploads to its downloads: a node that
    only received would show the cost per byte moved."""
    moved = recv + sent
    return {"cpu_s_per_gb_moved": round(cpu / (moved / 1e9), 2) if moved else None}


def _pad_received(st: dict[str, Any]) -> int:
    return int((((st.get("transport") or {}).get("warm_up")) or {}).get("pad_received", 0))


def _figures(fleet: Any, meter: Meter, sts: dict[str, dict[str, Any]],
             before: dict[str, Any], cpu: tuple[dict, dict], io: tuple[dict, dict],
             m: tuple[dict, dict], polls: dict[int, int], t0: float, handoff: float,
             version: int, patch_bytes: int) -> dict[str, Any]:
    """One version's figures from the counters before (``[0]``) and after (``[1]``)."""
    cpu0, cpu1 = cpu
    io0, io1 = io
    m0, m1 = m
    per_node = {}
    regions: dict[str, float] = {}
    recv_total, sent_total, cross_app = 0, 0, {}
    for n in fleet.nodes:
        st = sts[n.name]
        t_act = st["activated_at"][str(version)]
        got = st["bytes"]["received"]
        got0 = before[n.name]["bytes"]["received"]
        recv = sum(got.values()) - sum(got0.values())
        sent = sum(st["bytes"]["sent"].values()) - sum(before[n.name]["bytes"]["sent"].values())
        cross = (got["cross_region"] + got["from_trainer"]) - (got0["cross_region"]
                                                                + got0["from_trainer"])
        recv_total += recv
        sent_total += sent
        r = n.region.rsplit("-", 1)[1]
        cross_app[r] = cross_app.get(r, 0) + cross
        cpu = cpu1[n.name] - cpu0[n.name]
        per_node[n.name] = {"s": round(t_act - t0, 3), "received": recv,
                            "received_by_kind": {k: got[k] - got0.get(k, 0) for k in got},
                            "cpu_s": round(cpu, 2),
                            "cpu_s_per_gb": round(cpu / (recv / 1e9), 2) if recv else None,
                            "sent": sent,
                            **_per_gb_moved(cpu, recv, sent),
                            "apply": (st.get("apply_split") or {}).get(str(version)),
                            # BBR restarts on its links since the node started (cumulative)
                            "congestion_restarts": (st.get("transport") or {}).get(
                                "congestion_restarts"),
                            # striped links: lanes opened or accepted, links found capped
                            # by random loss (lanes = "auto"); cumulative as well
                            "lanes_opened": (st.get("transport") or {}).get("lanes_opened"),
                            "loss_capped_links": (st.get("transport") or {}).get(
                                "loss_capped_links"),
                            "lanes_learned": (st.get("transport") or {}).get("lanes_learned"),
                            "stripe_wants": (st.get("transport") or {}).get("stripe_wants"),
                            "chunks_restriped": (st.get("transport") or {}).get(
                                "chunks_restriped"),
                            # whole chunks received that were held already (endgame
                            # twins that were not stopped in time), this version
                            "dup_chunks": st.get("dup_chunks", 0) - before[n.name].get(
                                "dup_chunks", 0),
                            "withdrawn_chunks": st.get("withdrawn_chunks", 0) - before[
                                n.name].get("withdrawn_chunks", 0),
                            # RELAY_ALIVE reports this border sent (cumulative)
                            "relay_alive": st.get("relay_alive"),
                            # receive marks set inside chunk blocks, and marks the 100 ms
                            # guard dropped, this version ([network] read_lowat_kib)
                            **{k: (st.get("transport") or {}).get(k, 0) - (
                                before[n.name].get("transport") or {}).get(k, 0)
                               for k in ("read_marks", "read_marks_expired")},
                            # warm-up padding this node took in during the version (counted
                            # in the uplinks' bytes; the bench waits for it to land before)
                            "pad_received": _pad_received(st) - _pad_received(before[n.name]),
                            "proc": {k: io1[n.name].get(k, 0) - io0[n.name].get(k, 0)
                                     for k in io1[n.name]}}
        regions[r] = max(regions.get(r, 0.0), t_act - t0)
    last = max(v["s"] for v in per_node.values())
    digest_ok = len({st["active_digest"] for st in sts.values()}) == 1
    out = {"version": version, "payload_bytes": patch_bytes, "all_s": round(last, 3),
           "all_from_handoff_s": round(last - (handoff - t0), 3),
           "handoff_s": round(handoff - t0, 3),
           "regions_s": {k: round(v, 3) for k, v in sorted(regions.items())},
           "nodes": per_node, "converged": digest_ok,
           "cross_region_app_copies": {r: round(b / patch_bytes, 4) for r, b in cross_app.items()
                                       if r != "0"}}
    out.update(meter.diff(m0, m1, patch_bytes, polls))
    cpus = [v["cpu_s"] for v in per_node.values()]
    out["node_cpu_s"] = round(sum(cpus), 2)
    out["read_marks"] = {k: sum(v[k] for v in per_node.values())
                         for k in ("read_marks", "read_marks_expired")}
    out["cpu_s_per_gb"] = round(sum(cpus) / (recv_total / 1e9), 2) if recv_total else None
    out["cpu_s_per_gb_max_node"] = max(v["cpu_s_per_gb"] or 0 for v in per_node.values())
    out.update(_per_gb_moved(sum(cpus), recv_total, sent_total))
    # chunk bytes the nodes took in per byte of patch each needed (1.0: no duplicates;
    # more: endgame twins that arrived whole), and node CPU per GB of patch delivered
    out["received_copies"] = round(recv_total / (patch_bytes * len(per_node)), 4)
    out["cpu_s_per_patch_gb"] = round(sum(cpus) / (patch_bytes * len(per_node) / 1e9), 2)
    out["dup_chunks"] = sum(v["dup_chunks"] for v in per_node.values())
    out["pad_received"] = sum(v["pad_received"] for v in per_node.values())
    # the nodes' user time alone per GB received (their system time includes softirq
    # ticks of the emulated network's packet processing: ``box_cpu``)
    user = sum(v["proc"].get("user_ms", 0) for v in per_node.values()) / 1000
    out["user_cpu_s_per_gb"] = round(user / (recv_total / 1e9), 2) if recv_total else None
    # the apply after the last chunk, its CPU (decoded ahead meanwhile: in the rest)
    tail = [v["apply"]["cpu_s"] for v in per_node.values()
            if v["apply"] and "cpu_s" in v["apply"]]
    out["apply_tail_cpu_s"] = round(statistics.median(tail), 4) if tail else None
    return out


PERF_NODE = "n1-0"  # the profiled node (--perf): a border of a remote region


def _perf_start(args: argparse.Namespace, pids: dict[str, int], workdir: Path) -> Any:
    """``--perf``: start ``perf record`` of one remote border node for this transfer."""
    if not args.perf or PERF_NODE not in pids:
        return None
    import perfstat

    proc = perfstat.record(args.perf, pids[PERF_NODE], workdir / "perf.data",
                           call_graph="dwarf" if args.perf_keep else None)
    time.sleep(0.5)  # perf attaches before the publish
    return proc


def _perf_stop(args: argparse.Namespace, proc: Any, workdir: Path) -> dict[str, float] | None:
    """``--perf``: stop the profiler; the node's samples, % per ``perfstat.PERF_GROUPS`` group."""
    if proc is None:
        return None
    import perfstat

    perfstat.interrupt(proc)
    shares = perfstat.read_perf(args.perf, workdir / "perf.data")
    if args.perf_keep:
        args.perf_keep.mkdir(parents=True, exist_ok=True)
        kept = args.perf_keep / f"perf-{PERF_NODE}-{time.strftime('%H%M%S')}.data"
        shutil.copyfile(workdir / "perf.data", kept)
        print(f"    perf data with call graphs: {kept} (perf report -i {kept} -G)")
    print(f"    perf, {PERF_NODE} during the transfer (% of its samples): "
          + ", ".join(f"{g} {p}" for g, p in shares.items()))
    return shares


# ---------------------------------------------------------------- libtorrent


def lt_peers(lab: Any, r: int, h: int, k_cross: int, rng: random.Random) -> list[str]:
    """The host's region, the seed, and ``k_cross`` random hosts of other regions."""
    mine = [lab.ip_host(r, i) for i in range(lab.hosts_per_region) if i != h]
    others = [lab.ip_host(q, i) for q in range(lab.regions) if q != r
              for i in range(lab.hosts_per_region)]
    peers = set(mine) | {lab.ip_trainer} | set(rng.sample(others, min(k_cross, len(others))))
    peers.discard(lab.ip_host(r, h))
    return sorted(peers)


def run_libtorrent(lab: Any, args: argparse.Namespace, meter: Meter, seed: int
                   ) -> dict[str, Any]:
    size = args.size_mib << 20
    workdir = Path(tempfile.mkdtemp(prefix="patchswarm-wan-lt-"))
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    py = sys.executable
    try:
        (workdir / "seed").mkdir()
        payload = workdir / "seed" / "payload.bin"
        with payload.open("wb") as f:
            rnd = random.Random(seed)
            for _ in range(size // (1 << 20)):
                f.write(rnd.randbytes(1 << 20))
            f.write(rnd.randbytes(size % (1 << 20)))
        torrent = workdir / "payload.torrent"
        subprocess.run([py, str(LT_SCRIPT), "make", "--file", str(payload), "--torrent",
                        str(torrent), "--piece-kib", str(args.lt_piece_kib)], check=True,
                       timeout=300)
        rng = random.Random(seed)

        def spawn(name: str, ns: str, cmd: list[str], region: int) -> None:
            p = subprocess.Popen([*lab.exec_prefix(ns), py, str(LT_SCRIPT), *cmd],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=workdir)
            procs[name] = (p, region)

        spawn("seed", lab.ns_trainer, ["seed", "--ip", lab.ip_trainer, "--torrent",
                                      str(torrent), "--dir", str(workdir / "seed"),
                                      *(["--no-pex"] if args.lt_no_pex else [])], 0)
        for r in range(lab.regions):
            for h in range(lab.hosts_per_region):
                if (r, h) == (lab.trainer_region, lab.trainer_host):
                    continue
                name = f"n{r}-{h}"
                peers = ",".join(lt_peers(lab, r, h, args.lt_cross_peers, rng))
                spawn(name, lab.ns_host(r, h),
                      ["fetch", "--ip", lab.ip_host(r, h), "--torrent", str(torrent),
                       "--dir", str(workdir / name), "--peers", peers,
                       "--timeout", str(args.timeout), *(["--no-pex"] if args.lt_no_pex else [])],
                      r)
        for name, (p, _) in procs.items():
            line = p.stdout.readline() if p.stdout else ""
            if '"ready"' not in line:
                raise RuntimeError(f"libtorrent {name} did not start: {line!r}")
        time.sleep(1.0)
        cpu0 = {k: cpu_seconds(p.pid) for k, (p, _) in procs.items()}
        m0 = meter.snapshot()
        t_go = time.monotonic()
        for p, _ in procs.values():
            p.stdin.write("go\n")
            p.stdin.flush()
        done: dict[str, float] = {}
        for name, (p, _) in procs.items():
            if name == "seed":
                continue
            line = p.stdout.readline()
            ev = json.loads(line) if line.strip() else {"event": "exit"}
            if ev.get("event") != "done":
                raise RuntimeError(f"libtorrent {name}: {ev}")
            done[name] = ev["t"] - t_go
        cpu1 = {k: cpu_seconds(p.pid) for k, (p, _) in procs.items()}
        m1 = meter.snapshot()
        stats = {}
        for name, (p, _) in procs.items():
            p.stdin.write("quit\n")
            p.stdin.flush()
            for line in p.stdout:
                if '"stats"' in line:
                    stats[name] = json.loads(line)
                    break
            p.wait(30)
        ok = all((workdir / n / "payload.bin").read_bytes() == payload.read_bytes() for n in done)
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)
    per_node, regions, cross_app = {}, {}, {}
    for name, t in done.items():
        r = procs[name][1]
        got = stats.get(name, {}).get("from_peers", {})
        recv = sum(got.values())
        cross = sum(b for ip, b in got.items() if region_of_ip(ip) != r)
        cross_app[str(r)] = cross_app.get(str(r), 0) + cross
        cpu = cpu1[name] - cpu0[name]
        sent = int(stats.get(name, {}).get("uploaded", 0))
        per_node[name] = {"s": round(t, 3), "received": recv, "cpu_s": round(cpu, 2),
                          "cpu_s_per_gb": round(cpu / (size / 1e9), 2), "sent": sent,
                          **_per_gb_moved(cpu, recv, sent)}
        regions[str(r)] = max(regions.get(str(r), 0.0), t)
    last = max(done.values())
    out = {"payload_bytes": size, "all_s": round(last, 3), "all_from_handoff_s": round(last, 3),
           "handoff_s": 0.0, "regions_s": {k: round(v, 3) for k, v in sorted(regions.items())},
           "nodes": per_node, "converged": ok,
           "cross_region_app_copies": {r: round(b / size, 4) for r, b in cross_app.items()
                                       if r != "0"},
           "seed_cpu_s": round(cpu1["seed"] - cpu0["seed"], 2)}
    out.update(meter.diff(m0, m1, size, {}))
    cpus = [v["cpu_s"] for v in per_node.values()]
    out["node_cpu_s"] = round(sum(cpus), 2)
    out["cpu_s_per_gb"] = round(sum(cpus) / (len(cpus) * size / 1e9), 2)
    out["cpu_s_per_gb_max_node"] = max(v["cpu_s_per_gb"] for v in per_node.values())
    out.update(_per_gb_moved(sum(cpus), sum(v["received"] for v in per_node.values()),
                             sum(v["sent"] for v in per_node.values())))
    return out


# ---------------------------------------------------------------- driver


def inner(args: argparse.Namespace) -> int:
    from lab.netlab import NetLab

    lab = NetLab.attach(json.loads(Path(args.inner).read_text()))
    meter = Meter(lab, args)
    size = args.size_mib << 20
    bound = size * 8 / (args.uplink_mbit * 1e6) + args.delay_ms / 1e3
    result: dict[str, Any] = {
        "bench": "wan", "regions": lab.regions, "hosts_per_region": lab.hosts_per_region,
        "receivers": lab.regions * lab.hosts_per_region - 1, "size_mib": args.size_mib,
        "uplink_mbit": args.uplink_mbit, "host_mbit": args.host_mbit,
        "delay_ms": args.delay_ms, "intra_delay_ms": args.intra_delay_ms,
        "chunk_size": args.chunk_size, "tls": args.tls, "lt_piece_kib": args.lt_piece_kib,
        "lt_cross_peers": args.lt_cross_peers, "lt_pex": not args.lt_no_pex,
        "uplink_burst_kib": args.uplink_burst_kib, "flow_bound_s": round(bound, 3),
        "swarm_knobs": args.swarm or [], "host_sysctls": dict(args.sysctl),
        "host_route": dict(args.route),
        "warm_memory_mib": args.warm_mib, "origin_warm_memory_mib": args.origin_warm_mib,
        "loss": args.loss, "versions": args.versions,
        "congestion_control": args.congestion if args.congestion is not None else "bbr",
        # the [network] knobs set (None: the shipped value)
        **{key: getattr(args, key) for _f, key, *_ in NETWORK_KNOBS},
        "cpus": os.cpu_count(), "runs": []}
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for k in range(args.runs):
        for system in systems:
            check = verify_delay(lab, args)
            load0 = os.getloadavg()
            print(f"run {k + 1}/{args.runs} {system}: delay ok "
                  f"(RTT {check['cross_rtt_ms']} / {check['intra_rtt_ms']} ms) ...", flush=True)
            try:
                if system == "libtorrent":
                    row = run_libtorrent(lab, args, meter, seed=k + 1)
                else:
                    row = run_patchswarm(lab, args, meter, oneshot=system == "oneshot",
                                         seed=k + 1)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                row = {"error": str(exc)[-800:]}
            if meter.last_trace is not None:
                row["trace"], meter.last_trace = meter.last_trace, None
                print_trace(row["trace"])
            row.update(system=system, run=k + 1, delay_check=check,
                       load_avg_before=[round(x, 2) for x in load0],
                       load_avg_after=[round(x, 2) for x in os.getloadavg()])
            result["runs"].append(row)
            print(summary_line(row), flush=True)
    print_table(result)
    sim = simulate(args, result)
    if sim is not None:
        result["simulator"] = sim
    out = Path(args.out or ROOT / "benchmarks" / "results" / "wan.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(r.get("converged") for r in result["runs"]) else 1


def print_trace(rows: list[dict[str, Any]]) -> None:
    """Uplink Mbit/s over time, one line per sample."""
    if not rows:
        return
    keys = [k for k in rows[0] if k != "t"]
    print("    t s  " + " ".join(f"{k:>6}" for k in keys))
    for r in rows:
        print(f"  {r['t']:6.2f} " + " ".join(f"{r.get(k, 0):6.1f}" for k in keys))


def summary_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"  {row['system']} run {row['run']}: ERROR {row['error']}"
    up = row["uplinks"]
    into = " ".join(f"r{r}={u['into_copies']}" for r, u in up.items() if r != "0")
    later = ""
    if row.get("later_versions"):
        later = ("; later versions " + ", ".join(
            f"{v['all_s']} s ({max(u['into_copies'] for r, u in v['uplinks'].items() if r != '0')} copies)"
            for v in row["later_versions"]))
    marks = row.get("read_marks")
    gather = (f", {marks['read_marks']} receive marks ({marks['read_marks_expired']} expired)"
              if marks else "")
    return (f"  {row['system']} run {row['run']}: all {row['all_s']} s "
            f"(from hand-off {row['all_from_handoff_s']} s), regions {row['regions_s']}, "
            f"copies in {into}, {row['cpu_s_per_gb']} CPU-s/GB{gather}, "
            f"holders {row['holders']['cpu_s']} CPU-s / {row['holders']['packets']} pkts{later}")


def simulate(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any] | None:
    """The simulator's ``wan-3x4`` with this run's measured node CPU, apply CPU (the
    nodes' own: what their applies after the last chunk cost) and hand-off
    (``simulations.emulated``) against the emulation's median: prints and returns it."""
    rows = [r for r in result["runs"] if r.get("system") == "patchswarm" and "error" not in r]
    if not rows:
        return None
    from simulations.emulated import emulated_wan, predict

    tails = [r["apply_tail_cpu_s"] for r in rows if r.get("apply_tail_cpu_s")]
    if not tails:
        print("simulator: the nodes reported no apply CPU (an older node?): no prediction")
        return None
    size = statistics.median(int(r["payload_bytes"]) for r in rows)
    sc = emulated_wan(
        size_bytes=int(size),
        chunk_bytes=args.chunk_size, handoff_s=statistics.median(r["handoff_s"] for r in rows),
        node_cpu_s_per_gb=statistics.median(r["cpu_s_per_gb"] for r in rows),
        apply_cpu_s_per_gb=statistics.median(tails) / (size / 1e9),
        regions=result["regions"], hosts_per_region=result["hosts_per_region"],
        uplink_mbit=args.uplink_mbit, delay_ms=args.delay_ms, loss=args.loss,
        lanes=args.lanes or 1, congestion=args.congestion or "bbr",
        warm_up_kib=args.warm_up_kib)
    if sc is None:
        print("simulator: no scenario file for this shape (configs/sim/wan-3x4.toml is 3x4, "
              "100 Mbit uplinks)")
        return None
    sim = predict(sc)
    emu = statistics.median(r["all_s"] for r in rows)
    sim["emulated_s"] = emu
    sim["difference"] = round(sim["serving_s"] / emu - 1, 4)
    print(f"simulator (wan-3x4, calibrated to this run: io {sim['io_mb_s']} MB/s, apply "
          f"{sim['apply_mb_s']} MB/s, hand-off "
          f"{sim['encode_s']:.2f} s): every node serving at {sim['serving_s']:.2f} s against "
          f"{emu:.2f} s emulated ({sim['difference']:+.1%}); holding it at {sim['held_s']:.2f} s")
    return sim


def print_table(result: dict[str, Any]) -> None:
    print(f"\nflow bound {result['flow_bound_s']} s; {result['receivers']} receivers, "
          f"{result['size_mib']} MiB, uplinks {result['uplink_mbit']} Mbit, "
          f"{result['delay_ms']} ms between regions")
    hdr = ("system", "run", "all s", "from hand-off s", "per region s", "copies into remote "
           "(uplink)", "copies (app)", "tbf drops into remote", "CPU-s/GB", "CPU-s/GB moved",
           "holder CPU-s", "held pkts", "load", "ok")
    print(" | ".join(hdr))
    for row in result["runs"]:
        if "error" in row:
            print(f"{row['system']} | {row['run']} | error: {row['error'][:200]}")
            continue
        up = ",".join(str(u["into_copies"]) for r, u in row["uplinks"].items() if r != "0")
        app = ",".join(str(v) for _, v in sorted(row["cross_region_app_copies"].items()))
        drops = ",".join(str(u["tbf_drops_into"]) for r, u in row["uplinks"].items() if r != "0")
        print(" | ".join(str(x) for x in (
            row["system"], row["run"], row["all_s"], row["all_from_handoff_s"],
            ",".join(str(v) for v in row["regions_s"].values()), up, app, drops,
            row["cpu_s_per_gb"], row.get("cpu_s_per_gb_moved"),
            row["holders"]["cpu_s"], row["holders"]["packets"], row["load_avg_before"][0],
            row["converged"])))
    by: dict[str, list[float]] = {}
    for row in result["runs"]:
        if "error" not in row:
            by.setdefault(row["system"], []).append(row["all_s"])
    for s, v in by.items():
        print(f"{s}: median {statistics.median(v):.2f} s, range {min(v):.2f}-{max(v):.2f} s")
    later: dict[int, list[float]] = {}
    for row in result["runs"]:
        for k, v in enumerate(row.get("later_versions") or [], start=2):
            later.setdefault(k, []).append(v["all_s"])
    for k, v in sorted(later.items()):
        print(f"patchswarm version {k} of each run (same origin): median "
              f"{statistics.median(v):.2f} s, range {min(v):.2f}-{max(v):.2f} s")


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    from lab.netlab import NetLab, delay_available

    why = delay_available()
    if why:
        print(f"bench_wan: {why}", file=sys.stderr)
        return 2
    lab = NetLab(args.regions, args.hosts_per_region, uplink_mbit=args.uplink_mbit,
                 host_mbit=args.host_mbit, trainer_in_region=0, delay_ms=args.delay_ms,
                 intra_delay_ms=args.intra_delay_ms, loss=args.loss,
                 uplink_burst_bytes=int(args.uplink_burst_kib * 1024),
                 host_sysctls=dict(args.sysctl), host_route=dict(args.route))
    desc_file = None
    try:
        lab.build()
        fd, desc_file = tempfile.mkstemp(prefix="patchswarm-wan-", suffix=".json")
        os.close(fd)
        Path(desc_file).write_text(json.dumps(lab.describe()))
        cmd = [*lab.exec_prefix(lab.ns_trainer), sys.executable, str(Path(__file__).resolve()),
               *argv, "--inner", desc_file]
        child = subprocess.Popen(cmd, cwd=ROOT)
        try:
            rc = child.wait()
        except KeyboardInterrupt:  # a terminal's ^C reached the run too; SIGTERM did not
            if _TERMINATED:
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
            rc = 130
    finally:
        lab.close()
        if desc_file:
            Path(desc_file).unlink(missing_ok=True)
    totals = [h.get("final") for h in lab.holders if h.get("final")]
    if totals:
        print(f"delay holders over the whole bench: {len(totals)} processes, "
              f"{sum(t['cpu_s'] for t in totals):.2f} CPU-s, "
              f"{sum(t['packets'] for t in totals)} packets held, "
              f"{sum(t['dropped_over_cap'] for t in totals)} dropped over the cap, "
              f"largest hold {max(t['max_held'] for t in totals)} packets")
    return rc


_TERMINATED: list[bool] = []


def _sysctl(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip() or not key.replace(".", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. "
                                         "net.ipv4.tcp_slow_start_after_idle=0")
    return key.strip(), value.strip()


def _route(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or key not in ROUTE_ATTRS or not value.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected ATTR=N, ATTR one of "
                                         f"{', '.join(ROUTE_ATTRS)}")
    return key, value


ROUTE_ATTRS = ("initcwnd", "initrwnd")


def _on_sigterm(*_: object) -> None:
    """SIGTERM cleans up like ^C: the fleet, the lab's processes and namespaces."""
    _TERMINATED.append(True)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with ^C ignored
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                    help="comma-separated, of: " + ", ".join(SYSTEMS) + " (default: all)")
    ap.add_argument("--runs", type=int, default=3, metavar="N", help="runs per system (default 3)")
    ap.add_argument("--size-mib", type=int, default=64, metavar="MIB", help="payload in MiB (default 64)")
    ap.add_argument("--quick", action="store_true", help="16 MiB, 1 run: a smoke check")
    ap.add_argument("--regions", type=int, default=3, metavar="N", help="regions (default 3)")
    ap.add_argument("--hosts-per-region", type=int, default=4, metavar="N",
                    help="hosts per region; region 0's last host is the trainer (default 4)")
    ap.add_argument("--uplink-mbit", type=float, default=100.0, metavar="MBIT",
                    help="region uplinks, tbf both ways (default 100)")
    ap.add_argument("--host-mbit", type=float, default=1000.0, metavar="MBIT",
                    help="host links, tbf (default 1000)")
    ap.add_argument("--delay-ms", type=float, default=40.0, metavar="MS",
                    help="one way, between regions (default 40)")
    ap.add_argument("--intra-delay-ms", type=float, default=1.0, metavar="MS",
                    help="one way, inside a region (default 1; 0: none, and no per-host "
                         "holders)")
    ap.add_argument("--chunk-size", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                    help="patchswarm chunk size (default: the shipped 4 MiB)")
    ap.add_argument("--no-tls", dest="tls", action="store_false",
                    help="patchswarm without mutual TLS (shipped default: TLS on)")
    ap.add_argument("--lt-piece-kib", type=int, default=256, metavar="KIB",
                    help="libtorrent piece size (default 256)")
    ap.add_argument("--lt-cross-peers", type=int, default=2, metavar="N",
                    help="hosts of other regions each libtorrent host dials (default 2)")
    ap.add_argument("--lt-no-pex", action="store_true",
                    help="libtorrent without peer exchange (hosts keep to the peers given)")
    ap.add_argument("--uplink-burst-kib", type=float, default=96.0, metavar="KIB",
                    help="tbf burst of the uplinks; under 64 KiB tbf splits GSO "
                         "super-packets, so the router's holder sees more (default 96)")
    ap.add_argument("--poll-s", type=float, default=0.5, metavar="S",
                    help="seconds between /status polls; times come from the nodes' own "
                         "clocks (default 0.5)")
    ap.add_argument("--long-poll", type=float, default=0.0, metavar="S",
                    help="wait for each node with one blocking request of up to S seconds "
                         "(/status?wait_active), not a poll every --poll-s (default 0: poll, "
                         "as every round's figures did; round 61's A/B of the two is in "
                         "docs/benchmarks.md)")
    ap.add_argument("--trace", action="store_true",
                    help="sample the uplinks every 0.25 s during each transfer: Mbit/s into "
                         "and out of every region over time, printed (the first version) and "
                         "kept in the JSON (every version)")
    ap.add_argument("--swarm", action="append", metavar="KNOB=VALUE",
                    help="a protocol knob for the trainer and every node ([swarm] of their "
                         "configs; VALUE in JSON), e.g. --swarm uplink_window=3; repeatable")
    ap.add_argument("--cpu-account", action="store_true",
                    help="patchswarm nodes count the CPU of each stage of their data path "
                         "(node.cpu_account; a few percent slower): summed per run into "
                         "its \"cpu_account\" and printed")
    ap.add_argument("--perf", nargs="?", const="perf", default=None, metavar="PATH",
                    help="profile one remote border node (n1-0) during each patchswarm transfer "
                         "with Linux perf (optionally its path); shares per stage go in the run's "
                         "\"perf\" (benchmarks/perfstat.py)")
    ap.add_argument("--perf-keep", type=Path, default=None, metavar="DIR",
                    help="with --perf: record call graphs (dwarf) and keep each run's perf.data "
                         "in DIR, for perf report -G")
    ap.add_argument("--sysctl", type=_sysctl, action="append", default=[], metavar="KEY=VALUE",
                    help="set in every host's namespace (repeatable), to measure a deployment "
                         "setting: e.g. net.ipv4.tcp_slow_start_after_idle=0 (Linux restarts "
                         "an idle connection's congestion window from its initial one)")
    ap.add_argument("--route", type=_route, action="append", default=[], metavar="ATTR=VALUE",
                    help="an attribute of every host's route to the other regions (repeatable), "
                         "to measure a deployment setting: e.g. initcwnd=64 and initrwnd=64 "
                         "(TCP's first congestion and receive windows on the long paths)")
    ap.add_argument("--loss", type=float, default=0.0, metavar="P",
                    help="drop each TCP segment between regions with probability P (the core's "
                         "delay holder; default 0): a long lossy path caps a loss-based TCP flow "
                         "near MSS / RTT x 1.22 / sqrt(P)")
    ap.add_argument("--congestion", default=None, metavar="NAME",
                    help="[network] congestion_control of the trainer and every node (default: "
                         "the shipped bbr; \"\" = the host's, see --sysctl "
                         "net.ipv4.tcp_congestion_control=cubic for a CUBIC-default host)")
    ap.add_argument("--tcp-trace", action="store_true",
                    help="with --keep-logs: sample every host's TCP connections (ss -tin) "
                         "4 times a second into DIR/run<k>-patchswarm/tcp-trace.txt "
                         "(benchmarks/wan_tcp.py reads it)")
    for flag, key, kind, metavar, what in NETWORK_KNOBS:
        ap.add_argument(flag, dest=key, type=kind, default=None, metavar=metavar,
                        help=f"[network] {key} of the trainer and every node: {what}")
    ap.add_argument("--versions", type=int, default=1, metavar="N",
                    help="patchswarm: the long-running origin publishes N dense versions in a "
                         "row per run (RL's steady state: it keeps what it measured); the "
                         "run's figures are the first's, the others' under later_versions "
                         "(default 1)")
    ap.add_argument("--warm-mib", type=int, default=DEFAULT_WARM_MEMORY_MIB, metavar="MIB",
                    help="[node] warm_memory_mib of every node: heap touched at start so the "
                         "first version runs on warm memory (0: off; default: the shipped "
                         f"{DEFAULT_WARM_MEMORY_MIB})")
    ap.add_argument("--origin-warm-mib", type=int, default=DEFAULT_ORIGIN_WARM_MEMORY_MIB,
                    metavar="MIB", help="the trainer's [node] warm_memory_mib (default: the "
                    f"shipped origin's {DEFAULT_ORIGIN_WARM_MEMORY_MIB})")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="copy every node's log (and the origin's, logged at INFO) to "
                         "DIR/run<k>-<system>/ before the run's files are removed; the nodes "
                         "then log at DEBUG (a line per chunk transfer)")
    ap.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="give up on a transfer after this long (default 300)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="JSON results (default benchmarks/results/wan.json)")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.runs = 16, 1
    bad = [s for s in args.systems.split(",") if s.strip() and s.strip() not in SYSTEMS]
    if bad:
        ap.error(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    if args.regions < 2 or args.hosts_per_region < 2:
        ap.error("need at least 2 regions and 2 hosts per region")
    if args.tcp_trace and not args.keep_logs:
        ap.error("--tcp-trace writes into the kept logs: give --keep-logs DIR too")
    try:
        return inner(args) if args.inner else outer(args, argv)
    except KeyboardInterrupt:  # everything started was closed on the way out
        print("bench_wan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
