"""A node's CPU as FIFO jobs on a few cores (hashing, storing, applying).

A job of ``d`` seconds submitted at ``t`` starts on the core that frees first
(no earlier than ``t``) and ends ``d`` later. A node's jobs run on its own
cores; when the scenario puts the whole fleet on one machine
(``[cpu] host_cores``, the emulated WAN), each job also needs a core of that
shared pool, so 11 node processes on 2 cores queue behind each other. Only
the end time of each job is computed: no events, O(cores) per job.
"""

from __future__ import annotations


class Cores:
    """``n`` cores, each known by the time it becomes free."""

    __slots__ = ("busy_s", "free")

    def __init__(self, n: int) -> None:
        self.free = [0.0] * max(1, n)
        self.busy_s = 0.0  # CPU seconds of work done (reported)

    def _first(self) -> int:
        free = self.free
        return 0 if len(free) == 1 else min(range(len(free)), key=free.__getitem__)


def run_job(now: float, seconds: float, own: Cores, shared: Cores | None = None) -> float:
    """Queue a job of ``seconds`` on ``own`` (and one core of ``shared``); return its end."""
    i = own._first()
    start = max(now, own.free[i])
    j = 0
    if shared is not None:
        j = shared._first()
        start = max(start, shared.free[j])
        shared.free[j] = start + seconds
        shared.busy_s += seconds
    own.free[i] = start + seconds
    own.busy_s += seconds
    return start + seconds
