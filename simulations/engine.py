"""A discrete-event loop with a virtual clock.

Events are ``(time, seq, fn, arg)`` tuples on one binary heap. ``seq`` is a
global counter, so two events at the same virtual time always run in the order
they were scheduled: with seeded randomness everywhere else, the same scenario
gives the same event trace, the same numbers, on every run and machine.

Cancelling is lazy: whoever schedules keeps a token and ignores stale wakeups
(the flow model does this for finish times that moved). That keeps both
``schedule`` and ``run`` O(log n) with no heap surgery.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Callback = Callable[[Any], None]


class Engine:
    """Virtual clock plus the pending-event heap."""

    __slots__ = ("_heap", "_seq", "events", "now", "stopped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callback, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0  # events executed so far (reported as ``events``)
        self.stopped = False

    def schedule(self, at: float, fn: Callback, arg: Any = None) -> None:
        """Run ``fn(arg)`` at virtual time ``at`` (never earlier than now)."""
        if at < self.now:
            at = self.now
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, fn, arg))

    def after(self, delay: float, fn: Callback, arg: Any = None) -> None:
        self.schedule(self.now + delay, fn, arg)

    def pending(self) -> int:
        return len(self._heap)

    def stop(self) -> None:
        """Make ``run`` return after the event being executed."""
        self.stopped = True

    def run(
        self,
        until: float = float("inf"),
        max_events: int | None = None,
        on_batch: Callable[[], None] | None = None,
        batch: int = 20_000,
    ) -> None:
        """Execute events in time order until the heap empties, ``until`` or ``stop()``.

        ``on_batch`` is called every ``batch`` events (progress bars, checks);
        ``max_events`` bounds the loop so a livelocked protocol cannot spin forever.
        """
        heap = self._heap
        pop = heapq.heappop
        limit = max_events if max_events is not None else -1
        base = self.events
        n = 0
        self.stopped = False
        while heap and not self.stopped:
            if heap[0][0] > until:
                self.now = until
                break
            at, _, fn, arg = pop(heap)
            self.now = at
            fn(arg)
            n += 1
            if n == limit:
                break
            if on_batch is not None and n % batch == 0:
                self.events = base + n
                on_batch()
        self.events = base + n
