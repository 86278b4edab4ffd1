"""Vectorised bit-level codes: Rice-coded gaps, Exp-Golomb, fixed and variable fields.

Everything here works on whole numpy arrays (no Python loop per element; the
only loops run over bit *positions*, at most 64 times). A record's streams are
written back to back into one bit sequence (``BitWriter``), packed MSB-first
into bytes (``np.packbits`` order) and zero-padded to a whole byte only at the
end; ``BitReader`` walks it with a bit cursor. Unary codes end with a one bit,
so no stream needs a stored length.

Why Rice codes: changed positions in an Adam-absorption step are close to
i.i.d. with a small per-tensor probability p, so the gaps between them are
geometric, and a Golomb–Rice code with the right parameter is within a few
tenths of a percent of the geometric entropy (see docs/patch-format.md for the
measurement against an ANS coder). It decodes with two ``np.flatnonzero``
calls, and an independent implementation needs ten lines.
"""

from __future__ import annotations

import numpy as np

from swarm.errors import PatchFormatError

MAX_RICE_K = 40
MAX_FIELD_BITS = 64


class BitWriter:
    """Collects bit arrays (uint8 0/1) and packs them once."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def bits(self, b: np.ndarray) -> None:
        if b.size:
            self.parts.append(b.astype(np.uint8, copy=False))

    def fixed(self, values: np.ndarray, width: int) -> None:
        """Each value as ``width`` bits (0 <= width <= 64); values must fit."""
        if width == 0 or values.size == 0:
            return
        word = 8 if width <= 8 else 16 if width <= 16 else 32 if width <= 32 else 64
        v = values.astype(f">u{word // 8}")
        bits = np.unpackbits(v.view(np.uint8).reshape(-1, word // 8), axis=1)
        self.parts.append(bits[:, word - width:].ravel())

    def varbits(self, values: np.ndarray, lengths: np.ndarray) -> None:
        """Value i as ``lengths[i]`` bits (MSB first), all concatenated."""
        total = int(lengths.sum())
        if total == 0:
            return
        out = np.zeros(total, dtype=np.uint8)
        starts = np.cumsum(lengths) - lengths
        v = values.astype(np.uint64, copy=False)
        for j in range(int(lengths.max())):
            m = lengths > j
            shift = (lengths[m] - 1 - j).astype(np.uint64)
            out[starts[m] + j] = ((v[m] >> shift) & np.uint64(1)).astype(np.uint8)
        self.parts.append(out)

    def unary(self, q: np.ndarray) -> None:
        """Each q as q zero bits followed by a one bit."""
        if q.size == 0:
            return
        ends = np.cumsum(q.astype(np.int64) + 1) - 1
        out = np.zeros(int(ends[-1]) + 1, dtype=np.uint8)
        out[ends] = 1
        self.parts.append(out)

    def rice(self, values: np.ndarray, k: int) -> None:
        """Rice code, parameter k: all unary quotients, then all k-bit remainders."""
        v = values.astype(np.int64, copy=False)
        self.unary(v >> k)
        self.fixed(v & ((1 << k) - 1), k)

    def expgolomb(self, values: np.ndarray) -> None:
        """Exp-Golomb order 0: unary bit lengths, then the mantissas."""
        w = values.astype(np.uint64) + np.uint64(1)
        mant_len = bit_length(w) - 1
        self.unary(mant_len)
        self.varbits(w & ((np.uint64(1) << mant_len.astype(np.uint64)) - np.uint64(1)), mant_len)

    def nbits(self) -> int:
        return sum(p.size for p in self.parts)

    def to_bytes(self) -> bytes:
        if not self.parts:
            return b""
        return np.packbits(np.concatenate(self.parts)).tobytes()


class BitReader:
    """Bit cursor over packed bytes; every read is bounds-checked."""

    def __init__(self, data: bytes | memoryview, what: str) -> None:
        self.bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        self.pos = 0
        self.what = what

    def _take(self, n: int, what: str) -> np.ndarray:
        if self.pos + n > self.bits.size:
            raise PatchFormatError(f"{self.what} {what}: bit stream truncated")
        out = self.bits[self.pos:self.pos + n]
        self.pos += n
        return out

    def bits_(self, n: int, what: str) -> np.ndarray:
        return self._take(n, what)

    def fixed(self, count: int, width: int, what: str) -> np.ndarray:
        if width == 0 or count == 0:
            return np.zeros(count, dtype=np.uint64)
        if width > MAX_FIELD_BITS:
            raise PatchFormatError(f"{self.what} {what}: field width {width} too large")
        b = self._take(count * width, what).reshape(count, width)
        if width <= 16:  # narrow fields (Rice remainders): shift in one column at a time
            acc = np.dtype(np.uint8 if width <= 8 else np.uint16)
            out = b[:, 0].astype(acc)
            for j in range(1, width):
                out <<= acc.type(1)
                out |= b[:, j]
            return out.astype(np.uint64)
        # Left-pad each field to a whole machine word and let packbits do the rest.
        word = 32 if width <= 32 else 64
        padded = np.zeros((count, word), dtype=np.uint8)
        padded[:, word - width:] = b
        return np.packbits(padded, axis=1).view(f">u{word // 8}").reshape(-1).astype(np.uint64)

    def varbits(self, lengths: np.ndarray, what: str) -> np.ndarray:
        total = int(lengths.sum())
        out = np.zeros(lengths.size, dtype=np.uint64)
        if total == 0:
            return out
        b = self._take(total, what)
        starts = np.cumsum(lengths) - lengths
        for j in range(int(lengths.max())):
            m = lengths > j
            out[m] = (out[m] << np.uint64(1)) | b[starts[m] + j].astype(np.uint64)
        return out

    def unary(self, count: int, what: str) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        # Scan a window that usually holds all ``count`` codes, widening if not.
        window = 4 * count + 64
        while True:
            ones = np.flatnonzero(self.bits[self.pos:self.pos + window])
            if ones.size >= count or self.pos + window >= self.bits.size:
                break
            # Widen to what the density of ones seen so far says is needed (+20%).
            window = int(window * max(2.0, 1.2 * count / max(1, ones.size)))
        if ones.size < count:
            raise PatchFormatError(f"{self.what} {what}: unary codes truncated")
        ends = ones[:count]
        self.pos += int(ends[-1]) + 1
        return np.diff(ends, prepend=-1) - 1

    def rice(self, count: int, k: int, what: str) -> np.ndarray:
        if k > MAX_RICE_K:
            raise PatchFormatError(f"{self.what} {what}: Rice parameter {k} out of range")
        q = self.unary(count, what)
        return (q << k) | self.fixed(count, k, what).astype(np.int64)

    def expgolomb(self, count: int, what: str) -> np.ndarray:
        mant_len = self.unary(count, what)
        if mant_len.size and int(mant_len.max()) > 63:
            raise PatchFormatError(f"{self.what} {what}: Exp-Golomb code longer than 64 bits")
        low = self.varbits(mant_len, what)
        return (((np.uint64(1) << mant_len.astype(np.uint64)) | low) - np.uint64(1)).astype(np.int64)

    def done(self) -> None:
        """Only zero padding (< 8 bits) may remain."""
        rest = self.bits.size - self.pos
        if rest >= 8 or self.bits[self.pos:].any():
            raise PatchFormatError(f"{self.what}: {rest} unexpected trailing bits")


# --------------------------------------------------------------- Rice parameter and gaps


def best_rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that minimises the coded size of ``gaps`` (exact search)."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    centre = int(np.log2(mean * 0.69 + 1.0)) if mean > 0 else 0
    best_k, best_cost = 0, None
    g = gaps.astype(np.int64, copy=False)
    for k in range(max(0, centre - 2), min(MAX_RICE_K, centre + 3) + 1):
        cost = int((g >> k).sum()) + g.size * (k + 1)
        if best_cost is None or cost < best_cost:
            best_k, best_cost = k, cost
    return best_k


def positions_to_gaps(positions: np.ndarray) -> np.ndarray:
    """Sorted distinct positions -> gaps (number of skipped slots before each)."""
    return np.diff(positions.astype(np.int64), prepend=-1) - 1


def gaps_to_positions(gaps: np.ndarray, universe: int, what: str) -> np.ndarray:
    if gaps.size and int(gaps.min()) < 0:
        raise PatchFormatError(f"{what}: negative gap")
    pos = np.cumsum(gaps + 1) - 1
    if pos.size and int(pos[-1]) >= universe:
        raise PatchFormatError(f"{what}: position {int(pos[-1])} beyond {universe} elements")
    return pos


def bit_length(v: np.ndarray) -> np.ndarray:
    """Bit length of non-negative values (0 -> 0), exact up to 2**64 - 1."""
    v = v.astype(np.uint64, copy=False)
    if v.size == 0 or int(v.max()) < (1 << 53):  # exact in float64: one frexp
        return np.frexp(v.astype(np.float64))[1].astype(np.int64)
    out = np.zeros(v.shape, dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        m = v >= (np.uint64(1) << np.uint64(shift))
        out[m] += shift
        v = np.where(m, v >> np.uint64(shift), v)
    return out + (v > 0)


def expgolomb_lengths(values: np.ndarray) -> np.ndarray:
    """Coded length in bits of each value under Exp-Golomb order 0."""
    return 2 * bit_length(values.astype(np.uint64) + np.uint64(1)) - 1
