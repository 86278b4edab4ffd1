"""``NodeCore``: the sans-I/O swarm protocol of one node (or of the origin).

Feed it events (``swarm.protocol.events``) with ``handle`` and carry out the
actions it returns; ask ``next_wakeup`` when to send the next ``Tick``. It
never reads a clock, opens a socket or touches a chunk payload, so the real
node daemon and the simulator run exactly this code.

Layout: ``wire`` encodes and checks frames, ``handshake`` proves membership,
``membership`` is the address book, ``picker`` chooses chunks, ``seeding``
is the origin's per-region plan. This module routes events between them and
keeps the per-version state (manifests, held chunks, requests, uploads).
Nothing a peer sends can raise out of ``handle``: a bad frame closes that peer
with a logged reason.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

from swarm.errors import ProtocolError
from swarm.protocol import events as ev
from swarm.protocol import handshake as hs
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.membership import AddressBook
from swarm.protocol.peer import CROSS, KINDS, ORIGIN, SAME, Peer
from swarm.protocol.picker import iter_bits, pick_some, popcount
from swarm.protocol.seeding import Seeder


class Counters:
    """Chunk traffic of this node, split by the kind of peer on the other end."""

    __slots__ = ("bad_chunks", "dup_chunks", "recv_bytes", "recv_chunks", "region_recv",
                 "region_sent", "sent_bytes", "sent_chunks")

    def __init__(self) -> None:
        self.sent_bytes = dict.fromkeys(KINDS, 0)
        self.recv_bytes = dict.fromkeys(KINDS, 0)
        self.sent_chunks = dict.fromkeys(KINDS, 0)
        self.recv_chunks = dict.fromkeys(KINDS, 0)
        self.region_sent: dict[tuple[str, str], int] = {}  # (src, dst region) -> bytes we sent
        self.region_recv: dict[tuple[str, str], int] = {}  # (src, dst region) -> bytes we received
        self.dup_chunks = 0
        self.bad_chunks = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent_bytes": dict(self.sent_bytes), "recv_bytes": dict(self.recv_bytes),
            "sent_chunks": dict(self.sent_chunks), "recv_chunks": dict(self.recv_chunks),
            "region_sent": {f"{a}->{b}": n for (a, b), n in self.region_sent.items()},
            "region_recv": {f"{a}->{b}": n for (a, b), n in self.region_recv.items()},
            "dup_chunks": self.dup_chunks, "bad_chunks": self.bad_chunks,
        }


class NodeCore:
    """The protocol state machine of one node. See the module docstring."""

    #: tests set this to re-raise internal errors instead of logging them
    raise_internal_errors = False

    def __init__(self, config: CoreConfig, *, verify_manifest: Callable[[bytes], Any],
                 rng: random.Random, now: float = 0.0) -> None:
        self.cfg = config
        self._verify = verify_manifest
        self.rng = rng
        self.now = now
        self._out: list[ev.Action] = []
        self.peers: dict[int, Peer] = {}
        self.by_id: dict[str, int] = {}  # READY peers by node id
        self.book = AddressBook(config.max_known_peers * (8 if config.is_origin else 1), rng)
        self.counters = Counters()
        # versions
        self.active_version: int | None = config.active_version
        self.manifests: dict[int, Any] = {}
        self.raw: dict[int, bytes] = {}
        self._seen_raw: dict[bytes, int] = {}
        self._ann: dict[int, bytes] = {}
        self._have: dict[int, int] = {}
        self._full: dict[int, int] = {}
        self._inflight: dict[int, int] = {}
        self._dups: dict[int, int] = {}  # endgame: chunks requested twice
        self._avail: dict[int, list[int]] = {}
        self._reqs: dict[tuple[int, int], list[int]] = {}  # (v, i) -> conns asked
        self.n_req = 0
        self.budget = config.max_requests  # outstanding requests allowed (all peers)
        self.wanted: list[int] = []
        self._stalled: set[int] = set()
        self._stall_since: dict[int, float] = {}
        self.applying: int | None = None
        self._apply_tries: dict[int, int] = {}
        self._apply_retry_at: float | None = None
        # uploads
        self._uploads: set[tuple[int, int, int]] = set()  # (conn, v, i) being sent
        self._queue: deque[tuple[int, int, int]] = deque()
        self._relays: set[tuple[int, int, int]] = set()
        self._refused: dict[int, None] = {}  # conns we turned away for want of a slot, oldest first
        # batching and timers
        self._pending_have: dict[int, list[int]] = {}
        self._have_due: float | None = None
        self._have_next = float("-inf")  # HAVEs may go out at once from then on
        self._next_hb = now + config.heartbeat_s
        # membership
        self._dialing: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}
        self._origin_addrs: set[str] = set()
        self.is_border = False
        self._links_sent: frozenset[str] = frozenset()
        self._kind_origin = config.is_origin
        # bans: corrupt chunks are counted per node id, so reconnecting does not reset them
        self._bad_by_id: dict[str, int] = {}
        self._banned: dict[str, float] = {}  # node id -> banned until
        self._reports: list[str] = []  # bans not yet reported to the origin
        self._want_origin = False  # lost a kept origin link: redial the bootstrap list
        self._origin_dial_at = float("-inf")
        self.seeder = Seeder(self) if config.is_origin else None

    # ================================================================ public API
    def start(self, now: float) -> list[ev.Action]:
        """Dial the bootstrap addresses."""
        self.now = now
        self._next_hb = now + self.cfg.heartbeat_s
        for addr in self.cfg.bootstrap:
            self._dial(addr)
        return self._take()

    def handle(self, event: ev.Event) -> list[ev.Action]:
        """Process one event; return the actions to carry out, in order."""
        if event.now > self.now:
            self.now = event.now
        try:
            h = _HANDLERS.get(type(event))
            if h is None:
                self._log("warning", "unknown_event", type=type(event).__name__)
            else:
                h(self, event)
        except Exception as e:  # a bug must not take the node down; it is logged loudly
            if self.raise_internal_errors:
                raise
            self._log("error", "internal_error", error=f"{type(e).__name__}: {e}",
                      event=type(event).__name__)
        return self._take()

    def next_wakeup(self) -> float | None:
        t = self._next_hb
        if self._have_due is not None and self._have_due < t:
            t = self._have_due
        if self._apply_retry_at is not None and self._apply_retry_at < t:
            t = self._apply_retry_at
        if self.seeder is not None:
            s = self.seeder.next_wakeup()
            if s is not None and s < t:
                t = s
        return t

    # ---- read-only views for drivers, status pages and the simulator
    @property
    def uploading(self) -> int:
        return len(self._uploads)

    @property
    def staged_versions(self) -> list[int]:
        """Versions newer than the active one that we know of (being fetched or complete)."""
        a = -1 if self.active_version is None else self.active_version
        return sorted(v for v in self.manifests if v > a)

    def have(self, version: int) -> set[int]:
        return set(iter_bits(self._have.get(version, 0)))

    def banned(self, node_id: str) -> bool:
        """True while ``node_id`` is banned (it sent corrupt chunks, or the origin was told so)."""
        until = self._banned.get(node_id)
        if until is None:
            return False
        if until <= self.now:
            del self._banned[node_id]
            self._bad_by_id.pop(node_id, None)
            return False
        return True

    def ban(self, node_id: str, reason: str) -> None:
        """Refuse ``node_id`` for ``ban_s``: close its link, forget its address, never dial it.

        A node (not the origin) also reports the ban to the origin, which re-plans
        chunks a banned border was the region's only source of.
        """
        if not node_id or node_id == self.cfg.node_id:
            return
        first = not self.banned(node_id)
        self._banned[node_id] = self.now + self.cfg.ban_s
        self.book.remove(node_id)
        conn = self.by_id.get(node_id)
        if conn is not None:
            self._close(self.peers[conn], reason, "warning")
        if not first:
            return
        self._log("warning", "peer_banned", peer=node_id, reason=reason, seconds=self.cfg.ban_s)
        if self.cfg.is_origin:
            if self.seeder is not None:
                self.seeder.schedule()
            return
        if node_id not in self._reports:
            self._reports.append(node_id)
        self._flush_reports()

    def _flush_reports(self) -> None:
        """Send pending bans to the origin; with no origin link, dial the bootstrap list."""
        if not self._reports:
            return
        for p in self.peers.values():
            if p.state == hs.READY and p.is_origin:
                for node_id in self._reports:
                    self._send(p, wire.encode(wire.REPORT, node_id))
                self._reports.clear()
                return
        self._dial_origin()

    def _dial_origin(self) -> None:
        """Dial the bootstrap list (the origin is the tracker), at most once per ``redial_s``."""
        if self.now - self._origin_dial_at < self.cfg.redial_s:
            return
        if any(a in self._dialing for a in self.cfg.bootstrap):
            return
        self._origin_dial_at = self.now
        for addr in self.cfg.bootstrap:
            if self._retry_at.get(addr, 0.0) <= self.now:
                self._dial(addr)

    def complete(self, version: int) -> bool:
        return version in self._full and self._have[version] == self._full[version]

    def peer_list(self) -> list[dict[str, Any]]:
        return [
            {"id": p.node_id, "region": p.region, "addr": p.listen_addr, "role": p.role,
             "kind": p.kind, "border": p.border}
            for p in self.peers.values() if p.state == hs.READY
        ]

    def status(self) -> dict[str, Any]:
        return {
            "node_id": self.cfg.node_id, "region": self.cfg.region, "role": self.cfg.role,
            "active_version": self.active_version, "staged_versions": self.staged_versions,
            "applying": self.applying, "border": self.is_border, "peers": self.peer_list(),
            "counters": self.counters.as_dict(),
        }

    # ================================================================ plumbing
    def _take(self) -> list[ev.Action]:
        out = self._out
        self._out = []
        return out

    def _log(self, level: str, event: str, **fields: Any) -> None:
        self._out.append(ev.Log(level, event, fields))

    def _send(self, p: Peer, frame: bytes) -> None:
        p.last_sent = self.now
        self._out.append(ev.SendFrame(p.conn, frame))

    def _close(self, p: Peer, reason: str, level: str = "info") -> None:
        self._log(level, "peer_closed", peer=p.node_id or p.addr, conn=p.conn, reason=reason)
        self._out.append(ev.Close(p.conn, reason))
        self._forget(p)

    def _dial(self, addr: str) -> None:
        if addr == self.cfg.listen_addr or addr in self._dialing:
            return
        self._dialing[addr] = self.now
        self._out.append(ev.Connect(addr))

    def _ready_peers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.state == hs.READY]

    # ================================================================ transport events
    def _on_connected(self, e: ev.PeerConnected) -> None:
        if e.conn in self.peers:
            self._log("warning", "duplicate_conn", conn=e.conn)
            return
        if e.outbound:
            self._dialing.pop(e.addr, None)
        p = Peer(e.conn, e.outbound, e.addr, self.now)
        self.peers[e.conn] = p
        c = self.cfg
        p.hello_out = hs.hello_frame(model=c.model, node_id=c.node_id, region=c.region,
                                     addr=c.listen_addr, role=c.role,
                                     nonce=self.rng.randbytes(wire.NONCE_LEN))
        self._send(p, p.hello_out)

    def _on_connect_failed(self, e: ev.ConnectFailed) -> None:
        self._log("debug", "connect_failed", addr=e.addr, reason=e.reason)
        self._dialing.pop(e.addr, None)
        self._retry_at[e.addr] = self.now + self.cfg.redial_s

    def _on_disconnected(self, e: ev.PeerDisconnected) -> None:
        p = self.peers.get(e.conn)
        if p is not None:
            self._log("info", "peer_lost", peer=p.node_id or p.addr, reason=e.reason)
            self._forget(p)

    def _forget(self, p: Peer) -> None:
        """Drop every trace of a connection (its requests go back to the pool)."""
        if self.peers.pop(p.conn, None) is None:
            return
        if p.node_id and self.by_id.get(p.node_id) == p.conn:
            del self.by_id[p.node_id]
        if p.state != hs.READY:
            return
        if p.can_req:
            for v, av in self._avail.items():
                for i in iter_bits(p.bits.get(v, 0) & self._full[v]):
                    av[i] -= 1
        for key in list(p.req):
            self._unrequest(p, key)
        if self._relays:
            self._relays = {r for r in self._relays if r[0] != p.conn}
        if self._uploads:
            self._uploads = {u for u in self._uploads if u[0] != p.conn}
            self._pump_uploads()
        if self.seeder is not None:
            self.seeder.on_leave(p)
        if p.is_origin and p.kept and not self.cfg.is_origin:
            # the origin went away (restart, one-shot publish, network): come back to it
            self._want_origin = True
        if p.is_origin and self.is_border:
            self.is_border = False
            self._links_sent = frozenset()
        if self.is_border and p.border:
            self._send_links()
        self._fill_all()

    # ================================================================ frames
    def _on_frame(self, e: ev.FrameReceived) -> None:
        p = self.peers.get(e.conn)
        if p is None:
            return
        try:
            f = wire.decode(e.frame)
            p.last_heard = self.now
            t = f[0]
            if p.state == hs.READY:
                h = _FRAME_HANDLERS.get(t)
                if h is None:
                    raise ProtocolError(f"{wire.NAMES[t]} after the handshake")
                h(self, p, f)
            elif p.state == hs.HELLO_WAIT:
                if t != wire.HELLO:
                    raise ProtocolError(f"{wire.NAMES[t]} before HELLO")
                self._on_hello(p, f, e.frame)
            else:
                if t != wire.AUTH:
                    raise ProtocolError(f"{wire.NAMES[t]} before AUTH")
                if not hs.check_mac(self.cfg.swarm_secret, f[1], p.hello_in, p.hello_out):
                    raise ProtocolError("bad membership proof (HMAC)")
                self._on_ready(p)
        except ProtocolError as err:
            if p.conn in self.peers:
                self._close(p, f"protocol error: {err}", "warning")

    def _on_hello(self, p: Peer, f: list, raw: bytes) -> None:
        hs.check_hello(f, model=self.cfg.model, node_id=self.cfg.node_id)
        if self.banned(f[3]):
            if p.outbound:
                self._retry_at[p.addr] = self.now + self.cfg.redial_s
            self._close(p, "banned")
            return
        p.hello_in = raw
        p.node_id, p.region, p.listen_addr, p.role = f[3], f[4], f[5], f[6]
        p.state = hs.AUTH_WAIT
        self._send(p, wire.encode(wire.AUTH, hs.mac(self.cfg.swarm_secret, p.hello_out, p.hello_in)))

    def _on_ready(self, p: Peer) -> None:
        c = self.cfg
        old = self.by_id.get(p.node_id)
        if old is not None:
            # Keep the connection dialled by the smaller node id; both ends agree.
            q = self.peers[old]
            dialer_q = c.node_id if q.outbound else q.node_id
            dialer_p = c.node_id if p.outbound else p.node_id
            if dialer_p < dialer_q:
                self._close(q, "duplicate connection")
            else:
                self._close(p, "duplicate connection")
                return
        p.state = hs.READY
        self.by_id[p.node_id] = p.conn
        if p.is_origin:
            p.kind = ORIGIN
            self._origin_addrs.add(p.listen_addr)
            self._want_origin = False
        elif self.cfg.is_origin:
            p.kind = CROSS if p.region != c.region else SAME
        else:
            p.kind = SAME if p.region == c.region else CROSS
        if c.origin_only and not c.is_origin and not p.is_origin:
            self._close(p, "origin-only mode: no node peers")
            return
        if not c.is_origin:
            if c.region_aware and p.kind == CROSS:
                p.border = True  # only borders link across regions
            p.can_req = (p.kind == SAME) if c.region_aware else not c.origin_only
            if p.is_origin:
                p.can_req = not c.region_aware and not c.origin_only
            self.book.add(p.node_id, p.region, p.listen_addr, wire.PEER_ORIGIN if p.is_origin else 0)
        # tell the peer what we hold: manifests first, then bitfields
        lo = -1 if self.active_version is None else self.active_version - c.keep_versions + 1
        for v in sorted(self.raw):
            if v >= lo:
                self._send(p, self._ann[v])
                if self._have.get(v):
                    self._send(p, self._bitfield(v))
        if self.seeder is not None:
            self.seeder.on_ready(p)
            return
        if p.is_origin:
            self._flush_reports()
        if not p.is_origin and (p.kind == SAME or not c.region_aware):
            region = c.region if c.region_aware else None
            sample = [x for x in self.book.sample(region, c.tracker_sample) if x[0] != p.node_id]
            if sample:
                self._send(p, wire.encode(wire.PEERS, [list(x) for x in sample]))
        if self.is_border and p.border:
            self._send_links()
        self._fill(p)

    def _bitfield(self, v: int) -> bytes:
        return wire.encode(wire.BITFIELD, v, wire.bits_to_bytes(self._have.get(v, 0), self.manifests[v].chunk_count))

    # ---- READY-state frames
    def _f_ping(self, p: Peer, f: list) -> None:
        if p.busy:  # a peer that turned us away pings when it has a free upload slot
            p.busy = False
            self._fill(p)

    def _f_peers(self, p: Peer, f: list) -> None:
        c = self.cfg
        for node_id, region, addr, flags in f[1]:
            if node_id == c.node_id or self.banned(node_id):
                continue
            if flags & wire.PEER_ORIGIN and not p.is_origin:
                continue  # only the origin may name itself as origin
            self.book.add(node_id, region, addr, flags)
            if (flags & wire.PEER_BORDER and self.is_border and c.relay and region != c.region
                    and c.node_id < node_id and node_id not in self.by_id):
                self._dial(addr)
        if c.origin_only:
            return
        self._maintain_mesh()

    def _f_role(self, p: Peer, f: list) -> None:
        if not p.is_origin:
            raise ProtocolError("ROLE from a peer that is not the origin")
        p.kept = bool(f[1] & wire.ROLE_KEEP)
        if not p.kept:
            self._close(p, "origin: tracker only")
            self._maintain_mesh()
            return
        if self.cfg.region_aware and not self.cfg.origin_only:
            self.is_border = True
            self._log("info", "border_granted")
            self._send_links()

    def _f_announce(self, p: Peer, f: list) -> None:
        raw = f[1]
        v = self._seen_raw.get(raw)
        if v is not None:
            if v not in p.bits:
                p.bits[v] = 0
                self._catch_up(p, v)
            return
        try:
            m = self._verify(raw)
        except Exception as err:
            self._log("warning", "manifest_refused", peer=p.node_id, error=str(err)[:200])
            self._close(p, "forged or invalid manifest", "warning")
            return
        if m.model != self.cfg.model:
            self._close(p, f"manifest for model {m.model!r}", "warning")
            return
        if len(self._seen_raw) > 4 * (len(self.manifests) + 16):
            self._seen_raw.clear()
        self._seen_raw[raw] = m.version
        if self.active_version is not None and m.version <= self.active_version:
            self._log("debug", "manifest_ignored", version=m.version, reason="not newer than active")
            return
        if m.version in self.manifests:
            self._log("warning", "manifest_conflict", version=m.version, peer=p.node_id)
            return
        p.bits.setdefault(m.version, 0)
        self._accept(m, raw, persist=True)

    def _catch_up(self, p: Peer, v: int) -> None:
        """``p`` just showed it knows version ``v``: send it our bitfield.

        HAVEs skip peers that have not shown the version yet (they could not
        use them), so what we got before that moment is told now.
        """
        if self._have.get(v) and v in self.manifests and self.seeder is None:
            self._send(p, self._bitfield(v))

    def _f_bitfield(self, p: Peer, f: list) -> None:
        v = f[1]
        new = wire.bits_from_bytes(f[2])
        full = self._full.get(v)
        if full is not None:
            new &= full
        elif len(p.bits) > 32 and v not in p.bits:
            return  # bound what an unknown-version flood can make us hold
        old = p.bits.get(v)
        if old is None:
            old = 0
            self._catch_up(p, v)
        p.bits[v] = old | new
        p.busy = False
        if self.seeder is not None:
            self.seeder.on_have(p, v, new & ~old)
            return
        av = self._avail.get(v)
        if av is not None and p.can_req:
            for i in iter_bits(new & ~old):
                av[i] += 1
            self._fill(p)

    def _f_have(self, p: Peer, f: list) -> None:
        v = f[1]
        full = self._full.get(v)
        add = 0
        for i in f[2]:
            add |= 1 << i
        if full is not None:
            add &= full
        elif len(p.bits) > 32 and v not in p.bits:
            return
        old = p.bits.get(v)
        if old is None:
            old = 0
            self._catch_up(p, v)
        gained = add & ~old
        p.bits[v] = old | add
        p.busy = False
        if self.seeder is not None:
            self.seeder.on_have(p, v, gained)
            return
        av = self._avail.get(v)
        if av is not None and p.can_req and gained:
            for i in iter_bits(gained):
                av[i] += 1
            self._fill(p)

    def _f_request(self, p: Peer, f: list) -> None:
        v, idx = f[1], f[2]
        c = self.cfg
        have = self._have.get(v, 0)
        allowed = not (c.region_aware and p.kind != SAME) or (c.is_origin and not c.region_aware)
        if c.is_origin and (c.region_aware or c.origin_only):
            allowed = False  # the origin pushes; it does not serve requests in these modes
        rejected = []
        m = self.manifests.get(v)
        for i in idx:
            if not allowed or m is None or not (have >> i) & 1:
                rejected.append(i)
            elif len(self._uploads) < c.upload_slots:
                self._uploads.add((p.conn, v, i))
                self._out.append(ev.SendChunk(p.conn, v, i, m.chunk_length(i)))
            elif len(self._queue) < c.upload_queue:
                self._queue.append((p.conn, v, i))
            else:
                rejected.append(i)
                if len(self._refused) < 64:
                    self._refused[p.conn] = None
        if rejected:
            self._send(p, wire.encode(wire.REJECT, v, rejected))

    def _f_cancel(self, p: Peer, f: list) -> None:
        drop = {(p.conn, f[1], i) for i in f[2]}
        if self._queue:
            self._queue = deque(q for q in self._queue if q not in drop)

    def _f_reject(self, p: Peer, f: list) -> None:
        v = f[1]
        for i in f[2]:
            self._unrequest(p, (v, i))
        p.busy = True
        self._fill_all(skip=p)

    def _f_relay(self, p: Peer, f: list) -> None:
        if not p.is_origin:
            raise ProtocolError("RELAY from a peer that is not the origin")
        v, i, target = f[1], f[2], f[3]
        tc = self.by_id.get(target)
        m = self.manifests.get(v)
        if tc is None or m is None or i >= m.chunk_count or not (self._have.get(v, 0) >> i) & 1:
            self._send(p, wire.encode(wire.RELAY_FAIL, v, i, target))
            return
        self._relays.add((tc, v, i))
        self._out.append(ev.SendChunk(tc, v, i, m.chunk_length(i)))

    def _f_origin_only(self, p: Peer, f: list) -> None:
        if self.seeder is None:
            raise ProtocolError(f"{wire.NAMES[f[0]]} sent to a node that is not the origin")
        if f[0] == wire.RELAY_FAIL:
            self.seeder.on_relay_fail(p, f[1], f[2], f[3])
        else:
            self.seeder.on_links(p, f[1])

    def _f_report(self, p: Peer, f: list) -> None:
        """Node -> origin: it banned ``f[1]`` for corrupt chunks."""
        if self.seeder is None:
            raise ProtocolError("REPORT sent to a node that is not the origin")
        self.seeder.on_report(p, f[1])

    def _send_links(self) -> None:
        """Border -> origin: the cross-region borders we are linked to (relay targets)."""
        links = frozenset(p.node_id for p in self.peers.values()
                          if p.state == hs.READY and p.border and not p.is_origin)
        if links == self._links_sent:
            return
        self._links_sent = links
        for p in self.peers.values():
            if p.state == hs.READY and p.is_origin:
                self._send(p, wire.encode(wire.LINKS, sorted(links)[: wire.MAX_PEERS]))

    # ================================================================ versions
    def _accept(self, m: Any, raw: bytes, *, persist: bool, have_all: bool = False) -> None:
        v = m.version
        self.manifests[v] = m
        self.raw[v] = raw
        self._seen_raw[raw] = v
        n = m.chunk_count
        self._full[v] = (1 << n) - 1
        self._have.setdefault(v, 0)
        if have_all:
            self._have[v] = self._full[v]
        self._inflight.setdefault(v, 0)
        self._ann[v] = wire.encode(wire.ANNOUNCE, raw)
        if persist:
            self._out.append(ev.AcceptManifest(v, raw))
        self._log("info", "manifest_accepted", version=v, kind=m.kind, chunks=n)
        full = self._full[v]
        bf = None
        for p in self.peers.values():
            if p.state != hs.READY:
                continue
            if v not in p.bits:
                self._send(p, self._ann[v])
            else:
                p.bits[v] &= full
            if v in p.bits or self._have[v]:
                if bf is None:
                    bf = self._bitfield(v)
                self._send(p, bf)
        self._replan()

    def _replan(self) -> None:
        """Work out the chain of versions to fetch, oldest first."""
        by_parent: dict[int, int] = {}
        fulls = []
        for v, m in self.manifests.items():
            if v in self._stalled:
                continue
            if m.kind == "full":
                fulls.append(v)
            elif m.parent_version is not None and m.parent_version < v:
                cur = by_parent.get(m.parent_version)
                if cur is None or v < cur:
                    by_parent[m.parent_version] = v
        chain: list[int] = []
        cur = self.active_version
        for _ in range(len(self.manifests) + 1):
            nxt = by_parent.get(cur) if cur is not None else None
            if nxt is None:
                later = [v for v in fulls if cur is None or v > cur]
                if not later:
                    break
                nxt = max(later)
            chain.append(nxt)
            cur = nxt
        self.chain = chain
        wanted = [v for v in chain if self._have[v] != self._full[v]]
        for v in wanted:
            if v not in self._avail:
                av = [0] * self.manifests[v].chunk_count
                for p in self.peers.values():
                    if p.state == hs.READY and p.can_req:
                        for i in iter_bits(p.bits.get(v, 0) & self._full[v]):
                            av[i] += 1
                self._avail[v] = av
        for v in list(self._avail):
            if v not in wanted:
                del self._avail[v]
        self.wanted = wanted
        self._fill_all()
        self._check_apply()

    def _check_apply(self) -> None:
        if self.applying is not None or self._apply_retry_at is not None:
            return
        chain = getattr(self, "chain", [])
        if not chain:
            return
        v = chain[0]
        m = self.manifests[v]
        if self._have[v] != self._full[v]:
            return
        if m.kind == "patch" and m.parent_version != self.active_version:
            return
        self.applying = v
        self._out.append(ev.ApplyVersion(v))

    def _on_applied(self, e: ev.Applied) -> None:
        if e.version != self.applying:
            self._log("warning", "unexpected_applied", version=e.version)
            return
        self.applying = None
        if not e.ok:
            n = self._apply_tries.get(e.version, 0) + 1
            self._apply_tries[e.version] = n
            self._log("error", "apply_failed", version=e.version, reason=e.reason, attempt=n)
            if n < self.cfg.apply_retries:
                self._apply_retry_at = self.now + self.cfg.apply_retry_s
            else:
                self._stalled.add(e.version)
                self._replan()
            return
        self.active_version = e.version
        self._log("info", "version_active", version=e.version)
        lo = e.version - self.cfg.keep_versions + 1
        for v in [v for v in self.manifests if v < lo]:
            self._drop_version(v)
        self._replan()

    def _drop_version(self, v: int) -> None:
        for d in (self.manifests, self.raw, self._ann, self._have, self._full, self._inflight,
                  self._dups, self._avail, self._pending_have):
            d.pop(v, None)
        for p in self.peers.values():
            p.bits.pop(v, None)

    def _on_publish(self, e: ev.Publish) -> None:
        try:
            m = self._verify(e.manifest)
        except Exception as err:
            self._log("error", "publish_refused", error=str(err)[:200])
            return
        if m.version in self.manifests:
            return
        # the origin holds what it publishes: it is active at once, nothing to apply
        if self.active_version is None or m.version > self.active_version:
            self.active_version = m.version
        self._accept(m, e.manifest, persist=False, have_all=True)
        if self.seeder is not None:
            self.seeder.on_publish(m.version)

    def _on_local(self, e: ev.LocalChunks) -> None:
        try:
            m = self._verify(e.manifest)
        except Exception as err:
            self._log("error", "local_manifest_refused", error=str(err)[:200])
            return
        if m.model != self.cfg.model:
            self._log("error", "local_manifest_refused", error=f"model {m.model!r}")
            return
        v = m.version
        if self.active_version is not None and v < self.active_version - self.cfg.keep_versions + 1:
            return
        if v not in self.manifests:
            self._accept(m, e.manifest, persist=False)
        bits = 0
        for i in e.have:
            if 0 <= i < m.chunk_count:
                bits |= 1 << i
        gained = bits & ~self._have[v]
        self._have[v] |= bits
        self._inflight[v] &= ~bits
        if gained:
            for p in self.peers.values():
                if p.state == hs.READY and v in p.bits:
                    self._send(p, self._bitfield(v))
        self._replan()
        if self.seeder is not None and self.complete(v) and v not in self.seeder.plans:
            # a restarted origin keeps seeding what it published before (one-shot publish)
            self.seeder.on_publish(v)

    # ================================================================ chunk exchange
    def _fill_all(self, skip: Peer | None = None) -> None:
        if not self.wanted or self.n_req >= self.budget:
            return
        for p in list(self.peers.values()):
            if p is not skip and p.can_req and not p.busy and p.state == hs.READY:
                self._fill(p)
                if self.n_req >= self.budget:
                    return

    def _fill(self, p: Peer) -> None:
        """Top up our pipeline of requests to ``p`` (rarest first, then endgame)."""
        if not p.can_req or p.busy or not self.wanted:
            return
        c = self.cfg
        room = min(c.pipeline - len(p.req), self.budget - self.n_req)
        if room <= 0:
            return
        for v in self.wanted:
            pb = p.bits.get(v)
            if not pb:
                continue
            missing = self._full[v] & ~self._have[v]
            cand = pb & missing & ~self._inflight[v]
            picks = pick_some(cand, self._avail[v], self.rng, room) if cand else []
            if not picks and popcount(missing) <= c.endgame_chunks:
                # endgame: everything missing is in flight; ask a second peer once
                cand = pb & missing & ~self._dups.get(v, 0)
                for key in p.req:
                    if key[0] == v:
                        cand &= ~(1 << key[1])
                if cand:
                    picks = pick_some(cand, self._avail[v], self.rng, room)
                    d = self._dups.get(v, 0)
                    for i in picks:
                        d |= 1 << i
                    self._dups[v] = d
            if not picks:
                continue
            now = self.now
            infl = self._inflight[v]
            for i in picks:
                key = (v, i)
                p.req[key] = now
                lst = self._reqs.get(key)
                if lst is None:
                    self._reqs[key] = [p.conn]
                else:
                    lst.append(p.conn)
                infl |= 1 << i
            self._inflight[v] = infl
            self.n_req += len(picks)
            self._send(p, wire.encode(wire.REQUEST, v, picks))
            room -= len(picks)
            if room <= 0:
                return

    def _unrequest(self, p: Peer, key: tuple[int, int]) -> bool:
        """Forget our request ``key`` to ``p``; True if it was outstanding."""
        if p.req.pop(key, None) is None:
            return False
        self.n_req -= 1
        lst = self._reqs.get(key)
        if lst is not None:
            if p.conn in lst:
                lst.remove(p.conn)
            if not lst:
                del self._reqs[key]
                v, i = key
                if v in self._inflight:
                    self._inflight[v] &= ~(1 << i)
        return True

    def _on_chunk(self, e: ev.ChunkReceived) -> None:
        v, i = e.version, e.index
        m = self.manifests.get(v)
        if m is None or not 0 <= i < m.chunk_count:
            self._log("warning", "unexpected_chunk", version=v, index=i, conn=e.conn)
            return
        p = self.peers.get(e.conn)
        size = m.chunk_length(i)
        kind = p.kind if p is not None else SAME
        cnt = self.counters
        cnt.recv_bytes[kind] += size
        cnt.recv_chunks[kind] += 1
        if p is not None:
            rk = (p.region, self.cfg.region)
            cnt.region_recv[rk] = cnt.region_recv.get(rk, 0) + size
            p.last_heard = self.now
            p.busy = False
            t0 = p.req.get((v, i))
            if t0 is not None:
                dt = self.now - t0
                p.ewma = dt if p.samples == 0 else 0.7 * p.ewma + 0.3 * dt
                p.samples += 1
                p.timeouts = 0
            requested = self._unrequest(p, (v, i))
        else:
            requested = False
        bit = 1 << i
        if not e.valid:
            cnt.bad_chunks += 1
            self._log("warning", "bad_chunk", version=v, index=i, peer=p.node_id if p else None)
            if p is not None:
                p.bad += 1
                old = p.bits.get(v, 0)
                if old & bit:  # never ask this peer for that chunk again
                    p.bits[v] = old & ~bit
                    av = self._avail.get(v)
                    if av is not None and p.can_req:
                        av[i] -= 1
                # counted per node id: a reconnect does not wipe the slate
                n = self._bad_by_id.get(p.node_id, 0) + 1
                self._bad_by_id[p.node_id] = n
                if n >= self.cfg.max_bad_chunks:
                    self.ban(p.node_id, f"sent {n} corrupt chunks")
                    return
            self._fill_all()
            return
        if self._have[v] & bit:
            cnt.dup_chunks += 1
        else:
            self._have[v] |= bit
            self._inflight[v] &= ~bit
            # endgame: cancel the twin request
            lst = self._reqs.pop((v, i), None)
            if lst:
                cf = wire.encode(wire.CANCEL, v, [i])
                for conn in lst:
                    q = self.peers.get(conn)
                    if q is not None and q.req.pop((v, i), None) is not None:
                        self.n_req -= 1
                        self._send(q, cf)
            self._queue_have(v, i)
            if self._have[v] == self._full[v]:
                self._log("info", "version_complete", version=v)
                self.wanted = [w for w in self.wanted if w != v]
                self._avail.pop(v, None)
                self._check_apply()
        if p is not None and requested:
            self._fill(p)
        self._fill_all()

    def _queue_have(self, v: int, i: int) -> None:
        """Queue a HAVE; flush at once unless a flush went out less than ``have_batch_s`` ago.

        Batching is a rate limit (one HAVE burst per window), not a delay: a
        chunk that arrives after a quiet spell is announced at once, so every
        store-and-forward hop does not pay ``have_batch_s``.
        """
        lst = self._pending_have.get(v)
        if lst is None:
            self._pending_have[v] = [i]
        else:
            lst.append(i)
        if self._have_due is not None:
            return
        if self.now >= self._have_next:
            self._flush_haves()
        else:
            self._have_due = self._have_next

    def _flush_haves(self) -> None:
        self._have_due = None
        self._have_next = self.now + self.cfg.have_batch_s
        pending, self._pending_have = self._pending_have, {}
        border = self.is_border
        for v, idx in pending.items():
            full = self._full.get(v)
            if full is None:
                continue
            frames = [wire.encode(wire.HAVE, v, idx[k:k + wire.MAX_INDICES])
                      for k in range(0, len(idx), wire.MAX_INDICES)]
            mask = 0
            for i in idx:
                mask |= 1 << i
            for p in self.peers.values():
                if p.state != hs.READY:
                    continue
                pb = p.bits.get(v)
                if pb is None:
                    continue
                if p.is_origin:
                    if not border:
                        continue
                elif mask & ~pb != mask:
                    # a peer needs HAVEs only for chunks it lacks (it never asks for the
                    # others); this halves the HAVE frames of an epidemic spread
                    rest = [i for i in idx if not (pb >> i) & 1]
                    for k in range(0, len(rest), wire.MAX_INDICES):
                        self._send(p, wire.encode(wire.HAVE, v, rest[k:k + wire.MAX_INDICES]))
                    continue
                for fr in frames:
                    self._send(p, fr)

    def _on_sent(self, e: ev.ChunkSent) -> None:
        p = self.peers.get(e.conn)
        m = self.manifests.get(e.version)
        key = (e.conn, e.version, e.index)
        if key in self._relays:
            self._relays.discard(key)
        elif self.seeder is not None and self.seeder.on_sent(e.conn, e.version, e.index):
            pass
        else:
            self._uploads.discard(key)
        if p is not None and m is not None and 0 <= e.index < m.chunk_count:
            size = m.chunk_length(e.index)
            cnt = self.counters
            cnt.sent_bytes[p.kind] += size
            cnt.sent_chunks[p.kind] += 1
            rk = (self.cfg.region, p.region)
            cnt.region_sent[rk] = cnt.region_sent.get(rk, 0) + size
        self._pump_uploads()
        self._wake_refused()
        if self.seeder is not None:
            self.seeder.schedule()

    def _wake_refused(self) -> None:
        """A slot is free: ping the peer we turned away longest ago, so it asks again.

        Without this a refused peer waits until we happen to send it a HAVE (or
        the next heartbeat), and a node with few neighbours falls behind.
        """
        r = self._refused
        while r and len(self._uploads) < self.cfg.upload_slots:
            conn = next(iter(r))
            del r[conn]
            p = self.peers.get(conn)
            if p is not None and p.state == hs.READY:
                self._send(p, wire.encode(wire.PING))
                return

    def _pump_uploads(self) -> None:
        q = self._queue
        while q and len(self._uploads) < self.cfg.upload_slots:
            conn, v, i = q.popleft()
            p = self.peers.get(conn)
            m = self.manifests.get(v)
            if p is None or m is None or not (self._have.get(v, 0) >> i) & 1:
                continue
            self._uploads.add((conn, v, i))
            self._out.append(ev.SendChunk(conn, v, i, m.chunk_length(i)))

    # ================================================================ timers
    def _on_tick(self, e: ev.Tick) -> None:
        now = self.now
        if self._have_due is not None and now >= self._have_due:
            self._flush_haves()
        if self._apply_retry_at is not None and now >= self._apply_retry_at:
            self._apply_retry_at = None
            self._check_apply()
        if self.seeder is not None:
            self.seeder.tick()
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.heartbeat_s
            self._heartbeat()

    def _heartbeat(self) -> None:
        c = self.cfg
        now = self.now
        ping = None
        slow: list[Peer] = []
        for p in list(self.peers.values()):
            if p.state != hs.READY:
                if now - p.since > c.handshake_timeout_s:
                    self._close(p, "handshake timeout")
                continue
            if p.req:
                expired = [k for k, t in p.req.items() if now - t > c.request_timeout_s]
                for k in expired:
                    self._unrequest(p, k)
                    p.timeouts += 1
                if expired:
                    self._log("info", "request_timeout", peer=p.node_id, chunks=len(expired))
                    if p.timeouts >= c.max_timeouts:
                        self._close(p, f"{p.timeouts} request timeouts", "warning")
                        continue
            elif now - p.last_heard > c.peer_timeout_s:
                self._close(p, "peer timeout (no heartbeat)")
                continue
            if self.seeder is not None and not p.kept and now - p.since > c.handshake_timeout_s:
                self._close(p, "tracker contact done")
                continue
            p.busy = False
            if now - p.last_sent >= c.heartbeat_s:
                if ping is None:
                    ping = wire.encode(wire.PING)
                self._send(p, ping)
            if p.can_req and p.samples >= c.slow_min_samples:
                slow.append(p)
        self._evict_slow(slow)
        if (not c.is_origin and (self._want_origin or self._reports)
                and not any(p.is_origin for p in self.peers.values() if p.state == hs.READY)):
            self._dial_origin()
        if not c.is_origin and not c.origin_only:
            self._maintain_mesh()
        elif c.origin_only and not c.is_origin and not self.peers and not self._dialing:
            for addr in c.bootstrap:
                if self._retry_at.get(addr, 0.0) <= now:
                    self._dial(addr)
        if self._retry_at:
            self._retry_at = {a: t for a, t in self._retry_at.items() if t > now}
        self._fill_all()

    def _evict_slow(self, peers: list[Peer]) -> None:
        """Drop the slowest peer if it is a timing outlier and we can afford to lose it."""
        if len(peers) < 3 or len(self.by_id) <= self.cfg.mesh_low:
            return
        times = sorted(p.ewma for p in peers)
        median = times[len(times) // 2]
        worst = max(peers, key=lambda p: p.ewma)
        if median > 0 and worst.ewma > self.cfg.slow_factor * median:
            self._close(worst, f"slow peer ({worst.ewma:.2f}s per chunk, median {median:.2f}s)")

    def _maintain_mesh(self) -> None:
        """Keep between mesh_low and mesh_high region peers; dial from the book."""
        c = self.cfg
        if c.is_origin or c.origin_only:
            return
        region = c.region if c.region_aware else None
        mesh = [p for p in self.peers.values()
                if not p.is_origin and not p.border and (p.state != hs.READY or p.kind == SAME
                                                         or not c.region_aware)]
        n = len(mesh) + len(self._dialing)
        if n < c.mesh_degree:
            connected = {p.listen_addr for p in self.peers.values()}
            for node_id, _r, addr, flags in self.book.sample(region, 2 * c.mesh_degree):
                if n >= c.mesh_degree:
                    break
                if (flags & wire.PEER_ORIGIN or node_id in self.by_id or addr in connected
                        or addr in self._dialing or self._retry_at.get(addr, 0.0) > self.now):
                    continue
                self._dial(addr)
                n += 1
            if not self.by_id and not self._dialing:
                for addr in c.bootstrap:
                    if self._retry_at.get(addr, 0.0) <= self.now:
                        self._dial(addr)
        elif len(mesh) > c.mesh_high:
            extra = [p for p in mesh if p.state == hs.READY and not p.req]
            self.rng.shuffle(extra)
            for p in extra[: len(mesh) - c.mesh_high]:
                self._close(p, "mesh over mesh_high")


_HANDLERS: dict[type, Callable[[NodeCore, Any], None]] = {
    ev.Tick: NodeCore._on_tick,
    ev.PeerConnected: NodeCore._on_connected,
    ev.ConnectFailed: NodeCore._on_connect_failed,
    ev.PeerDisconnected: NodeCore._on_disconnected,
    ev.FrameReceived: NodeCore._on_frame,
    ev.ChunkReceived: NodeCore._on_chunk,
    ev.ChunkSent: NodeCore._on_sent,
    ev.Publish: NodeCore._on_publish,
    ev.LocalChunks: NodeCore._on_local,
    ev.Applied: NodeCore._on_applied,
}

_FRAME_HANDLERS: dict[int, Callable[[NodeCore, Peer, list], None]] = {
    wire.PING: NodeCore._f_ping,
    wire.PEERS: NodeCore._f_peers,
    wire.ROLE: NodeCore._f_role,
    wire.ANNOUNCE: NodeCore._f_announce,
    wire.BITFIELD: NodeCore._f_bitfield,
    wire.HAVE: NodeCore._f_have,
    wire.REQUEST: NodeCore._f_request,
    wire.CANCEL: NodeCore._f_cancel,
    wire.REJECT: NodeCore._f_reject,
    wire.RELAY: NodeCore._f_relay,
    wire.RELAY_FAIL: NodeCore._f_origin_only,
    wire.LINKS: NodeCore._f_origin_only,
    wire.REPORT: NodeCore._f_report,
}
