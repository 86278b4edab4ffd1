"""Emulated geography on one machine: network namespaces, bridges, shaped uplinks.

``NetLab`` builds, as root, a small internet of its own and removes it on
``close``::

    host ns (one per node) ─veth─┐
    host ns ─veth────────────────┤ region ns: bridge ── uplink veth (tbf) ── core ns (router)
    trainer ns ─veth─ trainer-region ns: bridge ── uplink veth (tbf) ───────┘

Every region (the trainer sits in a region of its own) reaches the others
only through its uplink, shaped with ``tbf`` in both directions to
``uplink_mbit``; host links can be shaped to ``host_mbit``. Addresses are
10.213.R.H/24 inside region R and 10.214.R.0/30 on uplinks; traffic never
leaves the namespaces this object made (nothing is added to the root
namespace). This kernel has no ``netem``, so links add no delay.

Processes are started inside a host with ``NetLab.exec_prefix(ns)``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

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


@dataclass
class NetLab:
    regions: int
    hosts_per_region: int
    uplink_mbit: float = 100.0
    trainer_uplink_mbit: float | None = None  # default: uplink_mbit
    host_mbit: float | None = None  # None: host links unshaped
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    namespaces: list[str] = field(default_factory=list)

    # ------------------------------------------------------------ names and addresses

    @property
    def trainer_region(self) -> int:
        return self.regions  # the trainer's own region index

    def ns_host(self, region: int, host: int) -> str:
        return f"psw{self.tag}-h{region}-{host}"

    def ns_region(self, region: int) -> str:
        return f"psw{self.tag}-g{region}"

    @property
    def ns_core(self) -> str:
        return f"psw{self.tag}-core"

    @property
    def ns_trainer(self) -> str:
        return self.ns_host(self.trainer_region, 0)

    @staticmethod
    def ip_host(region: int, host: int) -> str:
        return f"10.213.{region}.{host + 1}"

    @property
    def ip_trainer(self) -> str:
        return self.ip_host(self.trainer_region, 0)

    @staticmethod
    def exec_prefix(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    # ------------------------------------------------------------ build and tear down

    def _run(self, *cmd: str, ns: str | None = None) -> None:
        full = ([*self.exec_prefix(ns)] if ns else []) + list(cmd)
        res = subprocess.run(full, capture_output=True, text=True, timeout=20)
        if res.returncode != 0:
            raise LabError(f"{' '.join(full)}: {res.stderr.strip()}")

    def _add_ns(self, name: str) -> None:
        self._run("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._run("ip", "link", "set", "dev", "lo", "up", ns=name)

    def _shape(self, ns: str, dev: str, mbit: float | None) -> None:
        if mbit:
            burst = max(32 * 1024, int(mbit * 1e6 / 8 / 250))  # ~4 ms of data, >= 32 KiB
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
        core = self.ns_core
        self._add_ns(core)
        self._run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=core)
        for r in range(self.regions + 1):
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
            self._shape(g, "uplink", mbit)
            self._shape(core, f"r{r}", mbit)
            self._run("ip", "route", "add", "default", "via", f"10.214.{r}.2", ns=g)
            self._run("ip", "route", "add", f"10.213.{r}.0/24", "via", f"10.214.{r}.1", ns=core)
            hosts = 1 if r == self.trainer_region else self.hosts_per_region
            for h in range(hosts):
                ns = self.ns_host(r, h)
                self._add_ns(ns)
                self._veth(ns, "eth0", g, f"h{h}")
                self._run("ip", "link", "set", "dev", f"h{h}", "master", "br0", ns=g)
                self._run("ip", "link", "set", "dev", f"h{h}", "up", ns=g)
                self._run("ip", "addr", "add", f"{self.ip_host(r, h)}/24", "dev", "eth0", ns=ns)
                self._run("ip", "link", "set", "dev", "eth0", "up", ns=ns)
                self._run("ip", "route", "add", "default", "via", f"10.213.{r}.254", ns=ns)
                self._shape(ns, "eth0", self.host_mbit)
                self._shape(g, f"h{h}", self.host_mbit)

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
        """Delete every namespace this lab made (their links go with them)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.namespaces.clear()

    def __enter__(self) -> NetLab:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()
