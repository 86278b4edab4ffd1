"""Diff two served versions into a patch.

``encode_patch(old, new)`` compares bit patterns tensor by tensor and writes
one record per tensor that differs (unchanged tensors get none). Per tensor it
uses SPARSE when few elements changed and, when many did, DENSE unless SPARSE
is clearly smaller — decided from the changed count and samples before any
full-size entropy coding, so a dense tensor never pays for the sparse coder
(``plan_op``); tensors added, reshaped or re-typed travel whole (FULL),
removed ones as DELETE.
Tensors are processed on a thread pool: the heavy numpy and hashing calls
release the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from swarm.codec import context as ctx
from swarm.codec import records
from swarm.codec.digest import state_digest, tensor_digest
from swarm.codec.dtypes import DType, bits_view, dtype_of
from swarm.codec.format import DIGEST_BYTES, Op, TableEntry, encode_header, record_prefix

# Try DENSE when more than this fraction of a tensor changed.
DENSE_TRY_FRACTION = 0.15
# Above it DENSE is used unless SPARSE is (estimated) more than DENSE_BIAS
# smaller: in that regime the sparse coder is 30-100x slower than DENSE, on
# both sides, so a few percent of bytes do not pay for it. The SPARSE size is
# estimated without coding, from the changed count and a strided sample of
# SPARSE_SAMPLE elements; the DENSE size by compressing SAMPLE_BLOCKS evenly
# spread blocks of SAMPLE_BLOCK elements (tensors of DENSE_SAMPLE_MIN elements
# or more, at most 1/16 of the work) or, for smaller tensors, the payload itself.
DENSE_BIAS = 0.15
# The scan writes DENSE's byte planes instead of the change mask once more than
# this fraction of the tensor's first eighth changed (see _scan).
DENSE_SCAN_FRACTION = 0.5
SCAN_BLOCK_BYTES = 1 << 18
SPARSE_SAMPLE = 1 << 12
SAMPLE_BLOCKS = 8
SAMPLE_BLOCK = 1 << 12
DENSE_SAMPLE_MIN = 16 * SAMPLE_BLOCKS * SAMPLE_BLOCK


@dataclass
class TensorStats:
    name: str
    op: str
    elements: int
    changed: int
    record_bytes: int
    full_bytes: int


@dataclass
class EncodeResult:
    patch: bytes
    base_digest: bytes
    target_digest: bytes
    encode_s: float
    tensors: list[TensorStats] = field(default_factory=list)
    # XXH3 tensor digests of ``new`` (name -> 8 bytes): pass them as the next
    # encode's ``old_digests`` so the old view is not hashed again.
    digests: dict[str, bytes] = field(default_factory=dict)

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors if t.op != "DELETE")

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def patch_bytes(self) -> int:
        return len(self.patch)


class Scratch:
    """Byte-plane buffers of one ``encode_patch`` call, one per thread, reused
    from tensor to tensor (grown when a larger tensor comes): a fresh plane
    array per tensor costs the kernel's page faults and zeroing on every first
    touch of it, ~10% of a dense encode. Planes taken from it are valid until
    the same thread takes the next ones."""

    def __init__(self) -> None:
        self._local = threading.local()

    def planes(self, itemsize: int, n: int) -> np.ndarray:
        size = itemsize * n
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < size:
            buf = self._local.buf = np.empty(size, dtype=np.uint8)
        return buf[:size].reshape(itemsize, n)

    def release(self) -> None:
        """The planes last taken are kept by their caller: the next ones get a new buffer."""
        self._local.buf = None


def _frame_parts(planes: np.ndarray, scratch: Scratch | None) -> list[bytes | memoryview]:
    """DENSE/FULL payload of ``planes`` as pieces for the patch's one join; raw
    blocks are views of ``planes``, which then must not be reused until it."""
    parts, views = records.compress_planes_parts(planes)
    if scratch is not None and views:
        scratch.release()
    return parts


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _bits(t: torch.Tensor, dt: DType) -> np.ndarray:
    return bits_view(t, dt).numpy()


def use_context(mode: str, dt: DType) -> bool:
    """Context modelling costs passes over the whole tensor: by default ("auto")
    only for 8-bit floats, where it is cheap and the patch is mostly positions."""
    if mode == "on":
        return ctx.supports(dt)
    if mode == "auto":
        return ctx.supports(dt) and dt.width == 8
    return False


def _scan(old_bits: np.ndarray, new_bits: np.ndarray, hash_old: bool = True,
          scratch: Scratch | None = None, samples: list[np.ndarray] | None = None
          ) -> tuple[np.ndarray | None, int, np.ndarray | None, bytes | None, bytes]:
    """One blocked pass over both tensors -> (changed-element mask, changed count,
    XOR byte planes, old digest, new digest), hashing each block while in cache.

    After the first block, and again after the first eighth of the tensor, if
    more than ``DENSE_SCAN_FRACTION`` of what was read so far changed, the pass
    stops writing the mask and writes the XOR's byte planes instead (what DENSE
    compresses), so a dense tensor is read once: then the mask is None;
    otherwise the planes are None. (The first block settles a dense tensor
    with one block redone; the eighth catches one whose start is unchanged.)
    The old digest is None when ``hash_old`` is false (the caller knows it).
    The planes are written into ``scratch``'s buffer when given.

    ``samples``, if given, receives ``old_bits[::stride]`` and
    ``new_bits[::stride]`` (stride ``max(1, n // SPARSE_SAMPLE)``, the sample
    ``plan_op`` estimates SPARSE from), gathered block by block while in cache."""
    n = new_bits.size
    w = new_bits.itemsize
    step = SCAN_BLOCK_BYTES // w  # elements per block: ~256 KB of each input
    # the first block's mask on its own: a dense tensor never needs the rest
    # (a fresh n-byte array would cost its first huge page's fault and zeroing)
    mask = np.empty(min(n, step), dtype=bool)
    planes = None
    h_old, h_new = xxhash.xxh3_64(), xxhash.xxh3_64()
    o8, n8 = old_bits.view(np.uint8), new_bits.view(np.uint8)
    uo, un = records._uview(old_bits), records._uview(new_bits)
    probe = max(step, n // 8)
    stride = max(1, n // SPARSE_SAMPLE)
    so: list[np.ndarray] = []
    sn: list[np.ndarray] = []
    k = 0
    for s in range(0, n, step):
        e = min(n, s + step)
        if hash_old:
            h_old.update(o8[s * w:e * w])
        h_new.update(n8[s * w:e * w])
        if samples is not None:
            first = -(-s // stride) * stride
            so.append(old_bits[first:e:stride])
            sn.append(new_bits[first:e:stride])
        if planes is not None:
            k += records.shuffle_range(uo, un, planes, s, e)
            continue
        if s == step:  # still sparse-looking after the first block
            head, mask = mask, np.empty(n, dtype=bool)
            mask[:step] = head
        np.not_equal(old_bits[s:e], new_bits[s:e], out=mask[s:e])
        if (s == 0 or s < probe <= e) and e < n:
            k = int(np.count_nonzero(mask[:e]))
            if k > DENSE_SCAN_FRACTION * e:
                planes = (scratch.planes(w, n) if scratch is not None
                          else np.empty((w, n), dtype=np.uint8))
                records.shuffle_range(uo, un, planes, 0, e)
    if samples is not None:
        samples[:] = [_join(so, old_bits), _join(sn, new_bits)]
    old_digest = h_old.digest() if hash_old else None
    if planes is None:
        return mask, int(np.count_nonzero(mask)), None, old_digest, h_new.digest()
    return None, k, planes, old_digest, h_new.digest()


def _join(pieces: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces) if pieces else like[:0]


def _block_starts(n: int) -> np.ndarray:
    return np.linspace(0, n - SAMPLE_BLOCK, SAMPLE_BLOCKS).astype(np.int64)


def _block_sample(bits: np.ndarray) -> np.ndarray:
    return np.concatenate([bits[s:s + SAMPLE_BLOCK] for s in _block_starts(bits.size)])


def _plane_block_sample(planes: np.ndarray) -> np.ndarray:
    """The byte planes of ``_block_sample(old) ^ _block_sample(new)``, taken from the
    planes of ``old ^ new`` (the same bytes, without reading the inputs again)."""
    return np.concatenate([planes[:, s:s + SAMPLE_BLOCK] for s in _block_starts(planes.shape[1])],
                          axis=1)


def plan_op(old_bits: np.ndarray, new_bits: np.ndarray, changed: int, dt: DType,
            planes: np.ndarray | None = None,
            sample: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[str, bytes | None]:
    """Which coder a same-shape tensor with ``changed`` elements changed gets:
    ("sparse" or "dense", the DENSE payload if it was computed on the way).

    Decided before any full-size entropy coding: up to ``DENSE_TRY_FRACTION``
    changed is SPARSE; above it DENSE unless SPARSE is estimated more than
    ``DENSE_BIAS`` smaller. The estimates (see the constants) are within ~1% of
    the real SPARSE size and ~3% of DENSE (15% for random data) on the
    benchmark's cases, and cost a few percent of a DENSE encode.

    ``planes`` (the XOR's byte planes, from the scan) and ``sample`` (the
    strided SPARSE sample, ``_scan(samples=)``) only save reading the inputs
    again: the decision and the payload are the same without them."""
    n = new_bits.size
    if changed <= DENSE_TRY_FRACTION * n:
        return "sparse", None
    if sample is None:
        stride = max(1, n // SPARSE_SAMPLE)
        sample = old_bits[::stride], new_bits[::stride]
    so, sn = sample
    j = np.flatnonzero(so != sn)
    sparse = records.estimate_sparse_bytes(n, changed, so[j], sn[j], dt)
    payload = None
    if n >= DENSE_SAMPLE_MIN:
        if planes is not None:
            sp = _plane_block_sample(planes)
            dense = len(records.compress_planes(sp)) * n / sp.shape[1]
        else:
            bo, bn = _block_sample(old_bits), _block_sample(new_bits)
            dense = len(records.encode_xor_blob(bo, bn, dt)) * n / bo.size
    else:
        payload = (records.compress_planes(planes) if planes is not None
                   else records.encode_xor_blob(old_bits, new_bits, dt))
        dense = len(payload)
    return ("sparse" if sparse < (1 - DENSE_BIAS) * dense else "dense"), payload


def _encode_sparse(old_bits: np.ndarray, new_bits: np.ndarray, idx: np.ndarray, dt: DType,
                   context: str) -> tuple[bytes, Op]:
    old_vals, new_vals = old_bits[idx], new_bits[idx]
    payload, _ = records.encode_sparse(idx, old_vals, new_vals, dt)
    op = Op.SPARSE
    if use_context(context, dt):
        thresholds = ctx.choose_thresholds(old_bits, idx, dt)
        if thresholds:
            ranks = ctx.encode_ranks(old_bits, idx, thresholds, dt)
            with_ctx, _ = records.encode_sparse(idx, old_vals, new_vals, dt,
                                                thresholds=thresholds, ranks=ranks)
            if len(with_ctx) < len(payload):
                payload, op = with_ctx, Op.SPARSE_CTX
    return payload, op


def _encode_one(name: str, old: torch.Tensor | None, new: torch.Tensor | None,
                context: str = "auto", hash_old: bool = True, scratch: Scratch | None = None
                ) -> tuple[TableEntry, list[bytes | memoryview] | None, TensorStats, bytes | None,
                           bytes | None]:
    """-> (table entry, record body as parts to concatenate or None when unchanged,
    stats, new tensor digest, old tensor digest or None when not computed)."""
    if new is None:
        assert old is not None
        dt = dtype_of(old, name)
        entry = TableEntry(name, Op.DELETE, dt, tuple(old.shape))
        return entry, [], TensorStats(name, "DELETE", old.numel(), 0, 0, 0), None, None
    dt = dtype_of(new, name)
    new_bits = _bits(new, dt)
    full_bytes = new.numel() * dt.itemsize
    if old is None or old.dtype != new.dtype or tuple(old.shape) != tuple(new.shape):
        digest = tensor_digest(new)
        entry = TableEntry(name, Op.FULL, dt, tuple(new.shape))
        out = scratch.planes(dt.itemsize, new_bits.size) if scratch is not None else None
        planes = records.shuffle_planes(new_bits, dt.itemsize, out=out)
        body = [digest[:DIGEST_BYTES], *_frame_parts(planes, scratch)]
        stats = TensorStats(name, "FULL", new.numel(), new.numel(), 0, full_bytes)
        return entry, body, stats, digest, None
    old_bits = _bits(old, dt)
    samples: list[np.ndarray] = []
    mask, k, planes, old_digest, digest = _scan(old_bits, new_bits, hash_old, scratch, samples)
    stats = TensorStats(name, "SPARSE", new.numel(), k, 0, full_bytes)
    if k == 0:
        return TableEntry(name, Op.SPARSE, dt, tuple(new.shape)), None, stats, digest, old_digest
    plan, dense = plan_op(old_bits, new_bits, k, dt, planes, (samples[0], samples[1]))
    parts: list[bytes | memoryview]
    if plan == "sparse":
        idx = np.flatnonzero(mask if mask is not None else old_bits != new_bits)
        del mask, planes
        payload, op = _encode_sparse(old_bits, new_bits, idx, dt, context)
        parts = [payload]
    else:
        del mask
        op = Op.DENSE
        if dense is not None:
            parts = [dense]
        elif planes is not None:
            parts = _frame_parts(planes, scratch)
        else:
            parts = [records.encode_xor_blob(old_bits, new_bits, dt)]
    stats.op = op.name
    entry = TableEntry(name, op, dt, tuple(new.shape))
    return entry, [digest[:DIGEST_BYTES], *parts], stats, digest, old_digest


def encode_patch(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 threads: int = 2, context: str = "auto",
                 old_digests: Mapping[str, bytes] | None = None) -> EncodeResult:
    """Encode the patch that turns ``old`` into ``new`` bit for bit.

    ``context``: "auto" (magnitude-bucket position models for 8-bit floats),
    "on" (for every float dtype: smaller, slower), or "off".
    ``old_digests``: tensor digests of ``old`` the caller already holds (the
    previous result's ``digests``); those tensors are not hashed again (a
    quarter of a dense encode's memory traffic). They must be right: the
    patch's base digest is built from them.
    """
    if context not in ("auto", "on", "off"):
        raise ValueError(f"context must be 'auto', 'on' or 'off', not {context!r}")
    t0 = time.perf_counter()
    names = sorted(set(old) | set(new))
    olds = {n: _cpu(old[n]) for n in names if n in old}
    news = {n: _cpu(new[n]) for n in names if n in new}

    known = dict(old_digests or {})
    scratch = Scratch()

    def work(name: str):
        return _encode_one(name, olds.get(name), news.get(name), context, name not in known,
                           scratch)

    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(pool.map(work, names))
    else:
        results = [work(n) for n in names]

    new_digests = {n: d for n, (_, _, _, d, _) in zip(names, results, strict=True) if d is not None}
    # Same-shape tensors had their old digest taken in the scan; the rest are hashed here.
    base_digests = {
        n: od if od is not None else known.get(n) or tensor_digest(olds[n])
        for n, (_, _, _, _, od) in zip(names, results, strict=True) if n in olds
    }
    base_digest = state_digest(olds, base_digests)
    target_digest = state_digest(news, new_digests)

    entries: list[TableEntry] = []
    framed: list[bytes | memoryview] = []
    stats: list[TensorStats] = []
    for entry, body, st, _, _ in results:
        stats.append(st)
        if body is None:
            continue
        prefix = record_prefix(sum(len(b) for b in body))
        st.record_bytes = len(prefix) + sum(len(b) for b in body)
        entries.append(entry)
        framed.append(prefix)
        framed.extend(body)
    # One concatenation: a dense patch is tens of MB, every extra join is a memcpy.
    patch = b"".join([encode_header(base_digest, target_digest, entries), *framed])
    return EncodeResult(patch, base_digest, target_digest, time.perf_counter() - t0, stats,
                        new_digests)
