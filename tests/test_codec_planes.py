"""Byte planes read where they lie (swarm.codec.planes): a DENSE/FULL record's frame
cut into pieces at any points decodes to zstd's planes, bit for bit; frames it does not
read itself go to zstd whole; bad frames are refused with a PatchFormatError."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import apply_patch, encode_patch, records
from swarm.codec.apply import PatchApplier
from swarm.codec.format import decode_header, record_layout
from swarm.codec.planes import MAX_BLOCK, ZSTD_MAGIC, Pieces, Planes, read_planes
from swarm.errors import PatchFormatError
from tests.codec_cases import same_bits

FUSED = records.fused


def _planes(rng: np.random.Generator, itemsize: int, n: int, noisy: int) -> np.ndarray:
    """(itemsize, n) planes: the ``noisy`` low planes random (stored raw by the
    encoder), the others mostly zero with a few small values (compressed)."""
    planes = np.zeros((itemsize, n), dtype=np.uint8)
    for j in range(itemsize):
        if j < noisy:
            planes[j] = rng.integers(0, 256, n, dtype=np.uint8)
        else:
            hit = rng.random(n) < 0.05
            planes[j, hit] = rng.integers(1, 4, int(hit.sum()), dtype=np.uint8)
    return planes


def _frame(planes: np.ndarray) -> bytes:
    return records.compress_planes(planes)


def _cut(data: bytes, cuts: list[int]) -> Pieces:
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return Pieces([memoryview(data)[a:b] for a, b in itertools.pairwise(edges)])


def _blocks(frame: bytes) -> list[int]:
    """The block types of a frame with a 4-byte content size and a window byte (zstd's)."""
    fhd = frame[4]
    pos = 5 + (0 if fhd >> 5 & 1 else 1) + (1 if fhd >> 5 & 1 else 0, 2, 4, 8)[fhd >> 6]
    kinds = []
    while True:
        h = int.from_bytes(frame[pos:pos + 3], "little")
        kinds.append(h >> 1 & 3)
        pos += 3 + (1 if h >> 1 & 3 == 1 else h >> 3)
        if h & 1:
            return kinds


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 3),
       st.sampled_from([1, 1000, MAX_BLOCK - 1, MAX_BLOCK, MAX_BLOCK + 7, 3 * MAX_BLOCK // 2]),
       st.integers(0, 2**32 - 1), st.lists(st.integers(0, 1 << 22), max_size=6), st.booleans())
def test_a_frame_cut_anywhere_reads_as_zstd_decodes_it(itemsize, noisy, n, seed, cuts, fused):
    """Any itemsize, any number of raw planes (none, some, all), planes shorter and
    longer than a raw block, the frame cut at any points: the planes, the elements
    un-shuffled run by run, and the count are zstd's and numpy's, with the fused loops
    and without."""
    noisy = min(noisy, itemsize)
    planes = _planes(np.random.default_rng(seed), itemsize, n, noisy)
    frame = _frame(planes)
    assert zstandard.ZstdDecompressor().decompress(frame) == planes.tobytes()
    records.fused = FUSED if fused else None
    try:
        got = read_planes(_cut(frame, cuts), n, itemsize, "case")
        assert np.array_equal(got.array(), planes)
        want = np.zeros(n, dtype=np.dtype(f"u{itemsize}"))
        for j in range(itemsize):
            want |= planes[j].astype(want.dtype) << (8 * j)
        assert np.array_equal(records.unshuffle_planes(got), want)
        base = np.random.default_rng(seed + 1).integers(0, 256, n * itemsize, np.uint8).view(want.dtype)
        out, new, changed = np.empty_like(want), np.empty_like(want), 0
        for a, b, parts in got.parts(0, n):
            assert all(p.size == b - a for p in parts) and a < b
            changed += records.unshuffle_parts(parts, out[a:b], base[a:b], new[a:b])
        assert np.array_equal(out, want) and np.array_equal(new, base ^ want)
        assert changed == int(np.count_nonzero(want))
    finally:
        records.fused = FUSED


def test_raw_planes_are_views_of_the_pieces_and_only_the_rest_is_decoded():
    """The point of it: a record with its low planes raw, in three pieces, keeps those
    planes' bytes where they lie (no segment of them is a copy) and decodes the rest."""
    n = 3 * MAX_BLOCK
    planes = _planes(np.random.default_rng(5), 2, n, 1)
    frame = _frame(planes)
    assert _blocks(frame)[:3] == [0, 0, 0] and 2 in _blocks(frame)
    buf = np.frombuffer(frame, dtype=np.uint8)
    lo, hi = buf.ctypes.data, buf.ctypes.data + buf.size
    cuts = [len(frame) // 3, 2 * len(frame) // 3]
    got = read_planes(_cut(frame, cuts), n, 2, "case")
    inside = [s for s in got.segments if lo <= s.ctypes.data < hi]
    assert sum(s.size for s in inside) == n  # plane 0, all of it, read in place
    assert not got.owned
    assert np.array_equal(got.array(), planes)


def test_a_frame_zstd_wrote_whole_that_refers_back_into_a_raw_block_is_decoded_whole():
    """zstd may start a frame with a raw block and match into it later: the blocks after
    the raw ones cannot be decoded alone, and the frame is decoded whole instead."""
    rnd = np.random.default_rng(9).integers(0, 256, MAX_BLOCK, dtype=np.uint8).tobytes()
    data = rnd + rnd  # the second block is one long match into the first
    frame = zstandard.ZstdCompressor(level=1, write_checksum=False).compress(data)
    assert _blocks(frame) == [0, 2]  # the case: a raw block, then one that refers to it
    got = read_planes(_cut(frame, [100, 70_000]), len(data), 1, "case")
    assert got.owned and got.array().tobytes() == data


def _bad(frame: bytes, how: str) -> bytes:
    raw = bytearray(frame)
    if how == "truncated":
        return bytes(raw[:-10])
    if how == "trailing":
        return bytes(raw) + b"\x00\x01\x02"
    if how == "size":  # the content size says one element more
        raw[6:10] = (int.from_bytes(raw[6:10], "little") + 2).to_bytes(4, "little")
        return bytes(raw)
    if how == "checksum":
        raw[4] |= 0x04
        return bytes(raw)
    if how == "big-block":  # the first raw block claims more than a block may hold
        raw[10:13] = ((MAX_BLOCK + 1) << 3).to_bytes(3, "little")
        return bytes(raw)
    if how == "tail":  # a byte of the compressed blocks after the raw ones
        raw[-5] ^= 0xFF
        return bytes(raw)
    if how == "magic":
        raw[0] ^= 1
        return bytes(raw)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "trailing", "size", "checksum", "big-block",
                                 "tail", "magic"])
