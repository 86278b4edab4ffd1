"""The real driver: runs a ``NodeCore`` over peer links, real timers and disk.

Peers connect to the swarm port over ``node.link`` (length-prefixed messages over
mutual TLS, read in batches); without TLS the HTTP API may share that port. Every
link message is a control frame (msgpack, fed to the core as ``FrameReceived``) or a
chunk block (``PSB1`` header + bytes, see ``swarm.protocol.wire``). The driver owns
everything the core may not touch:

- chunk payloads: on ``SendChunk`` it reads the chunk from the ``ChunkStore``
  (which re-hashes it, or serves a chunk received moments ago from the verified
  copy it kept in memory) and sends it; on receipt it checks the chunk against the
  manifest hash, stores it durably, and only then reports
  ``ChunkReceived(valid=True)``;
- time: ``loop.time()`` (monotonic) is the core's ``now``; one timer, re-armed
  after every event from ``core.next_wakeup()``;
- the apply pipeline: ``ApplyVersion`` -> stage + commit on the node's
  checkpoint-coordinate truth (``weights``; checks the trainer's target digest)
  in a worker thread -> hand the engine a ``WeightUpdate`` (stage + commit, in a
  worker thread) -> record the active version in the store -> ``Applied``;
- the engine's health: a watch task asks the engine which version it serves
  every ``[engine] probe_s`` and brings it back to the node's verified version
  (with back-off) when it failed, fell behind or restarted.

Versions, and what each record means (docs/engines.md, "When the engine fails"):

- the core's ``active_version`` is the node's *verified* version: the truth
  holds it, bitwise checked; the node patches from it and seeds it to peers.
  A verified version is always reported ``Applied(ok=True)``, even when the
  engine then fails to take it: the swarm keeps moving and the store keeps
  every chunk the engine may still need;
- the engine's *served* version is what the engine confirmed after a commit
  (``engine.served_version``);
- the store's ``active`` record is written only once the engine confirmed the
  version, so it is the version that was both verified and served; after a
  restart the truth is rebuilt to it and newer stored versions are applied again.

All core calls happen on the event-loop thread; other threads (a training
loop using ``Publisher``) go through ``call`` / ``feed_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from node.engines.base import CommitStats, Engine, EngineError, WeightUpdate
from node.engines.config import EngineConfig
from node.engines.inprocess import InProcessWeights, merge_changes
from node.guard import ConnectionGuard
from node.link import READ_COALESCE_S, Link, LinkServer, Placed, dial
from node.ports import StorePort, TrustPort
from node.store import aligned_buffer
from node.tcp import (
    CONGESTION_CONTROL,
    CONGESTION_RESTART_S,
    UNSENT_LIMIT,
    CongestionRestart,
    RandomLoss,
    acked_bytes,
    congestion_of,
    keeps_window_across_idle,
    limit_unsent,
    path_sample,
    restart_congestion,
    set_congestion,
    slow_start_after_idle,
    unacked_bytes,
)
from swarm.errors import ChunkError, PatchswarmError, ProtocolError, StoreError
from swarm.protocol import events as ev
from swarm.protocol import stripes, wire
from swarm.protocol.core import NodeCore
from swarm.trust.confidential import NoKeyError, decrypt_payload
from swarm.trust.manifest import Manifest

log = logging.getLogger("patchswarm.node")

MAX_LINK_MESSAGE = wire.CHUNK_HEADER_LEN + wire.MAX_CHUNK_BYTES
_STRIPED = (stripes.STRIPE_MAGIC, stripes.DONE_MAGIC, stripes.WITHDRAW_MAGIC, stripes.OFFER_MAGIC,
            stripes.ASK_MAGIC, stripes.WANT_MAGIC)
SEND_QUEUE_LIMIT = 4096  # frames queued per peer before it is dropped as too slow
CONNECT_TIMEOUT_S = 5.0
# the origin looks this often whether a chunk it handed over is still being acknowledged
ACK_WATCH_S = 1.0
AHEAD_GRACE_TRIES = 3  # probes an engine ahead of a restarted node is given before a rebuild
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


@dataclass
class Faults:
    """Deliberate misbehaviour, for tests of the swarm's defences only."""

    corrupt_chunks: bool = False  # flip a byte in every chunk this node sends


@dataclass
class EngineState:
    """What the node knows about its engine (read by /status, /healthz, /metrics)."""

    kind: str
    state: str = "starting"  # starting | ok | behind | unhealthy
    reason: str = ""
    served_version: int | None = None  # last version the engine confirmed
    uncertain: bool = True  # the engine may hold a mix: rebuild it with a full update
    last_commit: CommitStats | None = None
    last_commit_at: float | None = None
    commits: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    commit_seconds: float = 0.0  # totals over all commits
    paused_seconds: float = 0.0
    next_retry_at: float | None = None  # monotonic
    since: float = field(default_factory=time.monotonic)

    @property
    def healthy(self) -> bool:
        return self.state == "ok"


@dataclass(frozen=True)
class TlsContexts:
    """Mutual TLS for the swarm port (``swarm.trust.ca``): accept and dial."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, ca: Path, cert: Path, key: Path) -> TlsContexts:
        from swarm.trust import ca as swarm_ca

        return cls(swarm_ca.server_context(ca, cert, key), swarm_ca.client_context(ca, cert, key))


@dataclass
class Arrival:
    """A chunk whose blocks are arriving on link ``conn``, for cut-through relays: its
    first ``got`` bytes in ``buf`` are final; ``state`` becomes ``stored`` once the whole
    chunk was verified and kept, ``failed`` if it was not (corrupt, withdrawn, the link
    closed, a local fault). Every change wakes the writers of the links relaying it."""

    conn: int
    buf: memoryview
    length: int
    got: int = 0
    state: str = "arriving"  # arriving | stored | failed
    t0: float = 0.0  # when its first block came (loop time; the debug log's transfer times)
    watchers: list = field(default_factory=list)  # Conns whose writers stream it

    def changed(self) -> None:
        for w in self.watchers:
            w.wake.set()


@dataclass
class Lane:
    """An extra connection of a striped link (``swarm.protocol.stripes``): blocks only."""

    n: int
    link: Link
    sock: Any = None
    reader: asyncio.Task | None = None


@dataclass
class Conn:
    """One link to a peer, with its ordered send queue."""

    id: int
    link: Link
    outbound: bool
    addr: str
    # Control frames go before the next block of a chunk (see _writer): they wait for
    # one block on the wire, never for a whole chunk.
    ctrl: deque = field(default_factory=deque)
    data: deque = field(default_factory=deque)  # (version, index, arriving) chunks to send
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Chunks are reassembled in aligned, not zero-filled buffers (the assembler writes
    # every byte it returns): the store writes them to disk with O_DIRECT, no page cache.
    blocks: wire.BlockAssembler = field(
        default_factory=lambda: wire.BlockAssembler(alloc=aligned_buffer))
    heard_at: float = 0.0  # last Progress fed to the core (rate-limited)
    writer: asyncio.Task | None = None
    closing: bool = False
    sock: Any = None  # the TCP socket under the link (options, BBR restarts), if known
    restart: CongestionRestart = field(default_factory=CongestionRestart)
    restart_timer: asyncio.TimerHandle | None = None  # the next CongestionRestart.next_check
    cut_through: bool = False  # the chunk being sent is forwarded as it arrives
    # striped links (docs/striped-links.md): the extra connections, the token they carry,
    # the receiving assembler, and the sender's seq counter and unfinished window
    identity: tuple[str, str, str] | None = None
    lanes: list[Lane] = field(default_factory=list)
    lane_token: bytes | None = None
    laning: bool = False  # the dialer asked for lanes (once per link)
    offer_taken: bool = False  # the dialer: the peer echoed our lane offer
    stripes: stripes.StripedAssembler | None = None
    seq: int = 0
    unfinished: set = field(default_factory=set)
    next_lane: int = 0  # where the next look for a lane with room starts
    # ``[network] lanes = "auto"``: whether this link's sender is capped by random loss
    # (None: not looked into, or not a link that could be; ``loss_checked``: decided so)
    loss: RandomLoss | None = None
    loss_checked: bool = False
    asked: bool = False  # the acceptor asked the dialer for lanes (PSA2, its own token)
    # the sender's striped chunks the peer has not finished: seq -> [v, i, payload, the
    # blocks sent again (bits), bytes handed over so far], and blocks the peer asked for
    # again (PSQ2), to send
    out: dict = field(default_factory=dict)
    resends: deque = field(default_factory=deque)
    stall_timer: asyncio.TimerHandle | None = None  # the receiver's next stalled() look
    # whether its bytes are still being acknowledged (ev.Acked keeps a push or relay
    # alive): the origin after a chunk was handed over, a border while it relays one to
    # another region and after; the next look, the count last seen
    ack_timer: asyncio.TimerHandle | None = None
    ack_seen: int = 0
    in_chunk: bool = False  # a chunk is being sent (the ack watch goes on meanwhile)

    def queued(self) -> int:
        return len(self.ctrl) + len(self.data)


PRESTAGE_NICE = 10  # niceness of the prestage thread (Linux: per thread)
# prestage feeds a chunk in slices of this many bytes and checks between them whether an
# apply waits: the apply waits for one slice's decode at most, which on a loaded host (the
# thread is niced) can be much longer than on an idle one
PRESTAGE_SLICE = 1 << 20


def lower_thread_priority() -> None:
    """Lower the calling thread's scheduling priority to ``PRESTAGE_NICE`` (never
    raise it). Linux only (niceness is per thread there); elsewhere, or when the
    system refuses, the thread runs at normal priority."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere a thread id is no target for setpriority
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < PRESTAGE_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, PRESTAGE_NICE)
    except (AttributeError, OSError):
        pass


