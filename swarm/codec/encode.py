"""Diff two served versions into a patch.

``encode_patch(old, new)`` compares bit patterns tensor by tensor and writes
one record per tensor that differs (unchanged tensors get none). Per tensor it
picks the smaller of SPARSE and, when many elements changed, DENSE; tensors
added, reshaped or re-typed travel whole (FULL), removed ones as DELETE.
Tensors are processed on a thread pool: the heavy numpy and hashing calls
release the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from swarm.codec import context as ctx
from swarm.codec import records
from swarm.codec.digest import state_digest, tensor_digest
from swarm.codec.dtypes import DType, bits_view, dtype_of
from swarm.codec.format import DIGEST_BYTES, Op, TableEntry, encode_header, frame_record

# Try DENSE when more than this fraction of a tensor changed.
DENSE_TRY_FRACTION = 0.15


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

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors if t.op != "DELETE")

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def patch_bytes(self) -> int:
        return len(self.patch)


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


def _encode_one(name: str, old: torch.Tensor | None, new: torch.Tensor | None,
                context: str = "auto"
                ) -> tuple[TableEntry, bytes | None, TensorStats, bytes | None]:
    """-> (table entry, record body or None when unchanged, stats, new tensor digest)."""
    if new is None:
        assert old is not None
        dt = dtype_of(old, name)
        entry = TableEntry(name, Op.DELETE, dt, tuple(old.shape))
        return entry, b"", TensorStats(name, "DELETE", old.numel(), 0, 0, 0), None
    dt = dtype_of(new, name)
    new_bits = _bits(new, dt)
    digest = tensor_digest(new)
    full_bytes = new.numel() * dt.itemsize
    if old is None or old.dtype != new.dtype or tuple(old.shape) != tuple(new.shape):
        entry = TableEntry(name, Op.FULL, dt, tuple(new.shape))
        body = digest[:DIGEST_BYTES] + records.encode_blob(new_bits, dt)
        return entry, body, TensorStats(name, "FULL", new.numel(), new.numel(), 0, full_bytes), digest
    old_bits = _bits(old, dt)
    idx = np.flatnonzero(old_bits != new_bits)
    stats = TensorStats(name, "SPARSE", new.numel(), int(idx.size), 0, full_bytes)
    if idx.size == 0:
        return TableEntry(name, Op.SPARSE, dt, tuple(new.shape)), None, stats, digest
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
    if idx.size > DENSE_TRY_FRACTION * new.numel():
        dense = records.encode_blob(old_bits ^ new_bits, dt)
        if len(dense) < len(payload):
            payload, op = dense, Op.DENSE
    stats.op = op.name
    entry = TableEntry(name, op, dt, tuple(new.shape))
    return entry, digest[:DIGEST_BYTES] + payload, stats, digest


def encode_patch(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 threads: int = 2, context: str = "auto") -> EncodeResult:
    """Encode the patch that turns ``old`` into ``new`` bit for bit.

    ``context``: "auto" (magnitude-bucket position models for 8-bit floats),
    "on" (for every float dtype: smaller, slower), or "off".
    """
    if context not in ("auto", "on", "off"):
        raise ValueError(f"context must be 'auto', 'on' or 'off', not {context!r}")
    t0 = time.perf_counter()
    names = sorted(set(old) | set(new))
    olds = {n: _cpu(old[n]) for n in names if n in old}
    news = {n: _cpu(new[n]) for n in names if n in new}

    def work(name: str):
        return _encode_one(name, olds.get(name), news.get(name), context)

    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(pool.map(work, names))
    else:
        results = [work(n) for n in names]

    new_digests = {n: d for n, (_, _, _, d) in zip(names, results, strict=True) if d is not None}
    # An unchanged tensor's old digest is its new one; others are hashed once.
    old_digests = {
        n: new_digests[n] if (body is None and n in new_digests) else tensor_digest(olds[n])
        for n, (_, body, _, _) in zip(names, results, strict=True) if n in olds
    }
    base_digest = state_digest(olds, old_digests)
    target_digest = state_digest(news, new_digests)

    entries: list[TableEntry] = []
    framed: list[bytes] = []
    stats: list[TensorStats] = []
    for entry, body, st, _ in results:
        stats.append(st)
        if body is None:
            continue
        record = frame_record(body)
        st.record_bytes = len(record)
        entries.append(entry)
        framed.append(record)
    patch = encode_header(base_digest, target_digest, entries) + b"".join(framed)
    return EncodeResult(patch, base_digest, target_digest, time.perf_counter() - t0, stats)
