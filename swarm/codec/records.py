"""Per-tensor record bodies: encode from bit patterns, decode into (positions, values).

A SPARSE body models an Adam-absorption step directly (docs/patch-format.md):

- *positions* of changed elements as Rice-coded gaps, parameter chosen per tensor;
- the *sign* of each ordinal (ULP) delta, one raw bit each (±1 are equally likely);
- which deltas are not ±1 ("big"), as Rice-coded gaps over the change list;
- among big deltas, which are *escaped* (raw new bit pattern, where that is
  cheaper than the delta: sign flips far from zero, NaN, huge jumps);
- the other big magnitudes minus 2, Exp-Golomb order 0.

DENSE and FULL bodies are byte-shuffled zstd: used when a tensor changed
nearly everywhere, or is new, reshaped or re-typed.
"""

from __future__ import annotations

import itertools
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from swarm.codec import bitstream as bs
from swarm.codec import context
from swarm.codec.dtypes import DType, from_ordinal, to_ordinal
from swarm.codec.format import BodyReader, put_varint
from swarm.codec.planes import MAX_BLOCK, ZSTD_MAGIC, Planes
from swarm.errors import PatchFormatError

try:  # the fused loops (swarm/codec/_dense.c), built by the install where a C compiler is
    from swarm.codec import _dense as fused
except ImportError:  # numpy's loops below: the same bits, about half as fast
    fused = None

ZSTD_DENSE_LEVEL = 1  # on shuffled XOR planes level 3 is 2-3x slower for <1% smaller (docs/benchmarks.md)
ESCAPE_SLACK_BITS = 2  # escape when Exp-Golomb is this much longer than a raw value


@dataclass
class SparseStats:
    changed: int
    big: int
    escaped: int


# ------------------------------------------------------------------ SPARSE


def encode_sparse(idx: np.ndarray, old_vals: np.ndarray, new_vals: np.ndarray,
                  dt: DType, *, thresholds: list[int] | None = None,
                  ranks: list[np.ndarray] | None = None) -> tuple[bytes, SparseStats]:
    """Body (after the digest) for changes at sorted ``idx`` from old to new bits.

    Layout: varint k | u8 (kp | big<<6 | esc<<7) | [varint nb | u8 kb]
    | [varint ne | u8 ke] | [context] | bits,
    where bits = positions, k sign bits, [Rice(kb) big gaps],
    [Rice(ke) escape gaps], [Exp-Golomb(|Δ|-2) of non-escaped big], [raw values].
    Positions are Rice(kp) gaps (SPARSE) or, with ``thresholds`` and ``ranks``
    (SPARSE_CTX, see context.py), per magnitude bucket the Rice(kp_b) gaps of
    the changed elements' ranks within the bucket; then [context] is
    u8 T | T x varint threshold | (T+1) x (varint k_b | u8 kp_b) and kp = 0.
    """
    k = idx.size
    delta = to_ordinal(new_vals, dt) - to_ordinal(old_vals, dt)
    sign = (delta < 0).astype(np.uint8)
    mag = np.abs(delta)  # wraps to negative for |delta| = 2**63 (64-bit dtypes only)
    big = np.flatnonzero(mag != 1)
    mag_big = mag[big]
    eg_len = np.where(mag_big >= 2, bs.expgolomb_lengths(np.maximum(mag_big - 2, 0)), 1 << 30)
    esc = np.flatnonzero((mag_big < 2) | (eg_len > dt.width + ESCAPE_SLACK_BITS))
    nb, ne = big.size, esc.size
    sign[big[esc]] = 0  # the sign of an escaped entry is not used

    head = bytearray()
    put_varint(head, k)
    w = bs.BitWriter()
    ctx = bytearray()
    if ranks is None:
        gaps = bs.positions_to_gaps(idx)
        kp = bs.best_rice_k(gaps)
        w.rice(gaps, kp)
    else:
        assert thresholds is not None
        kp = 0
        ctx.append(len(thresholds))
        for t in thresholds:
            put_varint(ctx, t)
        for r in ranks:
            g = bs.positions_to_gaps(r)
            kb_ = bs.best_rice_k(g)
            put_varint(ctx, r.size)
            ctx.append(kb_)
            w.rice(g, kb_)
    head.append(kp | (nb > 0) << 6 | (ne > 0) << 7)
    w.bits(sign)
    if nb:
        big_gaps = bs.positions_to_gaps(big)
        kb = bs.best_rice_k(big_gaps)
        put_varint(head, nb)
        head.append(kb)
        w.rice(big_gaps, kb)
    if ne:
        esc_gaps = bs.positions_to_gaps(esc)
        ke = bs.best_rice_k(esc_gaps)
        put_varint(head, ne)
        head.append(ke)
        w.rice(esc_gaps, ke)
    if nb - ne:
        keep = np.ones(nb, dtype=bool)
        keep[esc] = False
        w.expgolomb(mag_big[keep] - 2)
    if ne:
        w.fixed(new_vals[big[esc]].view(_unsigned(dt)), dt.width)
    return bytes(head) + bytes(ctx) + w.to_bytes(), SparseStats(k, nb, ne)


