"""node.buffers: aligned buffers; the pool reuses one only once nothing references it."""

from __future__ import annotations

import gc
import itertools
import threading
import time

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from node.buffers import ALIGN, MIN_CLASS, POOL, POOLED_MIN, BufferPool, aligned_room, size_class


def _addr(view: memoryview) -> int:
    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


@given(st.integers(0, 1 << 34))
def test_size_classes_fit_waste_under_a_quarter_and_are_aligned(n: int) -> None:
    c = size_class(n)
    assert c >= n and c % ALIGN == 0
    if n > MIN_CLASS:
        assert c < n * 1.25
    assert size_class(c) == c  # a class is its own class
    assert size_class(n + 1) >= c  # monotone


def test_a_power_of_two_chunk_is_its_own_class() -> None:
    assert size_class(4 << 20) == 4 << 20
    assert size_class((4 << 20) + 1) == 5 << 20


@given(st.integers(0, 3 * MIN_CLASS))
@settings(max_examples=60)
def test_buffers_are_aligned_writable_and_whole_blocks(n: int) -> None:
    pool = BufferPool(limit_bytes=1 << 20)
    b = pool.take(n)
    assert len(b) == max(ALIGN, -(-n // ALIGN) * ALIGN)
    assert _addr(b) % ALIGN == 0 and not b.readonly
    b[:] = b"\x5a" * len(b)


def test_a_negative_size_is_refused_and_changes_nothing() -> None:
    pool = BufferPool(limit_bytes=1 << 20)
    with pytest.raises(ValueError, match="-1 bytes"):
        pool.take(-1)
    assert pool.stats() == {"taken": 0, "reused": 0, "allocated": 0, "out_bytes": 0,
                            "free_bytes": 0, "peak_out_bytes": 0}


def test_a_dropped_buffer_is_reused_and_a_referenced_one_is_not() -> None:
    pool = BufferPool(limit_bytes=64 << 20)
    a = pool.take(4 << 20)
    first = _addr(a)
    del a
    b = pool.take(4 << 20)
    assert _addr(b) == first and pool.reused == 1  # the same memory, no new pages
    b[:8] = b"12345678"
    kept = b[:8].toreadonly()  # a slice of it outlives the buffer itself
    del b
    c = pool.take(4 << 20)
    assert _addr(c) != first and pool.allocated == 2
    assert bytes(kept) == b"12345678"
    del kept
    d = pool.take(4 << 20)
    assert _addr(d) == first


def test_numpy_and_torch_views_hold_the_buffer() -> None:
    pool = BufferPool(limit_bytes=64 << 20)
    makers = [(lambda v: numpy.frombuffer(v, dtype=numpy.uint16),
               lambda a: a.view(numpy.uint8)[:4].tolist()),
              (lambda v: torch.frombuffer(v, dtype=torch.bfloat16),
               lambda a: a.view(torch.uint8)[:4].tolist())]
    for make, head in makers:
        b = pool.take(MIN_CLASS * 2)
        b[:] = bytes(range(256)) * (len(b) // 256)
        arr = make(b)
        at = _addr(b)
        del b
        gc.collect()
        other = pool.take(MIN_CLASS * 2)
        assert _addr(other) != at  # still held by the array
        other[:] = b"\xff" * len(other)
        assert head(arr) == [0, 1, 2, 3]
        del arr, other
        gc.collect()
        again = [pool.take(MIN_CLASS * 2) for _ in range(2)]
        assert at in {_addr(v) for v in again}  # back once the array went
        del again


def test_free_bytes_stay_under_the_limit_and_the_working_set() -> None:
    pool = BufferPool(limit_bytes=10 << 20)
    bufs = [pool.take(4 << 20) for _ in range(4)]  # 16 MiB out at the peak
    del bufs
    assert pool.free_bytes <= 10 << 20 and pool.out_bytes == 0
    small = BufferPool(limit_bytes=1 << 30)
    x = small.take(4 << 20)
    del x
    y = small.take(1 << 20)  # the free 4 MiB one holds it
    assert small.reused == 1 and small.peak_out_bytes == 4 << 20
    del y
    assert small.free_bytes == 4 << 20
    small.clear()
    assert small.free_bytes == 0


def test_an_apply_payload_takes_any_free_buffer_that_holds_it() -> None:
    pool = BufferPool(limit_bytes=1 << 30)
    big = pool.take(330 << 20)  # an apply's tail: class 384 MiB
    at = _addr(big)
    del big
    smaller = pool.take(40 << 20)  # a shorter tail next version: the same memory
    assert _addr(smaller) == at and len(smaller) == 40 << 20 and pool.allocated == 1
    del smaller
    assert pool.free_bytes == 384 << 20
    larger = pool.take(400 << 20)  # none holds it: the 384 MiB one is released first
    assert pool.free_bytes == 0 and pool.allocated == 2
    del larger
    assert pool.free_bytes == 448 << 20  # the one kept grows to the largest payload


def test_only_buffers_above_the_threshold_come_from_the_pool() -> None:
    """Buffers up to the largest chunk come from the heap (it reuses them; a pool of
    them cost fresh pages elsewhere), an apply's larger payload from the pool."""
    before = POOL.stats()["taken"]
    chunk = aligned_room(POOLED_MIN)
    assert POOL.stats()["taken"] == before and _addr(chunk) % ALIGN == 0
    assert len(chunk) == POOLED_MIN and len(aligned_room(5)) == ALIGN
    payload = aligned_room(POOLED_MIN + 1)
    assert POOL.stats()["taken"] == before + 1 and _addr(payload) % ALIGN == 0
    assert len(payload) == POOLED_MIN + ALIGN


class LiveBuffers(RuleBasedStateMachine):
    """Random takes and drops: buffers alive at once never overlap, and each keeps
    the bytes written into it until dropped, whatever the pool reuses or releases."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BufferPool(limit_bytes=12 * MIN_CLASS)
        self.live: list[tuple[memoryview, int]] = []
        self.tag = 0

    @rule(n=st.integers(0, 5 * MIN_CLASS), slice_only=st.booleans())
    def take(self, n: int, slice_only: bool) -> None:
        self.tag = (self.tag + 1) % 251
        b = self.pool.take(n)
        b[:] = bytes([self.tag]) * len(b)
        # keep the buffer itself or only a read-only slice of it
        self.live.append((b[: max(1, len(b) // 2)].toreadonly() if slice_only else b, self.tag))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))

    @invariant()
    def disjoint_and_intact(self) -> None:
        spans = sorted((_addr(v), _addr(v) + len(v)) for v, _ in self.live)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        for v, tag in self.live:
            assert v[0] == tag and v[-1] == tag
        assert self.pool.free_bytes <= self.pool.limit_bytes
        assert self.pool.free_bytes == sum(c for c, _ in self.pool._free)


TestLiveBuffers = LiveBuffers.TestCase
TestLiveBuffers.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_threads_taking_and_dropping_never_share_a_buffer() -> None:
    pool = BufferPool(limit_bytes=8 * MIN_CLASS)
    errors: list[str] = []

    def work(tag: int) -> None:
        for _ in range(300):
            b = pool.take(MIN_CLASS)
            b[:] = bytes([tag]) * len(b)
            time.sleep(0)  # let the other threads take and write theirs
            if bytes(b) != bytes([tag]) * len(b):
                errors.append(f"thread {tag}: buffer changed under it")
            del b

    threads = [threading.Thread(target=work, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.out_bytes == 0 and pool.reused > 0
