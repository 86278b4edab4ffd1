"""A DENSE or FULL record's byte planes, read where they lie instead of copied together.

The body of such a record is one zstd frame of the record's byte planes. The trainer
writes the planes that look incompressible (``records.raw_planes``: the low mantissa
planes of a dense update) as the frame's leading *raw* blocks, 128 KiB each, and the
rest as compressed blocks (``records.compress_planes_parts``). zstd's decoder copies
a raw block's bytes to its output, and a record that spans chunks had to be joined
into one buffer before zstd could read it: two passes over most of the record's bytes
that change nothing.

``read_planes`` takes the record's body as the pieces it lies in (views of the chunks
that hold it), walks the frame's leading raw blocks itself, keeps their bytes as views
of those pieces, and gives only the blocks after them to zstd, as a frame of their own.
The result, ``Planes``, is a list of segments of the planes' concatenation; the fused
loops read each element's bytes from wherever its planes lie (``parts``).

Only what is checked is taken this way: a standard frame header without dictionary or
checksum, the content size the tensor table expects, raw blocks no larger than the
frame allows, nothing after the last block. Anything else, and any error of the blocks
after the raw ones, goes to ``decompress_bounded`` with the record joined, exactly as
before, which decodes it or reports the error. Raw blocks change no decoder state
(repeat offsets, entropy tables), so the blocks after them decode as their own frame
exactly as in the whole one, unless they refer back into the raw bytes, which zstd
reports as corrupt (an offset before the frame's start) rather than decode otherwise:
then the whole frame is decoded as before. zstd never writes such frames for our planes
(the raw planes are not given to it), but a frame it wrote whole may start with a raw
block, and that is the case this fallback is for.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np

from swarm.codec.zstd_bounded import decompress_bounded
from swarm.errors import PatchFormatError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_BLOCK = 128 * 1024  # zstd's Block_Maximum_Size
_RAW, _RLE, _COMPRESSED = 0, 1, 2


class Pieces:
    """A run of bytes held as consecutive buffer views (a record spread over chunks),
    sliced and read without joining them."""

    def __init__(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self.ends: list[int] = []
        total = 0
        for p in self.parts:
            total += len(p)
            self.ends.append(total)

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def slice(self, start: int, stop: int) -> Pieces:
        """Bytes ``start..stop`` as views of the same buffers."""
        out: list[memoryview] = []
        start, stop = max(0, start), min(stop, len(self))
        k = bisect.bisect_right(self.ends, start)
        while start < stop:
            lo = self.ends[k] - len(self.parts[k])
            take = min(stop, self.ends[k])
            out.append(self.parts[k][start - lo:take - lo])
            start, k = take, k + 1
        return Pieces(out)

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes (fewer if there are not so many), copied."""
        return b"".join(self.slice(0, n).parts)

    def join(self) -> memoryview:
        """All the bytes as one buffer: a view where they lie in one piece, else a copy."""
        if len(self.parts) == 1:
            return self.parts[0]
        out = memoryview(np.empty(len(self), dtype=np.uint8)).cast("B")  # not zero-filled
        off = 0
        for p in self.parts:
            out[off:off + len(p)] = p
            off += len(p)
        return out


class Planes:
    """The (itemsize, n) byte planes of a record as segments of their concatenation
    (plane ``j`` is bytes ``j * n .. (j + 1) * n``), each a uint8 array, in order, with
    no gap. ``owned``: the segments are this object's own memory (zstd's output), not
    views of buffers the caller may reuse."""

    def __init__(self, itemsize: int, n: int, segments: list[np.ndarray], owned: bool) -> None:
        self.itemsize, self.n, self.owned = itemsize, n, owned
        self.segments = [seg for seg in segments if seg.size]
        self.starts: list[int] = []
        off = 0
        for seg in self.segments:
            self.starts.append(off)
            off += seg.size
        if off != itemsize * n:
            raise ValueError(f"planes segments hold {off} bytes, not {itemsize} x {n}")

    def parts(self, s: int, e: int) -> Iterator[tuple[int, int, list[np.ndarray]]]:
        """Elements ``s..e`` in runs ``a..b`` over which each plane's bytes lie in one
        segment: ``(a, b, [plane j's bytes of elements a..b for each j])``."""
        n, starts, segs = self.n, self.starts, self.segments
        a = s
        while a < e:
            b, where = e, []
            for j in range(self.itemsize):
                off = j * n + a
                k = bisect.bisect_right(starts, off) - 1
                b = min(b, starts[k] + segs[k].size - j * n)
                where.append((k, off - starts[k]))
            yield a, b, [segs[k][o:o + b - a] for k, o in where]
            a = b

    def single(self) -> np.ndarray | None:
        """The planes as one (itemsize, n) array where they lie in one segment, else None."""
        if len(self.segments) == 1:
            return self.segments[0].reshape(self.itemsize, self.n)
        return None if self.n else np.empty((self.itemsize, 0), dtype=np.uint8)

    def array(self) -> np.ndarray:
        """The planes as one (itemsize, n) array of memory of its own (copied unless
        they are one segment of zstd's output)."""
        if self.owned and len(self.segments) == 1:
            return self.segments[0].reshape(self.itemsize, self.n)
        out = np.empty(self.itemsize * self.n, dtype=np.uint8)
        for start, seg in zip(self.starts, self.segments, strict=True):
            out[start:start + seg.size] = seg
        return out.reshape(self.itemsize, self.n)


