"""Chunk exchange inside a swarm: holdings, requests, uploads, arriving and departing chunks.

``ChunkExchange`` answers BITFIELD, HAVE, REQUEST, CANCEL and REJECT and the
``ChunkReceived`` / ``ChunkSent`` events; it owns our outstanding requests
(``requests.Requests`` with its pick policy) and our upload slots
(``uploads.UploadSlots``), and reads the per-version state (``versions``). It
reaches the rest of the core through ``ExchangeHost``.
"""

from __future__ import annotations

from typing import Any, Protocol

from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.counters import Counters
from swarm.protocol.handshake import READY
from swarm.protocol.peer import SAME, Peer
from swarm.protocol.picker import iter_bits
from swarm.protocol.requests import PickPolicy, Requests
from swarm.protocol.roles import Role
from swarm.protocol.uploads import Offer, UploadSlots
from swarm.protocol.versions import VersionSet, VersionState


class ExchangeHost(Protocol):
    """What the exchange needs of the core."""

    now: float
    peers: dict[int, Peer]
    counters: Counters
    role: Role

    def send(self, p: Peer, frame: bytes) -> None: ...
    def send_chunk(self, conn: int, v: int, i: int) -> None: ...
    def stop_chunk(self, conn: int, v: int, i: int) -> None: ...
    def log(self, level: str, event: str, **fields: Any) -> None: ...
    def ban(self, node_id: str, reason: str) -> None: ...
    def close(self, p: Peer, reason: str, level: str = "info") -> None: ...
    def strike(self, node_id: str) -> int: ...
    def catch_up(self, p: Peer, v: int) -> None: ...
    def queue_have(self, v: int, i: int) -> None: ...
    def check_apply(self) -> None: ...
    def shown(self, v: int) -> None: ...
    def is_arriving(self, v: int, i: int) -> bool: ...


