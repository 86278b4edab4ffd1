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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from swarm.codec import bitstream as bs
from swarm.codec import context
from swarm.codec.dtypes import DType, from_ordinal, to_ordinal
from swarm.codec.format import BodyReader, put_varint
from swarm.codec.zstd_bounded import decompress_bounded
from swarm.errors import PatchFormatError

ZSTD_DENSE_LEVEL = 3
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


def shuffle_bytes(bits: np.ndarray, itemsize: int) -> bytes:
    """Byte planes: all first bytes, then all second bytes... (zstd-friendly)."""
    if itemsize == 1:
        return bits.tobytes()
    return np.ascontiguousarray(bits.view(np.uint8).reshape(-1, itemsize).T).tobytes()


def unshuffle_bytes(raw: bytes, count: int, dt: DType) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8)
    if dt.itemsize == 1:
        return planes.view(dt.np_view)
    return np.ascontiguousarray(planes.reshape(dt.itemsize, count).T).view(dt.np_view).reshape(-1)


def encode_blob(bits: np.ndarray, dt: DType, level: int = ZSTD_DENSE_LEVEL) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(shuffle_bytes(bits, dt.itemsize))


def decode_blob(r: BodyReader, count: int, dt: DType) -> np.ndarray:
    # The size comes from the tensor table; the frame's own header is not trusted.
    raw = decompress_bounded(r.rest(), count * dt.itemsize, r.what, PatchFormatError)
    return unshuffle_bytes(raw, count, dt)
