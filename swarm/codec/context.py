"""Context modelling of changed positions: buckets by the old value's magnitude.

An Adam step moves every weight by about the same amount (Adam normalises
the update), but the rounding grid of a float is proportional to its
magnitude, so small weights cross a boundary far more often than large ones.
The receiver knows the old values, so encoder and decoder can both split a
tensor's elements into buckets by magnitude and code the changed positions
*within each bucket* (as Rice-coded rank gaps) with that bucket's own change
rate. On MiniLM steps two or three buckets cut position bits by 15–29%,
which takes the patch under the i.i.d. entropy bound.

Buckets are nested thresholds on the magnitude bit pattern (the bits with the
sign cleared, which orders |x| for floats): bucket(x) = #{j : mag(x) >= t_j}.
Both sides walk the tensor in blocks of ``BLOCK`` elements, so the extra
memory is a few arrays of one block, never of the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from swarm.codec.dtypes import DType
from swarm.errors import PatchFormatError

BLOCK = 1 << 20
MAX_THRESHOLDS = 2
MIN_ELEMENTS = 1 << 14  # below this the bucket metadata outweighs the gain
MIN_GAIN_BYTES = 24
SAMPLE_STRIDE = 16

_MANTISSA_BITS = {
    "float32": 23, "float16": 10, "bfloat16": 7, "float8_e4m3fn": 3, "float8_e5m2": 2,
    "float64": 52,
}


def supports(dt: DType) -> bool:
    return dt.name in _MANTISSA_BITS


def magnitude(bits: np.ndarray, dt: DType) -> np.ndarray:
    """Bit pattern with the sign cleared, as an unsigned array (orders |x|)."""
    u = bits.view(np.dtype(f"u{dt.itemsize}"))
    return u & np.array((1 << (dt.width - 1)) - 1, dtype=u.dtype)


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    out = -(p * np.log2(p) + q * np.log2(q))
    return np.where((p <= 1e-300) | (q <= 1e-300), 0.0, out)


def choose_thresholds(old_bits: np.ndarray, idx: np.ndarray, dt: DType) -> list[int]:
    """Pick 0..2 exponent-aligned thresholds that minimise the estimated position bits.

    Element counts per exponent come from a strided sample; change counts are exact.
    """
    n, k = old_bits.size, idx.size
    if not supports(dt) or n < MIN_ELEMENTS or k < 16 or k > n // 2:
        return []
    shift = _MANTISSA_BITS[dt.name]
    exps = 1 << (dt.width - 1 - shift)
    e_all = (magnitude(old_bits[::SAMPLE_STRIDE], dt) >> shift).astype(np.int64)
    n_hist = np.bincount(e_all, minlength=exps).astype(float) * (n / max(1, e_all.size))
    e_chg = (magnitude(old_bits[idx], dt) >> shift).astype(np.int64)
    k_hist = np.bincount(e_chg, minlength=exps).astype(float)
    cn = np.concatenate([[0.0], np.cumsum(n_hist)])
    ck = np.concatenate([[0.0], np.cumsum(k_hist)])

    def seg(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        nn = cn[b] - cn[a]
        kk = np.minimum(ck[b] - ck[a], nn)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.where(nn > 0, kk / np.maximum(nn, 1e-9), 0.0)
        return nn * _h(p)

    base = float(seg(np.array([0]), np.array([exps]))[0])
    best_bits, best = base, []
    cuts = np.arange(1, exps)
    one = seg(np.zeros_like(cuts), cuts) + seg(cuts, np.full_like(cuts, exps))
    i = int(np.argmin(one))
    if one[i] + 40 < best_bits:
        best_bits, best = float(one[i]), [int(cuts[i])]
    a, b = np.meshgrid(cuts, cuts, indexing="ij")
    mask = a < b
    two = np.full(a.shape, np.inf)
    two[mask] = (seg(np.zeros_like(a[mask]), a[mask]) + seg(a[mask], b[mask])
                 + seg(b[mask], np.full_like(b[mask], exps)))
    j = int(np.argmin(two))
    if two.flat[j] + 40 < best_bits:
        best_bits, best = float(two.flat[j]), [int(a.flat[j]), int(b.flat[j])]
    if (base - best_bits) / 8 < max(MIN_GAIN_BYTES, 0.02 * base / 8):
        return []
    return [e << shift for e in best]


def bucket_of(mags: np.ndarray, thresholds: list[int]) -> np.ndarray:
    out = np.zeros(mags.shape, dtype=np.int64)
    for t in thresholds:
        out += mags >= t
    return out


SUB = 128  # sub-block size for counting members without materialising them
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _sub_counts(mask: np.ndarray) -> np.ndarray:
    """Members per SUB-element sub-block, via packbits + a popcount table (fast)."""
    pc = _POPCOUNT[np.packbits(mask)]
    pad = (-pc.size) % (SUB // 8)
    if pad:
        pc = np.concatenate([pc, np.zeros(pad, dtype=np.uint8)])
    return pc.reshape(-1, SUB // 8).sum(axis=1, dtype=np.int64)


def _rows(mask: np.ndarray, sb: np.ndarray) -> np.ndarray:
    """The SUB mask bits of each listed sub-block, one row each (False past the end)."""
    cols = np.arange(SUB)
    idx = sb[:, None] * SUB + cols
    inside = idx < mask.size
    return mask[np.minimum(idx, mask.size - 1)] & inside


def _sparse(count: int, size: int) -> bool:
    return count * SUB * 4 < size


def _prefix_counts(mask: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, int]:
    """For sorted distinct local positions ``p``: how many True in ``mask`` precede each,
    and the mask's total, without index arrays of the block's size."""
    if p.size == 0:
        return p, int(np.count_nonzero(mask))
    if _sparse(p.size, mask.size):
        counts = _sub_counts(mask)
        cum = np.concatenate([[0], np.cumsum(counts)])
        sb = p // SUB
        partial = (_rows(mask, sb) & (np.arange(SUB) < (p - sb * SUB)[:, None])).sum(axis=1)
        return cum[sb] + partial, int(cum[-1])
    head = int(np.count_nonzero(mask[: p[0]]))
    seg = np.add.reduceat(mask, p, dtype=np.int64)  # sums over [p_i, p_{i+1}) and [p_last, end)
    before = np.empty(p.size, dtype=np.int64)
    before[0] = head
    np.cumsum(seg[:-1], out=before[1:])
    before[1:] += head
    return before, head + int(seg.sum())


def _select(mask: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Positions of the ``local``-th True elements of ``mask`` (sorted ranks)."""
    if not _sparse(local.size, mask.size):
        return np.flatnonzero(mask)[local]
    counts = _sub_counts(mask)
    cum = np.cumsum(counts)
    sb = np.searchsorted(cum, local, side="right")
    within = local - (cum[sb] - counts[sb])
    seen = np.cumsum(_rows(mask, sb), axis=1)
    return sb * SUB + np.argmax(seen > within[:, None], axis=1)