@dataclass
class SparseHead:
    k: int
    nb: int
    ne: int
    kb: int
    ke: int
    bits: bs.BitReader


def decode_sparse_positions(r: BodyReader, numel: int, dt: DType,
                            old_block: Callable[[int, int], np.ndarray] | None = None
                            ) -> tuple[np.ndarray, SparseHead]:
    """First half of decoding: the changed positions (so the caller can gather the
    old values there, which are also its undo log). ``old_block(start, stop)``
    returns the base tensor's bit patterns in a range; it is needed (and only
    called) for SPARSE_CTX records."""
    what = r.what
    k = r.varint(limit=numel)
    if k == 0:
        raise PatchFormatError(f"{what}: sparse record with no changes")
    flags = r.u8()
    kp = flags & 0x3F
    nb = kb = ne = ke = 0
    if flags & 0x40:
        nb = r.varint(limit=k)
        kb = r.u8()
        if nb == 0:
            raise PatchFormatError(f"{what}: empty delta list flagged present")
    if flags & 0x80:
        ne = r.varint(limit=nb)
        ke = r.u8()
        if ne == 0:
            raise PatchFormatError(f"{what}: empty escape list flagged present")
    if old_block is None:
        bits = bs.BitReader(r.rest(), what)
        gaps = bits.rice(k, kp, "positions")
        idx = bs.gaps_to_positions(gaps, numel, f"{what} positions")
        return idx, SparseHead(k, nb, ne, kb, ke, bits)
    nthresh = r.u8()
    if nthresh > context.MAX_THRESHOLDS or not context.supports(dt):
        raise PatchFormatError(f"{what}: bad context model ({nthresh} thresholds, {dt.name})")
    limit = (1 << (dt.width - 1)) - 1
    thresholds = [r.varint(limit=limit) for _ in range(nthresh)]
    if any(a >= b for a, b in itertools.pairwise(thresholds)):
        raise PatchFormatError(f"{what}: context thresholds not increasing")
    sizes, params = [], []
    for _ in range(nthresh + 1):
        sizes.append(r.varint(limit=k))
        params.append(r.u8())
    if sum(sizes) != k:
        raise PatchFormatError(f"{what}: bucket sizes do not add up to {k}")
    bits = bs.BitReader(r.rest(), what)
    ranks = [bs.gaps_to_positions(bits.rice(size, kp_b, "positions"), numel, f"{what} positions")
             for size, kp_b in zip(sizes, params, strict=True)]
    idx = context.decode_positions(old_block, numel, ranks, thresholds, dt, what)
    return idx, SparseHead(k, nb, ne, kb, ke, bits)