def read_planes(body: Pieces, count: int, itemsize: int, what: str) -> Planes:
    """The byte planes of a DENSE/FULL payload (one zstd frame of ``count`` elements of
    ``itemsize`` bytes, the size the tensor table gives) held as ``body``; the frame's
    leading raw blocks stay where they are (module docstring)."""
    total = count * itemsize
    got = _raw_prefix(body, total)
    if got is not None:
        segments, produced, tail = got
        if produced == total:
            return Planes(itemsize, count, segments, owned=False)
        if produced:
            rest = total - produced
            fcs = (2, rest.to_bytes(4, "little")) if rest < 1 << 32 else (3, rest.to_bytes(8, "little"))
            # single segment (bit 5), the content size in 4 or 8 bytes, no window byte
            frame = b"".join([ZSTD_MAGIC, bytes([fcs[0] << 6 | 0x20]), fcs[1], *tail.parts])
            try:
                out = decompress_bounded(frame, rest, what, PatchFormatError)
            except PatchFormatError:
                pass  # e.g. blocks that refer back into the raw ones: the whole frame, below
            else:
                segments.append(np.frombuffer(out, dtype=np.uint8))
                return Planes(itemsize, count, segments, owned=False)
    out = decompress_bounded(body.join(), total, what, PatchFormatError)
    return Planes(itemsize, count, [np.frombuffer(out, dtype=np.uint8)], owned=True)


def _raw_prefix(body: Pieces, total: int) -> tuple[list[np.ndarray], int, Pieces] | None:
    """(views of the frame's leading raw blocks' bytes, how many bytes they hold, the
    bytes from the first other block on), or None where the frame is not one this
    reads (the caller then decodes it whole)."""
    head = body.head(18)
    if len(head) < 6 or head[:4] != ZSTD_MAGIC:
        return None
    fhd = head[4]
    fcs_flag, single = fhd >> 6, fhd >> 5 & 1
    if fhd & 0x0F:  # reserved bit, checksum, dictionary id: decoded whole
        return None
    pos = 5
    window = 0
    if not single:
        wd = head[pos]
        pos += 1
        base = 1 << (10 + (wd >> 3))
        window = base + (base >> 3) * (wd & 7)
    size_bytes = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size_bytes == 0 or len(head) < pos + size_bytes:
        return None
    declared = int.from_bytes(head[pos:pos + size_bytes], "little") + (256 if size_bytes == 2 else 0)
    pos += size_bytes
    if declared != total:
        return None
    block_max = min(MAX_BLOCK, declared if single else window)
    segments: list[np.ndarray] = []
    produced = 0
    parts, ends, n = body.parts, body.ends, len(body)
    k = 0  # the piece that holds byte ``pos``
    while True:
        if n - pos < 3:
            return None
        while ends[k] <= pos:
            k += 1
        lo = ends[k] - len(parts[k])
        if pos + 3 <= ends[k]:
            h = int.from_bytes(parts[k][pos - lo:pos - lo + 3], "little")
        else:  # a block header across two pieces
            h = int.from_bytes(body.slice(pos, pos + 3).head(3), "little")
        last, kind, size = h & 1, h >> 1 & 3, h >> 3
        if kind != _RAW:
            break
        pos += 3
        if size > block_max or produced + size > total or n - pos < size:
            return None
        stop = pos + size
        while pos < stop:  # the block's bytes, a view of each piece they lie in
            while ends[k] <= pos:
                k += 1
            lo = ends[k] - len(parts[k])
            take = min(stop, ends[k])
            segments.append(np.frombuffer(parts[k][pos - lo:take - lo], dtype=np.uint8))
            pos = take
        produced += size
        if last:
            if produced != total or pos != n:
                return None
            return segments, produced, Pieces([])
    return segments, produced, body.slice(pos, n)