def test_a_bad_frame_is_refused_as_zstd_refuses_it(how):
    """Bad frames: a PatchFormatError naming the record, whether the frame is whole or
    in pieces, and never planes that are not the frame's."""
    n = 2 * MAX_BLOCK
    planes = _planes(np.random.default_rng(3), 2, n, 1)
    frame = _frame(planes)
    assert frame[4] >> 6 == 2 and not frame[4] >> 5 & 1  # a 4-byte size and a window byte
    bad = _bad(frame, how)
    for cuts in ([], [1], [11, MAX_BLOCK + 20]):
        try:
            got = read_planes(_cut(bad, cuts), n, 2, "record 7 (w)")
        except PatchFormatError as exc:
            assert "record 7 (w)" in str(exc)
        else:  # only a change zstd itself accepts may decode, and then as zstd decodes it
            assert got.array().tobytes() == zstandard.ZstdDecompressor().decompress(bad)


def test_fused_unshuffle_parts_refuses_bad_sizes_before_writing():
    if FUSED is None:
        pytest.skip("the fused loops are not built")
    out = np.full(8, 0xA5A5, dtype=np.uint16)
    a, b = np.arange(8, dtype=np.uint8), np.arange(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="plane 1 holds 7"):
        FUSED.unshuffle_parts([a, b[:7]], out)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 planes"):
        FUSED.unshuffle_parts([a, b, a], out)
    with pytest.raises(ValueError, match="base and new"):
        FUSED.unshuffle_parts([a, b], out, out)
    with pytest.raises(ValueError, match="new holds"):
        FUSED.unshuffle_parts([a, b], out, out.copy(), np.empty(4, np.uint16))
    assert (out == 0xA5A5).all()


