"""Aligned buffers for the store's O_DIRECT reads and writes; the large ones pooled.

The store reads and writes chunk files with ``O_DIRECT`` into 4096-byte aligned
buffers, and the driver reassembles received chunks in one. Chunk-sized buffers come
from the heap, which reuses them (``node.daemon.tune_malloc`` keeps freed heap). An
apply's payload (the chunks left to decode after the prestage, read into one buffer)
is larger than glibc serves from the heap at 384 MiB versions, and every version's
fresh ``mmap`` was the kernel zeroing pages: a quarter of a node's CPU
(docs/benchmarks.md, rounds 43 and 44). Buffers larger than any chunk (``POOLED_MIN``,
64 MiB) therefore come from ``BufferPool``, which takes each back when the last
reference to it is gone: a buffer is a view of a pooled allocation, and a
``weakref.finalize`` on that view returns the allocation to the pool. Nothing is
released by hand, so a buffer can never be reused while anything (the apply, a tensor
made with ``torch.frombuffer``) still holds it. What nobody may do is keep a raw
address past the buffer's life; nothing in the project does.

Pooling chunk-sized buffers too was measured and not kept: it took nothing off at
384 MiB that pooling the large ones did not, and at 64-128 MiB, where the heap already
reused every buffer, the free ones the pool kept made the codec's temporaries take
fresh pages (+1-5 % CPU; docs/benchmarks.md round 44).
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy

from swarm.protocol.wire import MAX_CHUNK_BYTES

ALIGN = 4096  # O_DIRECT alignment of addresses, offsets and lengths (safe for 512 and 4K disks)
MIN_CLASS = 64 * 1024  # smaller buffers get a class of their own, rounded to ALIGN
POOLED_MIN = MAX_CHUNK_BYTES  # buffers larger than any chunk come from the pool
LIMIT_SHARE = 8  # free buffers kept: at most this share of the machine's memory (1/8)


def size_class(n: int) -> int:
    """The capacity a buffer of ``n`` bytes is taken with: ``n`` rounded up to
    ``ALIGN`` below ``MIN_CLASS``, else to the next of four steps per doubling
    (waste under 25 %; a power of two, such as a 4 MiB chunk, is its own class)."""
    if n <= MIN_CLASS:
        return max(ALIGN, -(-n // ALIGN) * ALIGN)
    top = 1 << (n - 1).bit_length()  # the power of two at or above n
    step = top // 8  # four classes in (top/2, top]
    return -(-n // step) * step


def _machine_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class BufferPool:
    """Aligned buffers that go back to the pool when their last reference goes.

    A request takes the smallest free buffer that holds it, whatever its size (an
    apply's payload changes length from version to version); one that no free buffer
    holds first releases them all, so that the allocator can reuse their memory for
    the new one. So the pool never holds memory a new allocation could have used
    instead, and the buffer it keeps grows to the largest payload and stays. Free
    buffers are kept up to the most bytes ever out at once (the node's working set),
    never more than ``limit_bytes``; past that the oldest go back to the system.

    Thread-safe: the store reads in worker threads, and a buffer may be dropped in
    any thread (its finalizer then runs there)."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = (_machine_bytes() // LIMIT_SHARE
                            if limit_bytes is None else max(0, limit_bytes))
        self._lock = threading.RLock()  # a finalizer may run inside a locked section (GC)
        self._free: list[tuple[int, numpy.ndarray]] = []  # (capacity, allocation), oldest first
        self.free_bytes = 0
        self.out_bytes = 0  # capacity of the buffers handed out and still referenced
        self.peak_out_bytes = 0
        self.taken = 0
        self.reused = 0
        self.allocated = 0

    def take(self, n: int) -> memoryview:
        """A writable, ``ALIGN``-aligned buffer of ``n`` bytes rounded up to ``ALIGN``;
        not zero-filled (a reused one holds an earlier buffer's bytes)."""
        if n < 0:
            raise ValueError(f"a buffer of {n} bytes")
        want = max(ALIGN, -(-n // ALIGN) * ALIGN)
        cap = size_class(n)
        raw = None
        dropped: list[tuple[int, numpy.ndarray]] = []
        with self._lock:
            self.taken += 1
            best = -1
            for j, (c, _) in enumerate(self._free):  # the smallest that holds it, newest
                if cap <= c and (best < 0 or c <= self._free[best][0]):
                    best = j
            if best >= 0:
                cap, raw = self._free.pop(best)
                self.free_bytes -= cap
                self.reused += 1
            else:  # none holds it: their memory goes to the new one
                dropped, self._free = self._free, []
                self.free_bytes = 0
            self.out_bytes += cap
            self.peak_out_bytes = max(self.peak_out_bytes, self.out_bytes)
        del dropped  # freed outside the lock, before the allocation
        if raw is None:
            try:
                raw = numpy.empty(cap + ALIGN, dtype=numpy.uint8)
            except MemoryError:
                with self._lock:
                    self.out_bytes -= cap
                raise
            with self._lock:
                self.allocated += 1
        off = (-raw.ctypes.data) % ALIGN
        lease = raw[off:off + cap]  # a view: the allocation goes back when it dies
        fin = weakref.finalize(lease, self._give_back, cap, raw)
        fin.atexit = False
        return memoryview(lease).cast("B")[:want]

    def _give_back(self, cap: int, raw: numpy.ndarray) -> None:
        with self._lock:
            self.out_bytes -= cap
            self._free.append((cap, raw))
            self.free_bytes += cap
            keep = min(self.limit_bytes, self.peak_out_bytes)
            while self._free and self.free_bytes > keep:
                c, _ = self._free.pop(0)
                self.free_bytes -= c

    def clear(self) -> None:
        """Release every free buffer to the system (buffers out stay valid)."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"taken": self.taken, "reused": self.reused, "allocated": self.allocated,
                    "out_bytes": self.out_bytes, "free_bytes": self.free_bytes,
                    "peak_out_bytes": self.peak_out_bytes}


POOL = BufferPool()  # one per process: a host runs one node daemon


def _heap(n: int) -> memoryview:
    """An aligned buffer of ``n`` rounded up to ``ALIGN`` bytes, from the heap."""
    cap = max(ALIGN, -(-n // ALIGN) * ALIGN)
    raw = numpy.empty(cap + ALIGN, dtype=numpy.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return memoryview(raw[off:off + cap]).cast("B")


def aligned_room(n: int) -> memoryview:
    """An aligned buffer of ``n`` rounded up to ``ALIGN`` bytes (whole O_DIRECT blocks),
    not zero-filled: from the pool above ``POOLED_MIN``, else from the heap."""
    return POOL.take(n) if n > POOLED_MIN else _heap(n)


def aligned_buffer(n: int) -> memoryview:
    """``n`` writable bytes at an ``ALIGN``-aligned address, not zero-filled. The store
    writes such a buffer's aligned part with ``O_DIRECT`` (no copy through the page
    cache)."""
    return aligned_room(n)[:n]