def encode_ranks(old_bits: np.ndarray, idx: np.ndarray, thresholds: list[int],
                 dt: DType) -> list[np.ndarray]:
    """For each bucket, the sorted ranks of its changed elements within the bucket."""
    nb = len(thresholds) + 1
    buckets = bucket_of(magnitude(old_bits[idx], dt), thresholds)
    ranks = [np.empty(int((buckets == b).sum()), dtype=np.int64) for b in range(nb)]
    filled = [0] * nb
    below = [0] * (nb + 1)  # running count of S_j = {mag < t_j} in earlier blocks, j = 1..T
    n = old_bits.size
    for start in range(0, n, BLOCK):
        stop = min(n, start + BLOCK)
        lo, hi = (int(x) for x in np.searchsorted(idx, [start, stop]))
        mag = magnitude(old_bits[start:stop], dt)
        p = idx[lo:hi] - start
        # c[j][i]: members of S_j before position i (global); S_0 is empty, S_{T+1} is all.
        c = [np.zeros(p.size, dtype=np.int64)]
        for j, t in enumerate(thresholds, start=1):
            before, total = _prefix_counts(mag < t, p)
            c.append(before + below[j])
            below[j] += total
        c.append(p + start)
        bk = buckets[lo:hi]
        for b in range(nb):
            sel = bk == b
            m = int(np.count_nonzero(sel))
            if m:
                ranks[b][filled[b]:filled[b] + m] = c[b + 1][sel] - c[b][sel]
                filled[b] += m
    return ranks


def decode_positions(old_block: Callable[[int, int], np.ndarray], n: int,
                     ranks: list[np.ndarray], thresholds: list[int], dt: DType,
                     what: str) -> np.ndarray:
    """Inverse of ``encode_ranks``: sorted global positions of the changed elements.

    ``old_block(start, stop)`` returns the old bit patterns of one block (on the
    host), so a CUDA tensor is read a block at a time, never copied whole."""
    nb = len(thresholds) + 1
    edges = [None, *thresholds, None]
    out = [np.empty(r.size, dtype=np.int64) for r in ranks]
    done = [0] * nb
    seen = [0] * nb  # bucket members in earlier blocks
    for start in range(0, n, BLOCK):
        if all(done[b] == ranks[b].size for b in range(nb)):
            break
        stop = min(n, start + BLOCK)
        mag = magnitude(old_block(start, stop), dt)
        for b in range(nb):
            lo_t, hi_t = edges[b], edges[b + 1]
            if lo_t is None and hi_t is None:
                mask = None
            elif lo_t is None:
                mask = mag < hi_t
            elif hi_t is None:
                mask = mag >= lo_t
            else:
                mask = (mag >= lo_t) & (mag < hi_t)
            count = stop - start if mask is None else int(np.count_nonzero(mask))
            r = ranks[b]
            hi = int(np.searchsorted(r, seen[b] + count))
            if hi > done[b]:
                local = r[done[b]:hi] - seen[b]
                pos = local if mask is None else _select(mask, local)
                out[b][done[b]:hi] = pos + start
                done[b] = hi
            seen[b] += count
    for b in range(nb):
        if done[b] != ranks[b].size:
            raise PatchFormatError(f"{what}: bucket {b} rank beyond the bucket's size")
    return np.sort(np.concatenate(out)) if nb > 1 else out[0]