class ChunkExchange:
    """See the module docstring."""

    def __init__(self, host: ExchangeHost, cfg: CoreConfig, versions: VersionSet,
                 policy: PickPolicy) -> None:
        self.host = host
        self.cfg = cfg
        self.versions = versions
        self.peers = host.peers
        self.requests = Requests(cfg, policy, host.counters)
        self.uploads = UploadSlots(cfg.upload_slots, cfg.upload_queue)
        # local faults (disk full, ...): no new requests until then; back-off doubles
        self.hold_until: float | None = None
        self.hold_s = 0.0
        # (conn, v, i): twin requests cancelled while their chunk was being verified here
        # (``on_whole``); bounded, and dropped with the conn
        self.cancelled: set[tuple[int, int, int]] = set()

    def frame_handlers(self) -> dict[type[wire.Frame], Any]:
        return {wire.Bitfield: self.on_bitfield, wire.Have: self.on_have,
                wire.Request: self.on_request, wire.Cancel: self.on_cancel,
                wire.Reject: self.on_reject, wire.Coming: self.on_coming}

    def forget(self, p: Peer) -> None:
        """``p`` (READY) is gone: its holdings, requests and uploads go with it."""
        if p.can_req:
            for st in self.versions.states.values():
                if st.avail is not None:
                    av = st.avail
                    for i in iter_bits(p.bits.get(st.version, 0) & st.full):
                        av[i] -= 1
        for key in list(p.req):
            self.requests.forget(p, key, self.versions)
        if self.cancelled:
            self.cancelled = {k for k in self.cancelled if k[0] != p.conn}
        if self.uploads.drop_conn(p.conn):
            self.pump()

    def fill(self, p: Peer) -> None:
        """Top up our pipeline of requests to ``p`` (see ``Requests.plan``)."""
        if self.hold_until is not None:
            return
        for v, picks in self.requests.plan(p, self.versions, self.host.now):
            self.host.send(p, wire.Request.pack(v, picks))

    def on_bitfield(self, p: Peer, f: wire.Bitfield) -> None:
        """What ``p`` holds of a version, all of it: chunks it no longer shows are no longer
        asked of it (a peer that forgot a version we still take sends an empty one)."""
        bits = wire.bits_from_bytes(f.bits)
        v = f.version
        gone = p.bits.get(v, 0) & ~bits
        if gone:
            p.bits[v] &= ~gone
            st = self.versions.get(v)
            if st is not None and st.avail is not None and p.can_req:
                for i in iter_bits(gone & st.full):
                    st.avail[i] -= 1
        self._holdings(p, v, bits, fill_anyway=True)

    def on_have(self, p: Peer, f: wire.Have) -> None:
        add = 0
        for i in f.indices:
            add |= 1 << i
        if p.coming:
            self._uncome(p, f.version, add)
        self._holdings(p, f.version, add, fill_anyway=False)

    def on_coming(self, p: Peer, f: wire.Coming) -> None:
        """A region peer says chunks are arriving there (``serve_arriving``): we may ask
        for them now. Ours to use only if we serve arriving chunks too; they count as
        held for requests, and as missing there for our HAVEs."""
        if p.kind is not SAME or not self.cfg.serve_arriving:
            return
        v = f.version
        add = 0
        for i in f.indices:
            add |= 1 << i
        st = self.versions.get(v)
        if st is None or v not in p.bits:
            return  # a version it has not shown: nothing to ask for yet
        add &= st.full & ~p.bits[v]
        if add:
            p.coming[v] = p.coming.get(v, 0) | add
            self._holdings(p, v, add, fill_anyway=False)

    def _uncome(self, p: Peer, v: int, bits: int) -> None:
        c = p.coming.get(v, 0) & ~bits
        if c:
            p.coming[v] = c
        else:
            p.coming.pop(v, None)

    def _not_coming(self, p: Peer, v: int, i: int) -> None:
        """Chunk ``i`` will not come from ``p`` after all: drop it from what ``p`` holds
        (its HAVE, once it stores it, brings it back)."""
        bit = 1 << i
        self._uncome(p, v, bit)
        old = p.bits.get(v, 0)
        if old & bit:
            p.bits[v] = old & ~bit
            st = self.versions.get(v)
            if st is not None and st.avail is not None and p.can_req:
                st.avail[i] -= 1

    def _holdings(self, p: Peer, v: int, add: int, *, fill_anyway: bool) -> None:
        """``p`` says it holds the chunks ``add`` of ``v`` (BITFIELD or HAVE).

        A BITFIELD tops up our requests to ``p`` even if it shows nothing new.
        """
        st = self.versions.get(v)
        if st is not None:
            add &= st.full
        elif len(p.bits) > 32 and v not in p.bits:
            return  # bound what an unknown-version flood can make us hold
        old = p.bits.get(v)
        if old is None:
            old = 0
            self.host.catch_up(p, v)
        gained = add & ~old
        p.bits[v] = old | add
        p.busy = False
        if gained and v in self.versions.unavailable:
            self.host.shown(v)
        if self.host.role.on_holdings(p, v, gained):
            return
        av = st.avail if st is not None else None
        if av is not None and p.can_req and (gained or fill_anyway):
            for i in iter_bits(gained):
                av[i] += 1
            self.fill(p)

    def on_request(self, p: Peer, f: wire.Request) -> None:
        v = f.version
        st = self.versions.get(v)
        allowed = st is not None and self.host.role.may_serve(p)
        # serve_arriving: a region peer may have a chunk that is still arriving here
        early = allowed and self.cfg.serve_arriving and p.kind is SAME
        rejected = []
        for i in f.indices:
            held = allowed and (st.have >> i) & 1  # type: ignore[union-attr]
            if not held and not (early and self.host.is_arriving(v, i)):
                rejected.append(i)
                continue
            offer = self.uploads.offer(p.conn, v, i, early=not held)
            if offer is Offer.SEND:
                self.host.send_chunk(p.conn, v, i)
            elif offer is Offer.REFUSED:
                rejected.append(i)
        if rejected:
            self.host.send(p, wire.Reject(v, rejected).encode())

    def on_cancel(self, p: Peer, f: wire.Cancel) -> None:
        """The peer got these chunks elsewhere first (endgame twins): drop the queued
        answers, and stop those under way (``ev.StopChunk``; the slot frees at their
        ``ChunkSent``) instead of sending the rest of a chunk it holds already."""
        up = self.uploads
        up.cancel(p.conn, f.version, f.indices)
        for i in f.indices:
            if up.sending(p.conn, f.version, i):
                self.host.counters.uploads_cancelled += 1
                self.host.stop_chunk(p.conn, f.version, i)

    def on_reject(self, p: Peer, f: wire.Reject) -> None:
        v = f.version
        coming = p.coming.get(v, 0)
        for i in f.indices:
            self.requests.forget(p, (v, i), self.versions)
            if (coming >> i) & 1:  # it said it was coming: not (or not any more)
                self._not_coming(p, v, i)
        p.busy = True
        self.fill_all(skip=p)

    def fill_all(self, skip: Peer | None = None) -> None:
        rq = self.requests
        if not self.versions.wanted or rq.n >= rq.budget or self.hold_until is not None:
            return
        plan, versions, now, send = rq.plan, self.versions, self.host.now, self.host.send
        for p in list(self.peers.values()):
            if p is not skip and p.can_req and not p.busy and p.state is READY:
                for v, picks in plan(p, versions, now):  # = self.fill(p), inlined: a hot loop
                    send(p, wire.Request.pack(v, picks))
                if rq.n >= rq.budget:
                    return

    def on_chunk(self, e: ev.ChunkReceived) -> None:
        v, i = e.version, e.index
        st = self.versions.get(v)
        if st is None or not 0 <= i < st.chunk_count:
            self.host.log("warning", "unexpected_chunk", version=v, index=i, conn=e.conn)
            return
        p = self.peers.get(e.conn)
        size = st.chunk_length(i)
        cnt = self.host.counters
        cnt.received(p.kind if p is not None else SAME, size)
        if p is not None:
            if self.cancelled:
                self.cancelled.discard((p.conn, v, i))  # it came whole after all
            cnt.received_from(p.region, self.cfg.region, size)
            p.last_heard = self.host.now
            p.busy = False
            t0 = p.req.get((v, i))
            if t0 is not None:
                p.timeouts = 0
                # an answer that came at its chunk's arrival pace there (``serve_arriving``)
                # times that arrival, not the peer: it would make a border a slow outlier
                if not (self.requests.early and (p.conn, v, i) in self.requests.early):
                    dt = self.host.now - t0
                    p.ewma = dt if p.samples == 0 else 0.7 * p.ewma + 0.3 * dt
                    p.samples += 1
            requested = self.requests.forget(p, (v, i), self.versions)
        else:
            requested = False
        bit = 1 << i
        if not e.valid:
            self._on_bad_chunk(p, st, i)
            return
        if st.have & bit:
            cnt.dup_chunks += 1
        else:
            st.have |= bit
            st.inflight &= ~bit
            self.hold_s = 0.0
            # endgame: cancel the twin request
            twins = self.requests.arrived((v, i), self.peers)
            if twins:
                cf = wire.Cancel(v, [i]).encode()
                for q in twins:
                    self.host.send(q, cf)
            self.host.queue_have(v, i)
            self.host.role.on_stored(v, i)
            if st.complete:
                self.host.log("info", "version_complete", version=v)
                vs = self.versions
                vs.wanted = [w for w in vs.wanted if w != v]
                st.avail = None
                self.host.check_apply()
            if v in self.versions.unavailable:
                # given up on while this chunk was on its way (a push or relay over a
                # slow path: nothing whole came for ``unavailable_s``): it came, so the
                # version is in the chain again, and applied if it is now whole
                self.host.shown(v)
        if p is not None and requested:
            self.fill(p)
        self.fill_all()

    def on_not_stored(self, e: ev.ChunkNotStored) -> None:
        """A local failure to keep a chunk: forget the request, blame nobody, back off."""
        st = self.versions.get(e.version)
        p = self.peers.get(e.conn)
        if st is None or not 0 <= e.index < st.chunk_count:
            return
        if p is not None:
            p.busy = False
            self.requests.forget(p, (e.version, e.index), self.versions)
        self.host.counters.local_faults += 1
        if p is not None and (p.is_origin or p.border):
            # A pushed or relayed chunk (one copy per region): the sender takes it for
            # delivered until a HAVE that will not come. Stepping down as a border makes
            # the origin re-plan it through the region's other borders at once.
            self.host.close(p, "local store fault: not taking pushed chunks", "warning")
        self.hold_s = min(30.0, max(1.0, self.hold_s * 2))
        self.hold_until = self.host.now + self.hold_s
        self.host.log("error", "chunk_not_stored", version=e.version, index=e.index,
                      reason=e.reason, hold_s=self.hold_s)

    def on_whole(self, p: Peer, v: int, i: int) -> None:
        """Chunk ``i`` of ``v`` we asked ``p`` for is all here, being verified: cancel its
        twin requests to other peers now (``ChunkWhole``). Their answers' withdrawals then
        change nothing of what those peers hold (``cancelled``)."""
        st = self.versions.get(v)
        key = (v, i)
        if (st is None or not 0 <= i < st.chunk_count or (st.have >> i) & 1
                or key not in p.req):
            return
        twins = [q for c in self.requests.asked.get(key, ()) if c != p.conn
                 and (q := self.peers.get(c)) is not None]
        if not twins:
            return
        cf = wire.Cancel(v, [i]).encode()
        for q in twins:
            self.requests.forget(q, key, self.versions)
            if len(self.cancelled) < 4096:
                self.cancelled.add((q.conn, v, i))
            self.host.send(q, cf)

    def on_withdrawn(self, p: Peer, v: int, i: int) -> None:
        """``p`` withdrew chunk ``i`` of ``v`` it was sending us while it arrived there
        (``serve_arriving``): it does not hold it after all. Forget the request and
        the bit (its HAVE comes once it holds it), blame nobody, ask elsewhere."""
        p.busy = False
        if (v, i) in p.req:
            self.requests.forget(p, (v, i), self.versions)
        st = self.versions.get(v)
        cancelled = (p.conn, v, i) in self.cancelled
        if cancelled:
            self.cancelled.discard((p.conn, v, i))
        if cancelled or (st is not None and (st.have >> i) & 1):
            # the answer we cancelled (an endgame twin), stopped: not a chunk that failed
            # to arrive at p, and what p holds is unchanged
            self.fill_all()
            return
        self.host.counters.withdrawn += 1
        self._not_coming(p, v, i)
        self.fill_all()

    def _on_bad_chunk(self, p: Peer | None, st: VersionState, i: int) -> None:
        v = st.version
        self.host.counters.bad_chunks += 1
        self.host.log("warning", "bad_chunk", version=v, index=i, peer=p.node_id if p else None)
        if p is not None:
            bit = 1 << i
            old = p.bits.get(v, 0)
            if old & bit:  # never ask this peer for that chunk again
                p.bits[v] = old & ~bit
                if p.coming:
                    self._uncome(p, v, bit)
                if st.avail is not None and p.can_req:
                    st.avail[i] -= 1
            # counted per node id: a reconnect does not wipe the slate
            n = self.host.strike(p.node_id)
            if n >= self.cfg.max_bad_chunks:
                self.host.ban(p.node_id, f"sent {n} corrupt chunks")
                return
        self.fill_all()

    def on_sent(self, e: ev.ChunkSent) -> None:
        p = self.peers.get(e.conn)
        st = self.versions.get(e.version)
        key = (e.conn, e.version, e.index)
        if self.uploads.finish_relay(key):
            if e.withdrawn:
                self.host.role.on_withdrawn(*key)
            else:
                self.host.role.on_relay_sent(*key)
        elif not self.host.role.on_sent(*key):
            self.uploads.finish(key)
        # a withdrawn chunk's last block never left: no chunk was delivered
        if not e.withdrawn and p is not None and st is not None and 0 <= e.index < st.chunk_count:
            self.host.counters.sent(p.kind, self.cfg.region, p.region, st.chunk_length(e.index))
        self.pump()
        self.wake_refused()
        self.host.role.after_sent()

    def wake_refused(self) -> None:
        """A slot is free: ping the peer we turned away longest ago, so it asks again.

        Without this a refused peer waits until we happen to send it a HAVE (or
        the next heartbeat), and a node with few neighbours falls behind.
        """
        while (conn := self.uploads.next_refused()) is not None:
            p = self.peers.get(conn)
            if p is not None and p.state is READY:
                self.host.send(p, wire.Ping().encode())
                return

    def pump(self) -> None:
        def size_of(conn: int, v: int, i: int) -> int | None:
            st = self.versions.get(v)
            if conn not in self.peers or st is None or not (st.have >> i) & 1:
                return None
            return st.chunk_length(i)

        for conn, v, i, _size in self.uploads.pump(size_of):
            self.host.send_chunk(conn, v, i)

    # ---- timers and planning
    def expire(self, p: Peer, now: float) -> int:
        """Forget ``p``'s requests older than ``request_timeout_s``; how many (counted on ``p``)."""
        limit = self.cfg.request_timeout_s
        expired = [k for k, t in p.req.items() if now - t > limit]
        for k in expired:
            self.requests.forget(p, k, self.versions)
            p.timeouts += 1
        return len(expired)

    def slow_outlier(self, peers: list[Peer]) -> tuple[Peer, float] | None:
        """The slowest of ``peers`` and the median, if it is a timing outlier."""
        if len(peers) < 3:
            return None
        times = sorted(p.ewma for p in peers)
        median = times[len(times) // 2]
        worst = max(peers, key=lambda p: p.ewma)
        if median > 0 and worst.ewma > self.cfg.slow_factor * median:
            return worst, median
        return None

    def track(self, wanted: list[int]) -> None:
        """Count who holds each chunk of the ``wanted`` versions (and only of those)."""
        states = self.versions.states
        for v in wanted:
            st = states[v]
            if st.avail is None:
                av = [0] * st.chunk_count
                for p in self.peers.values():
                    if p.state is READY and p.can_req:
                        for i in iter_bits(p.bits.get(v, 0) & st.full):
                            av[i] += 1
                st.avail = av
        for v, st in states.items():
            if st.avail is not None and v not in wanted:
                st.avail = None
