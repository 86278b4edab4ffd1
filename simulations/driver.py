"""Run real ``swarm.protocol.core.NodeCore`` objects over the modelled network.

This is the simulator's driver in the sense of ``swarm/protocol/events.py``:
it feeds every core events stamped with the *virtual* time and carries out the
actions it returns. Nothing of the protocol is re-implemented here; the
driver only decides how long things take:

- ``Connect``: the listener sees ``PeerConnected(outbound=False)`` one latency
  later, the dialler ``PeerConnected(outbound=True)`` one round trip later;
  a dead or cut-off address answers ``ConnectFailed`` (RST after a round trip,
  or after ``connect_timeout_s`` across a region cut).
- One byte stream per direction of a connection: chunks leave one after the
  other, and a control frame waits behind the chunk data queued ahead of it
  (``interleave_block_bytes``: 0 = behind every queued chunk, as whole-chunk
  link messages; N = behind the N-byte block on the wire).
- ``SendFrame``: the frame's real bytes arrive one latency after they leave
  (plus a retransmission timeout with the path's loss probability, plus a busy
  shaped uplink's queue), FIFO per direction. Control frames do not consume
  modelled bandwidth; their bytes are counted.
- ``SendChunk``: a flow of ``size`` bytes through sender uplink, site links and
  receiver downlink (:mod:`simulations.network`), capped per flow by the
  path's Mathis rate and, on a fresh connection, the slow-start window. A chunk
  that crosses sites (from the origin or another region) is announced to its
  receiver one latency after its flow starts (``ChunkArriving``: its first
  block; with ``serve_arriving`` every chunk is). A chunk sent while it still
  arrives (``SendChunk.arriving``: a cut-through relay, or an answer with
  ``serve_arriving``) runs as its own flow from the start, free while it is
  behind the flow bringing the chunk in, then no faster than that flow
  (``FlowNet.follow``); if it is done before the sender has verified the chunk,
  its last block waits for that (``ChunkSent`` and the arrival come one block
  later, at the path's rate), and it is withdrawn if the link the chunk came on
  closes first (the receiver hears ``ChunkWithdrawn`` one latency on). When
  its last byte leaves, the sender gets ``ChunkSent``; one latency later the
  chunk has arrived, the receiver's CPU hashes and stores it
  (:mod:`simulations.cpu`) and only then does its core get
  ``ChunkReceived(valid=True)`` (the payload is a size: there are no bytes to
  hash, so every chunk of an honest sender is valid).
- ``Close``: flows on the connection stop; the closer gets
  ``PeerDisconnected`` at once, the peer one latency later (after frames
  already in flight).
- ``ApplyVersion``: the node now holds every verified chunk; that instant is
  its completion time. ``Applied(ok=True)`` follows once its CPU applied the
  version, plus ``apply_s``. The trainer's ``Publish`` comes ``encode_s``
  after the publish call.

Manifests are real: Ed25519-signed once per version with a key drawn from the
seed, verified by every core with ``swarm.trust.manifest.verify_manifest``.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simulations.cpu import Cores, run_job
from simulations.engine import Engine
from simulations.network import INF, LOSS_BASED, FlowNet, Resource
from simulations.scenario import STRATEGY_KNOBS, Cpu, Scenario
from simulations.timeline import Timeline
from simulations.topology import Endpoint, Topology, draw_capacities
from swarm.protocol import events as ev

MODEL = "sim/model"
PORT = 7000
# Every node starts holding version 1 (the base checkpoint; manifests number
# versions from 1, and a patch's parent is >= 1); the scenario's k-th published
# version is BASE_VERSION + k. Reports number them k = 1..versions.
BASE_VERSION = 1
# how often a node's driver looks whether a link's bytes are being acknowledged
# (node.tcp_watch.ACK_WATCH_S; the simulator may not import the node)
ACK_WATCH_S = 1.0
# a sampled round trip above this x its floor reads as a queue on the path
# (node.tcp.QUEUE_FACTOR; ``ev.PathSample``)
PATH_QUEUE_FACTOR = 1.25
# node.warm_up's first look at a new link, its looks while the handshake is under way
# (each twice as late), and BBR's start-up gain per round trip (the simulator may not
# import the node)
WARM_UP_DELAY_S = 0.25
WARM_UP_LOOKS = 6
BBR_STARTUP_GAIN = 2.885

def _slow_start_time(nbytes: float, cwnd: float, rtt: float, ceil: float, most: float) -> float:
    """Time to send ``nbytes`` from window ``cwnd`` doubling every ``rtt`` (at most ``most``)."""
    t = 0.0
    while nbytes > 0.0 and t < most:
        rate = min(cwnd / rtt, ceil)
        if nbytes <= rate * rtt:
            return min(most, t + nbytes / rate)
        nbytes -= rate * rtt
        t += rtt
        cwnd *= 2
    return min(t, most)


class SimNode:
    """One simulated host: its core, its place in the network, its tallies."""

    __slots__ = (
        "active",
        "addr",
        "alive",
        "applied_at",
        "chunk_at",
        "cid",
        "conns",
        "core",
        "cpu",
        "cpu_spec",
        "done_at",
        "ep",
        "first_seen",
        "have",
        "idx",
        "inc",
        "manifests",
        "node_id",
        "origin",
        "recv_bytes",
        "region",
        "sent_bytes",
        "tick_at",
        "warm_free",
    )

    def __init__(
        self, idx: int, node_id: str, region: str, addr: str, ep: Endpoint, origin: bool
    ) -> None:
        self.idx = idx
        self.node_id = node_id
        self.region = region
        self.addr = addr
        self.ep = ep
        self.origin = origin
        self.core: Any = None
        self.alive = False
        self.inc = 0  # incarnation: events for an earlier life are dropped
        self.cid = 0
        self.conns: dict[int, Half] = {}
        self.tick_at = INF
        self.done_at: dict[int, float] = {}  # version -> virtual time it held all chunks
        self.applied_at: dict[int, float] = {}  # version -> virtual time its Applied arrived
        self.cpu: Cores | None = None  # None: CPU costs nothing (no [cpu] rates)
        self.cpu_spec = Cpu()
        self.have: dict[int, set[int]] = {}  # version -> verified chunks (the "store")
        self.manifests: dict[int, bytes] = {}
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.chunk_at = INF  # when it first sent or received a chunk (warm-ups end then)
        self.warm_free = 0.0  # when its last warm-up ends (one link at a time)
        self.first_seen = 0.0
        self.active = BASE_VERSION  # last version applied (the restart point)


class Half:
    """One end of a simulated connection: its outgoing byte stream.

    Chunks leave one after the other (one TCP stream: one flow at a time, the
    rest in ``queue``); control frames queue behind chunk bytes (``held``, see
    ``Simulation._send_frame``). ``cwnd`` is the sender's congestion window while
    it is still in slow start (``INF`` once open).
    """

    __slots__ = (
        "cid",
        "cur",
        "cwnd",
        "enq",
        "fifo",
        "held",
        "inc",
        "last",
        "lat",
        "node",
        "open",
        "peer",
        "queue",
        "rtt",
        "warm_at",
    )

    def __init__(self, node: SimNode, cid: int, lat: float) -> None:
        self.node = node
        self.inc = node.inc
        self.cid = cid
        self.lat = lat
        self.rtt = 2 * lat
        self.open = True
        self.peer: Half = self
        self.fifo = 0.0  # latest arrival time of anything sent from this end
        self.cur: list[Any] | None = None  # the chunk on the wire: [half, v, i, size, flow, seq, ceil]
        self.queue: deque[list[Any]] = deque()  # chunks waiting behind it
        self.enq = 0  # chunks queued on this end so far (their sequence numbers)
        self.held: deque[tuple[int, bytes, float]] = deque()  # (gate seq, frame, sent at)
        self.cwnd = INF  # bytes per RTT while ramping up (slow start)
        self.last = 0.0  # when the last chunk's last byte left (the window was last in use)
        self.warm_at = INF  # when its warm-up (Scenario.warm_up_kib) is over, if it has one


@dataclass
class RunResult:
    """Everything the report needs from one strategy's run."""

    strategy: str
    payload_bytes: int
    chunk_bytes: int
    publish_at: list[float]
    done: dict[int, dict[str, float]]  # version -> node id -> completion time (absolute)
    live_nodes: dict[str, str]  # node id -> region, for nodes alive at the end
    node_region: dict[str, str]
    upload_bytes: dict[str, int]
    pair_bytes: dict[tuple[str, str], int]  # (src site, dst site) -> chunk bytes
    trainer_egress_bytes: int
    control_bytes: int
    control_frames: int
    cross_region_control_bytes: int
    chunks_sent: int
    events: int
    wall_s: float
    cpu_s: float  # CPU seconds of this process (wall_s includes waiting on a shared machine)
    end_time: float
    capacities: dict[str, list[tuple[float, float]]]
    logs: dict[str, int] = field(default_factory=dict)
    churn: dict[str, int] = field(default_factory=dict)
    applied: dict[int, dict[str, float]] = field(default_factory=dict)  # like ``done``, Applied
    encode_s: float = 0.0
    hol: dict[str, float] = field(default_factory=dict)  # control frames behind chunk bytes
    cpu_busy_s: float = 0.0  # CPU seconds the nodes spent (hash, io, apply)
    idle_restarts: int = 0  # chunks started on a window decayed since the last chunk
    chunks_stopped: int = 0  # answers stopped short (``ev.StopChunk``)


