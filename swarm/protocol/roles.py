"""What a core does because of its role: a rollout ``NodeRole`` or the ``OriginRole``.

The core (``core.NodeCore``) runs what every participant does (handshake,
announcements, holdings, requests, uploads, timers) and calls its role at
fixed points (``Role``'s hooks). A role reaches the core only through the
narrow ``Host`` interface: send, dial, close, log, the peers and the holdings;
the core never looks inside a role. The origin's role lives in ``seeding``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from swarm.errors import ProtocolError
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.counters import Counters
from swarm.protocol.fleet import FleetEntry, StatusReporter
from swarm.protocol.membership import AddressBook
from swarm.protocol.peer import CROSS, SAME, Peer
from swarm.protocol.relays import PendingRelays, RelaysOut
from swarm.protocol.versions import VersionState


class Host(Protocol):
    """The part of the core a role may use."""

    cfg: CoreConfig
    rng: random.Random
    now: float
    peers: dict[int, Peer]
    by_id: dict[str, int]  # READY peers by node id
    book: AddressBook
    dialing: dict[str, float]  # addr -> dialled at
    retry_at: dict[str, float]  # addr -> not before
    active_version: int | None
    served_version: int | None  # what our engine confirmed serving (EngineServed)
    counters: Counters

    def send(self, p: Peer, frame: bytes) -> None: ...
    def send_chunk(self, conn: int, v: int, i: int) -> None: ...
    def relay_chunk(self, conn: int, v: int, i: int, arriving: bool = False) -> None: ...
    def is_arriving(self, v: int, i: int) -> bool: ...
    def arriving_since(self, v: int, i: int) -> float | None: ...
    def arrival_pace(self, v: int, i: int) -> float | None: ...
    def arrival_eta(self, v: int, i: int) -> float | None: ...
    def full_size(self, v: int, i: int) -> bool: ...
    def dial(self, addr: str) -> None: ...
    def close(self, p: Peer, reason: str, level: str = "info") -> None: ...
    def log(self, level: str, event: str, **fields: Any) -> None: ...
    def holding(self, v: int) -> VersionState | None: ...
    def ready_peers(self) -> list[Peer]: ...
    def ban(self, node_id: str, reason: str) -> None: ...
    def fill(self, p: Peer) -> None: ...


FrameHandler = Callable[[Peer, Any], None]


class Role:
    """The hooks the core calls; the defaults do nothing."""

    #: send our bitfield to a peer that shows a version late (the origin pushes instead)
    shares_bitfields = True

    def __init__(self, host: Host) -> None:
        self.host = host
        self.cfg = host.cfg

    # ---- frames only this role accepts after the handshake
    def frame_handlers(self) -> dict[type[wire.Frame], FrameHandler]:
        return {}

    # ---- peers
    def admit(self, p: Peer) -> bool:
        """``p`` finished the handshake (kind set); False if it was closed."""
        return True

    def on_ready(self, p: Peer) -> None:
        """``p`` got our manifests and bitfields; say the rest."""

    def on_leave(self, p: Peer) -> None:
        """``p`` is gone (its requests and uploads already forgotten)."""

    def may_serve(self, p: Peer) -> bool:
        """Whether we answer ``p``'s requests."""
        return True

    def on_peer_heard(self, node_id: str, region: str, addr: str, flags: int) -> None:
        """A PEERS entry we added to the address book."""

    def maintain_mesh(self) -> None:
        """Dial or trim links (after PEERS, ROLE and every heartbeat)."""

    def on_ban(self, node_id: str) -> None:
        """We banned ``node_id`` (first time)."""

    @property
    def is_border(self) -> bool:
        return False

    def region_sent(self, v: int) -> dict[str, int]:
        """Per region, the chunks of ``v`` this role saw enter it (bitsets); read model only."""
        return {}

    # ---- holdings and chunks
    def on_shown(self, p: Peer, v: int) -> None:
        """``p`` showed (ANNOUNCE) that it knows version ``v``, holding none of it yet."""

    def on_holdings(self, p: Peer, v: int, gained: int) -> bool:
        """``p`` showed new chunks of ``v``; True if the role took it over (no availability)."""
        return False

    def on_sent(self, conn: int, v: int, i: int) -> bool:
        """A chunk left; True if it was the role's own (not an upload slot)."""
        return False

    def on_acked(self, conn: int) -> None:
        """What we sent on ``conn`` is being acknowledged (``ev.Acked``)."""

    def on_path_sample(self, conn: int, queued: bool, rtt: float, ramping: bool) -> None:
        """A sample of ``conn``'s path while a chunk of ours leaves on it (``ev.PathSample``)."""

    def on_relay_sent(self, conn: int, v: int, i: int) -> None:
        """A relay we carried out to ``conn`` was handed over whole (``ChunkSent``)."""

    def on_stored(self, v: int, i: int) -> None:
        """We stored chunk ``i`` of ``v`` (verified; we did not hold it before)."""

    def on_arriving(self, v: int, i: int) -> None:
        """The first block of chunk ``i`` of ``v`` arrived; the rest is on its way."""

    def on_pace(self, v: int, i: int) -> None:
        """Chunk ``i`` of ``v``, still arriving, has a projected arrival (``arrival_eta``)."""

    def on_withdrawn(self, conn: int, v: int, i: int) -> None:
        """A relay we started while its chunk was arriving failed (``ChunkSent.withdrawn``)."""

    def after_sent(self) -> None:
        """A chunk left and the upload slots were topped up."""

    def on_publish(self, v: int) -> None:
        """We published (or, restarted, hold all of) version ``v``."""

    def on_local_complete(self, v: int) -> None:
        """At start-up the store holds all of version ``v``."""

    # ---- timers
    def next_wakeup(self) -> float | None:
        return None

    def tick(self) -> None:
        pass

    def heartbeat_drop(self, p: Peer) -> bool:
        """At a heartbeat: True if ``p`` was closed for role reasons."""
        return False

    def after_heartbeat(self) -> None:
        pass

    def on_versions_changed(self) -> None:
        """Our active or engine-served version changed."""

    def moving(self, v: int) -> bool:
        """True while this role moves chunks of ``v`` (the core does not forget it yet)."""
        return False

    def forget(self, v: int) -> None:
        """The core forgot version ``v``: drop what this role keeps of it."""

    def on_relays_lost(self, p: Peer, relays: list[tuple[int, int]]) -> None:
        """``p`` went away while we were relaying ``(version, index)`` chunks to it."""

    def fleet(self) -> list[FleetEntry]:
        """Origin: the last version report of every node; read model only."""
        return []


