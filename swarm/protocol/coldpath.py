"""What a fresh connection costs into one region, against a used one (the origin's gate
for staying on used borders: ``OriginRole._stay_used``, ``_used_depth``).

Kept per region: the origin's own region is a LAN and each remote region has its own
round trip, so a push into one region says nothing about slow start into another. Mixed,
a push inside the origin's region (1 ms, 1 Gbit/s) against first pushes across a thin
site uplink read as slow start where the difference was bandwidth (the emulated WAN,
docs/benchmarks.md round 20).
"""

from __future__ import annotations

from collections import deque

# warm pushes whose fastest is ``warm_s``: about a version's worth of pushes into a
# region, so the minimum survives a version's start (whose first pushes queue) and still
# forgets a path that got slower
WARM_PUSHES = 64


class ColdPath:
    """``cold_s``: first full pushes over fresh border connections into the region (their
    TCP window at its start; EWMA). ``warm_s``: the fastest of the last ``WARM_PUSHES``
    full pushes over connections that had carried one (a window: a path that got slower
    is seen as slower). ``slow``: the first is ``factor`` x the second or more."""

    __slots__ = ("cold_s", "recent", "slow", "warm_s")

    def __init__(self) -> None:
        self.cold_s: float | None = None
        self.warm_s: float | None = None
        self.recent: deque[float] = deque(maxlen=WARM_PUSHES)
        self.slow = False

    def cold(self, dt: float) -> None:
        c = self.cold_s
        self.cold_s = dt if c is None else 0.7 * c + 0.3 * dt

    def warm(self, dt: float) -> None:
        self.recent.append(dt)
        self.warm_s = min(self.recent)

    def judge(self, factor: float) -> bool:
        """Whether ``slow`` changed: set from the current figures (``factor`` 0: never)."""
        slow = (factor > 0 and self.cold_s is not None and self.warm_s is not None
                and self.cold_s >= factor * self.warm_s)
        changed = slow != self.slow
        self.slow = slow
        return changed

    def depth(self, border_inflight: int) -> int:
        """Transfers a used border may hold at once: ``border_inflight``, or, while
        ``slow``, as many as still land before a chunk over a fresh connection would
        (``cold_s`` / ``warm_s`` - 1, at most 4 x ``border_inflight``): a chunk stacked n
        deep on a warm connection lands after about (n + 1) x ``warm_s``."""
        bi = border_inflight
        if not self.slow or not self.cold_s or not self.warm_s:
            return bi
        return max(bi, min(4 * bi, int(self.cold_s / self.warm_s) - 1))