class Simulation:
    """One strategy on one scenario: build the fleet, run it, collect tallies."""

    def __init__(
        self,
        sc: Scenario,
        strategy: str,
        seed: int | None = None,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.sc = sc
        self.strategy = strategy
        self.seed = sc.seed if seed is None else seed
        self.rng = random.Random(f"sim:{self.seed}")
        self.engine = Engine()
        self.net = FlowNet(self.engine, sc.sharing)
        self.topo = Topology.build(sc)
        self.capacities = draw_capacities(sc, random.Random(f"caps:{self.seed}"))
        self.payload = sc.payload_bytes(strategy)
        self.progress = progress
        self.nodes: list[SimNode] = []
        self.by_addr: dict[str, SimNode] = {}
        self.pair_bytes: dict[tuple[str, str], int] = {}
        self.trainer_egress = 0
        self.control_bytes = 0
        self.control_frames = 0
        self.cross_control = 0
        self.chunks_sent = 0
        self.logs: dict[str, int] = {}
        self.timeline: Timeline | None = None  # set before run() to record one version
        self.cut: set[str] = set()
        # bytes on the wire per payload byte: a shaper counts every packet's headers
        self.wire = (sc.mss + sc.header_bytes) / sc.mss
        self.block = sc.interleave_block_bytes * self.wire
        self.shared_cpu = Cores(sc.host_cores) if sc.host_cores > 0 else None
        self.hol_frames = 0  # control frames that waited behind chunk bytes
        self.hol_wait = 0.0  # their total wait, seconds
        self.hol_max = 0.0
        self.idle_restarts = 0  # chunks started on a window decayed since the last chunk
        self.chunks_stopped = 0  # answers stopped short: their requester cancelled them
        self.churn = {"left": 0, "rejoined": 0, "joined": 0}
        self.pending_faults = 0
        # cut-through relays: (node, v, i) -> items whose last block waits for the chunk's
        # verification at ``node``; (node, v, i) -> the half the chunk arrives on
        self.parked: dict[tuple[SimNode, int, int], list[list[Any]]] = {}
        self.incoming: dict[tuple[SimNode, int, int], Half] = {}
        # serve_arriving: chunks from a region peer are announced while they arrive too,
        # and sends of an arriving chunk are paced: (node, v, i) -> their items
        from swarm.protocol.config import CoreConfig

        knobs = {**STRATEGY_KNOBS[strategy], **sc.protocol}
        self.arrive_all = bool(knobs.get("serve_arriving", CoreConfig.serve_arriving))
        # the origin's driver samples its pushes' paths (``ev.PathSample``)
        self.path_samples = bool(knobs.get("clear_startup", CoreConfig.clear_startup))
        self.paced: dict[tuple[SimNode, int, int], list[list[Any]]] = {}
        self.alive_count = 0  # rollout nodes alive now
        self.published = 0
        self.publish_at: list[float] = []
        self.done_count: dict[int, int] = {}
        self.manifests: list[bytes] = []
        self._make_trust()
        self._make_fleet()

    # ------------------------------------------------------------------ setup
    def _make_trust(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from swarm.trust.keys import TrustStore, key_id
        from swarm.trust.manifest import verify_manifest

        seed_bytes = random.Random(f"key:{self.seed}").randbytes(32)
        self.key = Ed25519PrivateKey.from_private_bytes(seed_bytes)
        self.key_id = key_id(self.key)
        self.trust = TrustStore([self.key.public_key()])
        trust = self.trust
        self.verify: Callable[[bytes], Any] = lambda raw: verify_manifest(raw, trust)

    def _sign(self, version: int, kind: str, length: int) -> bytes:
        """A real signed manifest of ``length`` bytes; chunk hashes stand in for absent bytes."""
        from swarm.trust.manifest import Manifest, sign_manifest

        c = self.sc.chunk_bytes
        count = max(1, -(-length // c))
        hrng = random.Random(f"hash:{self.seed}:{version}")
        digest = lambda v: random.Random(f"digest:{self.seed}:{v}").randbytes(32)  # noqa: E731
        m = Manifest(
            model=MODEL,
            version=version,
            kind=kind,
            parent_version=version - 1 if kind == "patch" else None,
            parent_digest=digest(version - 1) if kind == "patch" else None,
            target_digest=digest(version),
            payload_length=length,
            chunk_size=c,
            chunk_hashes=tuple(hrng.randbytes(32) for _ in range(count)),
            created_at=float(version),
            key_id=self.key_id,
        )
        return sign_manifest(m, self.key)

    def _config(self, node: SimNode, bootstrap: tuple[str, ...]) -> Any:
        from swarm.protocol.config import CoreConfig

        knobs = dict(STRATEGY_KNOBS[self.strategy])
        knobs.update(self.sc.protocol)  # checked by the scenario (check_knobs)
        knobs.setdefault("active_version", node.active)
        return CoreConfig(
            node_id=node.node_id,
            region=node.region,
            model=MODEL,
            listen_addr=node.addr,
            role="origin" if node.origin else "node",
            bootstrap=bootstrap,
            swarm_secret=b"sim-secret",
            **knobs,
        )

    def _make_fleet(self) -> None:
        sc = self.sc
        tsite = sc.trainer_site()
        t_up = Resource("up[trainer]", sc.trainer_uplink_mbps * 1e6 / 8)
        t_down = Resource("down[trainer]", INF)
        self.trainer = SimNode(
            0, "trainer", tsite, "10.255.0.1:7000", Endpoint(tsite, t_up, t_down), True
        )
        self.nodes.append(self.trainer)
        self.by_addr[self.trainer.addr] = self.trainer
        self.region_nodes: dict[str, list[SimNode]] = {}
        for ri, r in enumerate(sc.regions):
            lst = []
            for i, (up, down) in enumerate(self.capacities[r.name]):
                lst.append(self._new_node(ri, r.name, i, up, down))
            self.region_nodes[r.name] = lst

    def _new_node(self, ri: int, region: str, i: int, up: float, down: float) -> SimNode:
        addr = f"10.{ri}.{i >> 8}.{i & 255}:{PORT}"
        ep = Endpoint(
            region, Resource(f"up[{region}/{i}]", up), Resource(f"down[{region}/{i}]", down)
        )
        node = SimNode(len(self.nodes), f"{region}-{i}", region, addr, ep, False)
        spec = self.sc.regions[ri].cpu
        node.cpu_spec = spec
        if not spec.free:
            node.cpu = Cores(spec.cores)
        self.nodes.append(node)
        self.by_addr[addr] = node
        return node

    def add_node(self, ri: int, region: str, up: float, down: float) -> SimNode:
        """A new, not yet running node in region ``ri`` (``join`` starts it)."""
        node = self._new_node(ri, region, len(self.region_nodes[region]), up, down)
        self.region_nodes[region].append(node)
        return node

    def join(self, node: SimNode) -> None:
        """Start a node added by ``add_node``: an empty daemon joins the swarm."""
        node.first_seen = self.engine.now
        self._boot(node, fresh=True)
        self.check_finished()

    def _bootstrap(self, node: SimNode) -> tuple[str, ...]:
        """What a node's config would list: the trainer's address (it acts as tracker)."""
        return () if node.origin else (self.trainer.addr,)

    def _boot(self, node: SimNode, fresh: bool) -> None:
        from swarm.protocol.core import NodeCore

        node.alive = True
        if not node.origin:
            self.alive_count += 1
        node.inc += 1
        node.conns = {}
        node.tick_at = INF
        now = self.engine.now
        cfg = self._config(node, self._bootstrap(node))
        node.core = NodeCore(
            cfg,
            verify_manifest=self.verify,
            rng=random.Random(f"core:{self.seed}:{node.node_id}:{node.inc}"),
            now=now,
        )
        acts = list(node.core.start(now))
        if not fresh:  # a restarted daemon: its store still holds what it verified
            for v in sorted(node.have):
                if v > node.active and v in node.manifests:
                    acts += node.core.handle(
                        ev.LocalChunks(now, node.manifests[v], tuple(sorted(node.have[v])))
                    )
        self._apply(node, acts)
        self._rearm(node)

    # ------------------------------------------------------------------- run
    def run(self) -> RunResult:
        t0 = time.perf_counter()
        c0 = time.process_time()
        sc = self.sc
        for k in range(1, sc.versions + 1):
            kind = "full" if self.strategy == "full" else "patch"
            self.manifests.append(self._sign(BASE_VERSION + k, kind, self.payload))
        for node in self.nodes:
            self._boot(node, fresh=True)
        self._schedule_faults()
        self.engine.schedule(sc.start_s, self._publish, 1)
        if sc.interval_s > 0:
            for v in range(2, sc.versions + 1):
                self.engine.schedule(sc.start_s + (v - 1) * sc.interval_s, self._publish, v)
        self.engine.run(until=sc.max_time_s, on_batch=self._on_batch, max_events=500_000_000)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        done: dict[int, dict[str, float]] = {k: {} for k in range(1, sc.versions + 1)}
        applied: dict[int, dict[str, float]] = {k: {} for k in range(1, sc.versions + 1)}
        for n in self.nodes[1:]:
            for v, t in n.done_at.items():
                if v - BASE_VERSION in done:
                    done[v - BASE_VERSION][n.node_id] = t
            for v, t in n.applied_at.items():
                if v - BASE_VERSION in applied:
                    applied[v - BASE_VERSION][n.node_id] = t
        return RunResult(
            strategy=self.strategy,
            payload_bytes=self.payload,
            chunk_bytes=sc.chunk_bytes,
            publish_at=self.publish_at,
            done=done,
            live_nodes={n.node_id: n.region for n in self.nodes[1:] if n.alive},
            node_region={n.node_id: n.region for n in self.nodes[1:]},
            upload_bytes={n.node_id: n.sent_bytes for n in self.nodes},
            pair_bytes=dict(self.pair_bytes),
            trainer_egress_bytes=self.trainer.sent_bytes,
            control_bytes=self.control_bytes,
            control_frames=self.control_frames,
            cross_region_control_bytes=self.cross_control,
            chunks_sent=self.chunks_sent,
            chunks_stopped=self.chunks_stopped,
            events=self.engine.events,
            wall_s=wall,
            cpu_s=cpu,
            end_time=self.engine.now,
            capacities=self.capacities,
            logs=dict(self.logs),
            churn=dict(self.churn),
            applied=applied,
            encode_s=sc.encode_s,
            hol={
                "frames": self.hol_frames,
                "share": self.hol_frames / max(1, self.control_frames),
                "mean_ms": 1e3 * self.hol_wait / max(1, self.hol_frames),
                "max_s": self.hol_max,
            },
            cpu_busy_s=sum(n.cpu.busy_s for n in self.nodes if n.cpu is not None),
            idle_restarts=self.idle_restarts,
        )

    def _on_batch(self) -> None:
        if self.progress is not None:
            total = sum(self.done_count.values())
            self.progress(total, self.engine.events, self.engine.now)

    def _publish(self, k: int) -> None:
        """Publish the scenario's k-th version (protocol version BASE_VERSION + k)."""
        if k <= self.published:
            return
        self.published = k
        self.publish_at.append(self.engine.now)  # the publish call: encoding starts
        if self.timeline is not None:
            self.timeline.mark(self.engine.now, "published", BASE_VERSION + k)
        self.done_count.setdefault(k, 0)
        if self.sc.encode_s > 0:
            self.engine.schedule(self.engine.now + self.sc.encode_s, self._hand_off, k)
        else:
            self._hand_off(k)

    def _hand_off(self, k: int) -> None:
        """The encoded, signed version reaches the trainer's core."""
        t = self.trainer
        if self.timeline is not None:
            self.timeline.mark(self.engine.now, "handed_off", BASE_VERSION + k)
        self._deliver(t, t.inc, ev.Publish(self.engine.now, self.manifests[k - 1]))
        self.check_finished()

    def check_finished(self) -> None:
        """Publish the next version or stop once every live node holds the last one."""
        k = self.published
        if k == 0:
            return
        v = BASE_VERSION + k
        if self.done_count.get(k, 0) < self.alive_count:
            return  # cheap test first: done_count over-counts (it includes nodes that left)
        live = [n for n in self.nodes[1:] if n.alive]
        if all(v in n.done_at for n in live):
            if k < self.sc.versions:
                if self.sc.interval_s <= 0:
                    self.engine.schedule(self.engine.now, self._publish, k + 1)
            elif self.pending_faults == 0 and all(v in n.applied_at for n in live):
                self.engine.stop()  # every live node holds and has applied the last version

    # ------------------------------------------------------------- delivery
    def _deliver(self, node: SimNode, inc: int, event: ev.Event) -> None:
        if not node.alive or node.inc != inc:
            return
        self._apply(node, node.core.handle(event))
        self._rearm(node)

    def _rearm(self, node: SimNode) -> None:
        w = node.core.next_wakeup()
        if w is None:
            return
        now = self.engine.now
        if w <= now:
            w = now + 1e-6  # a core asking for "now" again must not livelock the clock
        if w < node.tick_at:
            node.tick_at = w
            self.engine.schedule(w, self._tick, (node, node.inc, w))

    def _tick(self, item: tuple[SimNode, int, float]) -> None:
        node, inc, w = item
        if node.inc != inc or node.tick_at != w:
            return
        node.tick_at = INF
        self._deliver(node, inc, ev.Tick(self.engine.now))

    def _apply(self, node: SimNode, actions: list[ev.Action]) -> None:
        for a in actions:
            t = type(a)
            if t is ev.SendFrame:
                self._send_frame(node, a)
            elif t is ev.SendChunk:
                self._send_chunk(node, a)
            elif t is ev.StopChunk:
                self._stop_chunk(node, a)
            elif t is ev.Connect:
                self._connect(node, a.addr)
            elif t is ev.Close:
                self._close(node, a.conn, a.reason)
            elif t is ev.AcceptManifest:
                node.manifests[a.version] = a.raw
            elif t is ev.ApplyVersion:
                self._applied(node, a.version)
            elif t is ev.Log:
                self.logs[a.event] = self.logs.get(a.event, 0) + 1
                if self.timeline is not None and node.origin:
                    self.timeline.decision(self.engine.now, a.event, a.fields)
            if not node.alive:
                return

    # ----------------------------------------------------------- connections
    def _lat(self, a: SimNode, b: SimNode) -> float:
        return self.topo.latency[(a.ep.site, b.ep.site)]

    def _severed(self, a: SimNode, b: SimNode) -> bool:
        return (
            bool(self.cut)
            and a.ep.site != b.ep.site
            and (a.ep.site in self.cut or b.ep.site in self.cut)
        )

    def _connect(self, node: SimNode, addr: str) -> None:
        now = self.engine.now
        peer = self.by_addr.get(addr)
        if peer is None or peer is node:
            self.engine.schedule(
                now + 0.001, self._connect_failed, (node, node.inc, addr, "unknown address")
            )
            return
        lat = self._lat(node, peer)
        if self._severed(node, peer):
            self.engine.schedule(
                now + self.sc.connect_timeout_s,
                self._connect_failed,
                (node, node.inc, addr, "timeout"),
            )
            return
        if not peer.alive:
            self.engine.schedule(
                now + 2 * lat, self._connect_failed, (node, node.inc, addr, "refused")
            )
            return
        self.engine.schedule(now + lat, self._accept, (node, node.inc, peer, addr, lat))

    def _connect_failed(self, item: tuple[SimNode, int, str, str]) -> None:
        node, inc, addr, reason = item
        self._deliver(node, inc, ev.ConnectFailed(self.engine.now, addr, reason))

    def _accept(self, item: tuple[SimNode, int, SimNode, str, float]) -> None:
        node, inc, peer, addr, lat = item
        now = self.engine.now
        if not node.alive or node.inc != inc:
            return
        if not peer.alive or self._severed(node, peer):
            self.engine.schedule(now + lat, self._connect_failed, (node, inc, addr, "refused"))
            return
        node.cid += 1
        peer.cid += 1
        mine = Half(node, node.cid, lat)
        theirs = Half(peer, peer.cid, lat)
        mine.last = theirs.last = now
        mine.peer, theirs.peer = theirs, mine
        node.conns[mine.cid] = mine
        peer.conns[theirs.cid] = theirs
        mine.fifo = theirs.fifo = now + lat
        if self.sc.slow_start:
            mine.cwnd = theirs.cwnd = self._initial_window(node, peer)
            if 2 * lat * 1000 >= self.sc.warm_up_min_rtt_ms:
                for h in (mine, theirs):
                    if self._warm_kib(h.node) > 0:
                        self.engine.schedule(now + WARM_UP_DELAY_S, self._warm_look, (h, h.inc, 0))
        # SYN-ACK reaches the dialler before any byte the listener sends: schedule it first
        self.engine.schedule(now + lat, self._connected, (mine, addr))
        self._deliver(peer, peer.inc, ev.PeerConnected(now, theirs.cid, False, node.addr))

    def _initial_window(self, a: SimNode, b: SimNode) -> float:
        """A new connection's window, bytes: a cross-region link striped over
        ``Scenario.lanes`` connections starts with that many windows (with "auto" they
        open later, once the node finds the link lossy: one window)."""
        iw = self.sc.initial_window * (self.sc.mss + self.sc.header_bytes)
        striped = a.ep.site != b.ep.site and not self.sc.lanes_auto
        return iw * self.sc.lanes if striped else iw

    def _warm_kib(self, node: SimNode) -> int:
        """``node``'s [network] warm_up_kib: the origin's and a node's ship apart."""
        return self.sc.origin_warm_up_kib if node.origin else self.sc.warm_up_kib

    def _warm_look(self, item: tuple[Half, int, int]) -> None:
        """node.warm_up: a long link whose handshake is done and that carries chunks between
        regions (the core's ``peer_border``) is warmed, after the node's other warm-ups, if
        the node has moved no chunk yet; looks again (twice as late) while the handshake
        is under way."""
        half, inc, look = item
        node = half.node
        if not half.open or node.inc != inc or node.chunk_at != INF:
            return
        core = node.core
        if not core.authenticated(half.cid):
            if look + 1 < WARM_UP_LOOKS:
                self.engine.schedule(self.engine.now + WARM_UP_DELAY_S * (2 << look),
                                     self._warm_look, (half, inc, look + 1))
            return
        if not core.peer_border(half.cid):
            return
        iw = self.sc.initial_window * (self.sc.mss + self.sc.header_bytes)
        budget, sent, rounds = self._warm_kib(node) * 1024, 0.0, 1  # + one for the acks
        while sent < budget:
            sent += iw * BBR_STARTUP_GAIN ** (rounds - 1)
            rounds += 1
        half.warm_at = max(self.engine.now, node.warm_free) + rounds * half.rtt
        node.warm_free = half.warm_at

    def _connected(self, item: tuple[Half, str]) -> None:
        half, addr = item
        if half.open and half.node.inc == half.inc:
            self._deliver(
                half.node, half.inc, ev.PeerConnected(self.engine.now, half.cid, True, addr)
            )

    def _close(self, node: SimNode, cid: int, reason: str) -> None:
        half = node.conns.pop(cid, None)
        if half is None or not half.open:
            return
        self._teardown(half, reason, notify_self=True)

    def _teardown(self, half: Half, reason: str, notify_self: bool) -> None:
        """Close ``half``'s connection: stop its flows, tell both ends."""
        now = self.engine.now
        half.open = False
        peer = half.peer
        self._drop_stream(half)
        self._drop_stream(peer)
        self._withdraw(half)
        self._withdraw(peer)
        half.node.conns.pop(half.cid, None)
        if notify_self:
            self.engine.schedule(now, self._disconnected, (half, reason))
        if peer.open:
            self.engine.schedule(max(now + half.lat, half.fifo), self._peer_gone, (peer, reason))

    def _drop_stream(self, half: Half) -> None:
        """The connection is gone: what this end was sending or about to send is lost."""
        if half.cur is not None:
            self.net.cancel(half.cur[4])
            half.cur = None
        half.queue.clear()
        half.held.clear()

    def _disconnected(self, item: tuple[Half, str]) -> None:
        half, reason = item
        self._deliver(half.node, half.inc, ev.PeerDisconnected(self.engine.now, half.cid, reason))

    def _peer_gone(self, item: tuple[Half, str]) -> None:
        half, reason = item
        if not half.open:
            return
        half.open = False
        half.node.conns.pop(half.cid, None)
        self._drop_stream(half)
        self._withdraw(half)
        self._deliver(
            half.node,
            half.inc,
            ev.PeerDisconnected(self.engine.now, half.cid, reason or "closed by peer"),
        )

    # ---------------------------------------------------------------- frames
    def _send_frame(self, node: SimNode, a: ev.SendFrame) -> None:
        half = node.conns.get(a.conn)
        if half is None or not half.open:
            return
        now = self.engine.now
        n = len(a.frame)
        self.control_bytes += n
        self.control_frames += 1
        peer = half.peer
        if node.ep.site != peer.node.ep.site:
            self.cross_control += n
        cur = half.cur
        wait = 0.0
        if cur is not None:
            # head-of-line: the frame shares the connection's byte stream with chunk data
            flow = cur[4]
            if not self.block:
                # whole-chunk messages: after every chunk byte queued before it
                half.held.append((half.enq, a.frame, now))
                return
            if half.held or flow.rate <= 0.0:
                # a stalled flow (or frames already waiting on it): after the chunk on the wire
                gate = half.held[-1][0] if half.held else cur[5]
                half.held.append((gate, a.frame, now))
                return
            # interleaved: it goes out after the block now on the wire
            sent = self.net.progress(flow)
            ahead = min(self.block - sent % self.block, flow.size - sent)
            wait = ahead / flow.rate
            if half.cwnd != INF and flow.rate >= flow.cap:
                wait = _slow_start_time(ahead, half.cwnd, half.rtt, cur[6], wait)
        self._put_frame(half, a.frame, now + wait, wait)

    def _put_frame(self, half: Half, frame: bytes, leaves: float, wait: float) -> None:
        """``frame`` leaves ``half`` at ``leaves`` (after ``wait`` behind data); FIFO arrival."""
        if wait > 0.0:
            self.hol_frames += 1
            self.hol_wait += wait
            if wait > self.hol_max:
                self.hol_max = wait
        key = (half.node.ep.site, half.peer.node.ep.site)
        at = leaves + half.lat
        if self.topo.queues:
            at += self.topo.queue_delay(*key)
        loss = self.topo.loss[key]
        if loss and self.rng.random() < loss:
            at += max(0.2, 4 * half.lat)  # one retransmission timeout
        if at < half.fifo:
            at = half.fifo
        half.fifo = at
        self.engine.schedule(at, self._frame_arrives, (half.peer, frame))

    def _frame_arrives(self, item: tuple[Half, bytes]) -> None:
        half, frame = item
        if half.open:
            self._deliver(half.node, half.inc, ev.FrameReceived(self.engine.now, half.cid, frame))

    # ---------------------------------------------------------------- chunks
    def _send_chunk(self, node: SimNode, a: ev.SendChunk) -> None:
        half = node.conns.get(a.conn)
        if half is None or not half.open:
            return
        half.enq += 1
        item: list[Any] = [half, a.version, a.index, a.size, None, half.enq, INF, a.arriving, 0.0]
        if half.cur is None:
            self._start_chunk(half, item)
        else:
            half.queue.append(item)  # one stream: it leaves after the chunks ahead of it

    def _start_chunk(self, half: Half, item: list[Any]) -> None:
        peer = half.peer
        now = self.engine.now
        for n in (half.node, peer.node):
            if n.chunk_at == INF:
                n.chunk_at = now
        if half.warm_at <= half.node.chunk_at and half.cwnd != INF:
            # warmed before the node's first chunk (node.warm_up): the window it opened
            iw = self.sc.initial_window * (self.sc.mss + self.sc.header_bytes)
            half.cwnd = max(half.cwnd, iw + self._warm_kib(half.node) * 1024)
        half.warm_at = INF
        src, dst = half.node.ep, peer.node.ep
        res = self.topo.flow_resources(src, dst)
        cap = self.topo.flow_cap[(src.site, dst.site)]
        if self.sc.slow_start and self.sc.idle_restart and self.sc.congestion in LOSS_BASED:
            self._idle_restart(half, cap, res)
        if half.cwnd != INF:
            # slow start: the window doubles every RTT until the path, not the window, limits
            ceil = min(cap, min(r.cap for r in res))
            if half.rtt <= 0.0 or half.cwnd / half.rtt >= ceil:
                half.cwnd = INF
            else:
                item[6] = ceil
                cap = half.cwnd / half.rtt
                self.engine.schedule(self.engine.now + half.rtt, self._ramp, item)
        item[4] = self.net.start(item[3] * self.wire, res, self._chunk_left, item, cap)
        item[8] = now = self.engine.now
        half.cur = item
        if self.timeline is not None:
            n, p = half.node, peer.node
            self.timeline.started(id(item), now, (n.node_id, n.region), (p.node_id, p.region),
                                  item[1], item[2], item[3], bool(item[7]))
        if not half.node.origin and src.site != dst.site:
            # a border relaying into another region: its driver tells its core every
            # ACK_WATCH_S that the target acknowledges bytes (``ev.Acked``), and the core
            # tells the origin (RELAY_ALIVE), which keeps a long relay from timing out
            self.engine.schedule(now + ACK_WATCH_S, self._acked, item)
        if half.node.origin and src.site != dst.site and self.path_samples:
            self.engine.schedule(now + max(half.rtt, 0.01), self._path_sample, item)
        if item[7]:
            # sent while it arrives here: it cannot leave faster than it comes in (it
            # follows the rate of the flow bringing it in until it is verified here)
            up = self.incoming.get((half.node, item[1], item[2]))
            cur = up.peer.cur if up is not None and up.open else None
            if cur is not None and cur[1] == item[1] and cur[2] == item[2] and cur[4].alive:
                self.net.follow(item[4], cur[4])
                self.paced.setdefault((half.node, item[1], item[2]), []).append(item)
        if src.site != dst.site or self.arrive_all:
            # a chunk from outside the region may be relayed on while it arrives (and,
            # with serve_arriving, any chunk may be served on while it arrives)
            key = (peer.node, item[1], item[2])
            if key not in self.incoming or not self.incoming[key].open:
                self.incoming[key] = peer
            self.engine.schedule(now + half.lat, self._arriving, (peer, item[1], item[2]))

    def _stop_chunk(self, node: SimNode, a: ev.StopChunk) -> None:
        """Stop an answer its requester cancelled (``ev.StopChunk``), as the node driver
        does at its next block: on the wire, its flow ends where it is (the bytes that
        went count as sent) and the receiver hears the withdrawal one latency on; still
        queued, it is dropped unsent; parked for its last block (sent while it arrived),
        it is withdrawn. The sender gets ``ChunkSent(withdrawn=True)`` at once."""
        half = node.conns.get(a.conn)
        if half is None or not half.open:
            return
        v, i = a.version, a.index
        cur = half.cur
        if cur is not None and cur[1] == v and cur[2] == i:
            flow = cur[4]
            went = int(self.net.progress(flow) / self.wire)
            self.net.cancel(flow)
            now = self.engine.now
            if self.timeline is not None:
                self.timeline.left(id(cur), now)
            node.sent_bytes += went
            key = (node.ep.site, half.peer.node.ep.site)
            self.pair_bytes[key] = self.pair_bytes.get(key, 0) + went
            lst = self.paced.get((node, v, i))
            if lst is not None:
                lst[:] = [x for x in lst if x is not cur]
            half.cur = None
            half.last = now
            held = half.held
            while held and held[0][0] <= cur[5]:  # frames that waited behind it go now
                _, frame, t = held.popleft()
                self._put_frame(half, frame, now, now - t)
            self._stopped(half, v, i, told=True)
            if half.open and half.queue and half.cur is None:
                self._start_chunk(half, half.queue.popleft())
            return
        for item in half.queue:
            if item[1] == v and item[2] == i:
                half.queue.remove(item)
                # frames queued behind it wait for the chunk still going before it instead
                seq = item[5]
                if any(g == seq for g, _, _ in half.held):
                    before = [x[5] for x in (half.cur, *half.queue) if x is not None and x[5] < seq]
                    if before:
                        prev = max(before)
                        half.held = deque((prev if g == seq else g, f, t)
                                          for g, f, t in half.held)
                    else:  # nothing goes before them now
                        now = self.engine.now
                        while half.held and half.held[0][0] <= seq:
                            _, frame, t = half.held.popleft()
                            self._put_frame(half, frame, now, now - t)
                self._stopped(half, v, i, told=False)
                return
        waiting = self.parked.get((node, v, i))
        if waiting is not None:
            for item in waiting:
                if item[0] is half:
                    waiting.remove(item)
                    self._stopped(half, v, i, told=True)
                    return

    def _stopped(self, half: Half, version: int, index: int, told: bool) -> None:
        self.chunks_stopped += 1
        # as an event of its own (not inside the actions being carried out)
        self.engine.schedule(self.engine.now, self._stop_sent, (half, version, index))
        if told and half.open:
            self.engine.schedule(self.engine.now + half.lat, self._withdrawal_arrives,
                                 (half.peer, version, index))

    def _stop_sent(self, item: tuple[Half, int, int]) -> None:
        half, version, index = item
        if half.open and half.node.inc == half.inc:
            self._deliver(half.node, half.inc,
                          ev.ChunkSent(self.engine.now, half.cid, version, index, withdrawn=True))

    def _acked(self, item: list[Any]) -> None:
        half = item[0]
        if half.cur is not item or not half.open or half.node.inc != half.inc:
            return  # the chunk left (its arrival is one latency on) or the link is gone
        self._deliver(half.node, half.inc, ev.Acked(self.engine.now, half.cid))
        self.engine.schedule(self.engine.now + ACK_WATCH_S, self._acked, item)

    def _path_sample(self, item: list[Any]) -> None:
        """The origin's driver samples a push's socket once a round trip while it leaves
        (``ev.PathSample``): its round trip runs above ``PATH_QUEUE_FACTOR`` x its floor
        where the queues of the full resources on its path hold that much."""
        half = item[0]
        if half.cur is not item or not half.open or half.node.inc != half.inc:
            return
        # the queues on its way that stand now: a shaped uplink (``queue_ms``) its flows
        # fill; links with no queue modelled hold next to none (a host's NIC)
        wait = 0.0
        for r, d in self.topo.queues.get((half.node.ep.site, half.peer.node.ep.site), ()):
            if sum(min(f.rate, r.cap) for f in r.flows) >= 0.98 * r.cap:
                wait += d
        queued = wait > (PATH_QUEUE_FACTOR - 1.0) * half.rtt
        now = self.engine.now
        self._deliver(half.node, half.inc, ev.PathSample(now, half.cid, queued, half.rtt,
                                                          ramping=half.cwnd != INF))
        self.engine.schedule(now + max(half.rtt, 0.01), self._path_sample, item)

    def _idle_restart(self, half: Half, cap: float, res: list[Resource]) -> None:
        """A connection's window decays while it carries no chunk: Linux halves a window
        the sender did not fill for a retransmission timeout (RTT + 200 ms here) toward
        what it used (``tcp_cwnd_application_limited``, RFC 2861: control frames use a
        few segments of it), and restarts it from the initial window after a timeout with
        nothing sent at all (``tcp_slow_start_after_idle``). Modelled as: one halving per
        timeout since the last chunk left, down to the initial window. An open window
        counts as the path's rate times the RTT.

        Loss-based algorithms only: Linux skips both checks for a congestion control that
        has its own ``cong_control`` (``tcp_slow_start_after_idle_check``,
        ``tcp_cwnd_validate``), as BBR does; BBR keeps its window and its bandwidth
        estimate (a max over round trips, which an idle connection does not count) and
        paces the first flight after idle at that estimate."""
        if half.cur is not None or half.queue:
            return
        idle = self.engine.now - half.last
        rto = half.rtt + 0.2
        if idle <= rto or half.rtt <= 0.0:
            return
        iw = self._initial_window(half.node, half.peer.node)
        w = min(cap, min(r.cap for r in res)) * half.rtt if half.cwnd == INF else half.cwnd
        half.cwnd = max(float(iw), w / 2.0 ** min(60, int(idle // rto)))
        self.idle_restarts += 1

    def _arriving(self, item: tuple[Half, int, int]) -> None:
        half, version, index = item
        if half.open and half.node.inc == half.inc:
            self._deliver(half.node, half.inc,
                          ev.ChunkArriving(self.engine.now, half.cid, version, index))
            cur = half.peer.cur
            if cur is not None and cur[1] == version and cur[2] == index and cur[4].alive:
                self.engine.schedule(self.engine.now + ev.PACE_LOOK_S, self._pace,
                                     (half, cur, self.net.progress(cur[4]) / self.wire))

    def _pace(self, item: tuple[Half, list[Any], float]) -> None:
        """``ChunkPace``, as the node driver sends it ``PACE_LOOK_S`` after a chunk's first
        block: the bytes of the sender's flow since then, and those left."""
        half, cur, p0 = item
        if not half.open or half.node.inc != half.inc or half.peer.cur is not cur:
            return
        if not cur[4].alive:
            return
        p = self.net.progress(cur[4]) / self.wire
        got, left = int(p - p0), int(cur[3] - p)
        if got > 0 and left > 0:
            self._deliver(half.node, half.inc,
                          ev.ChunkPace(self.engine.now, half.cid, cur[1], cur[2], got, left))

    def _ramp(self, item: list[Any]) -> None:
        half = item[0]
        if half.cur is not item or not half.open:
            return  # the next chunk on this connection carries on from the window reached
        half.cwnd *= 2
        ceil = item[6]
        if half.cwnd / half.rtt >= ceil:
            half.cwnd = INF
            self.net.set_cap(item[4], self.topo.flow_cap[(half.node.ep.site, half.peer.node.ep.site)])
        else:
            self.net.set_cap(item[4], half.cwnd / half.rtt)
            self.engine.schedule(self.engine.now + half.rtt, self._ramp, item)

    def _chunk_left(self, item: list[Any]) -> None:
        half, version, index, size, _flow, seq, _ceil, arriving, _t0 = item
        if self.timeline is not None:
            self.timeline.left(id(item), self.engine.now)
        node = half.node
        peer = half.peer
        src, dst = node.ep.site, peer.node.ep.site
        self.chunks_sent += 1
        node.sent_bytes += size
        key = (src, dst)
        self.pair_bytes[key] = self.pair_bytes.get(key, 0) + size
        now = self.engine.now
        half.cur = None
        half.last = now
        held = half.held
        while held and held[0][0] <= seq:  # frames that waited for this chunk's last byte
            _, frame, t = held.popleft()
            self._put_frame(half, frame, now, now - t)
        if half.queue:
            self._start_chunk(half, half.queue.popleft())
        if arriving and index not in node.have.get(version, ()):
            key = (node, version, index)
            src = self.incoming.get(key)
            if src is None or not src.open:  # it stopped arriving: withdrawn
                self._withdrawn(half, version, index)
                return
            # cut-through: the last block goes once the chunk is verified here, at the
            # rate this flow ran at (kept in item[8]); one held to the chunk's arrival
            # (``FlowNet.follow``) is let go then, at its path's rate
            if any(x is item for x in self.paced.get(key, ())):
                item[8] = min(item[4].base, *(r.cap for r in item[4].resources))
            else:
                item[8] = size / max(1e-9, now - item[8])
            self.parked.setdefault(key, []).append(item)
            return
        self._deliver_sent(item)

    def _deliver_sent(self, item: list[Any]) -> None:
        """``item``'s last byte left now: tell the sender; the chunk arrives one latency on."""
        half, version, index, size = item[0], item[1], item[2], item[3]
        node, peer = half.node, half.peer
        src, dst = node.ep.site, peer.node.ep.site
        now = self.engine.now
        at = now + half.lat
        if self.topo.queues:
            at += self.topo.queue_delay(src, dst)
        at = max(at, half.fifo)
        half.fifo = at
        if half.open:
            self._deliver(node, half.inc, ev.ChunkSent(now, half.cid, version, index))
        # Scheduled after the sender's reaction: frames it sent right behind the chunk that
        # arrive at the same instant are read while the receiver still verifies the chunk.
        self.engine.schedule(at, self._chunk_arrives, (peer, version, index, size))

    def _chunk_arrives(self, item: tuple[Half, int, int, int]) -> None:
        half, version, index, size = item
        if not half.open or half.node.inc != half.inc:
            return
        node = half.node
        node.recv_bytes += size
        # every byte is here: its twin requests are cancelled before the hash, as the
        # node driver does
        self._deliver(node, half.inc, ev.ChunkWhole(self.engine.now, half.cid, version, index))
        if not half.open or node.inc != half.inc:
            return
        if node.cpu is not None:
            # hash against the manifest, store: the core hears of it when the CPU is done
            done = run_job(self.engine.now, node.cpu_spec.chunk_s(size), node.cpu, self.shared_cpu)
            if done > self.engine.now:
                self.engine.schedule(done, self._chunk_verified, (half, version, index))
                return
        self._chunk_verified((half, version, index))

    def _chunk_verified(self, item: tuple[Half, int, int]) -> None:
        half, version, index = item
        if not half.open or half.node.inc != half.inc:
            return
        node = half.node
        node.have.setdefault(version, set()).add(index)
        self._deliver(
            node, half.inc, ev.ChunkReceived(self.engine.now, half.cid, version, index, True)
        )
        key = (node, version, index)
        self.incoming.pop(key, None)
        if self.paced:
            for item in self.paced.pop(key, ()):
                self.net.unfollow(item[4])  # verified here: it may leave as fast as its path allows
        waiting = self.parked.pop(key, None)
        if waiting:
            block = self.sc.interleave_block_bytes
            for item in waiting:  # cut-through relays: their last block leaves now
                if item[0].open:
                    last = min(item[3], block or item[3]) * self.wire
                    self.engine.schedule(self.engine.now + last / item[8], self._deliver_sent, item)

    def _withdraw(self, half: Half) -> None:
        """The link ``half`` received on closed: cut-through relays of the chunks that were
        arriving on it are withdrawn (their last block never leaves)."""
        if not self.incoming:
            return
        for key in [k for k, h in self.incoming.items() if h is half]:
            del self.incoming[key]
            for item in self.parked.pop(key, ()):
                self._withdrawn(item[0], key[1], key[2])

    def _withdrawn(self, half: Half, version: int, index: int) -> None:
        """A chunk sent on ``half`` while it arrived is withdrawn: its receiver drops
        what came (``ChunkWithdrawn``, one latency on) and asks elsewhere."""
        key = (half.peer.node, version, index)
        if self.incoming.get(key) is half.peer:
            del self.incoming[key]
        self.paced.pop((half.node, version, index), None)
        if half.open:
            self._deliver(half.node, half.inc,
                          ev.ChunkSent(self.engine.now, half.cid, version, index, withdrawn=True))
            self.engine.schedule(self.engine.now + half.lat, self._withdrawal_arrives,
                                 (half.peer, version, index))

    def _withdrawal_arrives(self, item: tuple[Half, int, int]) -> None:
        half, version, index = item
        if half.open and half.node.inc == half.inc:
            self._deliver(half.node, half.inc,
                          ev.ChunkWithdrawn(self.engine.now, half.cid, version, index))

    def _applied(self, node: SimNode, version: int) -> None:
        now = self.engine.now
        if not node.origin and version not in node.done_at:
            node.done_at[version] = now
            if self.timeline is not None and version == self.timeline.version:
                self.timeline.applied(now, node.node_id, node.region)
            k = version - BASE_VERSION
            self.done_count[k] = self.done_count.get(k, 0) + 1
        at = now
        if node.cpu is not None and not node.origin:
            at = run_job(now, node.cpu_spec.apply_s(self.payload), node.cpu, self.shared_cpu)
        self.engine.schedule(at + self.sc.apply_s, self._applied_event, (node, node.inc, version))
        if not node.origin:
            self.check_finished()

    def _applied_event(self, item: tuple[SimNode, int, int]) -> None:
        node, inc, version = item
        if node.alive and node.inc == inc:
            node.active = max(node.active, version)
            node.applied_at.setdefault(version, self.engine.now)
        self._deliver(node, inc, ev.Applied(self.engine.now, version, True))
        if not node.origin:
            self.check_finished()

    # ---------------------------------------------------------------- faults
    def _schedule_faults(self) -> None:
        from simulations.faults import schedule_faults

        schedule_faults(self)

    def kill(self, node: SimNode, reason: str = "node left") -> None:
        """The node leaves: its connections drop, its peers notice one latency later."""
        if not node.alive:
            return
        node.alive = False
        self.alive_count -= 1
        for half in list(node.conns.values()):
            if half.open:
                self._teardown(half, reason, notify_self=False)
        node.conns = {}
        node.core = None
        node.tick_at = INF
        self.check_finished()

    def revive(self, node: SimNode) -> None:
        """The node restarts from its store (chunks it verified before leaving)."""
        if node.alive:
            return
        self._boot(node, fresh=False)
        self.check_finished()

    def sever(self, region: str) -> None:
        """Cut ``region`` off: every connection crossing its border drops."""
        self.cut.add(region)
        for node in self.nodes:
            if not node.alive:
                continue
            for half in list(node.conns.values()):
                if half.open and self._severed(node, half.peer.node):
                    self._teardown(half, "network cut", notify_self=True)

    def heal(self, region: str) -> None:
        self.cut.discard(region)