class NodeRole(Role):
    """A rollout node: region mesh, border links when the origin grants them, ban reports."""

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.border = False  # the origin granted us a border (ROLE keep) in a region-aware swarm
        self._links_sent: frozenset[str] = frozenset()
        self._reports: list[str] = []  # bans not yet reported to the origin
        self._want_origin = False  # lost a kept origin link: redial the bootstrap list
        self._origin_dial_at = float("-inf")
        self.status = StatusReporter(host)
        self.status.changed()  # the first report goes at our first origin link
        self.pending = PendingRelays()  # RELAY orders for chunks still on their way (relays)
        self.out = RelaysOut()  # relays being carried out: reported alive while acknowledged
        # cut-through that waits ``cut_through_after_s`` for the chunk: (v, i) -> when to go
        self._cut_due: dict[tuple[int, int], float] = {}

    def frame_handlers(self) -> dict[type[wire.Frame], FrameHandler]:
        return {wire.Role: self._f_role, wire.Relay: self._f_relay}

    def on_relays_lost(self, p: Peer, relays: list[tuple[int, int]]) -> None:
        """Fail loudly: the origin re-plans what we could not deliver at once, instead
        of waiting for a HAVE that will never come."""
        o = self._origin_link()
        if o is None:
            return
        for v, i in relays:
            self.host.send(o, wire.RelayFail(v, i, p.node_id).encode())
        self.host.counters.relays["failed"] += len(relays)
        self.host.log("info", "relays_lost", peer=p.node_id, chunks=len(relays))

    def _relay_fail(self, v: int, i: int, target: str) -> None:
        self.host.counters.relays["failed"] += 1
        o = self._origin_link()
        if o is not None:
            self.host.send(o, wire.RelayFail(v, i, target).encode())

    def on_stored(self, v: int, i: int) -> None:
        target = self.pending.take(v, i) if self.pending else None
        if target is None:
            return
        tc = self.host.by_id.get(target)
        if tc is None:
            self._relay_fail(v, i, target)
        else:
            self.host.counters.relays["on_arrival"] += 1
            self._relay(tc, v, i)

    def on_arriving(self, v: int, i: int) -> None:
        if not self.cfg.cut_through or not self.pending or (v, i) not in self.pending.orders:
            return
        if self.cfg.cut_through_after_s > 0 and not self._slow_link(v, i):
            self._cut_due[(v, i)] = self.host.now + self.cfg.cut_through_after_s
            return
        target = self.pending.take(v, i)
        if target is not None:
            self._cut_through(v, i, target)

    def on_pace(self, v: int, i: int) -> None:
        """The chunk's own pace says it will be arriving past the wait: its relay, waiting
        ``cut_through_after_s``, goes now (``_slow_link``)."""
        key = (v, i)
        if key in self._cut_due and self._slow_link(v, i):
            del self._cut_due[key]
            target = self.pending.take(v, i)
            if target is not None:
                self._cut_through(v, i, target)

    def _cut_through_due(self) -> None:
        """Orders whose chunk is still arriving ``cut_through_after_s`` after its first
        block: it comes slowly (a thin or shared path), so the relay goes now, block by
        block, instead of waiting for the rest. A chunk that arrives fast (a fat path:
        4 MiB in 34 ms at 1 Gbit/s) is relayed whole once stored, as without cut-through."""
        now, host = self.host.now, self.host
        for key, t in list(self._cut_due.items()):
            if t > now:
                continue
            del self._cut_due[key]
            if host.is_arriving(*key):
                target = self.pending.take(*key)
                if target is not None:
                    self._cut_through(*key, target)

    def _cut_through(self, v: int, i: int, target: str) -> None:
        """Relay a chunk whose blocks are arriving now: each block goes on as it comes
        in, the last once the whole chunk was verified here. The relay no longer waits
        for the chunk (0.3-0.7 s for 4 MiB on a shared 100 Mbit uplink), and the
        connection to the target carries data while the chunk arrives instead of
        idling (and restarting from slow start) between relays."""
        tc = self.host.by_id.get(target)
        if tc is None:
            self._relay_fail(v, i, target)
            return
        self.host.counters.relays["cut_through"] += 1
        self._relay(tc, v, i, arriving=True)

    def _relay(self, conn: int, v: int, i: int, arriving: bool = False) -> None:
        self.out.started(conn, v, i)
        self.host.relay_chunk(conn, v, i, arriving)

    def on_relay_sent(self, conn: int, v: int, i: int) -> None:
        self.out.handed(conn, v, i, self.host.now)

    def on_acked(self, conn: int) -> None:
        """The target on ``conn`` is acknowledging our bytes: the relays we carry out to
        it (being sent, or handed over up to ``2 x request_timeout_s`` ago) are on their
        way. Tell the origin (RELAY_ALIVE), which keeps them from timing out."""
        keys = self.out.alive(conn, self.host.now, 2 * self.cfg.request_timeout_s)
        p = self.host.peers.get(conn)
        o = self._origin_link() if keys else None
        if o is None or p is None or not p.node_id:
            return
        for v, i in keys:
            self.host.send(o, wire.RelayAlive(v, i, p.node_id).encode())
        self.host.counters.relay_alive += len(keys)

    def on_withdrawn(self, conn: int, v: int, i: int) -> None:
        p = self.host.peers.get(conn)
        target = p.node_id if p is not None else ""
        self.out.ended(conn, v, i)
        self.host.log("info", "relay_withdrawn", version=v, index=i, peer=target)
        self._relay_fail(v, i, target)

    # ---- version reports (the origin's fleet view)
    def on_versions_changed(self) -> None:
        self.status.changed()

    def _origin_link(self) -> Peer | None:
        for p in self.host.peers.values():
            if p.ready and p.is_origin:
                return p
        return None

    def next_wakeup(self) -> float | None:
        times = [t for t in (self.status.next_wakeup(),
                             self.pending.next_deadline() if self.pending else None,
                             min(self._cut_due.values()) if self._cut_due else None)
                 if t is not None]
        return min(times) if times else None

    def tick(self) -> None:
        self.status.tick(self._origin_link(), lambda: self._dial_origin(report=True))
        if self._cut_due:
            self._cut_through_due()
        if self.pending:
            for v, i, target in self.pending.expired(self.host.now):
                self.host.log("info", "relay_expired", version=v, index=i, peer=target)
                self._relay_fail(v, i, target)

    @property
    def is_border(self) -> bool:
        return self.border

    # ---- peers
    def admit(self, p: Peer) -> bool:
        c, host = self.cfg, self.host
        if p.is_origin:
            self._want_origin = False
        elif c.origin_only:
            host.close(p, "origin-only mode: no node peers")
            return False
        if c.region_aware and p.kind == CROSS:
            p.border = True  # only borders link across regions
        p.can_req = (p.kind == SAME) if c.region_aware else not c.origin_only
        if p.is_origin:
            p.can_req = not c.region_aware and not c.origin_only
        host.book.add(p.node_id, p.region, p.listen_addr, wire.PEER_ORIGIN if p.is_origin else 0)
        return True

    def on_ready(self, p: Peer) -> None:
        c, host = self.cfg, self.host
        if p.is_origin:
            self._flush_reports()
            if self.status.pending:
                self.status.send(p)
        if not p.is_origin and (p.kind == SAME or not c.region_aware):
            region = c.region if c.region_aware else None
            sample = tuple(x for x in host.book.sample(region, c.tracker_sample) if x[0] != p.node_id)
            if sample:
                host.send(p, wire.Peers(sample).encode())
        if self.border and p.border:
            self._send_links()
        host.fill(p)

    def on_leave(self, p: Peer) -> None:
        self.out.drop(p.conn)
        if p.is_origin and p.kept:
            # the origin went away (restart, one-shot publish, network): come back to it
            self._want_origin = True
        if p.is_origin and self.border:
            self.border = False
            self._links_sent = frozenset()
            self.pending.clear()  # the origin re-plans what its border links carried
        elif self.pending and p.node_id:
            for v, i in self.pending.to_target(p.node_id):
                self._relay_fail(v, i, p.node_id)
        if self.border and p.border:
            self._send_links()

    def may_serve(self, p: Peer) -> bool:
        return not (self.cfg.region_aware and p.kind != SAME)

    def on_peer_heard(self, node_id: str, region: str, addr: str, flags: int) -> None:
        c, host = self.cfg, self.host
        if (flags & wire.PEER_BORDER and self.border and c.relay and region != c.region
                and c.node_id < node_id and node_id not in host.by_id):
            host.dial(addr)

    def on_ban(self, node_id: str) -> None:
        if node_id not in self._reports:
            self._reports.append(node_id)
        self._flush_reports()

    def _flush_reports(self) -> None:
        """Send pending bans to the origin; with no origin link, dial the bootstrap list."""
        if not self._reports:
            return
        host = self.host
        for p in host.peers.values():
            if p.ready and p.is_origin:
                for node_id in self._reports:
                    host.send(p, wire.Report(node_id).encode())
                self._reports.clear()
                return
        self._dial_origin()

    def _dial_origin(self, *, report: bool = False) -> None:
        """Dial the bootstrap list (the origin is the tracker), at most once per ``redial_s``
        (a version report may go sooner: it is sent once per change, and failed dials
        back off per address)."""
        host = self.host
        if not report and host.now - self._origin_dial_at < self.cfg.redial_s:
            return
        if any(a in host.dialing for a in self.cfg.bootstrap):
            return
        self._origin_dial_at = host.now
        for addr in self.cfg.bootstrap:
            if host.retry_at.get(addr, 0.0) <= host.now:
                host.dial(addr)

    def _send_links(self) -> None:
        """Border -> origin: the cross-region borders we are linked to (relay targets)."""
        host = self.host
        links = frozenset(p.node_id for p in host.peers.values()
                          if p.ready and p.border and not p.is_origin)
        if links == self._links_sent:
            return
        self._links_sent = links
        for p in host.peers.values():
            if p.ready and p.is_origin:
                host.send(p, wire.Links(tuple(sorted(links)[: wire.MAX_PEERS])).encode())

    # ---- frames
    def _f_role(self, p: Peer, f: wire.Role) -> None:
        if not p.is_origin:
            raise ProtocolError("ROLE from a peer that is not the origin")
        p.kept = bool(f.flags & wire.ROLE_KEEP)
        if not p.kept:
            self.host.close(p, "origin: tracker only")
            self.maintain_mesh()
            return
        if self.cfg.region_aware and not self.cfg.origin_only:
            was = self.border
            self.border = True
            self.host.log("info", "border_granted")
            self._send_links()
            if not was:
                # The origin named the other regions' borders (PEERS) just before this
                # ROLE, when we were no border yet: link to them now.
                for node_id in list(self.host.book.ids()):
                    e = self.host.book.get(node_id)
                    if e is not None:
                        self.on_peer_heard(node_id, e[0], e[1], e[2])

    def _f_relay(self, p: Peer, f: wire.Relay) -> None:
        if not p.is_origin:
            raise ProtocolError("RELAY from a peer that is not the origin")
        host = self.host
        v, i, target = f.version, f.index, f.target
        tc = host.by_id.get(target)
        st = host.holding(v)
        if tc is None or st is None or i >= st.chunk_count:
            self._relay_fail(v, i, target)
        elif (st.have >> i) & 1:
            host.counters.relays["at_once"] += 1
            self._relay(tc, v, i)
        elif self.cfg.cut_through and host.is_arriving(v, i) and self._arrived_long(v, i):
            self._cut_through(v, i, target)
        elif not self.pending.add(v, i, target, host.now + self.cfg.request_timeout_s):
            self._relay_fail(v, i, target)  # relay on arrival (``relays``): no room
        elif self.cfg.cut_through and host.is_arriving(v, i):
            since = host.arriving_since(v, i)
            self._cut_due[(v, i)] = (host.now if since is None else since) \
                + self.cfg.cut_through_after_s

    def _arrived_long(self, v: int, i: int) -> bool:
        """Chunk ``i`` of ``v`` has been arriving ``cut_through_after_s`` or longer, or
        comes over a link known to be slow (``_slow_link``)."""
        since = self.host.arriving_since(v, i)
        return (since is None or self.host.now - since >= self.cfg.cut_through_after_s
                or self._slow_link(v, i))

    def _slow_link(self, v: int, i: int) -> bool:
        """The last chunk that came whole over the link chunk ``i`` of ``v`` arrives on
        took ``2 x cut_through_after_s`` or longer, first block to stored, or this chunk's
        own pace says it will (``arrival_eta``, ``ChunkPace``): it will be arriving past
        ``cut_through_after_s``, so its relay goes now instead of waiting to find that
        out. On a thin or shared path (the emulated WAN: 4 MiB in 0.5-0.9 s at half a
        100 Mbit/s uplink) the wait left the target's inlet half used at every version's
        start, and the last chunk's relay ended that much after its push. A link's first
        chunks have no history: its pace is known ``PACE_LOOK_S`` after the first block
        (round 59). A link that brought its last chunk fast, with a chunk that comes fast
        now, keeps the wait."""
        slow = 2 * self.cfg.cut_through_after_s
        pace = self.host.arrival_pace(v, i)
        if pace is not None and pace >= slow:
            return True
        eta = self.host.arrival_eta(v, i)
        return eta is not None and eta >= slow

    # ---- timers
    def after_heartbeat(self) -> None:
        c, host = self.cfg, self.host
        if ((self._want_origin or self._reports)
                and not any(p.is_origin for p in host.peers.values() if p.ready)):
            self._dial_origin()
        if not c.origin_only:
            self.maintain_mesh()
        elif not host.peers and not host.dialing:
            for addr in c.bootstrap:
                if host.retry_at.get(addr, 0.0) <= host.now:
                    host.dial(addr)

    def maintain_mesh(self) -> None:
        """Keep between mesh_low and mesh_high region peers; dial from the book."""
        c, host = self.cfg, self.host
        if c.origin_only:
            return
        region = c.region if c.region_aware else None
        mesh = [p for p in host.peers.values()
                if not p.is_origin and not p.border and (not p.ready or p.kind == SAME
                                                         or not c.region_aware)]
        n = len(mesh) + len(host.dialing)
        if n < c.mesh_degree:
            connected = {p.listen_addr for p in host.peers.values()}
            for node_id, _r, addr, flags in host.book.sample(region, 2 * c.mesh_degree):
                if n >= c.mesh_degree:
                    break
                if (flags & wire.PEER_ORIGIN or node_id in host.by_id or addr in connected
                        or addr in host.dialing or host.retry_at.get(addr, 0.0) > host.now):
                    continue
                host.dial(addr)
                n += 1
            if not host.by_id and not host.dialing:
                for addr in c.bootstrap:
                    if host.retry_at.get(addr, 0.0) <= host.now:
                        host.dial(addr)
        elif len(mesh) > c.mesh_high:
            extra = [p for p in mesh if p.ready and not p.req]
            host.rng.shuffle(extra)
            for p in extra[: len(mesh) - c.mesh_high]:
                host.close(p, "mesh over mesh_high")
