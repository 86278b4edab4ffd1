"""Waiting for what a test expects, not for a fixed time.

A test that sleeps a fixed time and then asserts that something happened fails on a
loaded 2-core CI box where the event loop got there later (a 0.3 s quiet period once saw
nothing of a window of chunks). ``eventually`` polls instead: it returns as soon as the
condition holds and fails, naming what it waited for, only after ``timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(cond: Callable[[], object], what: str, timeout: float = 30.0,
                     step: float = 0.01) -> None:
    """Poll ``cond`` every ``step`` seconds until it is true; AssertionError naming ``what``
    after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(step)