def decode_sparse_values(head: SparseHead, old_vals: np.ndarray, dt: DType,
                         what: str) -> np.ndarray:
    """Second half: new bit patterns at the positions, from the old ones there."""
    k, nb, ne, bits = head.k, head.nb, head.ne, head.bits
    sign = bits.bits_(k, "signs").astype(bool)
    delta = np.ones(k, dtype=np.int64)
    escaped_at = np.zeros(0, dtype=np.int64)
    if nb:
        big = bs.gaps_to_positions(bits.rice(nb, head.kb, "deltas"), k, f"{what} deltas")
        keep = np.ones(nb, dtype=bool)
        if ne:
            esc = bs.gaps_to_positions(bits.rice(ne, head.ke, "escapes"), nb, f"{what} escapes")
            keep[esc] = False
            escaped_at = big[esc]
        if nb - ne:
            mags = bits.expgolomb(nb - ne, "magnitudes")
            if mags.size and int(mags.min()) < 0:
                raise PatchFormatError(f"{what}: delta magnitude out of range")
            delta[big[keep]] = mags + 2
    delta = np.where(sign, -delta, delta)
    delta[escaped_at] = 0  # replaced by raw values below
    new = from_ordinal(to_ordinal(old_vals, dt) + delta, dt, what)
    if ne:
        raw = bits.fixed(ne, dt.width, "raw values")
        new[escaped_at] = raw.astype(_unsigned(dt)).view(dt.np_view)
    bits.done()
    return new


def _unsigned(dt: DType) -> np.dtype:
    return np.dtype(f"u{dt.itemsize}")


# ------------------------------------------------------------------ DENSE / FULL
#
# Byte planes are built and taken apart in blocks of ``BLOCK`` elements, so each
# block's XOR, shuffle, count and hash run on data still in cache: a DENSE
# record costs one read of each input and one write of the planes, not a
# memory pass per step. The planes are split with integer casts and shifts
# (contiguous, vectorised) rather than a strided byte transpose, which numpy
# runs several times slower.

BLOCK = 1 << 16


def fusable(*arrays: np.ndarray) -> bool:
    """The fused loops (``fused``) can take these arrays: the module is built and each
    array is C-contiguous (a strided view, e.g. of a non-contiguous tensor, goes to numpy)."""
    return fused is not None and all(a.flags.c_contiguous for a in arrays)


def unshuffle_count(planes: np.ndarray, s: int, e: int, out: np.ndarray,
                    base: np.ndarray | None = None, new: np.ndarray | None = None) -> int:
    """Elements s..e of the (itemsize, n) ``planes`` into the unsigned array ``out``;
    returns how many are not 0. With ``base`` (elements s..e of the old bit patterns),
    ``new`` gets ``base ^ out``. One pass where the fused loops are built, else numpy's."""
    itemsize, n = planes.shape
    if fusable(planes, out) and (base is None or fusable(base, new)):
        return fused.unshuffle(planes, itemsize, n, s, e, out, base, new)
    if itemsize == 1:
        out[:] = planes[0, s:e]
    else:
        _unshuffle_block(planes, s, e, out)
    if base is not None:
        np.bitwise_xor(base, out, out=new)
    return int(np.count_nonzero(out))


def _uview(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.dtype(f"u{bits.dtype.itemsize}"))


def shuffle_range(u: np.ndarray, x2: np.ndarray | None, out: np.ndarray, start: int,
                  stop: int) -> int:
    """Elements ``start..stop`` of the unsigned array ``u`` (XORed with ``x2`` if
    given) into the (itemsize, n) byte planes ``out``, block by block; returns
    how many of them are nonzero after the XOR (0 without ``x2``)."""
    itemsize = out.shape[0]
    changed = 0
    if itemsize == 1:
        if x2 is None:
            out[0, start:stop] = u[start:stop]
        else:
            np.bitwise_xor(u[start:stop], x2[start:stop], out=out[0, start:stop])
            changed = int(np.count_nonzero(out[0, start:stop]))
        return changed
    scratch = np.empty(min(stop - start, BLOCK), dtype=u.dtype)
    for s in range(start, stop, BLOCK):
        e = min(stop, s + BLOCK)
        m = e - s
        if x2 is None:
            xb = u[s:e]
        else:
            xb = np.bitwise_xor(u[s:e], x2[s:e], out=scratch[:m])
            changed += int(np.count_nonzero(xb))
        np.copyto(out[0, s:e], xb, casting="unsafe")
        for j in range(1, itemsize):
            # shifted and narrowed to the plane's bytes in one ufunc pass
            np.right_shift(xb, 8 * j, out=out[j, s:e], casting="unsafe")
    return changed


