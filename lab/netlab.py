"""Emulated geography on one machine: network namespaces, bridges, shaped uplinks.

``NetLab`` builds, as root, a small internet of its own and removes it on
``close``::

    host ns (one per node) ─veth─┐
    host ns ─veth────────────────┤ region ns: bridge ── uplink veth (tbf) ── core ns (router)
    trainer ns ─veth─ trainer-region ns: bridge ── uplink veth (tbf) ───────┘

Every region (the trainer sits in a region of its own, or with
``trainer_in_region=R`` on the last host of region R) reaches the others
only through its uplink, shaped with ``tbf`` in both directions to
``uplink_mbit``; host links can be shaped to ``host_mbit``. Addresses are
10.213.R.H/24 inside region R and 10.214.R.0/30 on uplinks; traffic never
leaves the namespaces this object made (nothing is added to the root
namespace).

Delay: this kernel has no ``netem``, so ``delay_ms`` (one way, between
regions) and ``intra_delay_ms`` (one way, between two hosts of a region) are
added by user-space NFQUEUE holders (``lab.delay``, needs nftables and the
``wan`` extra): a forward rule in the core namespace holds every packet that
crosses regions, once (so a round trip between regions gains 2 x
``delay_ms``); an output rule in each host namespace holds what the host sends
to its own region's subnet (this kernel cannot queue from a ``bridge`` chain,
so the intra-region delay costs one holder per host). One holder process per
namespace with a rule; the rules (the xtables NFQUEUE target, in the ``ip
filter`` nf_tables table that ``iptables-nft`` makes inside the lab's own
namespaces) and the processes go on ``close``.
``uplink_bytes()`` reads the bytes through each region's uplink;
``delay_stats()`` what the holders cost.

Processes are started inside a host with ``NetLab.exec_prefix(ns)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.errors import PatchswarmError


class LabError(PatchswarmError):
    pass


def available() -> str | None:
    """None when a lab can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"psw-probe-{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def delay_available() -> str | None:
    """None when delayed links can be built here (``available()`` plus nft and fnfqueue)."""
    why = available()
    if why:
        return why
    if not shutil.which("nft") or not shutil.which("iptables-nft"):
        return ("needs nftables and iptables-nft: apt-get install -y nftables iptables "
                "(scripts/wan_setup.sh)")
    try:
        import fnfqueue  # noqa: F401
    except ImportError:
        return "needs fnfqueue: pip install -e '.[wan]' (scripts/wan_setup.sh)"
    return None


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class NetLab:
    regions: int
    hosts_per_region: int
    uplink_mbit: float = 100.0
    trainer_uplink_mbit: float | None = None  # default: uplink_mbit
    host_mbit: float | None = None  # None: host links unshaped
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    namespaces: list[str] = field(default_factory=list)
    trainer_in_region: int | None = None  # None: the trainer has a region of its own
    delay_ms: float = 0.0  # one way, between regions (NFQUEUE holder in the core)
    loss: float = 0.0  # per TCP segment between regions, at random (the core's holder)
    intra_delay_ms: float = 0.0  # one way, between hosts of one region (a holder per host)
    uplink_burst_bytes: int | None = None  # None: ~4 ms of data, >= 32 KiB
    # sysctls set in every host's namespace, e.g. {"net.ipv4.tcp_slow_start_after_idle": "0"}
    host_sysctls: dict[str, str] = field(default_factory=dict)
    # attributes of every host's default route (the one to other regions), e.g.
    # {"initcwnd": "64", "initrwnd": "64"}: TCP's first windows on the long paths
    host_route: dict[str, str] = field(default_factory=dict)
    holders: list[dict[str, Any]] = field(default_factory=list)
    tables: list[tuple[str, str]] = field(default_factory=list)  # (ns, "family name")

    # ------------------------------------------------------------ names and addresses

    @property
    def trainer_region(self) -> int:
        """The region index of the trainer's host."""
        return self.regions if self.trainer_in_region is None else self.trainer_in_region

    @property
    def trainer_host(self) -> int:
        """The trainer's host index in its region: with ``trainer_in_region`` the region's
        last host (a fleet then leaves that host out)."""
        return 0 if self.trainer_in_region is None else self.hosts_per_region - 1

    @property
    def n_region_ns(self) -> int:
        """Region namespaces built: one per region, plus the trainer's own if it has one."""
        return self.regions + (1 if self.trainer_in_region is None else 0)

    def ns_host(self, region: int, host: int) -> str:
        return f"psw{self.tag}-h{region}-{host}"

    def ns_region(self, region: int) -> str:
        return f"psw{self.tag}-g{region}"

    @property
    def ns_core(self) -> str:
        return f"psw{self.tag}-core"

    @property
    def ns_trainer(self) -> str:
        return self.ns_host(self.trainer_region, self.trainer_host)

    @staticmethod
    def ip_host(region: int, host: int) -> str:
        return f"10.213.{region}.{host + 1}"

    @property
    def ip_trainer(self) -> str:
        return self.ip_host(self.trainer_region, self.trainer_host)

    @property
    def table(self) -> str:
        return f"psw{self.tag}"

    @staticmethod
    def exec_prefix(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    # ------------------------------------------------------------ build and tear down

    def _run(self, *cmd: str, ns: str | None = None, stdin: str | None = None) -> str:
        full = ([*self.exec_prefix(ns)] if ns else []) + list(cmd)
        res = subprocess.run(full, capture_output=True, text=True, timeout=20, input=stdin)
        if res.returncode != 0:
            raise LabError(f"{' '.join(full)}: {res.stderr.strip()}")
        return res.stdout

    def _add_ns(self, name: str) -> None:
        self._run("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._run("ip", "link", "set", "dev", "lo", "up", ns=name)

    def _shape(self, ns: str, dev: str, mbit: float | None, burst: int | None = None) -> None:
        """tbf at ``mbit``; a burst under a GSO super-packet (64 KiB) makes tbf segment it."""
        if mbit:
            burst = burst or max(32 * 1024, int(mbit * 1e6 / 8 / 250))  # ~4 ms, >= 32 KiB
            self._run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                      "burst", str(burst), "latency", "100ms", ns=ns)

    def _veth(self, a_ns: str, a: str, b_ns: str, b: str) -> None:
        self._run("ip", "link", "add", a, "netns", a_ns, "type", "veth", "peer", "name", b,
                  "netns", b_ns)

    def build(self) -> NetLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        if self.trainer_in_region is not None and not 0 <= self.trainer_in_region < self.regions:
            raise LabError(f"trainer_in_region={self.trainer_in_region}: no such region")
        if (self.delay_ms or self.intra_delay_ms) and (why := delay_available()):
            raise LabError(f"delayed links: {why}")
        core = self.ns_core
        self._add_ns(core)
        self._run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=core)
        for r in range(self.n_region_ns):
            g = self.ns_region(r)
            self._add_ns(g)
            self._run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=g)
            self._run("ip", "link", "add", "name", "br0", "type", "bridge", ns=g)
            self._run("ip", "addr", "add", f"10.213.{r}.254/24", "dev", "br0", ns=g)
            self._run("ip", "link", "set", "dev", "br0", "up", ns=g)
            # uplink: region ns "up" <-> core ns "r<r>", shaped both ways
            self._veth(g, "uplink", core, f"r{r}")
            self._run("ip", "addr", "add", f"10.214.{r}.1/30", "dev", "uplink", ns=g)
            self._run("ip", "addr", "add", f"10.214.{r}.2/30", "dev", f"r{r}", ns=core)
            self._run("ip", "link", "set", "dev", "uplink", "up", ns=g)
            self._run("ip", "link", "set", "dev", f"r{r}", "up", ns=core)
            mbit = self.uplink_mbit
            if r == self.trainer_region and self.trainer_uplink_mbit:
                mbit = self.trainer_uplink_mbit
            self._shape(g, "uplink", mbit, self.uplink_burst_bytes)
            self._shape(core, f"r{r}", mbit, self.uplink_burst_bytes)
            self._run("ip", "route", "add", "default", "via", f"10.214.{r}.2", ns=g)
            self._run("ip", "route", "add", f"10.213.{r}.0/24", "via", f"10.214.{r}.1", ns=core)
            hosts = 1 if r == self.n_region_ns - 1 and self.trainer_in_region is None \
                else self.hosts_per_region
            for h in range(hosts):
                ns = self.ns_host(r, h)
                self._add_ns(ns)
                self._veth(ns, "eth0", g, f"h{h}")
                self._run("ip", "link", "set", "dev", f"h{h}", "master", "br0", ns=g)
                self._run("ip", "link", "set", "dev", f"h{h}", "up", ns=g)
                self._run("ip", "addr", "add", f"{self.ip_host(r, h)}/24", "dev", "eth0", ns=ns)
                self._run("ip", "link", "set", "dev", "eth0", "up", ns=ns)
                self._run("ip", "route", "add", "default", "via", f"10.213.{r}.254",
                          *(x for kv in self.host_route.items() for x in kv), ns=ns)
                for key, value in self.host_sysctls.items():
                    self._run("sysctl", "-qw", f"{key}={value}", ns=ns)
                self._shape(ns, "eth0", self.host_mbit)
                self._shape(g, f"h{h}", self.host_mbit)
                if self.intra_delay_ms:
                    self._delay(ns, 1, self.intra_delay_ms, hook="output",
                                match=("-d", f"10.213.{r}.0/24"))
        if self.loss and not self.delay_ms:
            raise LabError("loss between regions needs delay_ms > 0 (the holder drops)")
        if self.delay_ms:
            self._delay(core, 0, self.delay_ms, loss=self.loss)

    # ------------------------------------------------------------ delay (lab.delay holders)

    def _delay(self, ns: str, queue: int, delay_ms: float, hook: str = "forward",
               match: tuple[str, ...] = (), loss: float = 0.0) -> None:
        """A holder bound to ``queue`` in ``ns`` first, then the ``hook`` rule feeding it
        (no packet is queued before someone listens)."""
        stats = Path(tempfile.gettempdir()) / f"{self.table}-{ns}.json"
        proc = subprocess.Popen(
            [*self.exec_prefix(ns), sys.executable, "-m", "lab.delay", "--queue", str(queue),
             "--delay-ms", str(delay_ms), "--loss", str(loss), "--stats", str(stats)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True)  # a terminal's ^C stops the run, not the delay under it
        self.holders.append({"ns": ns, "hook": hook, "queue": queue, "delay_ms": delay_ms,
                             "loss": loss,
                             "pid": proc.pid, "proc": proc, "stats": stats})
        assert proc.stdout is not None
        ready = select.select([proc.stdout], [], [], 30)[0]
        line = proc.stdout.readline().strip() if ready else ""  # "ready" once bound
        if line != "ready":
            err = proc.stderr.read() if proc.stderr else ""
            raise LabError(f"delay holder in {ns} did not start: {err.strip()[-500:]}")
        # The kernel here lacks nft's own ``queue`` (CONFIG_NFT_QUEUE) but has the xtables
        # NFQUEUE target, which iptables-nft drives through nf_tables (table "ip filter").
        chain = {"forward": "FORWARD", "output": "OUTPUT"}[hook]
        self._run("iptables-nft", "-A", chain, *match, "-j", "NFQUEUE", "--queue-num",
                  str(queue), ns=ns)
        self.tables.append((ns, "ip filter"))

    def delay_stats(self) -> list[dict[str, Any]]:
        """Per holder: namespace, delay, CPU-seconds so far, packets queued so far (the
        kernel's last packet id) and drops (kernel queue full, holder over its cap)."""
        out = []
        for h in self.holders:
            row = {k: h[k] for k in ("ns", "hook", "queue", "delay_ms")}
            row["pid"] = h["pid"]
            row["cpu_s"] = _cpu_seconds(h["pid"])
            with contextlib.suppress(LabError, ValueError, IndexError):
                for line in self._run("cat", "/proc/net/netfilter/nfnetlink_queue",
                                      ns=h["ns"]).splitlines():
                    f = line.split()
                    if int(f[0]) == h["queue"]:
                        row.update(packets=int(f[7]), waiting=int(f[2]),
                                   kernel_dropped=int(f[5]) + int(f[6]))
            out.append(row)
        return out

    def _stop_holders(self) -> None:
        """SIGTERM each holder (it accepts what it holds and writes its counters), then
        SIGKILL stragglers; by PID only."""
        mine = [h for h in self.holders if "proc" in h]  # not those handed over by describe()
        for h in mine:
            with contextlib.suppress(ProcessLookupError):
                h["proc"].send_signal(signal.SIGTERM)
        for h in mine:
            p = h["proc"]
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(5)
            for stream in (p.stdout, p.stderr):
                with contextlib.suppress(Exception):
                    stream.close()
            with contextlib.suppress(OSError, ValueError):
                h["final"] = json.loads(h["stats"].read_text())
            h["stats"].unlink(missing_ok=True)

    def describe(self) -> dict[str, Any]:
        """What another process needs to measure this lab (``NetLab.attach``)."""
        return {"regions": self.regions, "hosts_per_region": self.hosts_per_region,
                "uplink_mbit": self.uplink_mbit, "host_mbit": self.host_mbit, "tag": self.tag,
                "trainer_in_region": self.trainer_in_region, "delay_ms": self.delay_ms,
                "loss": self.loss,
                "intra_delay_ms": self.intra_delay_ms,
                "uplink_burst_bytes": self.uplink_burst_bytes, "holders": [{k: h[k] for k in ("ns", "hook", "queue", "delay_ms", "pid")}
                            for h in self.holders]}

    @classmethod
    def attach(cls, desc: dict[str, Any]) -> NetLab:
        """A handle on a lab built by another process (names, addresses, counters); its
        ``close`` removes nothing: the builder does."""
        lab = cls(**{k: v for k, v in desc.items() if k != "holders"})
        lab.holders = list(desc.get("holders", []))
        return lab

    def _end_strays(self) -> None:
        """Processes still inside this lab's namespaces (a run killed before it cleaned up
        after itself): SIGTERM, then SIGKILL, each by PID. Only this lab made these
        namespaces, so only its own runs can be in them."""
        def pids() -> list[int]:
            out: list[int] = []
            for ns in self.namespaces:
                res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                     text=True, timeout=20)
                out += [int(x) for x in res.stdout.split() if x.isdigit()]
            return [p for p in out if p != os.getpid()]

        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            left = pids()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and pids():
                time.sleep(0.1)

    # ------------------------------------------------------------ measurement

    def uplink_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes through each region's uplink veth so far (``ip -s -j link``, region side):
        ``into`` the region from the core, ``out`` of it."""
        out = {}
        for r in range(self.n_region_ns):
            info = json.loads(self._run("ip", "-s", "-j", "link", "show", "dev", "uplink",
                                        ns=self.ns_region(r)))[0]
            st = info.get("stats64") or info["stats"]
            out[r] = {"into": int(st["rx"]["bytes"]), "out": int(st["tx"]["bytes"])}
        return out

    def uplink_drops(self) -> dict[int, dict[str, int]]:
        """Packets the uplink shapers dropped so far (``tc -s qdisc``): ``into`` a region
        (the core's tbf toward it), ``out`` of it (the region's own tbf). A drop is a TCP
        retransmission: bytes on the wire that no application counts."""
        def drops(ns: str, dev: str) -> int:
            rows = json.loads(self._run("tc", "-s", "-j", "qdisc", "show", "dev", dev, ns=ns))
            return sum(int(q.get("drops", 0)) for q in rows)

        return {r: {"into": drops(self.ns_core, f"r{r}"), "out": drops(self.ns_region(r), "uplink")}
                for r in range(self.n_region_ns)}

    def tcp_rtt_ms(self, src_ns: str, dst_ip: str, tries: int = 5) -> float:
        """Smallest TCP connect round trip from ``src_ns`` to ``dst_ip`` in ms: a SYN to a
        closed port answered by a RST (no listener needed)."""
        code = ("import socket,time\nbest=1e9\n"
                f"for _ in range({int(tries)}):\n"
                "    s=socket.socket(); s.settimeout(5); t=time.perf_counter()\n"
                f"    try: s.connect(('{dst_ip}', 9))\n"
                "    except ConnectionRefusedError: best=min(best,time.perf_counter()-t)\n"
                "    finally: s.close()\n"
                "    time.sleep(0.05)\n"
                "print(best*1e3)\n")
        ms = float(self._run(sys.executable, "-c", code, ns=src_ns).strip())
        if ms >= 1e11:
            raise LabError(f"no answer from {dst_ip} (from {src_ns})")
        return ms

    def cut(self, region: int) -> None:
        """Partition ``region`` from every other region (and the trainer): its uplink goes down."""
        self._run("ip", "link", "set", "dev", "uplink", "down", ns=self.ns_region(region))
        self._run("ip", "link", "set", "dev", f"r{region}", "down", ns=self.ns_core)

    def heal(self, region: int) -> None:
        """Undo ``cut``: the uplink comes back up with its routes (a link going down drops them)."""
        self._run("ip", "link", "set", "dev", "uplink", "up", ns=self.ns_region(region))
        self._run("ip", "link", "set", "dev", f"r{region}", "up", ns=self.ns_core)
        self._run("ip", "route", "replace", "default", "via", f"10.214.{region}.2",
                  ns=self.ns_region(region))
        self._run("ip", "route", "replace", f"10.213.{region}.0/24", "via", f"10.214.{region}.1",
                  ns=self.ns_core)

    def close(self) -> None:
        """Stop the delay holders and any process left in the lab, delete the nft tables
        and every namespace this lab made (their links go with them)."""
        with contextlib.suppress(BaseException):
            self._stop_holders()
        with contextlib.suppress(BaseException):
            self._end_strays()
        for ns, table in self.tables:
            subprocess.run([*self.exec_prefix(ns), "nft", "delete", "table", *table.split()],
                           capture_output=True, timeout=20)
        self.tables.clear()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.namespaces.clear()

    def __enter__(self) -> NetLab:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()
