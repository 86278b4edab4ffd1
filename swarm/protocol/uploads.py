"""Upload slots: the chunks we are sending, the queue behind them, the peers we turned away."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable

Upload = tuple[int, int, int]  # (conn, version, index)


class Offer(enum.Enum):
    SEND = "send"  # a slot was free: send it now
    QUEUED = "queued"  # waits for a slot
    REFUSED = "refused"  # no slot, queue full: REJECT it


class UploadSlots:
    """At most ``slots`` chunks in flight (answers to requests); relays are counted apart.
    Answers sent while the chunk still arrives here (``early``) take only a slot that
    is free of all others, and do not hold it against chunks held here: those go at
    the pace the chunk comes in, and must not keep out chunks that would leave at
    full speed."""

    __slots__ = ("active", "early", "queue", "queue_len", "refused", "relays", "slots")

    def __init__(self, slots: int, queue_len: int) -> None:
        self.slots = slots
        self.queue_len = queue_len
        self.active: set[Upload] = set()
        self.early: set[Upload] = set()
        self.queue: deque[Upload] = deque()
        self.relays: set[Upload] = set()  # RELAY orders being carried out
        self.refused: dict[int, None] = {}  # conns turned away for want of a slot, oldest first

    def __len__(self) -> int:
        return len(self.active)

    def offer(self, conn: int, v: int, i: int, early: bool = False) -> Offer:
        if early:  # still arriving here: only a slot nothing else uses, no queue
            if len(self.early) + len(self.active) < self.slots:
                self.early.add((conn, v, i))
                return Offer.SEND
            return Offer.REFUSED
        if len(self.active) < self.slots:
            self.active.add((conn, v, i))
            return Offer.SEND
        if len(self.queue) < self.queue_len:
            self.queue.append((conn, v, i))
            return Offer.QUEUED
        if len(self.refused) < 64:
            self.refused[conn] = None
        return Offer.REFUSED

    def cancel(self, conn: int, v: int, indices: Iterable[int]) -> None:
        if self.queue:
            drop = {(conn, v, i) for i in indices}
            self.queue = deque(q for q in self.queue if q not in drop)

    def sending(self, conn: int, v: int, i: int) -> bool:
        """An answer to ``conn``'s request for chunk ``i`` of ``v`` is under way (not a
        relay, not queued)."""
        key = (conn, v, i)
        return key in self.active or key in self.early

    def relay(self, conn: int, v: int, i: int) -> None:
        self.relays.add((conn, v, i))

    def finish_relay(self, key: Upload) -> bool:
        if key in self.relays:
            self.relays.discard(key)
            return True
        return False

    def finish(self, key: Upload) -> None:
        self.active.discard(key)
        self.early.discard(key)

    def drop_conn(self, conn: int) -> bool:
        """Forget a connection's uploads; True if slots were in use (worth a ``pump``)."""
        if self.relays:
            self.relays = {r for r in self.relays if r[0] != conn}
        if self.early:
            self.early = {u for u in self.early if u[0] != conn}
        if self.active:
            self.active = {u for u in self.active if u[0] != conn}
            return True
        return False

    def pump(self, size_of: Callable[[int, int, int], int | None]) -> list[tuple[int, int, int, int]]:
        """Start queued uploads while slots are free: ``[(conn, v, i, size)]``.

        ``size_of`` gives the chunk's length, or None if it can no longer be sent.
        """
        out = []
        q = self.queue
        while q and len(self.active) < self.slots:
            conn, v, i = q.popleft()
            size = size_of(conn, v, i)
            if size is None:
                continue
            self.active.add((conn, v, i))
            out.append((conn, v, i, size))
        return out

    def next_refused(self) -> int | None:
        """A slot is free: the conn turned away longest ago (removed), or None."""
        r = self.refused
        if r and len(self.active) < self.slots:
            conn = next(iter(r))
            del r[conn]
            return conn
        return None