def shuffle_planes(bits: np.ndarray, itemsize: int, xor_with: np.ndarray | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Byte planes of ``bits`` (or of ``bits ^ xor_with``): an (itemsize, n) uint8
    array holding all first (least significant) bytes, then all second bytes...
    Written into ``out`` (a contiguous uint8 array of that shape) if given."""
    n = bits.size
    u = _uview(bits.reshape(-1))
    if itemsize == 1 and xor_with is None:
        return u.reshape(1, n)
    x2 = None if xor_with is None else _uview(xor_with.reshape(-1))
    if out is None:
        out = np.empty((itemsize, n), dtype=np.uint8)
    shuffle_range(u, x2, out, 0, n)
    return out


def _unshuffle_block(planes: np.ndarray, s: int, e: int, out: np.ndarray) -> np.ndarray:
    """Elements s..e from (itemsize, n) planes into the unsigned array ``out``."""
    return _unshuffle_views([planes[j, s:e] for j in range(planes.shape[0])], out)


def _unshuffle_views(parts: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """Elements from plane j's bytes ``parts[j]`` (two or more planes) into ``out``."""
    itemsize = len(parts)
    # widen-and-shift, then OR in each lower plane: the ufuncs widen the uint8
    # operand themselves, so no plane is copied to a temporary first
    np.left_shift(parts[itemsize - 1], 8, out=out, dtype=out.dtype)
    np.bitwise_or(out, parts[itemsize - 2], out=out)
    for j in range(itemsize - 3, -1, -1):
        np.left_shift(out, 8, out=out)
        np.bitwise_or(out, parts[j], out=out)
    return out


def unshuffle_parts(parts: Sequence[np.ndarray], out: np.ndarray,
                    base: np.ndarray | None = None, new: np.ndarray | None = None) -> int:
    """``unshuffle_count`` of elements whose plane j's bytes are ``parts[j]`` (planes
    read where they lie: ``swarm.codec.planes``); returns how many are not 0."""
    fn = getattr(fused, "unshuffle_parts", None)  # None too where an older build is loaded
    if fn is not None and fusable(out, *parts) and (base is None or fusable(base, new)):
        return fn(parts, out, base, new)
    if len(parts) == 1:
        out[:] = parts[0]
    else:
        _unshuffle_views(parts, out)
    if base is not None:
        np.bitwise_xor(base, out, out=new)
    return int(np.count_nonzero(out))


def unshuffle_planes(planes: Planes) -> np.ndarray:
    """The elements of ``planes`` as a new, writable unsigned array."""
    out = np.empty(planes.n, dtype=np.dtype(f"u{planes.itemsize}"))
    for a, b, parts in planes.parts(0, planes.n):
        unshuffle_parts(parts, out[a:b])
    return out


def shuffle_bytes(bits: np.ndarray, itemsize: int) -> bytes:
    """Byte planes: all first bytes, then all second bytes... (zstd-friendly)."""
    return shuffle_planes(bits, itemsize).tobytes()


def unshuffle_bytes(raw: bytes | memoryview | np.ndarray, count: int, dt: DType) -> np.ndarray:
    """Inverse of ``shuffle_bytes``: a new, writable array of ``count`` bit patterns."""
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(dt.itemsize, count)
    out = np.empty(count, dtype=np.dtype(f"u{dt.itemsize}"))
    if fusable(planes):
        fused.unshuffle(planes, dt.itemsize, count, 0, count, out)
        return out.view(dt.np_view)
    if dt.itemsize == 1:
        out[:] = planes[0]
        return out.view(dt.np_view)
    for s in range(0, count, BLOCK):
        e = min(count, s + BLOCK)
        _unshuffle_block(planes, s, e, out[s:e])
    return out.view(dt.np_view)


def xor_planes_into(flat: np.ndarray, planes: np.ndarray, hasher=None) -> int:
    """``flat ^= unshuffle(planes)`` in place, block by block; returns how many
    elements the XOR changed. ``hasher`` (e.g. an XXH3 state), if given, is fed
    the result block by block, so the caller gets the new tensor's digest
    without another pass over it."""
    u = _uview(flat)
    n = u.size
    itemsize = planes.shape[0]
    changed = 0
    if fusable(planes, u):
        for s in range(0, n, BLOCK):
            e = min(n, s + BLOCK)
            changed += fused.xor_into(planes, itemsize, n, s, e, u[s:e])
            if hasher is not None:
                hasher.update(u[s:e])
        return changed
    scratch = np.empty(min(n, BLOCK), dtype=u.dtype)
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        m = e - s
        xb = planes[0, s:e] if itemsize == 1 else _unshuffle_block(planes, s, e, scratch[:m])
        ub = u[s:e]
        np.bitwise_xor(ub, xb, out=ub)
        changed += int(np.count_nonzero(xb))
        if hasher is not None:
            hasher.update(ub)
    return changed


# A byte plane whose order-0 entropy (on a sample) is above this many bits per
# byte is stored raw: zstd would spend ~1 ns/byte to save under 10% of it. Low
# mantissa planes of a dense update or a redrawn tensor are like that.
RAW_PLANE_BITS = 7.2
PLANE_SAMPLE = 1 << 14  # plug-in entropy bias at 2^14 samples: ~0.01 bit/byte
RAW_BLOCK = MAX_BLOCK  # zstd's Block_Maximum_Size


_local = threading.local()


# Match finder of the byte-plane frames: level ``ZSTD_DENSE_LEVEL``'s "fast"
# strategy with a 64-entry hash table and matches of 7+ bytes (repeat-offset
# matches, i.e. runs, are still found). Byte planes have almost no long matches;
# level 1's defaults (8K-entry table, 6-byte matches) find many short ones on
# mid-entropy planes (sign/exponent planes of redrawn or new tensors, ~3 bits
# per byte), each costing a sequence to code and decode, for nothing: this is
# 2-3x faster on those planes and 1-8% smaller, and on high-entropy (mantissa)
# planes no slower. Where the compressed part starts with a nearly empty plane
# (below NARROW_MIN_BITS: e.g. the second plane of an FP32 update, mostly zero
# runs between small carries) level 1's own table is ~6% faster, so it is kept
# there (docs/benchmarks.md). Standard zstd frames: decoders need nothing new.
PLANE_HASH_LOG = 6
PLANE_MIN_MATCH = 7
NARROW_MIN_BITS = 2.0


def _compressor(level: int, narrow: bool = True) -> zstandard.ZstdCompressor:
    """A compressor per thread, level and match finder (``narrow``: the plane
    settings above), reused: a fresh one costs an allocation (and page faults)
    of its context on every record."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get((level, narrow))
    if cctx is None:
        cctx = cache[(level, narrow)] = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters(**_params(level, narrow)))
    return cctx


def _params(level: int, narrow: bool) -> dict[str, int]:
    extra = {"hash_log": PLANE_HASH_LOG, "min_match": PLANE_MIN_MATCH} if narrow else {}
    return {"compression_level": level, "write_checksum": False, "write_dict_id": False, **extra}


# Large planes are compressed through python-zstandard's CFFI backend (the same
# wheel, the same bundled libzstd, the plain C API) straight into a numpy array:
# ``ZstdCompressor.compress`` returns a fresh ``bytes`` of ZSTD_compressBound
# size, i.e. new memory the kernel faults in and zeroes page by page (~0.45 ms
# per MB written here, ~10% of a dense encode when the heap has been trimmed
# since the last one), then shrinks it. A numpy array of that size is mapped
# with transparent huge pages where the kernel allows, and only the pages the
# frame fills are touched. Same parameters, same frames, byte for byte
# (tests/test_codec_encode_fast.py); without the CFFI backend, or with another
# libzstd in it than in the C backend, the C backend's ``compress`` is used.
DIRECT_MIN_BYTES = 1 << 20
_HUGE_PAGE = 1 << 21
try:
    from zstandard import backend_cffi as _zcffi

    _ffi, _lib = _zcffi.ffi, _zcffi.lib
    if _lib.ZSTD_versionNumber() != int("".join(f"{v:02d}" for v in zstandard.ZSTD_VERSION)):
        _ffi = _lib = None
except Exception:  # any failure to load it: the C backend does the work
    _ffi = _lib = None

_DIRECT_PARAMS = {"compression_level": "ZSTD_c_compressionLevel",
                  "write_checksum": "ZSTD_c_checksumFlag", "write_dict_id": "ZSTD_c_dictIDFlag",
                  "hash_log": "ZSTD_c_hashLog", "min_match": "ZSTD_c_minMatch"}


def _direct_cctx(level: int, narrow: bool):
    cache = getattr(_local, "direct", None)
    if cache is None:
        cache = _local.direct = {}
    cctx = cache.get((level, narrow))
    if cctx is None:
        cctx = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
        for name, value in _params(level, narrow).items():
            _check(_lib.ZSTD_CCtx_setParameter(cctx, getattr(_lib, _DIRECT_PARAMS[name]),
                                               int(value)))
        cache[(level, narrow)] = cctx
    return cctx


def _check(code: int) -> int:
    if _lib.ZSTD_isError(code):
        raise zstandard.ZstdError(_ffi.string(_lib.ZSTD_getErrorName(code)).decode())
    return code


def zstd_compress(data: np.ndarray, level: int, narrow: bool) -> bytes | memoryview:
    """One zstd frame of the contiguous uint8 array ``data`` with the plane
    parameters: ``bytes``, or for a large input a memoryview of a numpy array."""
    if _lib is None or data.size < DIRECT_MIN_BYTES:
        return _compressor(level, narrow).compress(data)
    cap = _lib.ZSTD_compressBound(data.size)
    # started on a 2 MiB boundary, so the frame's first pages are huge ones too
    buf = np.empty(cap + _HUGE_PAGE, dtype=np.uint8)
    start = -buf.ctypes.data % _HUGE_PAGE
    out = buf[start:start + cap]
    n = _check(_lib.ZSTD_compress2(_direct_cctx(level, narrow), _ffi.from_buffer(out), cap,
                                   _ffi.from_buffer(data), data.size))
    return memoryview(out)[:n]


def plane_entropy_bits(plane: np.ndarray) -> float:
    """Order-0 entropy in bits per byte of a strided sample of a byte plane."""
    sample = plane[:: max(1, plane.size // PLANE_SAMPLE)]
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    return float(-(p * np.log2(p)).sum())


def raw_planes(planes: np.ndarray) -> int:
    """How many leading (least significant) byte planes to store raw."""
    return _raw_planes(planes)[0]


def _raw_planes(planes: np.ndarray) -> tuple[int, float]:
    """(``raw_planes``, sampled entropy of the first plane after them, 8.0 if none)."""
    count = 0
    while count < planes.shape[0]:
        bits = plane_entropy_bits(planes[count])
        if bits <= RAW_PLANE_BITS:
            return count, bits
        count += 1
    return count, 8.0


def _frame_header_size(frame: bytes) -> tuple[int, int | None]:
    """(header bytes, window descriptor byte or None if single-segment) of a frame
    written by ``zstandard`` without checksum or dictionary id."""
    fhd = frame[4]
    single = (fhd >> 5) & 1
    if fhd & 0x07:  # checksum or dictionary id: not what we asked for
        raise ValueError("unexpected zstd frame header")
    fcs = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    return 5 + (0 if single else 1) + fcs, (None if single else frame[5])


def compress_planes(planes: np.ndarray, level: int = ZSTD_DENSE_LEVEL) -> bytes:
    """One zstd frame of the byte planes (all first bytes, then all second bytes...).

    Planes that look incompressible (``raw_planes``) are not given to zstd: the
    frame is then written here as their raw blocks followed by the blocks of a
    zstd frame of the remaining planes. That is a standard frame: raw blocks
    change no decoder state (repeat offsets, entropy tables), so the compressed
    blocks decode after them exactly as at the start of their own frame, and
    their matches reach back only inside their own planes."""
    parts, _ = compress_planes_parts(planes, level)
    return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def compress_planes_parts(planes: np.ndarray, level: int = ZSTD_DENSE_LEVEL
                          ) -> tuple[list[bytes | memoryview], bool]:
    """``compress_planes`` as (the pieces whose concatenation is the frame,
    whether they are views of ``planes``), so that the caller joins them once,
    with the rest of the patch. Where at least half the planes are stored raw
    (a redrawn or new tensor) the raw blocks are memoryviews of ``planes``:
    keep it unchanged until the join (a raw-heavy record is otherwise written
    twice to fresh memory, once per join). Where fewer are, they are copied
    once, so that the caller can reuse ``planes``' memory instead of holding
    mostly compressible planes."""
    n = planes.shape[1]
    nraw, next_bits = _raw_planes(planes) if n else (0, 8.0)
    narrow = next_bits >= NARROW_MIN_BITS
    if nraw == 0:
        return [zstd_compress(planes.reshape(-1), level, narrow)], False
    flat = planes.reshape(-1)
    raw, rest = flat[: nraw * n], flat[nraw * n:]
    views = 2 * nraw >= planes.shape[0]
    rawview = memoryview(raw if views else raw.tobytes())
    sub: bytes | memoryview = b""
    window = None
    if rest.size:
        frame = zstd_compress(rest, level, narrow)
        head, window = _frame_header_size(frame)
        sub = memoryview(frame)[head:]
    if window is None:  # window >= 128 KiB and >= the compressed part (when single-segment)
        wlog = max(17, int(rest.size - 1).bit_length())
        window = (wlog - 10) << 3
    total = flat.size
    fcs_flag, fcs = (2, struct.pack("<I", total)) if total < 1 << 32 else (3, struct.pack("<Q", total))
    out: list[bytes | memoryview] = [ZSTD_MAGIC + bytes([fcs_flag << 6, window]) + fcs]
    for off in range(0, raw.size, RAW_BLOCK):
        size = min(RAW_BLOCK, raw.size - off)
        last = int(off + size == raw.size and not rest.size)
        out.append((last | size << 3).to_bytes(3, "little"))
        out.append(rawview[off:off + size])
    if rest.size:
        out.append(sub)
    return out, views


def encode_blob(bits: np.ndarray, dt: DType, level: int = ZSTD_DENSE_LEVEL) -> bytes:
    """FULL payload: zstd of the byte planes of ``bits``."""
    return compress_planes(shuffle_planes(bits, dt.itemsize), level)


def encode_xor_blob(old_bits: np.ndarray, new_bits: np.ndarray, dt: DType,
                    level: int = ZSTD_DENSE_LEVEL) -> bytes:
    """DENSE payload: zstd of the byte planes of ``old ^ new`` (XOR fused into the shuffle)."""
    return compress_planes(shuffle_planes(old_bits, dt.itemsize, xor_with=new_bits), level)


# ------------------------------------------------------------------ size estimates


def rice_bits_geometric(count: int, p: float) -> float:
    """Expected bits of ``count`` Rice-coded gaps (best parameter) when each slot is
    a member with probability ``p`` (geometric gaps): per gap
    r + 1 + E[g >> r], with E[g >> r] = q^(2^r) / (1 - q^(2^r)), q = 1 - p."""
    if count == 0:
        return 0.0
    q = min(max(1.0 - p, 0.0), 1.0 - 1e-12)
    best = float("inf")
    for r in range(bs.MAX_RICE_K + 1):
        qr = q ** (1 << r)
        best = min(best, r + 1 + qr / (1.0 - qr))
        if qr < 1e-9:
            break
    return count * best


def estimate_sparse_bytes(n: int, k: int, old_vals: np.ndarray, new_vals: np.ndarray,
                          dt: DType) -> float:
    """Size of a SPARSE body for ``k`` changes among ``n`` elements, from a sample
    of the changes' (old, new) bit patterns, without coding anything: the same
    decisions as ``encode_sparse`` (big deltas, escapes, Exp-Golomb lengths)
    counted on the sample and scaled, with i.i.d. (geometric) gaps assumed for
    the Rice-coded position, delta and escape lists."""
    m = old_vals.size
    if k == 0 or m == 0:
        return 0.0
    delta = to_ordinal(new_vals, dt) - to_ordinal(old_vals, dt)
    mag = np.abs(delta)
    mag_big = mag[mag != 1]
    eg_len = np.where(mag_big >= 2, bs.expgolomb_lengths(np.maximum(mag_big - 2, 0)), 1 << 30)
    esc = (mag_big < 2) | (eg_len > dt.width + ESCAPE_SLACK_BITS)
    scale = k / m
    nb = mag_big.size * scale
    ne = int(np.count_nonzero(esc)) * scale
    bits = rice_bits_geometric(k, k / n) + k  # positions, signs
    if nb:
        bits += rice_bits_geometric(round(nb), nb / k)
        bits += float(eg_len[~esc].sum()) * scale
    if ne:
        bits += rice_bits_geometric(round(ne), ne / nb) + ne * dt.width
    return bits / 8 + 16