def test_planes_segments_must_cover_the_planes():
    with pytest.raises(ValueError):
        Planes(2, 10, [np.zeros(19, np.uint8)], owned=True)


def _dense_pair(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = {"a": torch.randn(300_000, generator=g).to(torch.bfloat16),
           "b": torch.randn(70_001, generator=g),
           "c": torch.randn(5000, generator=g).to(torch.bfloat16)}
    new = {k: (v.float() + 1e-2 * torch.randn(v.shape, generator=g)).to(v.dtype)
           for k, v in old.items()}
    new["c"] = old["c"].clone()
    new["c"][::97] += 1  # a sparse record among the dense ones
    new["d"] = torch.randn(200_000, generator=g).to(torch.bfloat16)  # a FULL record
    return old, new


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**16), st.lists(st.integers(0, 1 << 20), max_size=5))
def test_records_fed_as_pieces_apply_as_the_whole_patch(seed, cuts):
    """Each record handed to the staged applier as the pieces of arbitrary chunks it lies
    in: the result is the one-shot apply's, bit for bit, digests included."""
    old, new = _dense_pair(seed)
    res = encode_patch(old, new, threads=1)
    ops = {e.op.name for e in decode_header(res.patch).entries}
    assert {"DENSE", "FULL"} <= ops
    want = {k: v.clone() for k, v in old.items()}
    apply_patch(want, res.patch)
    sizes = record_layout(res.patch)
    starts = np.cumsum([0, *sizes]).tolist()
    w = {k: v.clone() for k, v in old.items()}
    ap = PatchApplier(w, stage=True)
    ap.feed_header(res.patch[:starts[1]])
    for i in reversed(range(len(sizes) - 1)):
        rec = res.patch[starts[i + 1]:starts[i + 2]]
        ap.feed_record(i, list(_cut(rec, cuts).parts))
    ap.finish()
    assert same_bits(w, want)


def _raw_frame(data: bytes, block: int, *, window: int | None = None, extra: bytes = b"",
               declared: int | None = None) -> bytes:
    """A frame of raw blocks of ``block`` bytes written by hand (a window byte, a 4-byte size)."""
    wlog = (window or 1 << 17).bit_length() - 1
    out = [ZSTD_MAGIC, bytes([2 << 6, (wlog - 10) << 3]),
           (len(data) if declared is None else declared).to_bytes(4, "little")]
    for off in range(0, len(data), block):
        part = data[off:off + block]
        last = int(off + block >= len(data))
        out += [(last | len(part) << 3).to_bytes(3, "little"), part]
    return b"".join(out) + extra


@pytest.mark.parametrize("case", ["ok", "oversized", "over-window", "trailing", "short"])
def test_frames_of_raw_blocks_only_are_read_only_when_zstd_reads_them(case):
    """All-raw frames written by hand: read as zstd reads them, in place where they
    keep to the format (blocks of at most 128 KiB and the window), refused where zstd
    refuses them (less content than declared). Bytes after the last block are left to
    zstd, which stops at the frame's end, as it did before."""
    data = np.random.default_rng(1).integers(0, 256, 3 * MAX_BLOCK + 5, np.uint8).tobytes()
    frame = {"ok": lambda: _raw_frame(data, MAX_BLOCK),
             "oversized": lambda: _raw_frame(data, MAX_BLOCK + 1),
             "over-window": lambda: _raw_frame(data, 1 << 16, window=1 << 15),
             "trailing": lambda: _raw_frame(data, MAX_BLOCK, extra=b"\x01\x02\x03\x04"),
             "short": lambda: _raw_frame(data, MAX_BLOCK, declared=len(data) + 1)}[case]()
    try:
        want = zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError:
        want = None
    count = len(data) + (case == "short")  # the size the table gives is the frame's
    for cuts in ([], [MAX_BLOCK], [3, 2 * MAX_BLOCK + 1]):
        if want is None:
            with pytest.raises(PatchFormatError):
                read_planes(_cut(frame, cuts), count, 1, "case")
        else:
            got = read_planes(_cut(frame, cuts), len(data), 1, "case")
            assert got.array().tobytes() == want
            assert got.owned == (case != "ok")  # out of the format: zstd decodes it whole
    assert (want is None) == (case == "short")
