"""A border's RELAY orders for chunks still on their way to it (relay on arrival).

The origin orders a relay as soon as it starts pushing the chunk to the border,
not after the border's HAVE: the order, the HAVE and its queueing behind the
origin's own pushes on a busy site uplink cost a round trip and more per
relayed chunk, while the region on the far side of the relay idles. The
border keeps such an order here and carries it out the moment the chunk is
stored (whoever sent it), or fails it loudly (RELAY_FAIL) when the target
leaves or the chunk does not come within ``request_timeout_s``.

Bounded: at most ``MAX_PENDING`` orders; one more is refused (RELAY_FAIL) at
once, so an origin cannot make a border hold unbounded state.
"""

from __future__ import annotations

MAX_PENDING = 256

Key = tuple[int, int]  # (version, index)


class PendingRelays:
    """RELAY orders waiting for their chunk: ``(version, index) -> (target id, deadline)``."""

    __slots__ = ("orders",)

    def __init__(self) -> None:
        self.orders: dict[Key, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self.orders)

    def add(self, v: int, i: int, target: str, deadline: float) -> bool:
        """Keep the order; False if it cannot be kept (full, or one for that chunk waits)."""
        if len(self.orders) >= MAX_PENDING or (v, i) in self.orders:
            return False
        self.orders[(v, i)] = (target, deadline)
        return True

    def take(self, v: int, i: int) -> str | None:
        """The chunk is here: the target of its order, if one waited."""
        entry = self.orders.pop((v, i), None)
        return entry[0] if entry is not None else None

    def to_target(self, target: str) -> list[Key]:
        """Drop and return the orders for ``target`` (it left: they fail)."""
        keys = [k for k, (t, _d) in self.orders.items() if t == target]
        for k in keys:
            del self.orders[k]
        return keys

    def expired(self, now: float) -> list[tuple[int, int, str]]:
        """Drop and return the orders whose chunk did not come in time."""
        out = [(v, i, t) for (v, i), (t, d) in self.orders.items() if d <= now]
        for v, i, _t in out:
            del self.orders[(v, i)]
        return out

    def next_deadline(self) -> float | None:
        return min((d for _t, d in self.orders.values()), default=None)

    def clear(self) -> None:
        self.orders.clear()


class RelaysOut:
    """The relays a border is carrying out, per target connection: ``(version, index)
    -> None`` while the chunk is being sent, the hand-off time once its last byte went
    to the kernel. While the target's TCP acknowledges bytes on that connection
    (``ev.Acked``) the border tells the origin these relays are alive (RELAY_ALIVE), so
    a relay over a long lossy path is not timed out and sent into the region twice.

    A handed-over relay is forgotten ``keep_s`` after its hand-off (the border never
    hears the target's HAVE: HAVEs go only to peers that lack the chunk), when it was
    withdrawn, or with its connection. Bounded: at most ``MAX_PENDING`` relays per
    connection, the oldest handed-over ones go first."""

    __slots__ = ("by_conn",)

    def __init__(self) -> None:
        self.by_conn: dict[int, dict[Key, float | None]] = {}

    def __len__(self) -> int:
        return sum(len(d) for d in self.by_conn.values())

    def started(self, conn: int, v: int, i: int) -> None:
        d = self.by_conn.setdefault(conn, {})
        d.pop((v, i), None)
        if len(d) >= MAX_PENDING:
            handed = [k for k, t in d.items() if t is not None]
            del d[handed[0] if handed else next(iter(d))]
        d[(v, i)] = None

    def handed(self, conn: int, v: int, i: int, now: float) -> None:
        d = self.by_conn.get(conn)
        if d is not None and (v, i) in d:
            d[(v, i)] = now

    def ended(self, conn: int, v: int, i: int) -> None:
        d = self.by_conn.get(conn)
        if d is not None:
            d.pop((v, i), None)
            if not d:
                del self.by_conn[conn]

    def drop(self, conn: int) -> None:
        self.by_conn.pop(conn, None)

    def alive(self, conn: int, now: float, keep_s: float) -> list[Key]:
        """The relays on ``conn`` to report alive now (forgets those handed over more
        than ``keep_s`` ago)."""
        d = self.by_conn.get(conn)
        if not d:
            return []
        for k in [k for k, t in d.items() if t is not None and now - t > keep_s]:
            del d[k]
        if not d:
            del self.by_conn[conn]
            return []
        return list(d)
