"""Our outstanding chunk requests, and the policy that picks which chunks to ask for.

``Requests`` is the bookkeeping (who was asked for what, the per-node budget,
endgame twins); the choice among candidate chunks is a swappable policy
(``RarestFirst`` by default), as Kraken separates its piece-request manager
from ``rarest_first_policy``.
"""

from __future__ import annotations

import random
from typing import Protocol

from swarm.protocol.config import CoreConfig
from swarm.protocol.counters import Counters
from swarm.protocol.peer import Peer
from swarm.protocol.picker import iter_bits, pick_some, popcount
from swarm.protocol.versions import VersionSet

Key = tuple[int, int]  # (version, chunk index)


class PickPolicy(Protocol):
    def pick(self, cand: int, avail: list[int], k: int) -> list[int]:
        """Up to ``k`` chunks of the bitset ``cand``; ``avail[i]`` peers hold chunk ``i``."""
        ...


class RarestFirst:
    """The chunks held by the fewest peers first; ties broken uniformly at random."""

    __slots__ = ("rng",)

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, cand: int, avail: list[int], k: int) -> list[int]:
        return pick_some(cand, avail, self.rng, k)


class Requests:
    """Requests we have out: per peer in ``Peer.req``, per chunk in ``asked``."""

    __slots__ = ("asked", "budget", "cfg", "counters", "early", "first", "n", "policy",
                 "twin_due")

    def __init__(self, cfg: CoreConfig, policy: PickPolicy,
                 counters: Counters | None = None) -> None:
        self.cfg = cfg
        self.policy = policy
        self.counters = counters  # ``endgame_twins`` counted there
        self.n = 0  # outstanding requests, all peers
        self.budget = cfg.max_requests
        self.asked: dict[Key, list[int]] = {}  # (v, i) -> conns asked
        # (v, i) -> (when it was first asked for, the chunk time expected of that peer):
        # while ``asked`` has the key (``twin_ready``)
        self.first: dict[Key, tuple[float, float]] = {}
        # the earliest time a twin held back by ``twin_ready`` may go (the core wakes then)
        self.twin_due: float | None = None
        # requests for chunks only arriving at the peer asked (COMING): (conn, v, i)
        self.early: set[tuple[int, int, int]] = set()

    @property
    def full(self) -> bool:
        return self.n >= self.budget

    def plan(self, p: Peer, versions: VersionSet, now: float) -> list[tuple[int, list[int]]]:
        """Top up our pipeline to ``p`` (policy first, then endgame); ``[(version, picks)]`` to send."""
        if not p.can_req or p.busy or not versions.wanted:
            return []
        c = self.cfg
        room = min(c.pipeline - len(p.req), self.budget - self.n)
        if room <= 0:
            return []
        out: list[tuple[int, list[int]]] = []
        for v in versions.wanted:
            pb = p.bits.get(v)
            if not pb:
                continue
            st = versions.states[v]
            avail = st.avail
            assert avail is not None  # every wanted version counts its holders
            missing = st.full & ~st.have
            cand = pb & missing & ~st.inflight
            coming = p.coming.get(v, 0) & cand if p.coming else 0
            if coming:
                # Chunks the peer only has arriving come no faster than they arrive there:
                # ask for one only when the peer holds nothing else we miss, and keep at
                # most ``early_requests`` such requests out (one per peer).
                if cand & ~coming:
                    cand &= ~coming
                    coming = 0
                elif len(self.early) >= c.early_requests:
                    cand = 0
                else:
                    room = 1
            short = cand & st.short
            if short:  # a patch's short last chunk first: it costs next to nothing now
                i = short.bit_length() - 1
                picks = [i] + (self.policy.pick(cand & ~short, avail, room - 1)
                               if room > 1 and cand & ~short else [])
            else:
                picks = self.policy.pick(cand, avail, room) if cand else []
            if not picks and popcount(missing) <= c.endgame_chunks:
                # endgame: everything missing is in flight; ask a second peer once
                cand = pb & missing & ~st.dups
                for key in p.req:
                    if key[0] == v:
                        cand &= ~(1 << key[1])
                if cand and c.endgame_twin_after_s > 0:
                    cand = self.twin_ready(v, cand, p, now)
                if cand:
                    picks = self.policy.pick(cand, avail, room)
                    if self.counters is not None:
                        self.counters.endgame_twins += len(picks)
                    d = st.dups
                    for i in picks:
                        d |= 1 << i
                    st.dups = d
            if not picks:
                continue
            infl = st.inflight
            for i in picks:
                key = (v, i)
                if (coming >> i) & 1:
                    self.early.add((p.conn, v, i))
                p.req[key] = now
                lst = self.asked.get(key)
                if lst is None:
                    self.asked[key] = [p.conn]
                    # an answer from a chunk only arriving there comes at that pace, which
                    # the peer's chunk time does not say: no expectation of it
                    self.first[key] = (now, p.ewma if p.samples and not (coming >> i) & 1
                                       else 0.0)
                else:
                    lst.append(p.conn)
                infl |= 1 << i
            st.inflight = infl
            self.n += len(picks)
            out.append((v, picks))
            room -= len(picks)
            if room <= 0:
                break
        return out

    def twin_ready(self, v: int, cand: int, p: Peer, now: float) -> int:
        """The chunks of ``cand`` (each in flight from another peer) a twin may be asked
        of ``p`` for now: its first request is ``endgame_twin_after_s`` old and overdue
        (older than the chunk time expected of its peer), or ``p`` is expected to deliver
        before that peer does. A twin asked at once shared the requester's link with the
        copy it doubled: on a LAN both came whole, each at half speed (round 60). The
        rest wait; ``twin_due`` says when the first of them may go."""
        after = self.cfg.endgame_twin_after_s
        mine = p.ewma if p.samples else 0.0
        first, out = self.first, 0
        for i in iter_bits(cand):
            f = first.get((v, i))
            if f is None:  # no request for it is out: not a twin
                out |= 1 << i
                continue
            at, expect = f
            # in absolute times, as the wake-up is: ``now - at >= after`` may round false
            # at ``now == at + after`` and wake the core at that same time forever
            held, late = at + after, at + expect
            if now >= held and (now >= late or now + mine < late):
                out |= 1 << i
                continue
            due = held if now < held else late  # later than now either way
            if self.twin_due is None or due < self.twin_due:
                self.twin_due = due
        return out

    def forget(self, p: Peer, key: Key, versions: VersionSet) -> bool:
        """Forget our request ``key`` to ``p``; True if it was outstanding."""
        if p.req.pop(key, None) is None:
            return False
        self.n -= 1
        if self.early:
            self.early.discard((p.conn, *key))
        lst = self.asked.get(key)
        if lst is not None:
            if p.conn in lst:
                lst.remove(p.conn)
            if not lst:
                del self.asked[key]
                self.first.pop(key, None)
                st = versions.states.get(key[0])
                if st is not None:
                    st.inflight &= ~(1 << key[1])
        return True

    def arrived(self, key: Key, peers: dict[int, Peer]) -> list[Peer]:
        """Chunk ``key`` is ours: drop every request for it; the peers to send CANCEL to."""
        lst = self.asked.pop(key, None)
        self.first.pop(key, None)
        if not lst:
            return []
        out = []
        for conn in lst:
            q = peers.get(conn)
            if q is not None and q.req.pop(key, None) is not None:
                self.n -= 1
                out.append(q)
            if self.early:
                self.early.discard((conn, *key))
        return out
