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

The driver is assembled from parts, one concern each (mixins over the same state):
``node.striping`` (striped links: lanes, stalls, the loss probe), ``node.tcp_watch``
(acknowledged bytes and congestion restarts on a link's sockets) and
``node.applying`` (prestage, apply, the engine); a link's state is ``node.conn.Conn``.
This module keeps the rest: the loop, actions, links, their readers and writers, and
the receive path of chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from node.active_wait import ActiveWaiters
from node.applying import (  # noqa: F401 (re-exported)
    PRESTAGE_NICE,
    PRESTAGE_SLICE,
    ApplyPipeline,
    EngineState,
    lower_thread_priority,
)
from node.conn import (  # noqa: F401 (Arrival, Lane, MAX_LINK_MESSAGE re-exported)
    CONNECT_TIMEOUT_S,
    MAX_LINK_MESSAGE,
    RESTRIPE_MIN_LEFT,
    Arrival,
    Conn,
    Lane,
)
from node.engines.base import Engine
from node.engines.config import EngineConfig
from node.engines.inprocess import InProcessWeights
from node.frames import REUSE_BYTES, TAG
from node.guard import ConnectionGuard
from node.link import READ_COALESCE_S, READ_LOWAT, Link, LinkServer, Placed, dial
from node.ports import StorePort, TrustPort
from node.striping import StripedLinks
from node.tcp import (
    CONGESTION_CONTROL,
    CONGESTION_RESTART_S,
    RESTART_IDLE_S,
    UNSENT_LIMIT,
    CongestionRestart,
    congestion_of,
    keeps_window_across_idle,
    limit_unsent,
    link_rate,
    set_congestion,
    slow_start_after_idle,
)
from node.tcp_watch import TcpWatch
from node.warm_up import WARM_UP_KIB, WARM_UP_MIN_RTT_MS, WARM_UP_POLL_S, WarmUps
from swarm.errors import ChunkError, PatchswarmError, ProtocolError, StoreError
from swarm.protocol import events as ev
from swarm.protocol import stripes, wire
from swarm.protocol.core import NodeCore
from swarm.trust.manifest import Manifest

log = logging.getLogger("patchswarm.node")

# link messages that carry chunk bytes (besides those placed straight into their buffer)
_CHUNK_BYTES = (wire.BLOCK_MAGIC, wire.CHUNK_MAGIC, stripes.STRIPE_MAGIC)
_STRIPED = (stripes.STRIPE_MAGIC, stripes.DONE_MAGIC, stripes.WITHDRAW_MAGIC, stripes.OFFER_MAGIC,
            stripes.ASK_MAGIC, stripes.WANT_MAGIC)
SEND_QUEUE_LIMIT = 4096  # frames queued per peer before it is dropped as too slow
# A chunk goes in blocks of ``wire.BLOCK_BYTES``, or of up to ``MAX_BLOCK_BYTES`` on a link
# fast enough that one takes at most ``BLOCK_HOL_S`` there: a control frame waits behind
# one block at most, and each block costs the writer and the reader a pass through
# Python (a seal, a frame, a header, a placement) whatever its size (``_block_size``).
# A block is at most a chunk's ``1 / MIN_BLOCKS`` (whole ``wire.BLOCK_BYTES``): a relay, a
# cut-through and an answer served while it arrives go on in that many steps at least, and
# a receiver places each block in the chunk's buffer (a chunk of one block it does not).
BLOCK_HOL_S = 0.010
MAX_BLOCK_BYTES = 4 * wire.BLOCK_BYTES
MIN_BLOCKS = 4
assert MAX_BLOCK_BYTES + TAG <= REUSE_BYTES  # a reader keeps its frame buffer for these
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _leaves_blocks_alone(data: bytes | bytearray) -> bool:
    """A queued message that does not touch a link's block assembler (``Link.place_with``):
    a control frame. Every binary message (``PS..``: blocks, withdrawals, stripes, whole
    chunks) counts, whatever it is, but warm-up padding."""
    return data[:2] != b"PS" or data[:4] == wire.PAD_MAGIC


@dataclass
class Faults:
    """Deliberate misbehaviour, for tests of the swarm's defences only."""

    corrupt_chunks: bool = False  # flip a byte in every chunk this node sends


@dataclass(frozen=True)
class TlsContexts:
    """Mutual TLS for the swarm port (``swarm.trust.ca``): accept and dial."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, ca: Path, cert: Path, key: Path) -> TlsContexts:
        from swarm.trust import ca as swarm_ca

        return cls(swarm_ca.server_context(ca, cert, key), swarm_ca.client_context(ca, cert, key))


def _hashed(blocks: wire.BlockAssembler, whole: tuple | None) -> tuple | None:
    """``whole`` (a chunk ``blocks`` just returned) with the hash ``blocks`` took of it
    as its blocks came (``BlockAssembler.digest``), for the store's check."""
    if whole is None or blocks.digest is None:
        return whole
    return (*whole, blocks.digest)


def _chunk_block(n: int, fast: int) -> int:
    """Block bytes for a chunk of ``n`` bytes on a link that allows ``fast``
    (``Driver._block_size``): at most ``n / MIN_BLOCKS`` in whole ``wire.BLOCK_BYTES``,
    one of those at least."""
    return max(wire.BLOCK_BYTES, min(fast, n // MIN_BLOCKS // wire.BLOCK_BYTES * wire.BLOCK_BYTES))


class Driver(StripedLinks, TcpWatch, WarmUps, ApplyPipeline):
    """Carry out a core's actions over real sockets; see the module docstring."""

    def __init__(self, core: NodeCore, store: StorePort, trust: TrustPort, *,
                 weights: InProcessWeights | None = None, engine: Engine | None = None,
                 engine_cfg: EngineConfig | None = None,
                 host: str, port: int, faults: Faults | None = None,
                 keep_versions: int = 0, tls: TlsContexts | None = None,
                 api_addr: tuple[str, int] | None = None,
                 guard: ConnectionGuard | None = None,
                 unsent_limit: int = UNSENT_LIMIT,
                 read_coalesce_s: float = READ_COALESCE_S, read_lowat: int = READ_LOWAT,
                 frames: bool = True, max_block: int = MAX_BLOCK_BYTES,
                 congestion: str = CONGESTION_CONTROL,
                 congestion_restart_s: float = CONGESTION_RESTART_S,
                 congestion_restart_idle_s: float = RESTART_IDLE_S,
                 lanes: int = 1, lanes_auto: bool = False,
                 warm_up_kib: int = WARM_UP_KIB,
                 warm_up_min_rtt_ms: float = WARM_UP_MIN_RTT_MS) -> None:
        self.core = core
        # long links' windows opened before the first version (node.warm_up)
        self._warm_setup(warm_up_kib, warm_up_min_rtt_ms)
        # connections per link that carries chunks to another region (1: no striping);
        # ``lanes_auto``: only on a link found capped by random loss (node.tcp.RandomLoss)
        self.lanes = max(1, min(int(lanes), stripes.MAX_LANES))
        self.lanes_auto = lanes_auto and self.lanes > 1
        self.loss_capped = 0  # links RandomLoss found capped by random loss
        # ``lanes_auto``: per other region, the lanes its last loss-capped link got, and
        # when (``node.striping.REGION_LANES_S``); links into that region take them
        # without a probe of their own
        self.region_lanes: dict[str, tuple[int, float]] = {}
        self.lanes_learned = 0  # links that took their region's lanes so
        self.lane_tokens: dict[bytes, int] = {}  # offered tokens -> conn (acceptor)
        self.lanes_opened = 0
        self.stripe_wants = 0  # striped chunks we asked for again (stuck on a lane)
        self.blocks_resent = 0  # striped blocks we sent again, asked by the peer
        self.chunks_restriped = 0  # chunks restarted over lanes that came up mid-chunk
        self.uploads_stopped = 0  # answers stopped short: the requester cancelled them
        # chunk blocks received straight into their chunk's buffer, and those that came
        # through a message buffer of their own (a copy more; Link.place_with)
        self.blocks_placed = 0
        self.blocks_copied = 0
        self.lanes_refused = 0
        self.read_coalesce_s = read_coalesce_s
        self.read_lowat = read_lowat
        self.frames = frames  # offer the data plane's frames on TLS links (node.frames)
        # the largest chunk block a fast link sends (``_block_size``; [network] max_block_kib)
        self.max_block = max(wire.BLOCK_BYTES, min(MAX_BLOCK_BYTES, max_block))
        self.unsent_limit = unsent_limit
        self.congestion = congestion
        # BBR started over on a link whose chunk starts after idle or runs long (node.tcp)
        self.congestion_restart_s = congestion_restart_s
        self.congestion_restart_idle_s = congestion_restart_idle_s
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
        self.verifying: dict[tuple[int, int], int] = {}  # whole copies being hashed and stored
        self._ids = itertools.count(1)
        self._timer: asyncio.Handle | None = None
        self._timer_for = 0.0  # the core's wake-up time the timer was armed for
        self._tasks: set[asyncio.Task] = set()
        self._apply_task: asyncio.Task | None = None
        # decoding the verified prefix of a patch while the rest downloads (``_prestage``)
        self._pre_task: asyncio.Task | None = None
        self._pre_again = False
        # its own low-priority thread (``_prestage_pool``), shut down by ``stop``
        self._pre_pool: ThreadPoolExecutor | None = None
        self._pre_closed = False
        self._pre_tid: int | None = None  # the prestage thread's id (Linux niceness)
        # a patch with a layout decoded record by record (``_prestage_records``)
        self._pre_layout = None  # node.applying._Layout
        self.prestage_boosts = 0  # applies that raised the prestage thread's priority
        self._applying = False
        self._ahead_bytes = 0  # of the last apply's payload, decoded while it downloaded
        self.apply_split: dict[str, float] = {}
        self.apply_splits: dict[int, dict[str, float]] = {}  # the last APPLIES_KEPT (/status)
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
        self.apply_seconds: dict[int, float] = {}  # the last APPLIES_KEPT (/status)
        self.activated_at: dict[int, float] = {}  # the last APPLIES_KEPT (/status)
        self.listeners: list[Callable[[ev.Action], None]] = []
        # GET /status?wait_active=N: requests woken as the active version reaches N
        self.active_waiters = ActiveWaiters()
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
            read_coalesce_s=self.read_coalesce_s, read_lowat=self.read_lowat,
            frames=self.frames)
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
        self.active_waiters.release_all()
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
        self.active_waiters.changed(self.core.active_version)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self.loop is None:
            return
        t = self.core.next_wakeup()
        if self._timer is not None:
            if t is not None and abs(self._timer_for - t) < 1e-4:
                return
            self._timer.cancel()
            self._timer = None
        if t is None or self.draining:
            return
        # The wake-up the timer is for is kept here, not read back with ``when()``: uvloop
        # keeps time in whole milliseconds and hands back a plain Handle (``call_soon``,
        # no ``when()``) for a delay that rounds to 0, which a time only just ahead of
        # ``loop.time()`` can become once its millisecond ticks over (a loaded box).
        self._timer_for = t
        self._timer = self.loop.call_at(max(t, self.loop.time() + 0.001), self._on_timer)

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
        elif isinstance(a, ev.StopChunk):
            c = self.conns.get(a.conn)
            if c is not None:
                self._stop_chunk(c, a.version, a.index)
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
            self._chunk_moved(c)
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
                 restart=CongestionRestart(self.congestion_restart_s,
                                           self.congestion_restart_idle_s),
                 identity=identity)
        # chunk blocks are decrypted straight into their chunk's buffer (_place)
        link.place_with(lambda header, n: self._place(c, header, n), wire.BLOCK_HEADER_LEN,
                        filled=lambda p: self._filled(c, p), neutral=_leaves_blocks_alone)
        self.conns[c.id] = c
        c.writer = self._spawn(self._writer(c))
        self._warm_schedule(c)
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
                              read_coalesce_s=self.read_coalesce_s, read_lowat=self.read_lowat,
                              frames=self.frames)
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
                if isinstance(data, Placed) or data[:4] in _CHUNK_BYTES:
                    self._chunk_moved(c)  # a version moves: warm-ups end (node.warm_up)
                if isinstance(data, Placed):
                    if stripes.magic_of(data.header) == stripes.STRIPE_MAGIC:
                        whole = None if data.diverted else c.stripes.placed(data.header)  # type: ignore[union-attr]
                        await self._stripe_block(c, data.header, whole)
                    elif data.settled:  # c.blocks took it as it completed (_filled)
                        self.blocks_placed += 1
                        await self._block_done(c, *data.info)
                    else:
                        self.blocks_placed += 1
                        await self._block_done(c, _hashed(c.blocks, c.blocks.placed()))
                elif wire.is_pad_message(data):
                    await self._on_pad(c, data)
                elif wire.is_block_message(data):
                    self.blocks_copied += 1
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
            self._warm_end(c, "closed")
            if c.warm_timer is not None:
                c.warm_timer.cancel()
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

    def _stop_chunk(self, c: Conn, v: int, i: int) -> None:
        """The requester cancelled chunk ``i`` of ``v`` (``ev.StopChunk``): not started, it
        is dropped here; under way, the writer withdraws it at its next block."""
        for item in c.data:
            if item[0] == v and item[1] == i:
                c.data.remove(item)
                self.uploads_stopped += 1
                self.feed(ev.ChunkSent(self.now(), c.id, v, i, withdrawn=True))
                return
        if c.sending == (v, i):
            c.stop = (v, i)
            c.wake.set()

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
                        if c.warm is not None and c.warm.why is None:
                            if c.link.buffered():
                                # padding goes only into the kernel (node.warm_up): a chunk
                                # that comes meanwhile waits behind its unsent limit at most
                                c.wake.clear()
                                with contextlib.suppress(TimeoutError):
                                    await asyncio.wait_for(c.wake.wait(), WARM_UP_POLL_S)
                                continue
                            if (pad := self._warm_pad(c)) is not None:
                                self.wire_bytes["sent"] += await c.link.send(pad)
                                continue
                        c.wake.clear()
                        await c.wake.wait()
                        continue
                    v, i, arriving = c.data.popleft()
                    c.sending, c.stop, c.handed = (v, i), None, 0
                    stream = self.arrivals.get((v, i)) if arriving else None
                    started = self.now()
                    c.in_chunk = True
                    if not self.core.cfg.is_origin and self._other_region(c):
                        self._watch_acks(c)  # a relay: RELAY_ALIVE while it is acknowledged
                    elif self.core.cfg.is_origin and self.core.cfg.clear_startup:
                        self._watch_path(c)  # a push: is there a queue on its path?
                    striped, seq = bool(c.lanes), None
                    c.block_bytes = self._block_size(c)
                    if not c.laning:
                        self._chunks_flow(c)
                    if stream is not None:
                        stream.watchers.append(c)
                        sending, offset = (v, i, stream.buf), 0
                        continue
                    payload = await self._chunk_bytes(v, i)
                    if payload is None:  # an arriving chunk that failed: nothing was sent
                        c.in_chunk = False
                        c.sending = None
                        if arriving:  # the peer may have asked for it: "it will not come"
                            self.wire_bytes["sent"] += await c.link.send(wire.pack_withdraw(v, i))
                        self.feed(ev.ChunkSent(self.now(), c.id, v, i, withdrawn=arriving))
                        continue
                    sending, offset = (v, i, payload), 0
                v, i, payload = sending
                if c.stop == (v, i):
                    # the requester got it elsewhere first (CANCEL): withdraw what went,
                    # send no more of it
                    if stream is not None:
                        stream.watchers.remove(c)
                    sending, stream, c.sending, c.stop = None, None, None, None
                    self._chunk_ended(c)
                    gone = (wire.pack_withdraw(v, i) if seq is None
                            else stripes.pack_withdraw(seq, v, i))
                    c.out.pop(seq, None)
                    self.uploads_stopped += 1
                    self.wire_bytes["sent"] += await c.link.send(gone)
                    self.feed(ev.ChunkSent(self.now(), c.id, v, i, withdrawn=True))
                    continue
                if stream is not None:
                    # its buffer may change (``_stripe_block``: restriped; ``_arrival_served``:
                    # verified on another link), to one with the same bytes so far: blocks
                    # asked for again come from it as well
                    payload = stream.buf
                    if seq is not None and (rec := c.out.get(seq)) is not None:
                        rec[2] = payload
                n = len(payload)
                end = min(n, offset + (wire.BLOCK_BYTES if striped else _chunk_block(n, c.block_bytes)))
                if (not striped and c.lanes and n - offset >= RESTRIPE_MIN_LEFT
                        and offset <= n // 2 and (stream is None or stream.state == "stored"
                                                  or stream.got - offset >= RESTRIPE_MIN_LEFT)):
                    # Lanes came up while this chunk went on the link alone (a lossy path
                    # found mid-chunk): withdraw that copy (PSW1; the peer drops its
                    # blocks, blames nobody) and send the whole chunk striped over all
                    # of them, instead of the rest crawling on one capped flow. A chunk
                    # sent while it arrives too, once this flow lags its arrival by two
                    # blocks or more (its pace is then this flow's, not its source's).
                    if offset:
                        self.wire_bytes["sent"] += await c.link.send(wire.pack_withdraw(v, i))
                        self.chunks_restriped += 1
                        log.info("chunk_restriped", extra={"fields": {
                            "peer": c.addr, "version": v, "index": i, "sent": offset,
                            "lanes": 1 + len(c.lanes)}})
                    striped, offset = True, 0
                    continue
                if stream is not None:
                    if stream.state == "failed":
                        # the chunk did not arrive whole and verified: withdraw what we sent
                        stream.watchers.remove(c)
                        sending, stream, c.sending = None, None, None
                        self._chunk_ended(c)
                        # also before any block: a requester waits
                        gone = (wire.pack_withdraw(v, i) if seq is None
                                else stripes.pack_withdraw(seq, v, i))
                        c.out.pop(seq, None)
                        self.wire_bytes["sent"] += await c.link.send(gone)
                        self.feed(ev.ChunkSent(self.now(), c.id, v, i, withdrawn=True))
                        continue
                    # blocks as they come; the last only once the chunk is verified here
                    ready = n if stream.state == "stored" else min(stream.got, n - 1)
                    if end > ready:
                        # a large block not all here yet: the whole small blocks that are
                        # go now (a relay's pace is its source's, not its own block size's)
                        whole = offset + (ready - offset) // wire.BLOCK_BYTES * wire.BLOCK_BYTES
                        if whole <= offset:
                            c.wake.clear()
                            await c.wake.wait()
                            continue
                        end = whole
                if striped and seq is None:
                    seq = self._take_seq(c)
                    if seq is None:  # the peer has a window of chunks unfinished: wait
                        c.wake.clear()
                        await c.wake.wait()
                        continue
                    c.out[seq] = [v, i, payload, 0, 0]  # kept until PSD2: blocks may be asked again
                if offset == 0 and self.congestion_restart_s > 0:
                    paced = stream is not None and stream.got < stream.length
                    if c.restart.chunk_started(self.now(), paced=paced):
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
                offset = c.handed = end
                if offset >= n:
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("chunk_sent", extra={"fields": {
                            "peer": c.addr, "version": v, "index": i,
                            "started_at": round(time.time() - (self.now() - started), 3),
                            "s": round(self.now() - started, 3), "cut_through": stream is not None,
                            "lanes": 1 + len(c.lanes) if seq is not None else 1}})
                    if stream is not None:
                        stream.watchers.remove(c)
                    sending, stream, c.sending = None, None, None
                    self._chunk_ended(c)
                    self._note_sent(c, v, i)
                    self.feed(ev.ChunkSent(self.now(), c.id, v, i))
        except (ConnectionError, RuntimeError):
            return  # the reader notices the closed socket and reports it
        finally:
            if stream is not None and c in stream.watchers:
                stream.watchers.remove(c)

    def _block_size(self, c: Conn) -> int:
        """Bytes per block of the chunk ``c`` starts to send: ``wire.BLOCK_BYTES`` times as
        many as the link's measured rate (``node.tcp.link_rate``) moves in ``BLOCK_HOL_S``,
        at most ``max_block`` (``[network] max_block_kib``, 1 MiB) and a quarter of the
        chunk (``_chunk_block``: a 4 MiB chunk, the default, in four). A striped link, a link
        with no rate measured yet and a long-haul one (100 Mbit/s: 0.1 MB in 10 ms) keep
        ``wire.BLOCK_BYTES``; a host link at 1 Gbit/s or loopback takes 1 MiB blocks, a
        quarter of the passes through the writer and the reader per byte
        (docs/benchmarks.md, round 56)."""
        if c.lanes or c.sock is None or self.max_block <= wire.BLOCK_BYTES:
            return wire.BLOCK_BYTES
        rate = link_rate(c.sock)
        if rate is None:
            return wire.BLOCK_BYTES
        k = int(rate * BLOCK_HOL_S) // wire.BLOCK_BYTES
        return wire.BLOCK_BYTES * max(1, min(k, self.max_block // wire.BLOCK_BYTES))

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
        if region is None:
            return
        if v not in self.sent_to_region:  # a new version: drop those the core forgot
            held = self.core.manifests
            for u in [u for u in self.sent_to_region if u not in held]:
                del self.sent_to_region[u]
        self.sent_to_region.setdefault(v, {}).setdefault(region, set()).add(i)

    # --------------------------------------------------------------- chunks

    async def _on_block(self, c: Conn, data: bytes) -> None:
        """One block of a chunk: progress (liveness) for the core; the chunk once whole."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "chunk before the handshake")
            return
        try:
            whole = _hashed(c.blocks, c.blocks.feed(data))
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

    def _filled(self, c: Conn, p: Placed) -> bool:
        """A placed chunk block came in whole (``Link.place_with``): ``c.blocks`` takes it
        now, as the link parses, not when the reader gets to it, so the next block can be
        placed while this one still waits in the queue. ``p.info`` keeps what the reader
        needs (``_block_done``'s arguments), as ``c.blocks`` was after this block. A
        striped block is left to the reader (``_stripe_block``)."""
        if stripes.magic_of(p.header) == stripes.STRIPE_MAGIC:
            return False
        whole = _hashed(c.blocks, c.blocks.placed())
        b = c.blocks
        p.info = (whole, None if whole is not None else (b.pending, b.buffer, b.length, b.received))
        return True

    async def _block_done(self, c: Conn, whole: tuple | None,
                          at: tuple | None = None) -> None:
        """A block of a chunk was taken: ``whole`` once it completed the chunk, else the
        chunk in progress, ``at`` (key, buffer, length, bytes received) as of this block
        (``_filled``), or ``c.blocks`` now."""
        if not c.laning:
            self._chunks_flow(c)
        if whole is None:
            b = c.blocks
            key, buf, length, got = at if at is not None else (b.pending, b.buffer, b.length,
                                                                b.received)
            a = self.arrivals.get(key)  # type: ignore[arg-type]
            if a is None:  # its first block: a RELAY order may go on from here (cut-through)
                a = self.arrivals[key] = Arrival(c.id, buf, length,  # type: ignore[index,arg-type]
                                                 t0=self.now())
                self.feed(ev.ChunkArriving(self.now(), c.id, *key))  # type: ignore[misc]
            now = self.now()
            if a.conn == c.id and a.buf is buf:  # not its striped copy
                a.got = got
                if a.watchers:
                    a.changed()
                pace = a.pace_due(now)
                if pace is not None:
                    self.feed(ev.ChunkPace(now, c.id, *key, *pace))  # type: ignore[misc]
            if now - c.heard_at >= 0.25:  # the core needs to know the link is alive, not every block
                c.heard_at = now
                self.feed(ev.Progress(now, c.id))
            return
        if c.restriped:
            c.restriped.discard(whole[:2])  # that copy came whole after all (no PSW1 now)
        await self._on_chunk(c, whole)

    async def _on_withdraw(self, c: Conn, data: bytes) -> None:
        """The sender withdrew the chunk it was sending us while it arrived there (a
        cut-through relay, or an answer with ``serve_arriving``): it did not arrive whole
        and verified there. Drop its blocks; nobody is to blame; the core asks elsewhere."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "withdrawal before the handshake")
            return
        buf = c.blocks.buffer
        try:
            v, i = c.blocks.withdraw(data)
        except ProtocolError as exc:
            await self._drop(c, str(exc))
            return
        if (v, i) in c.restriped:
            # the sender restarted it striped (``_stripe_block``): it is still coming
            c.restriped.discard((v, i))
            log.debug("peer %s restarted chunk %d of version %d over lanes", c.addr, i, v)
            return
        log.info("peer %s withdrew chunk %d of version %d", c.addr, i, v)
        a = self.arrivals.get((v, i))
        if a is not None and a.conn == c.id and (a.buf is buf or a.state == "stored"):
            self._copy_withdrawn((v, i), a)  # that copy, not another (or served from one)
        self.feed(ev.ChunkWithdrawn(self.now(), c.id, v, i))

    def _arrival_failed(self, key: tuple[int, int], a: Arrival) -> None:
        self.arrivals.pop(key, None)
        if a.state == "stored":  # served from a verified copy (``_arrival_served``)
            return
        a.state = "failed"
        a.changed()

    def _copy_withdrawn(self, key: tuple[int, int], a: Arrival) -> None:
        """The copy ``a`` will not arrive whole (its sender withdrew it). If another copy
        of the chunk is whole and being verified (its endgame twin, cancelled at
        ``ChunkWhole``), relays cut through from ``a`` wait for that verdict: they go on
        from the verified copy (``_arrival_served``) or fail with a bad one."""
        if a.watchers and a.state == "arriving" and self.verifying.get(key):
            a.withdrawn = True
            return
        self._arrival_failed(key, a)

    async def _arrival_served(self, key: tuple[int, int], a: Arrival,
                              payload: memoryview) -> None:
        """Chunk ``key`` came whole and verified on another link while the copy ``a`` still
        arrives (an endgame twin: its sender is told to stop, and withdraws it). Relays
        cut through from ``a`` go on from the verified copy, instead of being withdrawn
        with it, if what they sent so far (``a``'s first ``got`` bytes, unverified) is
        that copy's; otherwise they are withdrawn. ``a`` stays listed under its link until
        that copy ends, so its late blocks start no new arrival."""
        n = a.got
        same = True
        if a.watchers and n:
            same = await asyncio.to_thread(lambda: a.buf[:n] == payload[:n])
        if a.state != "arriving" or self.arrivals.get(key) is not a:
            return  # that copy ended meanwhile
        if not same:
            log.warning("chunk %d of version %d: the copy arriving on another link differs "
                        "from the verified one; its relays are withdrawn", key[1], key[0])
            self._arrival_failed(key, a)
            return
        a.buf, a.got, a.state = payload, a.length, "stored"
        self._source_done(a)
        a.changed()

    def _arrivals_end(self, conn: int) -> None:
        """Link ``conn`` closed: the chunks arriving on it will not arrive."""
        for key, a in [kv for kv in self.arrivals.items() if kv[1].conn == conn]:
            self._arrival_failed(key, a)

    async def _on_chunk(self, c: Conn, data: bytes | tuple) -> None:
        """A whole chunk: a chunk message, or ``(version, index, payload)`` put together
        from blocks, with its hash as they arrived where the assembler took one
        (``_hashed``)."""
        digest = None
        if isinstance(data, tuple):
            v, i, payload = data[:3]
            if len(data) > 3:
                digest = data[3]
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
        if c.id in self.conns:  # twins of it are cancelled now, not a verification later
            self.feed(ev.ChunkWhole(self.now(), c.id, v, i))
        a = self.arrivals.get((v, i))
        other = None  # another copy still arriving (another link's, or the one restarted striped)
        if a is not None and (a.conn != c.id or a.buf is not payload):
            if a.state == "arriving":
                other = a
            elif a.conn == c.id:  # this link's copy, served from another one already
                self.arrivals.pop((v, i), None)
            a = None
        if a is not None:
            a.got = a.length  # every byte is here; the last block waits for the verdict
            self._source_done(a)
        key = (v, i)
        self.verifying[key] = self.verifying.get(key, 0) + 1
        try:
            verdict = await asyncio.to_thread(self._check_and_store, v, i, payload, digest)
        finally:
            if self.verifying[key] > 1:
                self.verifying[key] -= 1
            else:
                del self.verifying[key]
        if a is not None:
            self.arrivals.pop((v, i), None)
            a.state = "stored" if verdict is None else "failed"
            a.changed()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("chunk_received", extra={"fields": {
                    "peer": c.addr, "version": v, "index": i, "state": a.state,
                    "first_block_at": round(time.time() - (self.now() - a.t0), 3),
                    "s": round(self.now() - a.t0, 3), "relays": len(a.watchers)}})
        elif other is None and log.isEnabledFor(logging.DEBUG):
            # a chunk that came as one message (a patch's short last chunk): its time is
            # its verdict's (the timeline's view of when each node had every chunk)
            log.debug("chunk_received", extra={"fields": {
                "peer": c.addr, "version": v, "index": i,
                "state": "stored" if verdict is None else "failed",
                "first_block_at": round(time.time(), 3), "s": 0.0, "relays": 0}})
        if isinstance(verdict, str):  # local fault: the core backs off, blames nobody
            self.store_fault = f"cannot keep chunks: {verdict}"
            self.feed(ev.ChunkNotStored(self.now(), c.id, v, i, verdict[:200]))
            return
        valid = verdict is None
        if valid:
            self.store_fault = None
            if other is not None:
                await self._arrival_served((v, i), other, payload)
        elif other is not None and other.withdrawn and self.arrivals.get(key) is other:
            self._arrival_failed(key, other)  # the copy its relays waited on was bad
        if c.id in self.conns or valid:
            self.feed(ev.ChunkReceived(self.now(), c.id, v, i, valid))
        if valid:
            self._prestage_kick(v)

    def _check_and_store(self, v: int, i: int, payload: memoryview,
                         digest: bytes | None = None) -> bool | str | None:
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
            self.store.put_chunk(v, i, payload, keep=True, digest=digest)
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
