"""A loopback fleet: one trainer and N node daemons as separate OS processes.

The trainer listens on 127.0.0.1; node ``i`` of region ``r`` on
``127.0.{r+1}.{i+1}``, all on one free port, so every node is its own
address as on a real network. Each node runs the real ``patchswarm node``
command from a generated TOML config. ``LoopbackFleet`` starts them, talks to
the trainer over a pipe (``publish``), reads every node's ``/status`` over
HTTP, kills and restarts nodes (by PID) and removes everything it made.
Used by ``patchswarm demo`` and by the integration tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.netlab import NetLab
from swarm.errors import PatchswarmError

MODEL = "all-MiniLM-L6-v2"
# the longest a blocking /status request waits for a node (wait_version): short enough
# that the progress callback and the deadline are looked at often
WAIT_STEP_S = 1.0


class FleetError(PatchswarmError):
    """The loopback fleet could not start or did not converge in time."""


@dataclass
class NodeProc:
    name: str
    region: str
    host: str
    port: int
    config: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    netns: str | None = None  # network namespace of an emulated host (lab.netlab)
    api_port: int | None = None  # the HTTP API's own port (with TLS); None: the swarm port
    gateway_port: int | None = None  # the request gateway's port (``gateway=``); None: none

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def api_addr(self) -> str:
        return f"{self.host}:{self.api_port or self.port}"

    @property
    def gateway_url(self) -> str | None:
        """``http://host:port`` of the node's request gateway, or None without one."""
        return f"http://{self.host}:{self.gateway_port}" if self.gateway_port else None


