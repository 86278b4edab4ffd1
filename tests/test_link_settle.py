"""Blocks placed while the reader lags (``Link.place_with`` with ``filled`` and
``neutral``): the link settles each placed block with the assembler as it completes, so
the next one is placed even while earlier messages wait in the queue; a queued message
that may move the assembler (an unplaced block, a withdrawal) holds placing back until it
is taken. Checked with the real ``LinkProtocol`` and ``wire.BlockAssembler`` and a reader
shaped like ``node.driver``'s, over random streams, read sizes and reader lags."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from node.link import PREFACE, LinkProtocol, Placed
from swarm.protocol import wire
from tests.test_link import MAX, _feed, _frame, _Transport

CONTROL = b"\x93\x01\x02\x03"  # a msgpack array: what a control frame starts with


def _leaves_blocks_alone(data: bytes | bytearray) -> bool:  # as node.driver's
    return data[:2] != b"PS"


class Reader:
    """The receiving side: a link whose placer is a block assembler, and a reader that
    takes messages as ``node.driver._reader`` does, only when told to (its lag)."""

    def __init__(self, settle: bool) -> None:
        self.asm = wire.BlockAssembler()
        self.p = LinkProtocol(MAX)
        self.p.connection_made(_Transport())  # type: ignore[arg-type]
        self.whole: list[tuple[int, int, bytes]] = []
        self.progress: list[tuple[tuple[int, int], int]] = []
        self.withdrawn: list[tuple[int, int]] = []
        self.controls = 0
        self.placed = self.copied = 0
        kw: dict[str, Any] = {}
        if settle:
            kw = {"filled": self._filled, "neutral": _leaves_blocks_alone}
        self.p.link.place_with(self._place, wire.BLOCK_HEADER_LEN, **kw)

    def _place(self, header: bytes, n: int) -> memoryview | None:
        if not wire.is_block_message(header):
            return None
        return self.asm.place(header, n)

    def _filled(self, p: Placed) -> bool:
        whole = self.asm.placed()
        a = self.asm
        p.info = (whole, None if whole else (a.pending, a.received))
        return True

    def _done(self, whole: Any, at: Any) -> None:
        if whole is not None:
            self.whole.append((whole[0], whole[1], bytes(whole[2])))
        else:
            self.progress.append(at)

    async def take(self, k: int) -> None:
        for _ in range(k):
            if not self.p.queue:
                return
            m = await self.p.link.recv()
            if isinstance(m, Placed):
                self.placed += 1
                if m.settled:
                    self._done(*m.info)
                else:
                    whole = self.asm.placed()
                    self._done(whole, None if whole else (self.asm.pending, self.asm.received))
            elif wire.is_block_message(m):
                self.copied += 1
                whole = self.asm.feed(m)
                self._done(whole, None if whole else (self.asm.pending, self.asm.received))
            elif wire.is_withdraw_message(m):
                self.withdrawn.append(self.asm.withdraw(m))
            else:
                assert bytes(m) == CONTROL
                self.controls += 1


def _stream(draw: Any) -> tuple[list[bytes], list[tuple[int, int, bytes]], list[tuple[int, int]], int]:
    """Messages a sender puts on one link: chunks as blocks (some withdrawn part way, as
    a cut-through relay's or a stopped answer's), control frames between any two."""
    msgs: list[bytes] = []
    whole: list[tuple[int, int, bytes]] = []
    withdrawn: list[tuple[int, int]] = []
    controls = 0
    for i in range(draw(st.integers(1, 5))):
        block = draw(st.sampled_from([17_000, 24_000, 40_000]))
        nblocks = draw(st.integers(1, 4))
        length = block * nblocks - draw(st.integers(0, 1000))
        data = os.urandom(length)
        cut = draw(st.integers(0, nblocks)) if draw(st.booleans()) else nblocks
        for b in range(cut):
            off = b * block
            msgs.append(wire.pack_block_header(1, i, length, off) + data[off:off + block])
            if draw(st.booleans()):
                msgs.append(CONTROL)
                controls += 1
        if cut < nblocks:
            msgs.append(wire.pack_withdraw(1, i))
            withdrawn.append((1, i))
        else:
            whole.append((1, i, data))
    return msgs, whole, withdrawn, controls


@settings(max_examples=60, deadline=None)
@given(data=st.data(), settle=st.booleans())
def test_blocks_arrive_whole_and_in_order_whatever_the_reader_lags(data: Any, settle: bool) -> None:
    msgs, whole, withdrawn, controls = _stream(data.draw)
    reads = data.draw(st.lists(st.integers(1_000, 70_000), min_size=1, max_size=6))
    lags = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6))

    async def run() -> Reader:
        r = Reader(settle)
        wire_bytes = PREFACE + b"".join(_frame(m) for m in msgs)
        for k, pos in enumerate(range(0, len(wire_bytes), 50_000)):  # reader turns
            _feed(r.p, wire_bytes[pos:pos + 50_000], reads)
            await r.take(lags[k % len(lags)])
        await r.take(len(msgs) + 1)
        return r

    r = asyncio.run(run())
    assert not r.p.closed, r.p.reason
    assert r.whole == whole
    assert r.withdrawn == withdrawn and r.controls == controls
    assert r.placed + r.copied == sum(1 for m in msgs if wire.is_block_message(m))
    for key, got in r.progress:  # what the reader saw of a chunk in progress, block by block
        assert key is not None and got > 0


def test_a_lagging_reader_gets_its_blocks_placed_only_with_settling() -> None:
    """Eight blocks of one chunk, a control frame after each, all read (in small reads,
    as off a thin link) before the reader takes anything: settled, every block is
    placed; without, only the first."""
    length = 8 * 30_000
    data = os.urandom(length)
    msgs = []
    for b in range(8):
        msgs += [wire.pack_block_header(1, 0, length, b * 30_000) + data[b * 30_000:(b + 1) * 30_000],
                 CONTROL]
    stream = PREFACE + b"".join(_frame(m) for m in msgs)
    for settle, placed in ((True, 8), (False, 1)):
        async def run(settle: bool = settle) -> Reader:
            r = Reader(settle)
            _feed(r.p, stream, [8_000])
            await r.take(len(msgs))
            return r

        r = asyncio.run(run())
        assert r.whole == [(1, 0, data)]
        assert (r.placed, r.copied) == (placed, 8 - placed)


def test_a_queued_withdrawal_holds_placing_back_until_it_is_taken() -> None:
    """A withdrawal waits in the queue: the next chunk's first block is not placed (the
    assembler still has the withdrawn chunk in progress), and nothing breaks."""
    a, b = os.urandom(60_000), os.urandom(60_000)
    msgs = [wire.pack_block_header(1, 0, 60_000, 0) + a[:30_000], wire.pack_withdraw(1, 0),
            wire.pack_block_header(1, 1, 60_000, 0) + b[:30_000],
            wire.pack_block_header(1, 1, 60_000, 30_000) + b[30_000:]]

    async def run() -> Reader:
        r = Reader(True)
        _feed(r.p, PREFACE + b"".join(_frame(m) for m in msgs), [8_000])
        await r.take(len(msgs))
        return r

    r = asyncio.run(run())
    assert r.withdrawn == [(1, 0)] and r.whole == [(1, 1, b)]
    assert (r.placed, r.copied) == (1, 2)  # only the first block: the rest came behind the PSW1
