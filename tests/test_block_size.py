"""Chunk blocks sized by the link's measured rate (``Driver._block_size``, round 56).

A writer sends a chunk in blocks of ``wire.BLOCK_BYTES``, or up to ``max_block`` (1 MiB)
on a link whose measured rate carries one in ``BLOCK_HOL_S``: fewer passes through the
writer and the reader per byte where a control frame waits only milliseconds behind a
block anyway. These run the driver's real writer over a real TCP link on loopback
(BBR where the kernel has it) and read the link messages at the far end: the sizes of
the blocks, and the bytes they put together.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from node.driver import MAX_BLOCK_BYTES, Arrival, Conn, Driver
from node.tcp import link_rate, set_congestion
from swarm.protocol import wire
from tests.test_cut_through import _driver, _link, _quiet, _running, _take

WARM = 8 * MAX_BLOCK_BYTES  # a first chunk: the link's rate is measured while it goes


def _arrival(payload: bytes, *, stored: bool) -> Arrival:
    a = Arrival(conn=99, buf=memoryview(bytearray(payload)), length=len(payload))
    if stored:
        a.got, a.state = len(payload), "stored"
    return a


async def _blocks(messages: asyncio.Queue, n: int) -> tuple[list[int], bytes]:
    """The far end: the blocks of one chunk of ``n`` bytes, their sizes and the chunk."""
    asm = wire.BlockAssembler()
    sizes: list[int] = []
    out = None
    while out is None:
        msg = await asyncio.wait_for(messages.get(), 10)
        sizes.append(len(msg) - wire.BLOCK_HEADER_LEN)
        out = asm.feed(msg)
    assert out[2] is not None and len(out[2]) == n
    return sizes, bytes(out[2])


@contextlib.asynccontextmanager
async def _warm_link(max_block: int | None = None
                     ) -> AsyncIterator[tuple[asyncio.Queue, Driver, Conn]]:
    """A driver's writer on a real loopback link that has carried one chunk (``WARM``
    bytes, whose blocks are returned first in the queue's place: already taken)."""
    messages: asyncio.Queue = asyncio.Queue()
    server, link = await _link(messages)
    drv = _driver([])
    if max_block is not None:
        drv.max_block = max_block
    sock = link.get_extra_info("socket")
    set_congestion(sock, "bbr")  # as shipped; where the kernel refuses: its delivery rate
    c = Conn(id=7, link=link, outbound=True, addr="peer", sock=sock)
    warm = os.urandom(WARM)
    drv.arrivals[(2, 0)] = _arrival(warm, stored=True)
    c.data.append((2, 0, True))
    c.wake.set()
    async with _running(drv, c, server):
        _sizes, got = await _blocks(messages, WARM)
        assert got == warm
        yield messages, drv, c


def _send(drv: Driver, c: Conn, index: int, a: Arrival) -> None:
    drv.arrivals[(2, index)] = a
    c.data.append((2, index, True))
    c.wake.set()


def test_a_fast_link_sends_a_chunk_in_large_blocks() -> None:
    asyncio.run(_fast())


async def _fast() -> None:
    async with _warm_link() as (messages, drv, c):
        rate = link_rate(c.sock)
        assert rate is not None and rate * 0.010 >= MAX_BLOCK_BYTES  # loopback: GB/s
        n = 4 * MAX_BLOCK_BYTES + 1000
        payload = os.urandom(n)
        _send(drv, c, 1, _arrival(payload, stored=True))
        sizes, got = await _blocks(messages, n)
        assert got == payload
        assert c.block_bytes == MAX_BLOCK_BYTES
        assert sizes == [MAX_BLOCK_BYTES] * 4 + [1000]
        # a smaller chunk goes in four blocks at least (whole BLOCK_BYTES)
        for n, block in ((2 * MAX_BLOCK_BYTES, MAX_BLOCK_BYTES // 2),
                         (MAX_BLOCK_BYTES + 7, wire.BLOCK_BYTES)):
            payload = os.urandom(n)
            _send(drv, c, 2 + n % 2, _arrival(payload, stored=True))
            sizes, got = await _blocks(messages, n)
            assert got == payload
            assert sizes == [block] * (n // block) + ([n % block] if n % block else [])


def test_max_block_keeps_a_fast_link_at_small_blocks() -> None:
    asyncio.run(_capped())


async def _capped() -> None:
    async with _warm_link(max_block=wire.BLOCK_BYTES) as (messages, drv, c):
        n = MAX_BLOCK_BYTES + 5
        payload = os.urandom(n)
        _send(drv, c, 1, _arrival(payload, stored=True))
        sizes, got = await _blocks(messages, n)
        assert got == payload and c.block_bytes == wire.BLOCK_BYTES
        assert sizes == [wire.BLOCK_BYTES] * (MAX_BLOCK_BYTES // wire.BLOCK_BYTES) + [5]


def test_a_link_with_no_rate_or_with_lanes_keeps_small_blocks() -> None:
    asyncio.run(_no_rate())


async def _no_rate() -> None:
    assert link_rate(None) is None
    with socket.socket() as fresh:  # nothing sent on it: no rate
        assert link_rate(fresh) is None
    drv = _driver([])
    c: Any = Conn(id=1, link=None, outbound=True, addr="peer")  # type: ignore[arg-type]
    assert c.sock is None and drv._block_size(c) == wire.BLOCK_BYTES
    c.lanes = [object()]
    c.sock = object()  # never asked: a striped link's blocks are numbered in BLOCK_BYTES
    assert drv._block_size(c) == wire.BLOCK_BYTES


def test_a_relay_on_a_fast_link_sends_the_whole_small_blocks_that_came() -> None:
    """Cut-through keeps its pace: a large block not all here yet goes as the whole
    ``BLOCK_BYTES`` blocks that are, and the last block still waits for the chunk to be
    verified here."""
    asyncio.run(_relay())


async def _relay() -> None:
    async with _warm_link() as (messages, drv, c):
        n = 5 * MAX_BLOCK_BYTES + 1000
        payload = os.urandom(n)
        a = _arrival(payload, stored=False)
        _send(drv, c, 1, a)
        asm = wire.BlockAssembler()
        assert await _quiet(messages)  # nothing here: nothing goes
        a.got = wire.BLOCK_BYTES + 1000
        a.changed()
        assert await _take(messages, asm, wire.BLOCK_BYTES) is None
        assert asm.received == wire.BLOCK_BYTES and await _quiet(messages)
        assert c.block_bytes == MAX_BLOCK_BYTES
        a.got = 3 * wire.BLOCK_BYTES + 5  # two more whole blocks: in one
        a.changed()
        msg = await asyncio.wait_for(messages.get(), 5)
        assert len(msg) - wire.BLOCK_HEADER_LEN == 2 * wire.BLOCK_BYTES
        assert asm.feed(msg) is None and await _quiet(messages)
        a.got = n  # all here, not verified: large blocks up to the last, which waits
        a.changed()
        sizes = []
        while asm.received < n - 1000:
            msg = await asyncio.wait_for(messages.get(), 5)
            sizes.append(len(msg) - wire.BLOCK_HEADER_LEN)
            assert asm.feed(msg) is None
        assert sizes == [MAX_BLOCK_BYTES] * 4 + [wire.BLOCK_BYTES]
        assert await _quiet(messages)
        a.state = "stored"
        a.changed()
        out = await _take(messages, asm, n)
        assert out is not None and bytes(out[2]) == payload
