"""Requests that wait until this node serves a version: ``GET /status?wait_active=N``.

Whatever must know when a node serves version N (a controller beside the rollout engine,
the benchmarks, a deploy script) used to poll ``/status``. Each poll costs the node
about a millisecond of CPU on a small VM (the whole document built and encoded, an HTTP
round): ~1 % of a core for a poller at 10 Hz, which the test fleets were. A blocking
request costs nothing measurable while it waits (docs/benchmarks.md, round 61): the
driver wakes it when the active version reaches N, as Consul's blocking queries do. The request then answers with the usual document (and what the wait
came to), so a client needs no second call.

``ActiveWaiters`` is the loop-thread side: ``changed`` after every batch of the core's
actions (a comparison when nothing changed), ``wait`` per request, ``release_all`` when
the node drains.
"""

from __future__ import annotations

import asyncio
import math

from swarm.protocol.wire import MAX_VERSION

MAX_WAITERS = 256  # requests waiting at once; more get 503 (each holds a connection)
MAX_WAIT_S = 300.0  # the longest ``timeout_s`` a request may ask for
DEFAULT_WAIT_S = 30.0


class TooManyWaiters(Exception):
    """``MAX_WAITERS`` requests wait already."""


def parse_wait(query: dict[str, str]) -> tuple[int, float] | None:
    """``(version, timeout_s)`` from a ``/status`` query, None without ``wait_active``.
    ``ValueError`` naming the parameter for anything else than a version number
    (0..MAX_VERSION) and a timeout in (0, MAX_WAIT_S] seconds."""
    if "wait_active" not in query:
        if "timeout_s" in query:
            raise ValueError("timeout_s: only with wait_active=VERSION")
        return None
    raw = query["wait_active"]
    try:
        version = int(raw)
    except ValueError:
        raise ValueError(f"wait_active: a version number, got {raw[:40]!r}") from None
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"wait_active: must be in 0..{MAX_VERSION}, got {version}")
    raw_t = query.get("timeout_s", str(DEFAULT_WAIT_S))
    try:
        timeout = float(raw_t)
    except ValueError:
        raise ValueError(f"timeout_s: seconds, got {raw_t[:40]!r}") from None
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_WAIT_S):
        raise ValueError(f"timeout_s: must be over 0 and at most {MAX_WAIT_S:g}, got {raw_t[:40]}")
    return version, timeout


def reached(active: int | None, version: int) -> bool:
    """Whether a node serving ``active`` (None: nothing yet) serves ``version`` or later."""
    return active is not None and active >= version


class ActiveWaiters:
    """The requests waiting for an active version, woken as it changes (loop thread)."""

    def __init__(self, limit: int = MAX_WAITERS) -> None:
        self.limit = limit
        self.seen: int | None = None  # the active version as last told
        self.woken = 0  # requests woken by a version (not by their timeout)
        self._waiting: list[tuple[int, asyncio.Future[bool]]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def changed(self, active: int | None) -> None:
        """The node's active version is ``active`` now: wake who waited for it."""
        if active == self.seen:
            return
        self.seen = active
        if not self._waiting:
            return
        keep = []
        for version, fut in self._waiting:
            if not reached(active, version):
                keep.append((version, fut))
            elif not fut.done():
                fut.set_result(True)
                self.woken += 1
        self._waiting = keep

    async def wait(self, version: int, timeout_s: float) -> bool:
        """Until the active version is ``version`` or later (True) or ``timeout_s`` passed
        (False). ``TooManyWaiters`` where ``limit`` requests wait already."""
        if reached(self.seen, version):
            return True
        if len(self._waiting) >= self.limit:
            raise TooManyWaiters(f"{self.limit} requests wait already")
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = (version, fut)
        self._waiting.append(entry)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return False
        finally:  # timed out, answered, or the client went away (the handler is cancelled)
            if entry in self._waiting:
                self._waiting.remove(entry)

    def release_all(self) -> None:
        """The node drains: every waiting request answers now, with what it has."""
        for _, fut in self._waiting:
            if not fut.done():
                fut.set_result(False)
        self._waiting = []
