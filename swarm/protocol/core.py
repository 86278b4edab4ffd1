"""``NodeCore``: the sans-I/O swarm protocol of one node (or of the origin).

Feed it events (``swarm.protocol.events``) with ``handle`` and carry out the
actions it returns; ask ``next_wakeup`` when to send the next ``Tick``. It
never reads a clock, opens a socket or touches a chunk payload, so the real
node daemon and the simulator run exactly this code.

This module is the dispatcher: events and frames go to their handler, and
the state lives in small objects beside it:

- ``wire``: typed frames; ``handshake``: the connection state table;
- ``versions``: one ``VersionState`` per manifest, the chain to apply, the
  apply in progress (``ApplyState``);
- ``exchange``: holdings frames, chunk arrival and departure, with
  ``requests`` (outstanding requests, the pick policy: rarest first) and
  ``uploads`` (upload slots, the queue behind them, relays);
- ``haves``: HAVE batching; ``counters``: traffic tallies;
- ``membership``: the address book;
- ``roles`` / ``seeding``: what a rollout node / the origin does on top
  (border links, reports, mesh upkeep / tracker, per-region seeding plan),
  behind the narrow ``roles.Host`` interface this class implements.

Nothing a peer sends can raise out of ``handle``: a bad frame closes that peer
with a logged reason.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

from swarm.errors import ProtocolError
from swarm.protocol import events as ev
from swarm.protocol import handshake as hs
from swarm.protocol import wire
from swarm.protocol.bans import BanList
from swarm.protocol.config import CoreConfig
from swarm.protocol.counters import Counters
from swarm.protocol.exchange import ChunkExchange
from swarm.protocol.haves import HaveBatch, have_frames
from swarm.protocol.liveness import heartbeat
from swarm.protocol.membership import AddressBook
from swarm.protocol.peer import CROSS, ORIGIN, SAME, Peer
from swarm.protocol.picker import iter_bits
from swarm.protocol.readmodel import ReadModel
from swarm.protocol.requests import PickPolicy, RarestFirst
from swarm.protocol.roles import NodeRole, Role
from swarm.protocol.seeding import OriginRole
from swarm.protocol.versions import ApplyState, VersionSet, VersionState

READY = hs.READY
REDIAL_MAX_S = 60.0  # redial back-off cap (or redial_s, if larger)
MAX_DIAL_FAILURES = 4096  # addresses whose failures we remember


class NodeCore(ReadModel):
    """The protocol state machine of one node. See the module docstring."""

    #: tests set this to re-raise internal errors instead of logging them
    raise_internal_errors = False

    def __init__(self, config: CoreConfig, *, verify_manifest: Callable[[bytes], Any],
                 rng: random.Random, now: float = 0.0, policy: PickPolicy | None = None) -> None:
        self.cfg = config
        self._verify = verify_manifest
        self.rng = rng
        self.now = now
        self._out: list[ev.Action] = []
        self.peers: dict[int, Peer] = {}
        self.by_id: dict[str, int] = {}  # READY peers by node id
        self.book = AddressBook(config.max_known_peers * (8 if config.is_origin else 1), rng)
        self.counters = Counters()
        self.active_version: int | None = config.active_version
        self.served_version: int | None = None  # what our engine confirmed (EngineServed)
        self.versions = VersionSet()
        self.exchange = ChunkExchange(self, config, self.versions, policy or RarestFirst(rng))
        self.requests = self.exchange.requests
        self.uploads = self.exchange.uploads
        # chunks whose first block came and that are not stored yet: (v, i) -> conn (cut-through)
        self.arriving: dict[tuple[int, int], int] = {}
        self.arriving_at: dict[tuple[int, int], float] = {}  # ... and when its first block came
        # ... and how long it will take, first block to whole, from its own pace (ChunkPace)
        self.arriving_eta: dict[tuple[int, int], float] = {}
        self.told_coming: set[tuple[int, int]] = set()  # ... offered to the region (COMING)
        self.apply = ApplyState()
        self.haves = HaveBatch(config.have_batch_s)
        self._next_hb = now + config.heartbeat_s
        self._unseen: dict[int, tuple[float, int]] = {}  # wanted, nobody shows: (since, have then)
        # dialling
        self.dialing: dict[str, float] = {}
        self.retry_at: dict[str, float] = {}
        self._dial_failures: dict[str, int] = {}  # consecutive failed dials per address
        # the protocol versions we speak, oldest and newest (``handshake.SPEAKS``; tests
        # set another to play an older or newer release)
        self.speaks: tuple[int, int] = hs.SPEAKS
        # bans: corrupt chunks are counted per node id, so reconnecting does not reset them
        self.bans = BanList(config.ban_s)
        self.role: Role = OriginRole(self) if config.is_origin else NodeRole(self)
        self._role_timers = type(self.role).next_wakeup is not Role.next_wakeup
        self._frames: dict[type[wire.Frame], Callable[[Peer, Any], None]] = {
            wire.Ping: self._f_ping, wire.Peers: self._f_peers, wire.Announce: self._f_announce,
            **self.exchange.frame_handlers(), **self.role.frame_handlers(),
        }

    # ================================================================ public API
    def start(self, now: float) -> list[ev.Action]:
        """Dial the bootstrap addresses."""
        self.now = now
        self._next_hb = now + self.cfg.heartbeat_s
        for addr in self.cfg.bootstrap:
            self.dial(addr)
        return self._take()

    def handle(self, event: ev.Event) -> list[ev.Action]:
        """Process one event; return the actions to carry out, in order."""
        if event.now > self.now:
            self.now = event.now
        try:
            h = _HANDLERS.get(type(event))
            if h is None:
                self.log("warning", "unknown_event", type=type(event).__name__)
            else:
                h(self, event)
        except Exception as e:  # a bug must not take the node down; it is logged loudly
            if self.raise_internal_errors:
                raise
            self.log("error", "internal_error", error=f"{type(e).__name__}: {e}",
                     on=type(event).__name__)
        return self._take()

    def next_wakeup(self) -> float | None:
        t = self._next_hb
        due = self.haves.due
        if due is not None and due < t:
            t = due
        r = self.apply.retry_at
        if r is not None and r < t:
            t = r
        h = self.exchange.hold_until
        if h is not None and h < t:
            t = h
        d = self.exchange.requests.twin_due
        if d is not None and d < t:
            t = d
        if self._role_timers:
            s = self.role.next_wakeup()
            if s is not None and s < t:
                t = s
        return t

    # ---- bans
    def banned(self, node_id: str) -> bool:
        """True while ``node_id`` is banned (it sent corrupt chunks, or the origin was told so)."""
        return self.bans.banned(node_id, self.now)

    def ban(self, node_id: str, reason: str) -> None:
        """Refuse ``node_id`` for ``ban_s``: close its link, forget its address, never dial it.

        A node (not the origin) also reports the ban to the origin, which re-plans
        chunks a banned border was the region's only source of.
        """
        if not node_id or node_id == self.cfg.node_id:
            return
        first = self.bans.ban(node_id, self.now)
        self.book.remove(node_id)
        conn = self.by_id.get(node_id)
        if conn is not None:
            self.close(self.peers[conn], reason, "warning")
        if not first:
            return
        self.log("warning", "peer_banned", peer=node_id, reason=reason, seconds=self.cfg.ban_s)
        self.role.on_ban(node_id)

    # ================================================================ Host (for roles)
    def log(self, level: str, event: str, **fields: Any) -> None:
        self._out.append(ev.Log(level, event, fields))

    def send(self, p: Peer, frame: bytes) -> None:
        p.last_sent = self.now
        self._out.append(ev.SendFrame(p.conn, frame))

    def send_chunk(self, conn: int, v: int, i: int) -> None:
        """Send chunk ``i`` of ``v`` (an upload, or an origin push); one we do not hold
        yet is sent while it arrives (``serve_arriving``, see ``ev.SendChunk``)."""
        st = self.versions.states[v]
        arriving = not (st.have >> i) & 1
        if arriving:
            self.counters.served_arriving += 1
        self._out.append(ev.SendChunk(conn, v, i, st.chunk_length(i), arriving))

    def stop_chunk(self, conn: int, v: int, i: int) -> None:
        """Stop an answer under way (its requester cancelled it; see ``ev.StopChunk``)."""
        self._out.append(ev.StopChunk(conn, v, i))

    def relay_chunk(self, conn: int, v: int, i: int, arriving: bool = False) -> None:
        """Carry out a RELAY order: send chunk ``i`` of ``v`` to the border on ``conn``
        (``arriving``: while it is still arriving here, see ``ev.SendChunk``)."""
        self.uploads.relay(conn, v, i)
        self._out.append(ev.SendChunk(conn, v, i, self.versions.states[v].chunk_length(i),
                                      arriving))

    def is_arriving(self, v: int, i: int) -> bool:
        """Whether chunk ``i`` of ``v`` is arriving now (its first block came, ``ChunkArriving``)."""
        return (v, i) in self.arriving

    def arriving_since(self, v: int, i: int) -> float | None:
        """When chunk ``i`` of ``v``'s first block came, while it is arriving; else None."""
        return self.arriving_at.get((v, i)) if (v, i) in self.arriving else None

    def full_size(self, v: int, i: int) -> bool:
        """Whether chunk ``i`` of ``v`` is at least half a full chunk (not a patch's short
        last chunk): only such transfers time a path."""
        st = self.versions.get(v)
        return st is None or 2 * st.chunk_length(i) >= st.chunk_length(0)

    def arrival_pace(self, v: int, i: int) -> float | None:
        """While chunk ``i`` of ``v`` arrives: how long the last chunk of full size that
        arrived whole over the same link took, first block to stored (None: no such
        chunk yet). A version's short last chunk comes in a few milliseconds over any
        path: taken as the pace, the next version's first relay over that link waited
        ``cut_through_after_s`` for its chunk (docs/benchmarks.md round 39)."""
        conn = self.arriving.get((v, i))
        p = self.peers.get(conn) if conn is not None else None
        return p.arrival_s if p is not None else None

    def arrival_eta(self, v: int, i: int) -> float | None:
        """While chunk ``i`` of ``v`` arrives: how long it will take, first block to
        whole, projected from its own pace (``ChunkPace``); None before that is known."""
        return self.arriving_eta.get((v, i)) if (v, i) in self.arriving else None

    def close(self, p: Peer, reason: str, level: str = "info") -> None:
        self.log(level, "peer_closed", peer=p.node_id or p.addr, conn=p.conn, reason=reason)
        self._out.append(ev.Close(p.conn, reason))
        self._forget(p)

    def dial(self, addr: str) -> None:
        if addr == self.cfg.listen_addr or addr in self.dialing:
            return
        self.dialing[addr] = self.now
        self._out.append(ev.Connect(addr))

    def holding(self, v: int) -> VersionState | None:
        return self.versions.get(v)

    def ready_peers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.state is READY]

    def fill(self, p: Peer) -> None:
        """Top up our requests to ``p``."""
        self.exchange.fill(p)

    def strike(self, node_id: str) -> int:
        """One more corrupt chunk from ``node_id`` (counted across reconnects); the count."""
        return self.bans.strike(node_id, self.now)

    def _take(self) -> list[ev.Action]:
        out = self._out
        self._out = []
        return out

    # ================================================================ transport events
    def _on_connected(self, e: ev.PeerConnected) -> None:
        if e.conn in self.peers:
            self.log("warning", "duplicate_conn", conn=e.conn)
            return
        if e.outbound:
            self.dialing.pop(e.addr, None)
        p = Peer(e.conn, e.outbound, e.addr, self.now)
        p.identity = e.identity
        self.peers[e.conn] = p
        c = self.cfg
        p.hello_out = hs.hello_frame(model=c.model, node_id=c.node_id, region=c.region,
                                     addr=c.listen_addr, role=c.role,
                                     nonce=self.rng.randbytes(wire.NONCE_LEN),
                                     proto=self.speaks[1])
        self.send(p, p.hello_out)

    def _on_connect_failed(self, e: ev.ConnectFailed) -> None:
        self.log("debug", "connect_failed", addr=e.addr, reason=e.reason)
        self.dialing.pop(e.addr, None)
        self.retry_at[e.addr] = self.now + self._backoff(e.addr)

    def _backoff(self, addr: str) -> float:
        """Back-off with jitter for redialling ``addr``: ``redial_s`` doubling per
        consecutive failure up to ``REDIAL_MAX_S``, times 0.5..1.5. Bootstrap
        addresses (the origin, our tracker: a restarted trainer must be found again
        quickly) keep ``redial_s``, jittered so that a fleet does not redial in step.
        The jitter is a hash of (our id, addr, failures), not a draw from ``rng``, so a
        run's other random choices (and the simulator's reports) do not shift with it."""
        n = self._dial_failures.pop(addr, 0) + 1
        self._dial_failures[addr] = n
        if len(self._dial_failures) > MAX_DIAL_FAILURES:  # bounded: the oldest goes first
            del self._dial_failures[next(iter(self._dial_failures))]
        grow = 0 if addr in self.cfg.bootstrap else min(n - 1, 20)
        base = min(self.cfg.redial_s * 2.0**grow, max(self.cfg.redial_s, REDIAL_MAX_S))
        h = hashlib.blake2b(f"{self.cfg.node_id}|{addr}|{n}".encode(), digest_size=8).digest()
        return base * (0.5 + int.from_bytes(h, "little") / 2.0**64)

    def _on_disconnected(self, e: ev.PeerDisconnected) -> None:
        p = self.peers.get(e.conn)
        if p is not None:
            self.log("info", "peer_lost", peer=p.node_id or p.addr, reason=e.reason)
            self._forget(p)

    def _forget(self, p: Peer) -> None:
        """Drop every trace of a connection (its requests go back to the pool)."""
        if self.peers.pop(p.conn, None) is None:
            return
        if self.arriving:
            for key in [k for k, c in self.arriving.items() if c == p.conn]:
                del self.arriving[key]
                self.arriving_at.pop(key, None)
                self.arriving_eta.pop(key, None)
                self.told_coming.discard(key)
        if p.node_id and self.by_id.get(p.node_id) == p.conn:
            del self.by_id[p.node_id]
        if p.state is not READY:
            return
        relays = [(v, i) for c, v, i in self.uploads.relays if c == p.conn]
        self.exchange.forget(p)
        self.role.on_leave(p)
        if relays:
            self.role.on_relays_lost(p, relays)
        self.exchange.fill_all()

    # ================================================================ frames
    def authenticated(self, conn: int) -> bool:
        """Whether ``conn`` finished the handshake: a driver reads nothing else before."""
        p = self.peers.get(conn)
        return p is not None and p.state is READY

    def _on_arriving(self, e: ev.ChunkArriving) -> None:
        p = self.peers.get(e.conn)
        if p is None or p.state is not READY:
            return
        v, i = e.version, e.index
        st = self.versions.get(v)
        if st is None or not 0 <= i < st.chunk_count or (st.have >> i) & 1:
            return
        if (v, i) not in self.arriving:  # the first sender's blocks are the ones relayed on
            self.arriving[(v, i)] = e.conn
            self.arriving_at[(v, i)] = self.now
            self.role.on_arriving(v, i)
            c = self.cfg
            if c.serve_arriving and (c.serve_arriving_region <= 1 or
                                     self.book.region_count(c.region) + 1 >= c.serve_arriving_region):
                self._tell_arriving(e.conn, v, i)
                self.told_coming.add((v, i))
            else:
                self._endgame_coming(v)

    def _on_pace(self, e: ev.ChunkPace) -> None:
        key = (e.version, e.index)
        since = self.arriving_at.get(key)
        if self.arriving.get(key) != e.conn or since is None or e.got <= 0 or e.left < 0:
            return  # not the copy whose blocks are relayed on, or nothing to project from
        took = self.now - since
        if took <= 0.0:
            return
        self.arriving_eta[key] = took + e.left * took / e.got
        self.role.on_pace(*key)

    def _endgame_coming(self, v: int) -> None:
        """``serve_arriving_endgame``: at the end of ``v``, offer (COMING) the chunks
        arriving here from outside the region to the region's peers that lack them.

        Below ``serve_arriving_region`` a node offers nothing while it arrives: a peer
        that asks for an arriving chunk waits on it at the arrival's pace, its request to
        this node taken, while this node may come to hold other chunks it could have
        had at full speed. At the end nothing else is left: this node lacks at most
        ``serve_arriving_endgame`` chunks, each arriving here from outside the region
        or held whole by none of its region peers, and the hop after the last byte (a
        whole chunk over a region link, then the verify) is what the region waits for."""
        c = self.cfg
        if not (c.serve_arriving and c.serve_arriving_endgame > 0):
            return
        st = self.versions.get(v)
        if st is None:
            return
        missing = st.full & ~st.have
        if not missing or missing.bit_count() > c.serve_arriving_endgame:
            return
        coming: list[tuple[int, int]] = []
        for i in iter_bits(missing):
            conn = self.arriving.get((v, i))
            src = self.peers.get(conn) if conn is not None else None
            if src is not None and src.kind is not SAME:
                coming.append((conn, i))  # type: ignore[arg-type]
                continue
            bit = 1 << i
            for p in self.peers.values():
                if (p.kind is SAME and p.state is READY
                        and p.bits.get(v, 0) & ~p.coming.get(v, 0) & bit):
                    return  # a region peer holds one whole: there is something to fetch
        for conn, i in coming:
            if (v, i) not in self.told_coming:
                self.told_coming.add((v, i))
                self.counters.endgame_coming += 1
                self._tell_arriving(conn, v, i)

    def _tell_arriving(self, src: int, v: int, i: int) -> None:
        """``serve_arriving``: COMING to the region's peers that lack chunk ``i``, so
        they may ask for it while it arrives (``exchange.on_request``). Not a HAVE:
        they still count it missing here, so their HAVE reaches us if it never does."""
        bit = 1 << i
        frame = None
        for p in self.peers.values():
            if p.conn == src or p.kind is not SAME or p.state is not READY:
                continue
            pb = p.bits.get(v)
            if pb is None or pb & bit:
                continue
            if frame is None:
                frame = wire.Coming.pack(v, [i])
            self.send(p, frame)

    def _arrived(self, conn: int, v: int, i: int) -> None:
        """The chunk arriving on ``conn`` is whole, or will not come from it."""
        if self.arriving.get((v, i)) == conn:
            del self.arriving[(v, i)]
            self.arriving_at.pop((v, i), None)
            self.arriving_eta.pop((v, i), None)
            self.told_coming.discard((v, i))

    def _on_not_stored(self, e: ev.ChunkNotStored) -> None:
        self._arrived(e.conn, e.version, e.index)
        self.exchange.on_not_stored(e)

    def _on_whole(self, e: ev.ChunkWhole) -> None:
        p = self.peers.get(e.conn)
        if p is not None and p.state is READY:
            self.exchange.on_whole(p, e.version, e.index)

    def _on_withdrawn(self, e: ev.ChunkWithdrawn) -> None:
        p = self.peers.get(e.conn)
        if p is None or p.state is not READY:
            return
        self._arrived(e.conn, e.version, e.index)
        self.exchange.on_withdrawn(p, e.version, e.index)

    def _on_chunk(self, e: ev.ChunkReceived) -> None:
        p = self.peers.get(e.conn)
        key = (e.version, e.index)
        if (e.valid and p is not None and self.arriving.get(key) == e.conn
                and self.full_size(e.version, e.index)):
            p.arrival_s = self.now - self.arriving_at.get(key, self.now)
        self._arrived(e.conn, e.version, e.index)
        if p is not None and p.state is not READY:
            # Nothing but the handshake is read from an unauthenticated peer, and
            # a peer that claimed an id in its HELLO is not blamed in that id's name.
            self.close(p, "chunk before the handshake", "warning")
            return
        self.exchange.on_chunk(e)
        if e.valid and self.arriving:
            self._endgame_coming(e.version)

    def _on_frame(self, e: ev.FrameReceived) -> None:
        p = self.peers.get(e.conn)
        if p is None:
            return
        try:
            f = wire.decode(e.frame)
            p.last_heard = self.now
            if p.state is READY:
                h = self._frames.get(type(f))
                if h is None:
                    hs.expect(READY, f)  # HELLO / AUTH: out of order
                    raise ProtocolError(f"{f.NAME} is not for a {self.cfg.role}")
                h(p, f)
                return
            hs.expect(p.state, f)
            if isinstance(f, wire.Hello):
                self._on_hello(p, f, e.frame)
            else:
                assert isinstance(f, wire.Auth)
                if not hs.check_mac(self.cfg.swarm_secret, f.mac, p.hello_in, p.hello_out):
                    raise ProtocolError("bad membership proof (HMAC)")
                self._on_ready(p)
        except hs.VersionRefused as err:
            # a release too old or too new for us: nobody's fault, and redialling it
            # at once would refuse again (the back-off grows: a dial counts once ready)
            self.counters.version_refused += 1
            if p.outbound:
                self.retry_at[p.addr] = self.now + self._backoff(p.addr)
            if p.conn in self.peers:
                self.close(p, str(err), "warning")
        except ProtocolError as err:
            if p.conn in self.peers:
                self.close(p, f"protocol error: {err}", "warning")

    def _on_hello(self, p: Peer, f: wire.Hello, raw: bytes) -> None:
        p.proto = hs.check_hello(f, model=self.cfg.model, node_id=self.cfg.node_id,
                                 speaks=self.speaks)
        if p.identity is not None and (f.node_id, f.region, f.role) != p.identity:
            raise ProtocolError(f"HELLO names {f.node_id!r}/{f.region!r}/{f.role!r}, its "
                                f"certificate {p.identity[0]!r}/{p.identity[1]!r}/{p.identity[2]!r}")
        if self.banned(f.node_id):
            if p.outbound:
                self.retry_at[p.addr] = self.now + self._backoff(p.addr)
            self.close(p, "banned")
            return
        p.hello_in = raw
        p.node_id, p.region, p.listen_addr, p.role = f.node_id, f.region, f.listen_addr, f.role
        p.state = hs.AUTH_WAIT
        self.send(p, wire.Auth(hs.mac(self.cfg.swarm_secret, p.hello_out, p.hello_in)).encode())

    def _on_ready(self, p: Peer) -> None:
        c = self.cfg
        old = self.by_id.get(p.node_id)
        if old is not None:
            # Keep the connection dialled by the smaller node id; both ends agree.
            q = self.peers[old]
            dialer_q = c.node_id if q.outbound else q.node_id
            dialer_p = c.node_id if p.outbound else p.node_id
            if dialer_p < dialer_q:
                self.close(q, "duplicate connection")
            else:
                self.close(p, "duplicate connection")
                return
        p.state = READY
        self.by_id[p.node_id] = p.conn
        if p.outbound:
            self._dial_failures.pop(p.addr, None)  # a dial succeeds once the handshake does
        p.kind = ORIGIN if p.is_origin else (SAME if p.region == c.region else CROSS)
        if not self.role.admit(p):
            return
        # tell the peer what we hold: manifests first, then bitfields
        lo = self.versions.retained_from(self.active_version, c.keep_versions)
        for v in sorted(self.versions.states):
            if v >= lo:
                st = self.versions.states[v]
                self.send(p, st.announce)
                if st.have:
                    self.send(p, st.bitfield())
        self.role.on_ready(p)

    # ---- READY-state frames
    def _f_ping(self, p: Peer, f: wire.Ping) -> None:
        if p.busy:  # a peer that turned us away pings when it has a free upload slot
            p.busy = False
            self.fill(p)

    def _f_peers(self, p: Peer, f: wire.Peers) -> None:
        c = self.cfg
        for node_id, region, addr, flags in f.entries:
            if node_id == c.node_id or self.banned(node_id):
                continue
            if flags & wire.PEER_ORIGIN and not p.is_origin:
                continue  # only the origin may name itself as origin
            self.book.add(node_id, region, addr, flags)
            self.role.on_peer_heard(node_id, region, addr, flags)
        if c.origin_only:
            return
        self.role.maintain_mesh()

    def _f_announce(self, p: Peer, f: wire.Announce) -> None:
        raw = f.manifest
        v = self.versions.seen(raw)
        if v is not None:
            if v not in p.bits:
                p.bits[v] = 0
                self.catch_up(p, v)
                self.role.on_shown(p, v)
            return
        try:
            m = self._verify(raw)
        except Exception as err:
            self.log("warning", "manifest_refused", peer=p.node_id, error=str(err)[:200])
            self.close(p, "forged or invalid manifest", "warning")
            return
        if m.model != self.cfg.model:
            self.close(p, f"manifest for model {m.model!r}", "warning")
            return
        self.versions.remember(raw, m.version)
        if self.active_version is not None and m.version <= self.active_version:
            self.log("debug", "manifest_ignored", version=m.version, reason="not newer than active")
            return
        if m.version in self.versions:
            self.log("warning", "manifest_conflict", version=m.version, peer=p.node_id)
            return
        p.bits.setdefault(m.version, 0)
        self._accept(m, raw, persist=True)

    def catch_up(self, p: Peer, v: int) -> None:
        """``p`` just showed it knows version ``v``: send it our bitfield.

        HAVEs skip peers that have not shown the version yet (they could not
        use them), so what we got before that moment is told now.
        """
        st = self.versions.get(v)
        if st is not None and st.have and self.role.shares_bitfields:
            self.send(p, st.bitfield())

    # ================================================================ versions
    def _accept(self, m: Any, raw: bytes, *, persist: bool, have_all: bool = False) -> None:
        v = m.version
        st = self.versions.add(m, raw)
        if have_all:
            st.have = st.full
        if persist:
            self._out.append(ev.AcceptManifest(v, raw, m))
        self.log("info", "manifest_accepted", version=v, kind=m.kind, chunks=m.chunk_count)
        full = st.full
        bf = None
        for p in self.peers.values():
            if p.state is not READY:
                continue
            if v not in p.bits:
                self.send(p, st.announce)
            else:
                p.bits[v] &= full
            if v in p.bits or st.have:
                if bf is None:
                    bf = st.bitfield()
                self.send(p, bf)
        self._replan()

    def _replan(self) -> None:
        """Work out the chain of versions to fetch; count who holds the wanted ones."""
        self.exchange.track(self.versions.replan(self.active_version))
        self.exchange.fill_all()
        self.check_apply()

    def check_apply(self) -> None:
        v = self.apply.next(self.versions, self.active_version)
        if v is not None:
            self._out.append(ev.ApplyVersion(v))

    def _on_applied(self, e: ev.Applied) -> None:
        if e.version != self.apply.applying:
            self.log("warning", "unexpected_applied", version=e.version)
            return
        if not e.ok:
            c = self.cfg
            n = self.apply.failed(e.version, retries=c.apply_retries, now=self.now,
                                  retry_s=c.apply_retry_s)
            self.log("error", "apply_failed", version=e.version, reason=e.reason, attempt=n)
            if n >= c.apply_retries:
                self.versions.stalled.add(e.version)
                self._replan()
            return
        self.apply.applying = None
        self.active_version = e.version
        self.log("info", "version_active", version=e.version)
        self.role.on_versions_changed()
        self._forget_old(e.version)
        self._replan()

    def _forget_old(self, active: int) -> None:
        """Forget every version below what ``active`` retains (``retained_from``: the
        last ``keep_versions`` and everything from the newest anchor), as announcements to
        new peers already leave them out: its state, the peers' bits of it, the role's;
        peers that still lack some of it get an empty BITFIELD of it, so they stop asking
        us. A version the role still moves (``Role.moving``: on the origin, pushes or relay
        orders of it under way, or a linked node still taking it) stays until a later call
        (the origin's next publish or heartbeat), so no region loses a link of its chain."""
        lo = self.versions.retained_from(active, self.cfg.keep_versions)
        states = self.versions.states
        for v in [v for v in states if v < lo and not self.role.moving(v)]:
            st = states[v]
            for p in self.peers.values():
                # a peer that still lacks some of it must not keep asking us for it
                if p.state is READY and p.bits.get(v, st.full) != st.full and st.have:
                    self.send(p, wire.Bitfield(v, wire.bits_to_bytes(0, st.chunk_count)).encode())
            self.versions.drop(v)
            self.role.forget(v)
        for p in self.peers.values():  # and what peers hold of versions we do not
            for v in [v for v in p.bits if v < lo and v not in states]:
                del p.bits[v]
            for v in [v for v in p.coming if v < lo and v not in states]:
                del p.coming[v]

    def _on_publish(self, e: ev.Publish) -> None:
        try:
            m = self._verify(e.manifest)
        except Exception as err:
            self.log("error", "publish_refused", error=str(err)[:200])
            return
        if m.version in self.versions:
            return
        # the origin holds what it publishes: it is active at once, nothing to apply
        if self.active_version is None or m.version > self.active_version:
            self.active_version = m.version
        self._accept(m, e.manifest, persist=False, have_all=True)
        self.role.on_publish(m.version)
        # a long-running origin forgets what it no longer announces, so its store can be
        # collected (trainer.publisher: gc keeps only what the core still holds)
        self._forget_old(self.active_version)

    def _on_local(self, e: ev.LocalChunks) -> None:
        try:
            m = self._verify(e.manifest)
        except Exception as err:
            self.log("error", "local_manifest_refused", error=str(err)[:200])
            return
        if m.model != self.cfg.model:
            self.log("error", "local_manifest_refused", error=f"model {m.model!r}")
            return
        v = m.version
        if self.active_version is not None and v < self.active_version - self.cfg.keep_versions + 1:
            return
        if v not in self.versions:
            self._accept(m, e.manifest, persist=False)
        st = self.versions.states[v]
        bits = 0
        for i in e.have:
            if 0 <= i < m.chunk_count:
                bits |= 1 << i
        gained = bits & ~st.have
        st.have |= bits
        st.inflight &= ~bits
        if gained:
            for p in self.peers.values():
                if p.state is READY and v in p.bits:
                    self.send(p, st.bitfield())
        self._replan()
        if st.complete:
            self.role.on_local_complete(v)

    # ================================================================ chunk exchange
    def queue_have(self, v: int, i: int) -> None:
        if self.haves.add(v, i, self.now):
            self._flush_haves()

    def _flush_haves(self) -> None:
        border = self.role.is_border
        for v, idx in self.haves.take(self.now).items():
            if v in self.versions:
                for p, frame in have_frames(v, idx, self.peers.values(), to_origin=border):
                    self.send(p, frame)

    def _on_progress(self, e: ev.Progress) -> None:
        p = self.peers.get(e.conn)
        if p is not None and p.state is READY:
            p.last_heard = self.now

    def _on_acked(self, e: ev.Acked) -> None:
        p = self.peers.get(e.conn)
        if p is not None and p.state is READY:
            self.role.on_acked(e.conn)

    def _on_path_sample(self, e: ev.PathSample) -> None:
        p = self.peers.get(e.conn)
        if p is not None and p.state is READY:
            self.role.on_path_sample(e.conn, e.queued, e.rtt, e.ramping)

    def _on_engine_served(self, e: ev.EngineServed) -> None:
        if e.version != self.served_version:
            self.served_version = e.version
            self.role.on_versions_changed()

    def check_available(self) -> None:
        """Availability fallback (at each heartbeat): a wanted version of which no linked
        peer holds a chunk we miss, and of which nothing arrived, for ``unavailable_s``
        is skipped, so the chain goes through an anchor instead of stalling; it is
        taken back when a peer shows it again (``_f_announce``, ``_holdings``)."""
        if self.cfg.is_origin:
            return
        now = self.now
        # peers we may ask: the origin and other regions' borders push or relay, and
        # what they hold is no source for a request
        ready = [p for p in self.peers.values() if p.state is READY and p.can_req]
        changed = False
        for v in self.versions.wanted:
            st = self.versions.states[v]
            missing = st.full & ~st.have
            if any(p.bits.get(v, 0) & missing for p in ready):
                self._unseen.pop(v, None)
                continue
            since, had = self._unseen.get(v, (now, st.have))
            if had != st.have:  # chunks still arrive (pushed or relayed)
                since, had = now, st.have
            self._unseen[v] = (since, had)
            if now - since >= self.cfg.unavailable_s:
                self.versions.unavailable.add(v)
                del self._unseen[v]
                self.log("warning", "version_unavailable", version=v, seconds=round(now - since, 1))
                changed = True
        if changed:
            self._replan()

    def shown(self, v: int) -> None:
        """A peer showed chunks of ``v``: if we had given up on it, take it back."""
        if v in self.versions.unavailable:
            self.versions.unavailable.discard(v)
            self._replan()

    # ================================================================ timers
    def _on_tick(self, e: ev.Tick) -> None:
        now = self.now
        if self.haves.due is not None and now >= self.haves.due:
            self._flush_haves()
        if self.apply.retry_at is not None and now >= self.apply.retry_at:
            self.apply.retry_at = None
            self.check_apply()
        if self.exchange.hold_until is not None and now >= self.exchange.hold_until:
            self.exchange.hold_until = None
            self.exchange.fill_all()
        rq = self.exchange.requests
        if rq.twin_due is not None and now >= rq.twin_due:
            rq.twin_due = None  # set again by the twins still held back
            self.exchange.fill_all()
        self.role.tick()
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.heartbeat_s
            heartbeat(self)
            self.check_available()
            if self.cfg.is_origin and self.active_version is not None:
                self._forget_old(self.active_version)  # versions whose pushes were under way

_HANDLERS: dict[type, Callable[[NodeCore, Any], None]] = {
    ev.Tick: NodeCore._on_tick,
    ev.PeerConnected: NodeCore._on_connected,
    ev.ConnectFailed: NodeCore._on_connect_failed,
    ev.PeerDisconnected: NodeCore._on_disconnected,
    ev.FrameReceived: NodeCore._on_frame,
    ev.ChunkReceived: NodeCore._on_chunk,
    ev.ChunkNotStored: NodeCore._on_not_stored,
    ev.ChunkArriving: NodeCore._on_arriving,
    ev.ChunkPace: NodeCore._on_pace,
    ev.ChunkWithdrawn: NodeCore._on_withdrawn,
    ev.ChunkWhole: NodeCore._on_whole,
    ev.ChunkSent: lambda core, e: core.exchange.on_sent(e),
    ev.Publish: NodeCore._on_publish,
    ev.LocalChunks: NodeCore._on_local,
    ev.Applied: NodeCore._on_applied,
    ev.EngineServed: NodeCore._on_engine_served,
    ev.Progress: NodeCore._on_progress,
    ev.Acked: NodeCore._on_acked,
    ev.PathSample: NodeCore._on_path_sample,
}