def until(what: str, fn: Any, timeout: float = 60.0, poll_s: float = 0.1) -> Any:
    """Poll ``fn`` until it returns something truthy; ``AssertionError`` naming ``what``
    and the last value after ``timeout`` seconds (for tests and lab scripts)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def free_port(hosts: list[str], tries: int = 50) -> int:
    """A port free on every one of ``hosts``."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ok = True
        for h in hosts:
            with socket.socket() as s:
                try:
                    s.bind((h, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise FleetError("no port free on every loopback address")


class LoopbackFleet:
    """See the module docstring. Use as a context manager; ``close`` kills what it started."""

    def __init__(self, regions: int = 3, nodes_per_region: int = 4, *, lr: float = 1e-6,
                 chunk_size: int = 64 * 1024, workdir: Path | None = None,
                 keep_workdir: bool = False, swarm: dict[str, Any] | None = None,
                 node_env: dict[str, dict[str, str]] | None = None,
                 lab: NetLab | None = None, tls: bool = False,
                 trainer_sections: dict[str, dict[str, Any]] | None = None,
                 node_keys: list[str] | None = None, model: str = MODEL,
                 gateway: dict[str, Any] | None = None,
                 model_config: dict[str, Any] | None = None,
                 network: dict[str, Any] | None = None,
                 node_section: dict[str, Any] | None = None,
                 trainer_warm_memory_mib: int | None = None,
                 node_log_level: str | None = None) -> None:
        """``lab``: place every node (and the trainer) on an emulated host of a
        ``lab.netlab.NetLab`` instead of 127.0.x.x. The calling process must
        then run inside one of the lab's namespaces (it polls the nodes over HTTP).
        ``tls``: a swarm CA for the fleet, a certificate per node and for the
        trainer, mutual TLS on the swarm port and the HTTP API on a port of its own.
        ``trainer_sections``: extra keys for the trainer's config, by section (e.g.
        ``{"publish": {"anchor_every": 3}, "store": {"keep_versions": 1}}``).
        ``node_keys``: confidential mode. These nodes (by name, e.g. "n0-1") get an
        X25519 key (``keys/<name>.x25519``, ``[trust] node_key``) and the trainer
        publishes every version encrypted for exactly them; the other nodes relay
        ciphertext they cannot open.
        ``model``: the model name in every config. ``gateway``: give every node a
        request gateway (``[gateway]``, in-process engine) on a port of its own, with
        these extra keys (e.g. ``{"retry_after_s": 1}``). ``model_config``: written as
        ``config.json`` beside the base checkpoint (the in-process runner's shape).
        ``network``: extra ``[network]`` keys for the trainer and every node (e.g.
        ``{"unsent_limit_kib": 0}``). ``node_section``: extra ``[node]`` keys for every
        node (its ``warm_memory_mib`` the trainer's too). A fleet on one machine starts its
        nodes and its trainer without warm memory
        (``warm_memory_mib = 0``: a dozen nodes would hold 256 MiB each for nothing in a
        demo or a test) unless ``node_section`` sets it; the benchmarks pass the shipped
        value. ``trainer_warm_memory_mib``: the trainer's own (default: the nodes').
        ``node_log_level``: every node's ``[log] level`` (e.g. "debug": a line per
        chunk transfer, for timelines)."""
        if regions < 1 or nodes_per_region < 1:
            raise FleetError("need at least one region and one node per region")
        if regions > 200 or nodes_per_region > 200:
            raise FleetError("at most 200 regions and 200 nodes per region on loopback")
        self.regions = [f"region-{r}" for r in range(regions)]
        self.lr = lr
        self.chunk_size = chunk_size
        self.own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="patchswarm-demo-"))
        self.keep_workdir = keep_workdir
        self.swarm = swarm or {}
        self.trainer_sections = trainer_sections or {}
        self.node_env = node_env or {}
        self.lab = lab
        self.tls = tls
        self.node_keys = None if node_keys is None else list(node_keys)
        self.model = model
        self.gateway = gateway
        self.network = dict(network or {})
        node_keys_extra = {"warm_memory_mib": 0, **(node_section or {})}
        self.warm_memory_mib = int(node_keys_extra["warm_memory_mib"] if trainer_warm_memory_mib
                                   is None else trainer_warm_memory_mib)  # the trainer's
        self.node_section = "".join(f"{k} = {json.dumps(v)}\n" for k, v in node_keys_extra.items())
        self.model_config = model_config
        self.node_log = f'[log]\nlevel = "{node_log_level}"\n\n' if node_log_level else ""
        self.trainer_host = lab.ip_trainer if lab else "127.0.0.1"
        # a trainer placed on a host of a region (lab ``trainer_in_region``) is of that
        # region: the origin then feeds it over its LAN and counts only the others as
        # remote (behind its site uplink); else it is a region of its own
        placed = getattr(lab, "trainer_in_region", None) if lab else None
        self.trainer_region = f"region-{placed}" if placed is not None else "trainer"
        self.trainer_prefix = NetLab.exec_prefix(lab.ns_trainer) if lab else []
        self.nodes: list[NodeProc] = []

        def place(r: int, i: int) -> tuple[str, str | None]:
            if lab:
                return lab.ip_host(r, i), lab.ns_host(r, i)
            return f"127.0.{r + 1}.{i + 1}", None

        if lab:
            if regions > lab.regions or nodes_per_region > lab.hosts_per_region:
                raise FleetError("the lab has fewer regions or hosts than the fleet needs")
            self.port = 7400  # every emulated host has its own port space
        else:
            hosts = [self.trainer_host] + [place(r, i)[0] for r in range(regions)
                                           for i in range(nodes_per_region)]
            self.port = free_port(hosts)
        self.api_port: int | None = None
        if tls:
            self.api_port = self.port + 1 if lab else free_port(hosts)
            while self.api_port == self.port:
                self.api_port = free_port(hosts)
        gateway_port: int | None = None
        if gateway is not None:
            taken = {self.port, self.api_port}
            gateway_port = self.port + 2 if lab else free_port(hosts)
            while gateway_port in taken:
                gateway_port = free_port(hosts)
        for r, region in enumerate(self.regions):
            for i in range(nodes_per_region):
                name = f"n{r}-{i}"
                host, netns = place(r, i)
                self.nodes.append(NodeProc(name, region, host, self.port,
                                           self.workdir / f"{name}.toml",
                                           self.workdir / f"{name}.log",
                                           dict(self.node_env.get(name, {})), netns=netns,
                                           api_port=self.api_port,
                                           gateway_port=gateway_port))
        self.trainer: subprocess.Popen | None = None
        self.trainer_log = self.workdir / "trainer.log"
        self.ready: dict[str, Any] = {}
        self.published: list[dict[str, Any]] = []

    # ------------------------------------------------------------ configs

    @property
    def trainer_addr(self) -> str:
        return f"{self.trainer_host}:{self.port}"

    @property
    def trainer_api_addr(self) -> str:
        return f"{self.trainer_host}:{self.api_port or self.port}"

    def _tls_sections(self, name: str, region: str, host: str, role: str = "node") -> str:
        """``[tls]`` and ``[api]`` for one process: its certificate, issued now."""
        if not self.tls:
            return ""
        from swarm.trust import ca

        w = self.workdir
        if not (w / "ca" / ca.CA_CERT).exists():
            ca.init_ca(w / "ca", name="patchswarm demo fleet CA")
        ca.issue(w / "ca", name, region=region, role=role, out_dir=w / "certs")
        return (f'[tls]\nca = "ca/{ca.CA_CERT}"\ncert = "certs/{name}.crt"\n'
                f'key = "certs/{name}.key"\n\n[api]\nlisten = "{host}:{self.api_port}"\n\n')

    def _write_configs(self) -> None:
        from swarm.trust.keys import generate_keypair

        w = self.workdir
        generate_keypair(w / "trainer.key")
        if self.model_config is not None:
            (w / "config.json").write_text(json.dumps(self.model_config, indent=1) + "\n")
        (w / "swarm.secret").write_text(os.urandom(32).hex() + "\n")
        knobs = "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.swarm.items())
        keyed: set[str] = set()
        recipients = ""
        if self.node_keys is not None:
            (w / "keys").mkdir(exist_ok=True)
            for name in self.node_keys:
                if not (w / "keys" / f"{name}.x25519").exists():
                    generate_keypair(w / "keys" / f"{name}.x25519", kind="x25519")
                keyed.add(name)
            recipients = "recipients = [" + ", ".join(
                f'"keys/{name}.x25519.pub"' for name in sorted(keyed)) + "]\n"
        common = '[network]\nswarm_secret_file = "swarm.secret"\n' + "".join(
            f"{k} = {json.dumps(v)}\n" for k, v in self.network.items())
        if not self.tls and self.lab is not None:  # lab hosts are not loopback addresses
            common += 'allow_plaintext = true\n'
        extra = {sec: "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                 for sec, keys in self.trainer_sections.items()}
        unknown = set(extra) - {"store", "publish"}
        if unknown:
            raise FleetError(f"trainer_sections: cannot add to {sorted(unknown)}")
        (w / "trainer.toml").write_text(
            f'[node]\nid = "trainer"\nregion = "{self.trainer_region}"\nmodel = "{self.model}"\n'
            f'role = "origin"\nwarm_memory_mib = {self.warm_memory_mib}\n\n'
            f'{common}listen = "{self.trainer_addr}"\n\n'
            f'[store]\ndir = "trainer-store"\nfsync = false\n{extra.get("store", "")}\n'
            f'[weights]\nbase = "base.safetensors"\nbase_version = 1\n\n'
            f'[publish]\nsigning_key = "trainer.key"\nchunk_size = {self.chunk_size}\n'
            f'served_dtype = "bf16"\n{extra.get("publish", "")}\n{recipients}\n'
            f'{self._tls_sections("trainer", self.trainer_region, self.trainer_host, "origin")}'
            f'[swarm]\n{knobs}'
        )
        for n in self.nodes:
            n.config.write_text(
                f'[node]\nid = "{n.name}"\nregion = "{n.region}"\nmodel = "{self.model}"\n'
                f'{self.node_section}\n'
                f'{common}listen = "{n.addr}"\nbootstrap = ["{self.trainer_addr}"]\n\n'
                f'[trust]\ntrainer_keys = ["trainer.key.pub"]\n'
                + (f'node_key = "keys/{n.name}.x25519"\n' if n.name in keyed else "") + "\n"
                f'[store]\ndir = "{n.name}-store"\nfsync = false\n\n'
                f'[weights]\nbase = "base.safetensors"\nbase_version = 1\ndevice = "cpu"\n\n'
                f'{self._tls_sections(n.name, n.region, n.host)}'
                f'{self._gateway_section(n)}'
                f'{self.node_log}'
                f'[swarm]\n{knobs}'
            )

    def _gateway_section(self, n: NodeProc) -> str:
        """``[gateway]`` for one node (``gateway=``), else nothing."""
        if self.gateway is None or n.gateway_port is None:
            return ""
        keys = "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.gateway.items())
        return f'[gateway]\nlisten = "{n.host}:{n.gateway_port}"\n{keys}\n'

    # ------------------------------------------------------------ processes

    def start(self, timeout: float = 150.0) -> None:
        """Start the trainer, wait for its base checkpoint, then every node."""
        self._write_configs()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.trainer_log.open("ab") as logf:
            self.trainer = subprocess.Popen(
                [*self.trainer_prefix, sys.executable, "-m", "lab.demo_trainer", "--config",
                 str(self.workdir / "trainer.toml"), "--base-out",
                 str(self.workdir / "base.safetensors"), "--lr", str(self.lr)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=env,
                cwd=self.workdir, text=True)
        self.ready = self._read_trainer(timeout)
        if self.ready.get("event") != "ready":
            raise FleetError(f"trainer did not start: {self.ready}")
        for n in self.nodes:
            self.start_node(n)
        self.wait_healthy(timeout)

    def start_origin(self, base: dict[str, Any], regions: int, settle_s: float = 2.0,
                     timeout: float = 60.0) -> Any:
        """A long-running origin (``trainer.publisher.Publisher``) in this process, on the
        fleet's ``trainer.toml``: started, once ``regions`` regions reached it (or after
        ``timeout``), and ``settle_s`` more so that every node has its region's peers
        from the tracker. The caller closes it."""
        from node.config import load_config
        from trainer.publisher import Publisher

        pub = Publisher(load_config(self.workdir / "trainer.toml"), base=base,
                        persist_view=False)
        pub.start()
        deadline = time.monotonic() + timeout
        while len(pub.regions()) < regions and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(settle_s)
        return pub

    def start_nodes_only(self, base: dict[str, Any], timeout: float = 120.0,
                         nodes: list[NodeProc] | None = None) -> None:
        """No trainer process: write ``base`` (served tensors) as the base checkpoint and
        start the nodes (``nodes``: only these; start the others later with
        ``start_node``); versions then come from ``publish_cli`` (one origin per version)
        or from a ``Publisher`` the caller runs on ``trainer.toml``."""
        from safetensors.torch import save_file

        self._write_configs()
        save_file(base, str(self.workdir / "base.safetensors"))
        for n in nodes if nodes is not None else self.nodes:
            self.start_node(n)
        self.wait_healthy(timeout, nodes)

    def publish_cli(self, checkpoint: Path, *args: str, timeout: float = 300.0
                    ) -> subprocess.CompletedProcess:
        """Run the real ``patchswarm publish --config trainer.toml CHECKPOINT`` once."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [*self.trainer_prefix, sys.executable, "-m", "patchswarm", "publish", "--config",
               str(self.workdir / "trainer.toml"), str(checkpoint), *args]
        with self.trainer_log.open("ab") as logf:
            return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=logf, env=env,
                                  cwd=self.workdir, text=True, timeout=timeout, check=False)

    def start_node(self, n: NodeProc) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **n.env)
        with n.log.open("ab") as logf:
            n.proc = subprocess.Popen(
                [*n.prefix, sys.executable, "-m", "patchswarm", "node", "--config", str(n.config)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                cwd=self.workdir)

    def _read_trainer(self, timeout: float) -> dict[str, Any]:
        assert self.trainer is not None and self.trainer.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.trainer.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise FleetError(f"trainer silent for {timeout:.0f} s (log: {self.trainer_log})")
        finally:
            sel.close()
        line = self.trainer.stdout.readline()
        if not line:
            raise FleetError(f"trainer exited: {self._tail(self.trainer_log)}")
        return json.loads(line)

    @staticmethod
    def _tail(path: Path, n: int = 1500) -> str:
        try:
            return path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float, nodes: list[NodeProc] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.nodes if nodes is None else nodes)
        while pending and time.monotonic() < deadline:
            for n in list(pending):
                if n.proc is not None and n.proc.poll() is not None:
                    raise FleetError(f"node {n.name} exited with {n.proc.returncode}: "
                                     f"{self._tail(n.log)}")
                if self.http(n.api_addr, "/healthz") is not None:
                    pending.remove(n)
            time.sleep(0.1)
        if pending:
            raise FleetError(f"nodes not healthy after {timeout:.0f} s: {[n.name for n in pending]}")

    @staticmethod
    def http(addr: str, path: str, timeout: float = 2.0) -> Any:
        try:
            with urllib.request.urlopen(f"http://{addr}{path}", timeout=timeout) as r:
                body = r.read()
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return json.loads(body) if path.split("?")[0] == "/status" else body

    @staticmethod
    def healthz(addr: str, timeout: float = 2.0) -> tuple[int, str]:
        """``/healthz`` as (status code, body); (0, reason) when nothing answers."""
        try:
            with urllib.request.urlopen(f"http://{addr}/healthz", timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            return 0, str(exc)

    def status(self, n: NodeProc) -> dict[str, Any] | None:
        return self.http(n.api_addr, "/status")

    def trainer_status(self) -> dict[str, Any] | None:
        return self.http(self.trainer_api_addr, "/status")

    # ------------------------------------------------------------ versions

    def publish(self, timeout: float = 120.0) -> dict[str, Any]:
        """One AdamW step + publish in the trainer; returns its report."""
        assert self.trainer is not None and self.trainer.stdin is not None
        self.trainer.stdin.write("publish\n")
        self.trainer.stdin.flush()
        r = self._read_trainer(timeout)
        if r.get("event") != "published":
            raise FleetError(f"publish failed: {r}")
        self.published.append(r)
        return r

    def wait_version(self, version: int, timeout: float, nodes: list[NodeProc] | None = None,
                     on_poll: Any = None) -> dict[str, dict[str, Any]]:
        """Wait until every node in ``nodes`` is active at ``version``; their ``/status``
        documents, read once all are. A node not there yet is asked with a blocking request
        (``/status?wait_active``, up to ``WAIT_STEP_S`` a time), so that a fleet test does
        not keep a dozen nodes answering polls at 10 Hz on a small box. ``on_poll(done,
        last)`` after each answer."""
        nodes = nodes if nodes is not None else self.nodes
        deadline = time.monotonic() + timeout
        last: dict[str, dict[str, Any]] = {}

        def at(n: NodeProc) -> bool:
            return (last.get(n.name) or {}).get("active_version") == version

        while True:
            for n in nodes:
                if at(n):
                    continue
                left = deadline - time.monotonic()
                active = (last.get(n.name) or {}).get("active_version")
                if left > 0.2 and (active is None or active < version):
                    w = min(WAIT_STEP_S, left)
                    st = self.http(n.api_addr, f"/status?wait_active={version}&timeout_s={w:.1f}",
                                   timeout=w + 5)
                else:  # past the version (never equal again) or out of time: a plain read
                    st = self.status(n)
                if st is not None:
                    last[n.name] = st
                if on_poll is not None:
                    on_poll(sum(1 for m in nodes if at(m)), last)
            if all(at(n) for n in nodes):
                for n in nodes:  # every document as of now, not as of its node's arrival
                    st = self.status(n)
                    if st is not None:
                        last[n.name] = st
                if all(at(n) for n in nodes):
                    return last
            if time.monotonic() > deadline:
                done = sum(1 for n in nodes if at(n))
                raise FleetError(f"version {version}: {done}/{len(nodes)} nodes active after "
                                 f"{timeout:.0f} s (logs in {self.workdir})")
            time.sleep(0.1)

    def publish_converged(self, timeout: float = 120.0) -> dict[str, dict[str, Any]]:
        """Publish a version, wait until every node serves it, and check that every node
        serves the trainer's digest (``FleetError`` if not); the nodes' last ``/status``."""
        pub = self.publish()
        statuses = self.wait_version(pub["version"], timeout=timeout)
        digests = {st["active_digest"] for st in statuses.values()}
        if digests != {pub["digest"]}:
            raise FleetError(f"version {pub['version']}: digests {sorted(digests)}, the "
                             f"trainer's {pub['digest']}")
        return statuses

    # ------------------------------------------------------------ faults

    def kill(self, n: NodeProc, sig: int = signal.SIGKILL) -> int | None:
        """Send ``sig`` to one node's process (by PID) and reap it."""
        if n.proc is None or n.proc.poll() is not None:
            return None if n.proc is None else n.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.kill(n.proc.pid, sig)
        try:
            return n.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(n.proc.pid, signal.SIGKILL)
            return n.proc.wait(5)

    # ------------------------------------------------------------ cleanup

    def close(self) -> None:
        """SIGTERM every process we started (by PID), SIGKILL stragglers, remove temp files."""
        if self.trainer is not None and self.trainer.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError, AssertionError):
                assert self.trainer.stdin is not None
                self.trainer.stdin.write("quit\n")
                self.trainer.stdin.flush()
        procs = [n.proc for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in [*procs, self.trainer]:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
        if self.trainer is not None:
            for stream in (self.trainer.stdin, self.trainer.stdout):
                with contextlib.suppress(Exception):
                    stream.close()  # type: ignore[union-attr]
        if self.own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LoopbackFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
