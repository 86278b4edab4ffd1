"""HAVE announcements: batched per window, and sent only to the peers that can use them."""

from __future__ import annotations

from collections.abc import Iterable

from swarm.protocol import wire
from swarm.protocol.handshake import READY
from swarm.protocol.peer import Peer


class HaveBatch:
    """Chunks gained and not yet announced, at most one burst per ``window`` seconds.

    Batching is a rate limit, not a delay: a chunk that arrives after a quiet
    spell is announced at once, so every store-and-forward hop does not pay
    the window.
    """

    __slots__ = ("_next", "due", "pending", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self.pending: dict[int, list[int]] = {}  # version -> indices, in arrival order
        self.due: float | None = None  # a flush is owed at this time
        self._next = float("-inf")  # HAVEs may go out at once from then on

    def add(self, v: int, i: int, now: float) -> bool:
        """Queue chunk ``i`` of ``v``; True if the batch should be flushed now."""
        lst = self.pending.get(v)
        if lst is None:
            self.pending[v] = [i]
        else:
            lst.append(i)
        if self.due is not None:
            return False
        if now >= self._next:
            return True
        self.due = self._next
        return False

    def take(self, now: float) -> dict[int, list[int]]:
        """Everything pending (the window restarts now)."""
        self.due = None
        self._next = now + self.window
        pending, self.pending = self.pending, {}
        return pending


def have_frames(v: int, idx: list[int], peers: Iterable[Peer], *,
                to_origin: bool) -> list[tuple[Peer, bytes]]:
    """(peer, HAVE frame) for every READY peer that knows ``v`` and lacks some of ``idx``.

    The origin hears HAVEs only from its borders (``to_origin``). A peer gets
    HAVEs only for chunks it lacks (it never asks for the others): this halves
    the HAVE frames of an epidemic spread. Frames going to many peers are
    encoded once.
    """
    step = wire.MAX_INDICES
    have = wire.Have.pack
    frames = [have(v, idx[k:k + step]) for k in range(0, len(idx), step)]
    out: list[tuple[Peer, bytes]] = []
    mask = 0
    for i in idx:
        mask |= 1 << i
    for p in peers:
        if p.state is not READY:
            continue
        pb = p.bits.get(v)
        if pb is None:
            continue
        if p.coming:  # chunks only arriving there are still missing there
            pb &= ~p.coming.get(v, 0)
        if p.is_origin:
            if not to_origin:
                continue
        elif mask & ~pb != mask:
            rest = [i for i in idx if not (pb >> i) & 1]
            for k in range(0, len(rest), step):
                out.append((p, have(v, rest[k:k + step])))
            continue
        for fr in frames:
            out.append((p, fr))
    return out
