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