class Driver:
    """Carry out a core's actions over real sockets; see the module docstring."""

    def __init__(self, core: NodeCore, store: StorePort, trust: TrustPort, *,
                 weights: InProcessWeights | None = None, engine: Engine | None = None,
                 engine_cfg: EngineConfig | None = None,
                 host: str, port: int, faults: Faults | None = None,
                 keep_versions: int = 0, tls: TlsContexts | None = None,
                 api_addr: tuple[str, int] | None = None,
                 guard: ConnectionGuard | None = None,
                 unsent_limit: int = UNSENT_LIMIT,
                 read_coalesce_s: float = READ_COALESCE_S,
                 congestion: str = CONGESTION_CONTROL,
                 congestion_restart_s: float = CONGESTION_RESTART_S,
                 lanes: int = 1, lanes_auto: bool = False) -> None:
        self.core = core
        # connections per link that carries chunks to another region (1: no striping);
        # ``lanes_auto``: only on a link found capped by random loss (node.tcp.RandomLoss)
        self.lanes = max(1, min(int(lanes), stripes.MAX_LANES))
        self.lanes_auto = lanes_auto and self.lanes > 1
        self.loss_capped = 0  # links RandomLoss found capped by random loss
        self.lane_tokens: dict[bytes, int] = {}  # offered tokens -> conn (acceptor)
        self.lanes_opened = 0
        self.stripe_wants = 0  # striped chunks we asked for again (stuck on a lane)
        self.blocks_resent = 0  # striped blocks we sent again, asked by the peer
        self.lanes_refused = 0
        self.read_coalesce_s = read_coalesce_s
        self.unsent_limit = unsent_limit
        self.congestion = congestion
        # BBR started over on a link whose chunk starts after idle or runs long (node.tcp)
        self.congestion_restart_s = congestion_restart_s
        self.congestion_restarts = 0
        # what the last peer socket ended up with (``/status``), and whether the kernel
        # refused ``congestion`` (logged once: every socket would say the same)
        self.congestion_in_use: str | None = None
        self.congestion_refused: str | None = None
        # a loss-based algorithm in use: whether Linux restarts an idle link's window
        # (between versions every link idles; docs/operations.md); None otherwise
        self.slow_start_after_idle: bool | None = None
        self.store = store
        self.guard = guard or ConnectionGuard(max_total=1024, max_per_ip=32, upgrade_timeout_s=10.0)
        self.tls = tls
        # the HTTP API on an address of its own (None: served on the swarm port)
        self.api_addr = api_addr
        self.api_app: web.Application | None = (
            web.Application(client_max_size=64 * 1024) if api_addr is not None else None)
        self.trust = trust
        self.weights = weights  # the checkpoint-coordinate truth (InProcessWeights) or None
        self.engine = engine  # the node.engines.base.Engine it feeds, or None (origin)
        self.engine_cfg = engine_cfg
        self.engine_state = EngineState(engine.kind if engine is not None else "none")
        if engine is not None and engine.kind == "inprocess" and weights is not None:
            # the truth is what serves: always in step with it
            self.engine_state = EngineState("inprocess", state="ok", served_version=weights.version,
                                            uncertain=False)
        self._owed: dict[str, Any] | None = None  # changes since engine_state.served_version
        self._engine_lock = asyncio.Lock()
        self._truth_commit_s = 0.0
        # Present while an engine commit may have left the engine uncertain (survives a
        # node restart): the engine's version label is then not trusted, it is rebuilt.
        root = getattr(store, "root", None)
        self._commit_mark = Path(root) / "engine-commit" if root is not None else None
        self._watch_task: asyncio.Task | None = None
        # Optional hold before each engine commit (the request gateway, node.gateway): entered
        # right before the engine (or the in-process truth) takes a new version, left once the
        # commit is done or failed; it may delay the commit a bounded time.
        self.commit_gate: Callable[[int], AbstractAsyncContextManager[None]] | None = None
        self.host, self.port = host, port
        self.faults = faults or Faults()
        self.keep_versions = keep_versions
        self.conns: dict[int, Conn] = {}
        self.arrivals: dict[tuple[int, int], Arrival] = {}  # chunks arriving now (cut-through)
        self._ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._apply_task: asyncio.Task | None = None
        # decoding the verified prefix of a patch while the rest downloads (``_prestage``)
        self._pre_task: asyncio.Task | None = None
        self._pre_again = False
        # its own low-priority thread (``_prestage_pool``), shut down by ``stop``
        self._pre_pool: ThreadPoolExecutor | None = None
        self._pre_closed = False
        self._applying = False
        self._ahead_bytes = 0  # of the last apply's payload, decoded while it downloaded
        self.apply_split: dict[str, float] = {}
        self.apply_splits: dict[int, dict[str, float]] = {}  # the last 16 (/status)
        self._truth_split: dict[str, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.link_server: LinkServer | None = None
        self.runner: web.AppRunner | None = None
        self.api_runner: web.AppRunner | None = None
        self.draining = False
        self.store_fault: str | None = None  # last local failure to keep a chunk (cleared on success)
        self.started_at = time.time()
        self.sent_to_region: dict[int, dict[str, set[int]]] = {}  # origin: v -> region -> chunks
        self.wire_bytes = {"sent": 0, "received": 0}
        # confidential mode: our X25519 key (node.daemon.build_node sets it from [trust]
        # node_key), and the versions we hold and relay but cannot open
        self.node_key: Any = None
        self.no_key_versions: dict[int, str] = {}
        self.apply_seconds: dict[int, float] = {}
        self.activated_at: dict[int, float] = {}
        self.listeners: list[Callable[[ev.Action], None]] = []
        # the HTTP API when it shares the swarm port (no TLS): connections that do not
        # start with a link preface are served by it (node.link.LinkServer)
        self.app = web.Application(client_max_size=1024 * 1024)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Listen, dial the bootstrap peers and arm the timer."""
        self.loop = asyncio.get_running_loop()
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self.runner.setup()
        self.link_server = LinkServer(
            self._accept_link, ssl_context=self.tls.server if self.tls is not None else None,
            max_message=MAX_LINK_MESSAGE, guard=self.guard, http=self.runner.server,
            read_coalesce_s=self.read_coalesce_s)
        await self.link_server.start(self.host, self.port)
        if self.api_app is not None and self.api_addr is not None:
            self.api_runner = web.AppRunner(self.api_app, access_log=None, handle_signals=False)
            await self.api_runner.setup()
            await web.TCPSite(self.api_runner, *self.api_addr, reuse_address=True).start()
        self._run(self.core.start(self.now()))
        if self.engine is not None and self.weights is not None and self.engine.kind != "inprocess":
            self._watch_task = self._spawn(self._watch_engine())

    def resume_from_store(self) -> None:
        """Tell the core what the store already holds (``LocalChunks``), after a restart."""
        for raw, m in self.store.manifests():
            have = tuple(sorted(self.store.have(m.version)))
            self.feed(ev.LocalChunks(self.now(), raw, have))

    async def stop(self, drain_s: float = 5.0) -> None:
        """Drain: refuse new peers, let an apply and queued sends finish, then close."""
        self.draining = True
        deadline = time.monotonic() + drain_s
        if self._apply_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._apply_task), drain_s)
        while any(c.queued() for c in self.conns.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._timer is not None:
            self._timer.cancel()
        if self.link_server is not None and self.link_server.server is not None:
            self.link_server.server.close()  # no new peers
        conns = list(self.conns.values())
        for c in conns:
            c.closing = True
        if conns:
            await asyncio.wait([asyncio.ensure_future(c.link.close("shutting down")) for c in conns],
                               timeout=2.5)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        if self.link_server is not None:
            await self.link_server.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.api_runner is not None:
            await self.api_runner.cleanup()
        await self._prestage_close()

    def now(self) -> float:
        assert self.loop is not None
        return self.loop.time()

    # --------------------------------------------------------------- events

    def feed(self, event: ev.Event) -> None:
        """Hand one event to the core and carry out its actions (loop thread only)."""
        self._run(self.core.handle(event))

    def feed_threadsafe(self, make: Callable[[float], ev.Event]) -> None:
        """From another thread: ``make(now)`` builds the event on the loop thread."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(lambda: self.feed(make(self.now())))

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the loop thread and return its result (from another thread)."""
        assert self.loop is not None

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def _spawn(self, coro: Any) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _run(self, actions: list[ev.Action]) -> None:
        for a in actions:
            try:
                self._do(a)
            except Exception:  # one failed action must not stop the rest
                log.exception("action %s failed", type(a).__name__)
            for fn in self.listeners:
                fn(a)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self.loop is None:
            return
        t = self.core.next_wakeup()
        if self._timer is not None:
            if t is not None and abs(self._timer.when() - t) < 1e-4:
                return
            self._timer.cancel()
            self._timer = None
        if t is None or self.draining:
            return
        # the loop's own clock: a time already past would make uvloop hand back a plain
        # Handle (``call_soon``), which has no ``when()`` to compare with above
        t = max(t, self.loop.time() + 0.001)
        self._timer = self.loop.call_at(t, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.feed(ev.Tick(self.now()))

    # -------------------------------------------------------------- actions

    def _do(self, a: ev.Action) -> None:
        if isinstance(a, ev.SendFrame):
            c = self.conns.get(a.conn)
            if c is not None:
                self._enqueue(c, ("frame", a.frame))
        elif isinstance(a, ev.SendChunk):
            c = self.conns.get(a.conn)
            if c is None:
                self.feed(ev.ChunkSent(self.now(), a.conn, a.version, a.index,
                                       withdrawn=a.arriving))
            else:
                self._enqueue(c, ("chunk", a.version, a.index, a.arriving))
        elif isinstance(a, ev.Connect):
            self._spawn(self._dial(a.addr))
        elif isinstance(a, ev.Close):
            c = self.conns.pop(a.conn, None)
            if c is not None:
                c.closing = True
                self._spawn(self._close_link(c, a.reason))
        elif isinstance(a, ev.AcceptManifest):
            self._persist_manifest(a.version, a.raw, a.manifest)
        elif isinstance(a, ev.ApplyVersion):
            self._apply_task = self._spawn(self._apply(a.version))
        elif isinstance(a, ev.Log):
            level = _LEVELS.get(a.level, logging.INFO)
            if log.isEnabledFor(level):
                log.log(level, a.event, extra={"fields": a.fields})
        else:
            log.warning("unknown action %s", type(a).__name__)

    def _enqueue(self, c: Conn, item: tuple) -> None:
        if c.queued() >= SEND_QUEUE_LIMIT:
            log.warning("peer %s: send queue full, dropping it", c.addr)
            self.conns.pop(c.id, None)
            c.closing = True
            self._spawn(self._close_link(c, "send queue full"))
            self.feed(ev.PeerDisconnected(self.now(), c.id, "send queue full"))
            return
        if item[0] == "frame":
            c.ctrl.append(item[1])
        else:
            c.data.append((item[1], item[2], item[3]))
        c.wake.set()

    def _persist_manifest(self, version: int, raw: bytes, m: Manifest) -> None:
        try:  # the core verified it (verify_manifest): stored as it is
            self.store.put_manifest(raw, m)
        except PatchswarmError as exc:
            log.error("cannot persist manifest of version %d: %s", version, exc)

    # ---------------------------------------------------------- connections

    def _register(self, link: Link, outbound: bool, addr: str,
                  identity: tuple[str, str, str] | None = None, sock: Any = None) -> Conn:
        limit_unsent(sock, self.unsent_limit)
        self._congestion(sock)
        c = Conn(next(self._ids), link, outbound, addr, sock=sock,
                 restart=CongestionRestart(self.congestion_restart_s), identity=identity)
        # chunk blocks are decrypted straight into their chunk's buffer (_place)
        link.place_with(lambda header, n: self._place(c, header, n), wire.BLOCK_HEADER_LEN)
        self.conns[c.id] = c
        c.writer = self._spawn(self._writer(c))
        self.feed(ev.PeerConnected(self.now(), c.id, outbound, addr, identity))
        return c

    def _congestion(self, sock: Any) -> None:
        why = set_congestion(sock, self.congestion)
        if why is not None and self.congestion_refused is None:
            self.congestion_refused = why
            log.warning("congestion control %r refused on peer links (%s): they use the "
                        "system's %r. Allow it (net.ipv4.tcp_allowed_congestion_control, or "
                        "run with CAP_NET_ADMIN) or set network.congestion_control = \"\" "
                        "(docs/operations.md)", self.congestion, why, congestion_of(sock))
        in_use = congestion_of(sock)
        if in_use is not None and in_use != self.congestion_in_use:
            self.congestion_in_use = in_use
            was = self.slow_start_after_idle
            self.slow_start_after_idle = (None if keeps_window_across_idle(in_use)
                                          else slow_start_after_idle())
            if self.slow_start_after_idle and not was:
                log.info("peer links use %r, a loss-based congestion control, and Linux "
                         "restarts a link's window after it idles "
                         "(net.ipv4.tcp_slow_start_after_idle=1): every link idles between "
                         "versions. Consider setting it to 0, or allowing BBR "
                         "(docs/operations.md)", in_use)

    def _tls_identity(self, ssl_object: Any, addr: str) -> tuple[str, str, str] | None:
        """The peer's identity proven by mutual TLS; ``ProtocolError`` if there is none."""
        if self.tls is None:
            return None
        from swarm.trust.ca import peer_identity

        try:
            ident = peer_identity(ssl_object)
        except PatchswarmError as exc:
            raise ProtocolError(f"peer {addr}: {exc}") from None
        return (ident.node_id, ident.region, ident.role)

    async def _accept_link(self, link: Link) -> None:
        peer = link.get_extra_info("peername")
        addr = f"{peer[0]}:{peer[1]}" if peer else "?"
        if self.draining:
            await link.close("draining")
            return
        try:
            identity = self._tls_identity(link.get_extra_info("ssl_object"), addr)
        except ProtocolError as exc:
            log.warning("%s", exc)
            await link.close("a swarm certificate is required")
            return
        if link.is_lane:
            await self._accept_lane(link, identity, addr)
            return
        c = self._register(link, False, addr, identity, link.get_extra_info("socket"))
        await self._reader(c)

    async def _dial(self, addr: str) -> None:
        host, _, port = addr.rpartition(":")
        try:
            # bounded as a whole: a listener that accepts but never completes TLS and the
            # preface must not leave the core waiting forever on this dial
            link = await dial(host.strip("[]"), int(port),
                              ssl_context=self.tls.client if self.tls is not None else None,
                              max_message=MAX_LINK_MESSAGE, timeout=CONNECT_TIMEOUT_S + 5.0,
                              read_coalesce_s=self.read_coalesce_s)
        except (TimeoutError, OSError, ValueError) as exc:
            if not self.draining:
                self.feed(ev.ConnectFailed(self.now(), addr, f"{type(exc).__name__}: {exc}"[:200]))
            return
        if self.draining:
            await link.close("draining")
            return
        try:
            identity = self._tls_identity(link.get_extra_info("ssl_object"), addr)
        except ProtocolError as exc:
            log.warning("%s", exc)
            await link.close("a swarm certificate is required")
            self.feed(ev.ConnectFailed(self.now(), addr, str(exc)[:200]))
            return
        c = self._register(link, True, addr, identity, link.get_extra_info("socket"))
        await self._reader(c)

    async def _incoming(self, c: Conn, link: Link) -> AsyncIterator[bytes | bytearray | Placed]:
        """``link``'s messages (counted) while it is open and ``c`` is a live link."""
        while (data := await link.recv()) is not None:
            self.wire_bytes["received"] += len(data)
            if c.id not in self.conns:
                return
            yield data

    async def _reader(self, c: Conn) -> None:
        reason = "closed by peer"
        try:
            async for data in self._incoming(c, c.link):
                if isinstance(data, Placed):
                    if stripes.magic_of(data.header) == stripes.STRIPE_MAGIC:
                        whole = None if data.diverted else c.stripes.placed(data.header)  # type: ignore[union-attr]
                        await self._stripe_block(c, data.header, whole)
                    else:
                        await self._block_done(c, c.blocks.placed())
                elif wire.is_block_message(data):
                    await self._on_block(c, data)
                elif wire.is_withdraw_message(data):
                    await self._on_withdraw(c, data)
                elif wire.is_chunk_message(data):
                    await self._on_chunk(c, data)
                elif stripes.magic_of(data) in _STRIPED:
                    await self._on_striped(c, data)
                else:
                    self.feed(ev.FrameReceived(self.now(), c.id, bytes(data)))
            reason = c.link.reason or reason
        except (TimeoutError, ConnectionError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self._lanes_end(c)
            self._arrivals_end(c.id)
            if self.conns.pop(c.id, None) is not None:
                self.feed(ev.PeerDisconnected(self.now(), c.id, reason[:200]))
            c.closing = True
            if c.writer is not None:
                c.writer.cancel()
            with contextlib.suppress(Exception):
                await c.link.close()

    async def _close_link(self, c: Conn, reason: str) -> None:
        with contextlib.suppress(Exception):
            await c.link.close(reason[:200])
        if c.writer is not None:
            c.writer.cancel()

    async def _writer(self, c: Conn) -> None:
        """Send the link's control frames and chunks, in order within each.

        A chunk goes as blocks of ``wire.BLOCK_BYTES``; before each block every
        control frame queued meanwhile is sent, so a heartbeat, HAVE or REQUEST
        waits for one block on the wire, not for a whole chunk. On a striped link
        (lanes attached when the chunk starts) each block goes as ``PSB2`` on whichever
        connection has room, and at most ``stripes.WINDOW`` chunks are unfinished at
        the peer (``_take_seq``).
        """
        sending: tuple[int, int, bytes] | None = None  # (version, index, payload)
        stream: Arrival | None = None  # the chunk being sent is still arriving (cut-through)
        offset = 0
        started = 0.0
        striped = False
        seq: int | None = None  # the striped chunk's seq, once its window slot is taken
        try:
            while not c.closing:
                if c.ctrl:
                    data = c.ctrl.popleft()
                    self.wire_bytes["sent"] += await c.link.send(data)
                    continue
                if c.resends:
                    await self._resend_block(c)
                    continue
                if sending is None:
                    if not c.data:
                        c.wake.clear()
                        await c.wake.wait()
                        continue
                    v, i, arriving = c.data.popleft()
                    stream = self.arrivals.get((v, i)) if arriving else None
                    started = self.now()
                    c.in_chunk = True
                    if not self.core.cfg.is_origin and self._other_region(c):
                        self._watch_acks(c)  # a relay: RELAY_ALIVE while it is acknowledged
                    striped, seq = bool(c.lanes), None
                    if not c.laning:
                        self._chunks_flow(c)
                    if stream is not None:
                        stream.watchers.append(c)
                        sending, offset = (v, i, stream.buf), 0
                        continue
                    payload = await self._chunk_bytes(v, i)
                    if payload is None:  # an arriving chunk that failed: nothing was sent
                        c.in_chunk = False
                        if arriving:  # the peer may have asked for it: "it will not come"
                            self.wire_bytes["sent"] += await c.link.send(wire.pack_withdraw(v, i))
                        self.feed(ev.ChunkSent(self.now(), c.id, v, i, withdrawn=arriving))
                        continue
                    sending, offset = (v, i, payload), 0
                v, i, payload = sending
                n = len(payload)
                end = min(n, offset + wire.BLOCK_BYTES)
                if stream is not None:
                    if stream.state == "failed":
                        # the chunk did not arrive whole and verified: withdraw what we sent
                        stream.watchers.remove(c)
                        sending, stream = None, None
                        self._chunk_ended(c)
                        # also before any block: a requester waits
                        gone = (wire.pack_withdraw(v, i) if seq is None
                                else stripes.pack_withdraw(seq, v, i))
                        c.out.pop(seq, None)
                        self.wire_bytes["sent"] += await c.link.send(gone)
                        self.feed(ev.ChunkSent(self.now(), c.id, v, i, withdrawn=True))
                        continue
                    # blocks as they come; the last only once the chunk is verified here
                    if end > (n if stream.state == "stored" else min(stream.got, n - 1)):
                        c.wake.clear()
                        await c.wake.wait()
                        continue
                if striped and seq is None:
                    seq = self._take_seq(c)
                    if seq is None:  # the peer has a window of chunks unfinished: wait
                        c.wake.clear()
                        await c.wake.wait()
                        continue
                    c.out[seq] = [v, i, payload, 0, 0]  # kept until PSD2: blocks may be asked again
                if offset == 0 and self.congestion_restart_s > 0:
                    c.cut_through = stream is not None
                    if c.restart.chunk_started(self.now()):
                        self._restart_congestion(c, "after_idle")
                    self._arm_restart_check(c)
                block: bytes | memoryview = payload[offset:end]
                if stream is not None and offset == 0 and self.faults.corrupt_chunks:
                    block = bytes([block[0] ^ 0xFF]) + bytes(block[1:])
                if seq is not None:
                    lane = self._lane_with_room(c)
                    if lane is None:
                        await self._any_lane_drained(c)
                        continue
                    self.wire_bytes["sent"] += lane.send_nowait(
                        stripes.pack_stripe_header(seq, v, i, offset // wire.BLOCK_BYTES, n),
                        block)
                    c.out[seq][4] = end  # bytes handed over: only these may go again
                else:
                    if (self.lanes_auto and not c.loss_checked) or c.loss is not None:
                        self._probe_loss(c, offset == 0)
                    self.wire_bytes["sent"] += await c.link.send(
                        wire.pack_block_header(v, i, n, offset), block)
                offset = end
                if offset >= n:
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("chunk_sent", extra={"fields": {
                            "peer": c.addr, "version": v, "index": i,
                            "started_at": round(time.time() - (self.now() - started), 3),
                            "s": round(self.now() - started, 3), "cut_through": stream is not None,
                            "lanes": 1 + len(c.lanes) if seq is not None else 1}})
                    if stream is not None:
                        stream.watchers.remove(c)
                    sending, stream = None, None
                    self._chunk_ended(c)
                    self._note_sent(c, v, i)
                    self.feed(ev.ChunkSent(self.now(), c.id, v, i))
        except (ConnectionError, RuntimeError):
            return  # the reader notices the closed socket and reports it
        finally:
            if stream is not None and c in stream.watchers:
                stream.watchers.remove(c)

    # ------------------------------------------------------------ striped links

    @staticmethod
    def _take_seq(c: Conn) -> int | None:
        """A seq for the next striped chunk, if the peer's window has room."""
        if len(c.unfinished) >= stripes.WINDOW:
            return None
        seq = c.seq
        c.seq = (seq + 1) & stripes.MAX_SEQ
        c.unfinished.add(seq)
        return seq

    @staticmethod
    def _lane_with_room(c: Conn) -> Link | None:
        """Of the link's connections that take a write now, the least loaded: bytes in
        its transport's buffer plus bytes the kernel holds unacknowledged (a lane whose
        flow is slow, in loss recovery say, holds more and gets fewer blocks); ties go
        round the lanes."""
        conns = [(c.link, c.sock), *((lane.link, lane.sock) for lane in c.lanes)]
        k = len(conns)
        best, least = -1, 0
        for j in range(k):
            at = (c.next_lane + j) % k
            link, sock = conns[at]
            if not link.writable:
                continue
            load = link.buffered() + ((unacked_bytes(sock) or 0) if sock is not None else 0)
            if best < 0 or load < least:
                best, least = at, load
        if best < 0:
            return None
        c.next_lane = best + 1
        return conns[best][0]

    @staticmethod
    async def _any_lane_drained(c: Conn) -> None:
        futs = [link.drained() for link in (c.link, *(lane.link for lane in c.lanes))]
        try:
            await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in futs:
                if not f.done():
                    f.cancel()
                elif not f.cancelled():
                    f.exception()  # retrieved: a closed lane shows in its reader
        if c.link.closed:
            raise ConnectionError(c.link.reason or "link closed")

    async def _resend_block(self, c: Conn) -> None:
        """Send one block the peer asked for again (``PSQ2``) on the least loaded
        connection (the lane it is stuck on holds the most)."""
        seq, b = c.resends[0]
        rec = c.out.get(seq)
        if rec is None:  # finished meanwhile
            c.resends.popleft()
            return
        lane = self._lane_with_room(c)
        if lane is None:
            await self._any_lane_drained(c)
            return
        c.resends.popleft()
        v, i, payload = rec[0], rec[1], rec[2]
        off = b * wire.BLOCK_BYTES
        self.wire_bytes["sent"] += lane.send_nowait(
            stripes.pack_stripe_header(seq, v, i, b, len(payload)),
            payload[off:off + wire.BLOCK_BYTES])
        self.blocks_resent += 1

    def _check_stalls(self, c: Conn) -> None:
        """The receiver of a striped link: ask again (``PSQ2``) for the blocks of a chunk
        stuck on a lane (``StripedAssembler.stalled``), turning a stuck block's copy away
        from the chunk's buffer (``Link.divert``); look again when one may be due."""
        asm = c.stripes
        if asm is None or c.closing or self.conns.get(c.id) is not c:
            return
        now = self.now()
        for seq, blocks in asm.stalled(now, divert=lambda s, b, k: self._divert(c, s, b, k)):
            self.stripe_wants += 1
            log.info("peer %s: striped chunk %d had no block for %.1f s while later ones "
                     "came: asking again for %d blocks", c.addr, seq, stripes.STALL_S,
                     len(blocks))
            c.ctrl.append(stripes.pack_want(seq, blocks))
            c.wake.set()
        due = asm.next_stall_check()
        if c.stall_timer is not None:
            c.stall_timer.cancel()
            c.stall_timer = None
        if due is not None and self.loop is not None:
            c.stall_timer = self.loop.call_at(max(due, now + 0.01), self._check_stalls, c)

    @staticmethod
    def _divert(c: Conn, seq: int, block: int, conn: int) -> bool:
        """Turn connection ``conn``'s copy of striped block ``block`` of ``seq`` away from
        the chunk's buffer, if that is the block it is receiving now."""
        link = c.link if conn == 0 else next((x.link for x in c.lanes if x.n == conn), None)
        header = link.placing() if link is not None else None
        if header is None or stripes.magic_of(header) != stripes.STRIPE_MAGIC:
            return False
        s, _, where = stripes.unpack_where(header)
        return s == seq and where & (stripes.MAX_BLOCKS - 1) == block and link.divert()

    def _stripes(self, c: Conn) -> stripes.StripedAssembler:
        if c.stripes is None:
            c.stripes = stripes.StripedAssembler(alloc=aligned_buffer)
        return c.stripes

    def _chunks_flow(self, c: Conn) -> None:
        """A chunk starts on ``c``, either way. If we dialed it and it goes to another
        region, offer a token on it and open ``[network] lanes - 1`` more connections
        with it (once per link): only links that carry chunks between regions (the
        origin's to the borders, the borders' to each other) get lanes, not every
        node's link to the tracker."""
        if c.laning or not c.outbound or not self.core.authenticated(c.id):
            return
        c.laning = True
        if self.lanes <= 1 or self.lanes_auto or not self._other_region(c):
            return  # "auto": once the link's sender finds it capped by loss (_probe_loss)
        self._offer_lanes(c)

    def _other_region(self, c: Conn) -> bool:
        region = self.core.peer_region(c.id)
        return region is not None and region != self.core.cfg.region

    def _offer_lanes(self, c: Conn) -> None:
        """The dialer offers a token on ``c`` (once): the lanes are dialed once the peer
        echoes it (``_on_striped``); a lane whose token reached the peer before the offer
        would be refused."""
        if c.lane_token is not None or c.closing:
            return
        c.lane_token = os.urandom(stripes.TOKEN_BYTES)
        c.ctrl.append(stripes.pack_offer(c.lane_token))
        c.wake.set()

    def _probe_loss(self, c: Conn, first: bool) -> None:
        """``[network] lanes = "auto"``: a plain block is about to go on ``c``; now and
        then look at its socket (``RandomLoss``) and, once it is found capped by random
        loss, get lanes: the dialer offers, an acceptor asks the dialer to (``PSA2``).
        Only links to another region, under a loss-based congestion control: BBR does
        not back off on random loss (lanes measured no faster under it)."""
        probe = c.loss
        if probe is None:
            c.loss_checked = True
            in_use = self.congestion_in_use
            if (c.sock is None or in_use is None or keeps_window_across_idle(in_use)
                    or c.lane_token is not None or not self._other_region(c)):
                return
            probe = c.loss = RandomLoss()
        now = self.now()
        if not first and not probe.due(now):
            return
        sample = path_sample(c.sock)
        if sample is None:
            c.loss = None
            return
        if not probe.sample(now, *sample, fresh=first):
            return
        c.loss = None
        if c.lane_token is not None:
            return  # the dialer offered meanwhile
        self.loss_capped += 1
        retrans, srtt, floor = sample
        log.info("peer %s: capped by random loss (%d retransmitted, round trip %.1f ms, "
                 "floor %.1f ms): %s %d lanes", c.addr, retrans, srtt / 1000, floor / 1000,
                 "opening" if c.outbound else "asking for", self.lanes - 1)
        if c.outbound:
            self._offer_lanes(c)
            return
        # the acceptor names the token: the dialer dials at once, no offer and echo
        c.lane_token, c.asked = os.urandom(stripes.TOKEN_BYTES), True
        self.lane_tokens[c.lane_token] = c.id
        c.ctrl.append(stripes.pack_ask(c.lane_token))
        c.wake.set()

    async def _open_lanes(self, c: Conn, token: bytes, lanes: int) -> None:
        """Dial lanes 1 .. ``lanes - 1`` of ``c`` at once (each a TLS handshake: on a
        150 ms path one after another took 0.6 s apiece)."""
        await asyncio.gather(*(self._open_lane(c, token, n) for n in range(1, lanes)))

    async def _open_lane(self, c: Conn, token: bytes, n: int) -> None:
        host, _, port = c.addr.rpartition(":")
        if c.closing or c.id not in self.conns:
            return
        try:
            link = await dial(host.strip("[]"), int(port),
                              ssl_context=self.tls.client if self.tls is not None else None,
                              max_message=MAX_LINK_MESSAGE, timeout=CONNECT_TIMEOUT_S + 5.0,
                              read_coalesce_s=self.read_coalesce_s, lane=True)
        except (TimeoutError, OSError, ValueError) as exc:
            log.warning("peer %s: lane %d not opened: %s", c.addr, n, exc)
            return
        why = None
        try:
            ident = self._tls_identity(link.get_extra_info("ssl_object"), c.addr)
            if c.identity is not None and (ident is None or ident[0] != c.identity[0]):
                raise ProtocolError("another node answered")
            await link.send(stripes.pack_lane(token, n))
            echo = await asyncio.wait_for(link.recv(), CONNECT_TIMEOUT_S + 5.0)
            if echo is None:
                why = link.reason or "closed"
            elif isinstance(echo, Placed) or bytes(echo) != stripes.pack_lane(token, n):
                why = "no lane acceptance"
        except (ProtocolError, TimeoutError, ConnectionError) as exc:
            why = str(exc) or type(exc).__name__
        if why is not None or c.closing or c.id not in self.conns:
            self.lanes_refused += why is not None
            if why is not None:
                log.warning("peer %s: lane %d refused: %s", c.addr, n, why)
            await link.close("lane not taken")
            return
        lane = self._attach_lane(c, n, link)
        lane.reader = self._spawn(self._lane_reader(c, lane))

    async def _accept_lane(self, link: Link, identity: tuple[str, str, str] | None,
                           addr: str) -> None:
        """A connection that says it is a lane: its first message names the link (token)."""
        why = None
        c = None
        try:
            first = await asyncio.wait_for(link.recv(), self.guard.upgrade_timeout_s)
            if first is None or isinstance(first, Placed):
                raise ProtocolError("no lane message")
            token, n = stripes.unpack_lane(first)
            c = self.conns.get(self.lane_tokens.get(token, -1))
            if c is None or c.closing or not self.core.authenticated(c.id):
                raise ProtocolError("no link offered that token")
            if c.identity is not None and (identity is None or identity[0] != c.identity[0]):
                raise ProtocolError("a lane of another node's link")
            if any(lane.n == n for lane in c.lanes) or len(c.lanes) >= stripes.MAX_LANES - 1:
                raise ProtocolError(f"lane {n} is taken")
            link.send_nowait(first)  # accepted: the dialer attaches it too
        except (ProtocolError, TimeoutError, ConnectionError) as exc:
            why = str(exc) or type(exc).__name__
        if why is not None or c is None:
            self.lanes_refused += 1
            log.warning("lane from %s refused: %s", addr, why)
            await link.close(f"lane refused: {why}")
            return
        lane = self._attach_lane(c, n, link)
        await self._lane_reader(c, lane)

    def _attach_lane(self, c: Conn, n: int, link: Link) -> Lane:
        sock = link.get_extra_info("socket")
        limit_unsent(sock, self.unsent_limit)
        self._congestion(sock)
        link.place_with(lambda header, k: self._place_lane(c, header, k, n),
                        stripes.STRIPE_HEADER_LEN)
        lane = Lane(n, link, sock)
        c.lanes.append(lane)
        self.lanes_opened += 1
        log.info("peer %s: lane %d open (%d connections)", c.addr, n, 1 + len(c.lanes))
        c.wake.set()
        return lane

    def _place_lane(self, c: Conn, header: bytes, n: int, lane: int) -> memoryview | None:
        if c.id not in self.conns or stripes.magic_of(header) != stripes.STRIPE_MAGIC:
            return None
        return self._stripes(c).place(header, n, lane)

    async def _lane_reader(self, c: Conn, lane: Lane) -> None:
        """A lane carries striped blocks and nothing else; when it ends, its link ends."""
        reason = "closed by peer"
        try:
            async for data in self._incoming(c, lane.link):
                if isinstance(data, Placed):
                    whole = None if data.diverted else self._stripes(c).placed(data.header)
                    await self._stripe_block(c, data.header, whole)
                elif stripes.magic_of(data) == stripes.STRIPE_MAGIC:
                    await self._on_striped(c, data)
                else:
                    reason = "a lane carries chunk blocks only"
                    break
            else:
                reason = lane.link.reason or reason
        except ProtocolError as exc:
            reason = str(exc)
        except (TimeoutError, ConnectionError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                await lane.link.close(reason[:200])
        if c.id in self.conns and not c.closing:
            await self._drop(c, f"lane {lane.n}: {reason}")

    def _lanes_end(self, c: Conn) -> None:
        """``c`` closed: so do its lanes; its offered token is void."""
        for timer in (c.stall_timer, c.ack_timer):
            if timer is not None:
                timer.cancel()
        c.stall_timer = c.ack_timer = None
        if c.lane_token is not None and self.lane_tokens.get(c.lane_token) == c.id:
            del self.lane_tokens[c.lane_token]
        for lane in c.lanes:
            lane.link.abort()

    async def _on_striped(self, c: Conn, data: bytes | bytearray) -> None:
        """A striped link's messages (``swarm.protocol.stripes``): blocks, DONE, PSW2, PST2."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "striped link message before the handshake")
            return
        magic = stripes.magic_of(data)
        try:
            if magic == stripes.STRIPE_MAGIC:
                await self._stripe_block(c, data, self._stripes(c).feed(data))
            elif magic == stripes.DONE_MAGIC:
                seq = stripes.unpack_done(data)
                if seq not in c.unfinished:
                    raise ProtocolError(f"done for striped chunk {seq}, not one we sent")
                c.unfinished.discard(seq)
                c.out.pop(seq, None)
                c.wake.set()
            elif magic == stripes.WITHDRAW_MAGIC:
                seq, v, i = stripes.unpack_withdraw(data)
                self._stripes(c).withdraw(seq)
                c.ctrl.append(stripes.pack_done(seq))
                c.wake.set()
                log.info("peer %s withdrew chunk %d of version %d", c.addr, i, v)
                a = self.arrivals.get((v, i))
                if a is not None and a.conn == c.id:
                    self._arrival_failed((v, i), a)
                self.feed(ev.ChunkWithdrawn(self.now(), c.id, v, i))
            elif magic == stripes.WANT_MAGIC:
                seq, blocks = stripes.unpack_want(data)
                rec = c.out.get(seq)
                if rec is not None:  # else finished meanwhile: nothing to send again
                    for b in blocks:
                        # each block once, and only one handed over already (blocks go
                        # whole; a chunk forwarded as it arrives has nothing past them)
                        if b * wire.BLOCK_BYTES < rec[4] and not (rec[3] >> b) & 1:
                            rec[3] |= 1 << b
                            c.resends.append((seq, b))
                    c.wake.set()
            elif magic == stripes.ASK_MAGIC:
                token = stripes.unpack_ask(data)
                if not c.outbound:
                    raise ProtocolError("a lane ask from the dialer (it offers)")
                # a dialer that stripes no links lets it be; one that offered already
                # waits for its echo (the acceptor takes our offer over its ask)
                if self.lanes > 1 and c.lane_token is None and not c.closing:
                    c.laning = c.offer_taken = True
                    c.lane_token = token
                    self._spawn(self._open_lanes(c, token, self.lanes))
            elif magic == stripes.OFFER_MAGIC:
                token = stripes.unpack_offer(data)
                if c.outbound:  # the peer took our offer: dial the lanes now
                    if c.lane_token is None or token != c.lane_token or c.offer_taken:
                        raise ProtocolError("a lane offer echo that answers no offer")
                    c.offer_taken = True
                    self._spawn(self._open_lanes(c, token, self.lanes))
                    return
                if c.lane_token is not None:
                    if not c.asked or c.lanes:
                        raise ProtocolError("a second lane offer on one link")
                    # our ask crossed the dialer's offer: take the offer
                    self.lane_tokens.pop(c.lane_token, None)
                    c.asked = False
                c.lane_token = token
                self.lane_tokens[token] = c.id
                c.ctrl.append(stripes.pack_offer(token))  # taken: the dialer may open lanes
                c.wake.set()
        except ProtocolError as exc:
            await self._drop(c, str(exc))

    async def _stripe_block(self, c: Conn, header: bytes | bytearray | memoryview,
                            whole: stripes.Whole | None) -> None:
        """A striped block is in (``whole``: its chunk is complete): as ``_block_done``;
        then whether a chunk is stuck on a lane (``_check_stalls``)."""
        asm = c.stripes
        if asm is None or len(header) < stripes.STRIPE_HEADER_LEN:
            return
        asm.touch(stripes.unpack_where(header)[0], self.now())
        self._check_stalls(c)
        if whole is not None:
            seq, v, i, payload = whole
            c.ctrl.append(stripes.pack_done(seq))
            c.wake.set()
            await self._on_chunk(c, (v, i, payload))
            return
        seq, v, where = stripes.unpack_where(header)
        key = (v, where >> stripes.BLOCK_BITS)
        ch = asm.open.get(seq)
        if ch is not None:  # not a late block of a withdrawn chunk
            a = self.arrivals.get(key)
            if a is None:  # its first block: a RELAY may go on from here
                a = self.arrivals[key] = Arrival(c.id, ch.buf, ch.length, t0=self.now())
                self.feed(ev.ChunkArriving(self.now(), c.id, *key))
            if a.conn == c.id:
                a.got = asm.prefix(seq)
                if a.watchers:
                    a.changed()
        now = self.now()
        if now - c.heard_at >= 0.25:
            c.heard_at = now
            self.feed(ev.Progress(now, c.id))

    def _chunk_ended(self, c: Conn) -> None:
        """``c``'s chunk is all handed to the kernel: look at the link's unacknowledged
        bytes later (``CongestionRestart.tail``), and on the origin whether they are
        still being acknowledged (``_ack_watch``)."""
        c.in_chunk = False
        if self.core.cfg.is_origin:
            self._watch_acks(c)
        c.restart.chunk_ended(self.now())
        if self.congestion_restart_s > 0 and c.sock is not None:
            self._arm_restart_check(c)

    @staticmethod
    def _socks(c: Conn) -> list[Any]:
        return [s for s in (c.sock, *(lane.sock for lane in c.lanes)) if s is not None]

    def _acked(self, c: Conn) -> int:
        return sum(acked_bytes(s) or 0 for s in self._socks(c))

    def _watch_acks(self, c: Conn) -> None:
        """Start ``_ack_watch`` on ``c`` unless it runs."""
        if c.ack_timer is None and self.loop is not None:
            c.ack_seen = self._acked(c)
            c.ack_timer = self.loop.call_later(ACK_WATCH_S, self._ack_watch, c)

    def _ack_watch(self, c: Conn) -> None:
        """A timer on ``c`` (the origin: after a chunk was handed over; a border: while
        it relays a chunk to another region): bytes are being acknowledged still, so the
        push or relay is on its way (``ev.Acked``: the core keeps it from timing out).
        Looks again while a chunk is being sent or bytes are unacknowledged."""
        c.ack_timer = None
        if c.closing or self.conns.get(c.id) is not c or self.loop is None:
            return
        seen = self._acked(c)
        if seen > c.ack_seen:
            self.feed(ev.Acked(self.now(), c.id))
        c.ack_seen = seen
        if c.in_chunk or any((unacked_bytes(s) or 0) > 0 for s in self._socks(c)):
            c.ack_timer = self.loop.call_later(ACK_WATCH_S, self._ack_watch, c)

    def _arm_restart_check(self, c: Conn) -> None:
        if c.restart_timer is not None:
            c.restart_timer.cancel()
            c.restart_timer = None
        t = c.restart.next_check()
        if t is None or self.loop is None or c.closing:
            return
        c.restart_timer = self.loop.call_at(max(t, self.now() + 0.001), self._restart_check, c)

    def _restart_check(self, c: Conn) -> None:
        """A timer: a chunk sending long, or a sent one's bytes stuck in the kernel. Runs
        off the writer, which may be waiting for the socket to drain all that time."""
        c.restart_timer = None
        if c.closing or self.conns.get(c.id) is not c:
            return
        now = self.now()
        if c.restart.started is not None:
            # a chunk forwarded as it arrives goes at its source's pace: not restarted
            why = "long_chunk" if not c.cut_through and c.restart.block(now) else None
        else:
            unacked = unacked_bytes(c.sock)
            why = f"tail ({unacked} bytes unacknowledged)" if c.restart.tail(now, unacked) else None
        if why is not None:
            self._restart_congestion(c, why)
        self._arm_restart_check(c)

    def _restart_congestion(self, c: Conn, why: str) -> None:
        """Start BBR over on ``c``'s socket (``node.tcp.CongestionRestart`` says when);
        nothing where the link does not run BBR."""
        in_use = self.congestion_in_use
        if c.sock is None or in_use is None or not keeps_window_across_idle(in_use):
            return
        if restart_congestion(c.sock, in_use):
            self.congestion_restarts += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("congestion_restart", extra={"fields": {"peer": c.addr, "why": why}})

    async def _chunk_bytes(self, v: int, i: int) -> memoryview | None:
        try:
            payload = await asyncio.to_thread(self.store.read_chunk, v, i)
        except (ChunkError, StoreError) as exc:
            log.warning("cannot send chunk %d of version %d: %s", i, v, exc)
            return None
        if self.faults.corrupt_chunks and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
        return memoryview(payload)

    def _note_sent(self, c: Conn, v: int, i: int) -> None:
        region = self.core.peer_region(c.id)
        if region is not None:
            self.sent_to_region.setdefault(v, {}).setdefault(region, set()).add(i)

    # --------------------------------------------------------------- chunks

    async def _on_block(self, c: Conn, data: bytes) -> None:
        """One block of a chunk: progress (liveness) for the core; the chunk once whole."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "chunk before the handshake")
            return
        try:
            whole = c.blocks.feed(data)
        except ProtocolError as exc:
            await self._drop(c, str(exc))
            return
        await self._block_done(c, whole)

    def _place(self, c: Conn, header: bytes, n: int) -> memoryview | None:
        """Where a block arriving on ``c`` goes (``Link.place_with``): its slice of the
        chunk buffer, for an authenticated peer's block; None leaves the message whole
        (``_on_block`` then takes or refuses it). ``ProtocolError`` closes the link."""
        if c.id not in self.conns or not self.core.authenticated(c.id):
            return None
        if stripes.magic_of(header) == stripes.STRIPE_MAGIC:
            return self._stripes(c).place(header, n)
        if not wire.is_block_message(header):
            return None
        return c.blocks.place(header, n)

    async def _block_done(self, c: Conn, whole: tuple[int, int, memoryview] | None) -> None:
        if not c.laning:
            self._chunks_flow(c)
        if whole is None:
            key = c.blocks.pending
            a = self.arrivals.get(key)  # type: ignore[arg-type]
            if a is None:  # its first block: a RELAY order may go on from here (cut-through)
                a = self.arrivals[key] = Arrival(c.id, c.blocks.buffer, c.blocks.length,  # type: ignore[index,arg-type]
                                                 t0=self.now())
                self.feed(ev.ChunkArriving(self.now(), c.id, *key))  # type: ignore[misc]
            if a.conn == c.id:
                a.got = c.blocks.received
                if a.watchers:
                    a.changed()
            now = self.now()
            if now - c.heard_at >= 0.25:  # the core needs to know the link is alive, not every block
                c.heard_at = now
                self.feed(ev.Progress(now, c.id))
            return
        await self._on_chunk(c, whole)

    async def _on_withdraw(self, c: Conn, data: bytes) -> None:
        """The sender withdrew the chunk it was sending us while it arrived there (a
        cut-through relay, or an answer with ``serve_arriving``): it did not arrive whole
        and verified there. Drop its blocks; nobody is to blame; the core asks elsewhere."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "withdrawal before the handshake")
            return
        try:
            v, i = c.blocks.withdraw(data)
        except ProtocolError as exc:
            await self._drop(c, str(exc))
            return
        log.info("peer %s withdrew chunk %d of version %d", c.addr, i, v)
        a = self.arrivals.get((v, i))
        if a is not None and a.conn == c.id:
            self._arrival_failed((v, i), a)
        self.feed(ev.ChunkWithdrawn(self.now(), c.id, v, i))

    def _arrival_failed(self, key: tuple[int, int], a: Arrival) -> None:
        self.arrivals.pop(key, None)
        a.state = "failed"
        a.changed()

    def _arrivals_end(self, conn: int) -> None:
        """Link ``conn`` closed: the chunks arriving on it will not arrive."""
        for key, a in [kv for kv in self.arrivals.items() if kv[1].conn == conn]:
            self._arrival_failed(key, a)

    async def _on_chunk(self, c: Conn, data: bytes | tuple[int, int, memoryview]) -> None:
        if isinstance(data, tuple):
            v, i, payload = data
        else:
            try:
                v, i, payload = wire.unpack_chunk(data)
            except ProtocolError as exc:
                await self._drop(c, str(exc))
                return
        if not self.core.authenticated(c.id):
            # Nothing but the handshake is read from an unauthenticated peer: the chunk
            # is neither hashed nor stored, and nobody is blamed in a claimed name.
            await self._drop(c, "chunk before the handshake")
            return
        a = self.arrivals.get((v, i))
        if a is not None and a.conn == c.id:
            a.got = a.length  # every byte is here; the last block waits for the verdict
        verdict = await asyncio.to_thread(self._check_and_store, v, i, payload)
        if a is not None and a.conn == c.id:
            self.arrivals.pop((v, i), None)
            a.state = "stored" if verdict is None else "failed"
            a.changed()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("chunk_received", extra={"fields": {
                    "peer": c.addr, "version": v, "index": i, "state": a.state,
                    "first_block_at": round(time.time() - (self.now() - a.t0), 3),
                    "s": round(self.now() - a.t0, 3), "relays": len(a.watchers)}})
        if isinstance(verdict, str):  # local fault: the core backs off, blames nobody
            self.store_fault = f"cannot keep chunks: {verdict}"
            self.feed(ev.ChunkNotStored(self.now(), c.id, v, i, verdict[:200]))
            return
        valid = verdict is None
        if valid:
            self.store_fault = None
        if c.id in self.conns or valid:
            self.feed(ev.ChunkReceived(self.now(), c.id, v, i, valid))
        if valid:
            self._prestage_kick(v)

    # ------------------------------------------------------------ prestage

    def _prestage_kick(self, v: int) -> None:
        """A chunk of ``v`` was stored: decode what it extends of the patch's verified
        prefix, in the prestage thread (``_prestage_pool``: its own, at low priority),
        while later chunks still download. The apply then decodes only the tail
        (``InProcessWeights.prefeed``); at most one such task runs, none during an
        apply, and none once the driver stopped."""
        if self.weights is None or self._applying or self._pre_closed:
            return
        if self._pre_task is not None:
            self._pre_again = True
            return
        self._pre_task = self._spawn(self._prestage(v))

    async def _prestage(self, v: int) -> None:
        try:
            while True:
                self._pre_again = False
                if self._pre_closed:  # stopped: no new pool
                    return
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._prestage_pool(), self._prestage_step, v)
                if not self._pre_again or self._applying:
                    return
        except Exception:  # an optimisation only: the apply decodes everything itself
            log.exception("decoding version %d ahead of its apply failed", v)
        finally:
            self._pre_task = None

    def _prestage_pool(self) -> ThreadPoolExecutor:
        """The prestage thread: one, of its own (not the default executor that chunk
        reads, stores and applies share), at a lower scheduling priority, so decoding
        ahead yields the CPU to the event loop (uploads, relays, heartbeats) and to
        everything else the node does. Created on first use, shut down by ``stop``."""
        if self._pre_pool is None:
            self._pre_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prestage",
                                                initializer=lower_thread_priority)
        return self._pre_pool

    async def _prestage_close(self) -> None:
        """Stop decoding ahead and join the prestage thread (it finishes at most the
        chunk it is feeding)."""
        self._pre_closed = True
        pool, self._pre_pool = self._pre_pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, True)

    def _prestage_step(self, v: int) -> None:
        """Feed every stored chunk that continues the decoded prefix (prestage thread)."""
        w = self.weights
        try:
            m = self.store.manifest(v)
        except (StoreError, KeyError):
            return
        if w is None or m.kind != "patch" or getattr(m, "encryption", None) is not None \
                or m.parent_digest is None or m.parent_digest != w.digest:
            return
        fed = w.prefed(v)
        i, start = divmod(fed, m.chunk_size)  # a chunk may be fed in part (slices)
        held = self.store.have(v)
        while i < m.chunk_count and i in held:
            try:
                data = memoryview(self.store.read_chunk(v, i))
            except (ChunkError, StoreError, OSError):
                return  # the apply reads it again and reports
            for off in range(start, len(data), PRESTAGE_SLICE):
                if self._applying or self._pre_closed:
                    return
                piece = data[off:off + PRESTAGE_SLICE]
                now = w.prefeed(v, m.parent_digest, fed, piece)
                if now != fed + len(piece):
                    return
                fed = now
            i, start = i + 1, 0

    def _check_and_store(self, v: int, i: int, payload: memoryview) -> bool | str | None:
        """Keep the chunk durably if it is the one its manifest names.

        ``None``: stored. ``False``: the *sender's* fault (the bytes are not the
        chunk the signed manifest names). A string: a *local* fault (disk full,
        quota, too many open files, our manifest not persisted) that must never
        be blamed on the sender. ``put_chunk`` is the one check a received chunk
        gets (``StorePort``).
        """
        try:
            # the payload is this chunk's own buffer (BlockAssembler, or the message):
            # nothing changes it, so the store may serve uploads of it from memory
            self.store.put_chunk(v, i, payload, keep=True)
            return None
        except ChunkError as exc:
            log.warning("chunk %d of version %d refused: %s", i, v, exc)
            return False
        except (StoreError, OSError) as exc:
            log.error("chunk %d of version %d not stored (local fault, sender not blamed): %s",
                      i, v, exc)
            return str(exc) or type(exc).__name__

    async def _drop(self, c: Conn, reason: str) -> None:
        log.warning("peer %s: %s", c.addr, reason)
        if self.conns.pop(c.id, None) is not None:
            c.closing = True
            self.feed(ev.PeerDisconnected(self.now(), c.id, reason))
        await self._close_link(c, reason)

    # ---------------------------------------------------------------- apply

    async def _apply(self, version: int) -> None:
        t0 = time.perf_counter()
        self._applying = True
        try:
            if self._pre_task is not None:  # its thread finishes its current chunk
                await asyncio.shield(self._pre_task)
            await self._apply_locked(version, t0)
        finally:
            self._applying = False

    async def _apply_locked(self, version: int, t0: float) -> None:
        async with self._engine_lock:
            t_lock = time.perf_counter()
            try:
                if self.weights is None:
                    raise StoreError("this node has no weights to apply versions to")
                async with self._gated(version, self.engine is not None
                                       and self.engine.kind == "inprocess"):
                    digest = await asyncio.to_thread(self._apply_truth, version)
                t_truth = time.perf_counter()
            except NoKeyError as exc:
                # Confidential version not for us: the chunks are held and verified
                # (ciphertext), so the core moves on and relays this version and later
                # ones; the weights, the engine and the store's active record stay at
                # the last version this node could open (docs/security.md).
                no_key = self.no_key_versions
                no_key[version] = str(exc)
                while len(no_key) > 64:
                    del no_key[min(no_key)]
                held = self.weights.version if self.weights is not None else None
                log.warning("%s; relaying it without applying it (weights stay at version %s)",
                            exc, held)
                self.feed(ev.Applied(self.now(), version, True))
                return
            except (PatchswarmError, OSError, RuntimeError, ValueError) as exc:
                log.error("apply of version %d failed: %s", version, exc)
                self.feed(ev.Applied(self.now(), version, False, str(exc)[:200]))
                return
            except Exception as exc:  # a bug must not leave the core waiting for Applied
                log.exception("apply of version %d failed", version)
                self.feed(ev.Applied(self.now(), version, False,
                                     f"{type(exc).__name__}: {exc}"[:200]))
                return
            # The truth holds `version`, bitwise checked: only now does the engine hear of it.
            if self.engine is not None:
                await self._sync_engine()
        t1 = time.perf_counter()
        self.apply_seconds[version] = t1 - t0
        # where the time went: waiting (decode ahead, engine lock), the truth, the engine
        self.apply_split = {"wait_s": round(t_lock - t0, 4), "truth_s": round(t_truth - t_lock, 4),
                            **self._truth_split, "engine_s": round(t1 - t_truth, 4)}
        self.apply_splits[version] = self.apply_split
        while len(self.apply_splits) > 16:
            del self.apply_splits[min(self.apply_splits)]
        self.activated_at[version] = time.time()
        st = self.engine_state
        if st.healthy:
            log.info("version %d active (digest %s, %.3f s: %s; %d bytes decoded ahead)",
                     version, digest.hex()[:16], self.apply_seconds[version],
                     ", ".join(f"{k} {v}" for k, v in self.apply_split.items()),
                     self._ahead_bytes)
        else:
            log.warning("version %d verified (digest %s) but the %s engine does not serve it: %s",
                        version, digest.hex()[:16], st.kind, st.reason)
        self.feed(ev.Applied(self.now(), version, True))

    def _apply_truth(self, version: int) -> bytes:
        """Stage + commit ``version`` on the checkpoint-coordinate truth (worker thread)."""
        m = self.store.manifest(version)
        w = self.weights
        t0 = time.perf_counter()
        c0 = time.thread_time()  # this worker thread's CPU: the apply's own cost
        self._ahead_bytes = 0
        self._truth_split = {}
        if m.kind == "full" and m.target_digest == w.digest:
            # an anchor of the weights we hold (the core did not fetch it): take its number
            digest = w.adopt(version, m.target_digest)
            self._truth_commit_s = time.perf_counter() - t0
            return self._after_truth_commit(version, digest)
        skip = w.prefed(version) if getattr(m, "encryption", None) is None else 0
        self._ahead_bytes = skip
        if skip:  # decoded while it downloaded: only the rest is read and decoded
            first, part = divmod(skip, m.chunk_size)  # from within a chunk (slices)
            payload = memoryview(b"".join(self.store.read_chunk(version, i)
                                          for i in range(first, m.chunk_count)))[part:]
        else:
            # a plain patch is decoded straight from one buffer read in place; a full
            # checkpoint (safetensors) and a confidential payload want bytes
            plain = m.kind == "patch" and getattr(m, "encryption", None) is None
            payload = self.store.payload_view(version) if plain else self.store.payload(version)
        if getattr(m, "encryption", None) is not None:
            # Confidential: chunks were verified as ciphertext; open them only here.
            # AES-GCM authenticates every chunk: a failure is local, nobody is blamed.
            node_key = self.node_key
            if node_key is None:
                raise NoKeyError(f"no key for version {version}: it is confidential and "
                                 "this node has no [trust] node_key")
            payload = bytes(decrypt_payload(m, payload, node_key))
        t1 = time.perf_counter()
        w.stage(version, m.kind, payload, m.parent_digest, offset=skip)
        t2 = time.perf_counter()
        digest = w.commit(version, m.target_digest)
        t3 = time.perf_counter()
        self._truth_commit_s = t3 - t2
        out = self._after_truth_commit(version, digest)
        self._truth_split = {"read_s": round(t1 - t0, 4), "stage_s": round(t2 - t1, 4),
                             "commit_s": round(t3 - t2, 4),
                             "record_s": round(time.perf_counter() - t3, 4),
                             "cpu_s": round(time.thread_time() - c0, 4)}
        return out

    def _after_truth_commit(self, version: int, digest: bytes) -> bytes:
        w = self.weights
        st = self.engine_state
        nothing_owed = st.served_version is not None and not st.uncertain and self._owed == {}
        self._owed = merge_changes(self._owed, w.last_changes, first=nothing_owed)
        if self.engine is None:
            self._record_active(version, digest)
        return digest

    def _record_active(self, version: int, digest: bytes) -> None:
        self.store.set_active(version, digest)
        if self.keep_versions:
            self.store.gc(self.keep_versions)

    # --------------------------------------------------------------- engine

    def _engine_update(self, target: int, served: int | None) -> WeightUpdate:
        """What takes the engine from ``served`` to the truth's ``target`` (worker thread)."""
        st = self.engine_state
        w = self.weights
        if self.engine.kind == "inprocess":
            return WeightUpdate(target, served, w.digest, (), full=False)
        incremental = (served is not None and served == st.served_version and not st.uncertain
                       and self._owed is not None)
        frac = self.engine_cfg.sparse_max_fraction if self.engine_cfg is not None else 1.0
        return w.weight_update(target, served, self._owed if incremental else None,
                               sparse_max_fraction=frac)

    async def _sync_engine(self) -> bool:
        """Bring the engine to the truth's version; call with ``_engine_lock`` held.

        Asks the engine what it serves first: already there -> nothing to send;
        at the version it last confirmed (and not uncertain) -> the changes
        since; anything else (restarted, uncertain, never synced) -> everything.
        """
        st = self.engine_state
        target = self.weights.version
        try:
            served = await asyncio.to_thread(self.engine.served_version)
            marked = self._commit_mark is not None and self._commit_mark.exists()
            if marked:
                st.uncertain = True
            if served == target and not marked:
                stats = None
                if st.kind == "inprocess":  # the truth's own commit was the engine's commit
                    stats = CommitStats(target, self._truth_commit_s, self._truth_commit_s,
                                        "inprocess", 0)
                self._engine_ok(target, stats)
                await self._record_served(target)
                return True
            if (served is not None and served > target and st.served_version is None and not marked
                    and st.consecutive_failures < AHEAD_GRACE_TRIES):
                # After a node restart the engine may already serve a version the node
                # verified before the crash but had not recorded: let the node re-apply
                # it from its store rather than take the engine back and forth.
                self._engine_failed(target, f"engine serves version {served}, newer than the "
                                    "node's verified version; waiting for the node to verify it",
                                    False)
                return False
            if served != st.served_version and st.served_version is not None:
                log.warning("%s engine serves %s, expected version %d (restarted?); rebuilding it",
                            st.kind, "no version" if served is None else f"version {served}",
                            st.served_version)
                st.uncertain = True
            update = await asyncio.to_thread(self._engine_update, target, served)
            await asyncio.to_thread(self.engine.stage, update)
            async with self._gated(target):
                await asyncio.to_thread(self._mark, target)
                stats = await asyncio.to_thread(self.engine.commit, update)
                await asyncio.to_thread(self._mark, None)
                self._engine_ok(target, stats)
        except EngineError as exc:
            if not exc.uncertain and not st.uncertain:
                await asyncio.to_thread(self._mark, None)
            self._engine_failed(target, str(exc), exc.uncertain)
            return False
        except Exception as exc:  # an adapter bug: the engine's state is unknown
            log.exception("%s engine adapter failed", st.kind)
            self._engine_failed(target, f"{type(exc).__name__}: {exc}", True)
            return False
        await self._record_served(target)
        return True

    def _gated(self, version: int, when: bool = True) -> AbstractAsyncContextManager[None]:
        """``commit_gate(version)`` around an engine commit, when one is set."""
        if self.commit_gate is None or not when:
            return contextlib.nullcontext()
        return self.commit_gate(version)

    def _mark(self, version: int | None) -> None:
        """Write (``version``) or remove (``None``) the commit-in-progress mark, durably."""
        p = self._commit_mark
        if p is None or self.engine.kind == "inprocess":
            return
        try:
            if version is None:
                p.unlink(missing_ok=True)
                return
            tmp = p.with_name(p.name + ".tmp")
            with open(tmp, "w") as f:
                f.write(f"{version}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except OSError as exc:
            log.warning("cannot %s %s: %s", "remove" if version is None else "write", p, exc)

    async def _record_served(self, version: int) -> None:
        """The store's active record: verified and served (see the module docstring)."""
        try:
            await asyncio.to_thread(self._record_active, version, self.weights.digest)
        except (PatchswarmError, OSError) as exc:
            # Local: the node keeps serving and patching from the verified version; a
            # restart rebuilds to the last recorded one and re-applies the rest from the store.
            log.error("cannot record active version %d: %s", version, exc)
            self.store_fault = f"cannot record active version {version}: {exc}"
        else:
            if self.store_fault is not None and self.store_fault.startswith("cannot record"):
                self.store_fault = None

    def _engine_ok(self, version: int, stats: CommitStats | None) -> None:
        st = self.engine_state
        was = st.state
        if self.core is not None and version != self.core.served_version:
            self.feed(ev.EngineServed(self.now(), version))  # the origin's fleet view
        st.served_version = version
        st.uncertain = False
        self._owed = {}
        st.state, st.reason = "ok", ""
        st.consecutive_failures = 0
        st.next_retry_at = None
        st.since = time.monotonic()
        if stats is not None:
            st.last_commit = stats
            st.last_commit_at = time.time()
            st.commits += 1
            st.commit_seconds += stats.commit_s
            st.paused_seconds += stats.paused_s
            if st.kind != "inprocess":
                log.info("%s engine serves version %d (%s, %d bytes, paused %.3f s, commit %.3f s)",
                         st.kind, version, stats.path, stats.bytes, stats.paused_s, stats.commit_s)
        if was != "ok":
            log.info("%s engine healthy again, serving version %d", st.kind, version)

    def _engine_failed(self, version: int, reason: str, uncertain: bool) -> None:
        st = self.engine_state
        st.failures += 1
        st.consecutive_failures += 1
        st.uncertain = st.uncertain or uncertain
        if st.uncertain:
            self._owed = None
        st.state = "unhealthy"
        served = "no version" if st.served_version is None else f"version {st.served_version}"
        st.reason = (f"{st.kind} engine failed to take version {version}"
                     f"{' mid-commit (state uncertain, will rebuild it)' if uncertain else ''}: "
                     f"{reason[:300]}; last confirmed {served}")
        st.since = time.monotonic()
        cap = self.engine_cfg.retry_max_s if self.engine_cfg is not None else 30.0
        delay = min(cap, 2.0 ** min(st.consecutive_failures - 1, 16))
        st.next_retry_at = time.monotonic() + delay
        log.error("%s (retry in %.0f s)", st.reason, delay)

    async def _watch_engine(self) -> None:
        """Probe the engine; bring it back to the verified version when needed."""
        probe = self.engine_cfg.probe_s if self.engine_cfg is not None else 5.0
        first = True
        while not self.draining:
            if not first:
                st = self.engine_state
                wait = probe
                if st.next_retry_at is not None:
                    wait = min(probe, max(0.05, st.next_retry_at - time.monotonic()))
                await asyncio.sleep(wait)
            first = False
            if self.draining:
                return
            st = self.engine_state
            if st.next_retry_at is not None and time.monotonic() < st.next_retry_at:
                continue
            if self._engine_lock.locked():
                continue  # an apply is talking to the engine
            async with self._engine_lock:
                if st.state == "ok" and st.served_version == self.weights.version:
                    try:
                        served = await asyncio.to_thread(self.engine.served_version)
                    except EngineError as exc:
                        self._engine_failed(self.weights.version, str(exc), False)
                        continue
                    if served == st.served_version:
                        continue
                    st.state = "behind"
                    st.reason = (f"{st.kind} engine serves "
                                 f"{'no version' if served is None else f'version {served}'}, "
                                 f"node verified version {self.weights.version}")
                    log.warning("%s; bringing it up to date", st.reason)
                await self._sync_engine()

    # --------------------------------------------------------------- status

    def region_progress(self, version: int) -> dict[str, int]:
        """Origin's view: chunks of ``version`` that reached each region (loop thread)."""
        union = self.core.region_chunks(version)
        for region, sent in self.sent_to_region.get(version, {}).items():
            bits = union.get(region, 0)
            for i in sent:
                bits |= 1 << i
            union[region] = bits
        return {region: bits.bit_count() for region, bits in union.items()}
