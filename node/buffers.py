"""Aligned chunk buffers, reused rather than faulted in anew for every chunk.

The store reads and writes chunk files with ``O_DIRECT`` into 4096-byte aligned
buffers, and the driver reassembles received chunks in one. A buffer freshly
taken from the system costs the kernel a zeroed page for every page first
touched: at 384 MiB versions that was 25-40 % of a node's CPU (docs/benchmarks.md,
round 43 and 44), because past the store's in-memory chunks every upload read and
the apply's tail read into newly mapped memory.

``BufferPool`` hands out aligned buffers and takes each back when the last
reference to it is gone: a buffer is a view of a pooled allocation, and a
``weakref.finalize`` on that view returns the allocation to the pool. Nothing is
released by hand, so a buffer can never be reused while anything (an upload in
flight, the store's recent chunks, a tensor made with ``torch.frombuffer``) still
holds it. What nobody may do is keep a raw address past the buffer's life; nothing
in the project does.

Free allocations are kept up to the most bytes ever out at once (the node's working
set: its recent chunks, its uploads in flight, one apply's payload), and never more
than ``limit_bytes``; past that the oldest free ones go back to the system. Chunk
buffers are reused by size class (four to a doubling); an apply's payload, whose
length differs from version to version, takes any free large buffer that holds it,
and one that none holds first releases them (the allocator reuses that memory), so
the large buffer kept grows to the largest payload and stays.
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy

ALIGN = 4096  # O_DIRECT alignment of addresses, offsets and lengths (safe for 512 and 4K disks)
MIN_CLASS = 64 * 1024  # smaller buffers get a class of their own, rounded to ALIGN
LARGE = 16 * 1024 * 1024  # above this a buffer is an apply's payload, not a chunk
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

    Two kinds, kept apart: chunk-sized buffers (``LARGE`` bytes or less: received
    chunks, reads for uploads), reused by size class; and large ones (an apply's
    payload, one at a time), where any free one that is big enough serves and a
    request that none fits first gives the smaller free ones back to the system, so
    that the allocator can reuse their memory for the new one. The pool never holds
    memory a new allocation could have used instead.

    Thread-safe: the store reads in worker threads, and a buffer may be dropped in
    any thread (its finalizer then runs there)."""

    def __init__(self, limit_bytes: int | None = None, large_bytes: int = LARGE) -> None:
        self.large_bytes = large_bytes
        self.limit_bytes = (_machine_bytes() // LIMIT_SHARE
                            if limit_bytes is None else max(0, limit_bytes))
        self._lock = threading.RLock()  # a finalizer may run inside a locked section (GC)
        # (capacity, allocation), oldest first; small and large apart
        self._free: dict[bool, list[tuple[int, numpy.ndarray]]] = {False: [], True: []}
        self._free_bytes = {False: 0, True: 0}
        self._out = {False: 0, True: 0}
        self._peak = {False: 0, True: 0}
        self.taken = 0
        self.reused = 0
        self.allocated = 0

    @property
    def free_bytes(self) -> int:
        return self._free_bytes[False] + self._free_bytes[True]

    @property
    def out_bytes(self) -> int:
        """Capacity of the buffers handed out and still referenced."""
        return self._out[False] + self._out[True]

    @property
    def peak_out_bytes(self) -> int:
        return self._peak[False] + self._peak[True]

    def take(self, n: int) -> memoryview:
        """A writable, ``ALIGN``-aligned buffer of ``n`` bytes rounded up to ``ALIGN``;
        not zero-filled (a reused one holds an earlier buffer's bytes)."""
        if n < 0:
            raise ValueError(f"a buffer of {n} bytes")
        want = max(ALIGN, -(-n // ALIGN) * ALIGN)
        cap = size_class(n)
        large = cap > self.large_bytes
        raw = None
        dropped: list[tuple[int, numpy.ndarray]] = []
        with self._lock:
            self.taken += 1
            free = self._free[large]
            best = -1
            for j, (c, _) in enumerate(free):  # the smallest that fits, newest first
                if cap <= c and (large or c < 2 * cap) \
                        and (best < 0 or c <= free[best][0]):
                    best = j
            if best >= 0:
                cap, raw = free.pop(best)
                self._free_bytes[large] -= cap
                self.reused += 1
            elif large and free:  # none fits: their memory goes to the new one
                dropped, free[:] = free[:], []
                self._free_bytes[large] = 0
            self._out[large] += cap
            self._peak[large] = max(self._peak[large], self._out[large])
        del dropped  # freed outside the lock, before the allocation
        if raw is None:
            try:
                raw = numpy.empty(cap + ALIGN, dtype=numpy.uint8)
            except MemoryError:
                with self._lock:
                    self._out[large] -= cap
                raise
            with self._lock:
                self.allocated += 1
        off = (-raw.ctypes.data) % ALIGN
        lease = raw[off:off + cap]  # a view: the allocation goes back when it dies
        fin = weakref.finalize(lease, self._give_back, large, cap, raw)
        fin.atexit = False
        return memoryview(lease).cast("B")[:want]

    def _give_back(self, large: bool, cap: int, raw: numpy.ndarray) -> None:
        with self._lock:
            self._out[large] -= cap
            free = self._free[large]
            free.append((cap, raw))
            self._free_bytes[large] += cap
            # both kinds together stay under the limit; each under its own working set
            keep = min(self.limit_bytes - self._free_bytes[not large], self._peak[large])
            while free and self._free_bytes[large] > keep:
                c, _ = free.pop(0)
                self._free_bytes[large] -= c

    def clear(self) -> None:
        """Release every free buffer to the system (buffers out stay valid)."""
        with self._lock:
            for large in (False, True):
                self._free[large].clear()
                self._free_bytes[large] = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"taken": self.taken, "reused": self.reused, "allocated": self.allocated,
                    "out_bytes": self.out_bytes, "free_bytes": self.free_bytes,
                    "peak_out_bytes": self.peak_out_bytes}


POOL = BufferPool()  # one per process: a host runs one node daemon


def aligned_buffer(n: int) -> memoryview:
    """``n`` writable bytes at an ``ALIGN``-aligned address from the process's pool,
    not zero-filled. The store writes such a buffer's aligned part with
    ``O_DIRECT`` (no copy through the page cache)."""
    return POOL.take(n)[:n]


def aligned_room(n: int) -> memoryview:
    """An aligned buffer of ``n`` rounded up to ``ALIGN`` bytes (whole O_DIRECT blocks)."""
    return POOL.take(n)
