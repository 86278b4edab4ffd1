"""Apply a patch in place, on the tensors' own device, all or nothing.

``PatchApplier`` is fed the patch as it arrives (``feed``) and applies each
record as soon as it is complete, so a node can apply tensor by tensor while
later chunks are still downloading. Every mutation is recorded in an undo log
(the old values at the changed positions, which the decoder needs anyway), so
any failure — a corrupt or truncated record, a digest mismatch, a wrong base —
rolls the weights back to exactly the state before the first record, then
raises. Extra memory is bounded by the decoded records (positions plus old and
new values), never a full-size copy of a tensor, except that DENSE records
hold their XOR (their decoded size, as byte planes) until the apply ends.
Bytes fed in are not copied while they hold whole records; only an incomplete
tail is buffered, and copied once when its record completes.

Contract for callers: while an apply is in progress the weights must not be
served; after ``finish`` they are the target version, after an exception they
are the base version.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from swarm.codec import records
from swarm.codec.digest import state_digest, tensor_digest
from swarm.codec.dtypes import bits_view, dtype_of
from swarm.codec.format import (
    DIGEST_BYTES,
    BodyReader,
    Op,
    PatchHeader,
    TableEntry,
    decode_header,
    header_size_needed,
    record_extent,
    split_record,
)
from swarm.errors import PatchApplyError, PatchFormatError


@dataclass
class ApplyReport:
    records: int
    changed: int
    target_digest: bytes


class _Undo:
    """What to do to revert one applied record."""

    def __init__(self, name: str, kind: str, data: object) -> None:
        self.name, self.kind, self.data = name, kind, data


class PatchApplier:
    def __init__(self, weights: MutableMapping[str, torch.Tensor], *,
                 check_base: bool = True, stage: bool = False,
                 digests: MutableMapping[str, bytes] | None = None) -> None:
        """``digests``: a cache of tensor digests of ``weights`` kept by the caller
        (e.g. the node's weight holder). Unchanged tensors are then never re-hashed,
        which matters on a GPU, where hashing means reading the tensor back. It is
        updated on success and left as it was on failure."""
        self.weights = weights
        self.check_base = check_base
        self.known = digests
        # stage=True: records are decoded as they arrive but applied only by commit().
        self.staged: list[_Edit] | None = [] if stage else None
        self.header: PatchHeader | None = None
        self._buf = bytearray()
        self._next = 0
        self._undo: list[_Undo] = []
        self._digests: dict[str, bytes] = {}
        self._changed = 0
        self._failed = False

    # ---------------------------------------------------------------- public

    def feed(self, data: bytes | memoryview) -> int:
        """Consume more patch bytes; apply every record they complete.

        Returns the number of records applied so far. On any error the weights
        are rolled back and the error re-raised.
        """
        if self._failed:
            raise PatchApplyError("apply already failed; weights were restored")
        try:
            if self._buf:
                self._buf += data
                if not self._ready():
                    return self._next
                data = bytes(self._buf)  # one copy per completed record, not per feed
                self._buf.clear()
            self._drain(memoryview(data))
        except BaseException:
            self.rollback()
            raise
        return self._next

    def finish(self) -> ApplyReport:
        """Check that the patch is complete and the result is the target; else roll back.

        In stage mode this is the commit: every decoded record is applied here,
        so the weights change only inside this call (the engine's pause)."""
        try:
            if self.header is None and self._buf:
                data = bytes(self._buf)
                self._buf.clear()
                self._drain(memoryview(data))
            if self.header is None:
                raise PatchFormatError(f"truncated patch: {len(self._buf)} bytes, no complete header")
            total = len(self.header.entries)
            if self._next < total:
                name = self.header.entries[self._next].name
                raise PatchFormatError(
                    f"truncated patch: {self._next} of {total} records complete "
                    f"(record for {name!r} incomplete)")
            if self._buf:
                raise PatchFormatError(f"{len(self._buf)} trailing bytes after the last record")
            if self.staged is not None:
                for edit in self.staged:
                    self._commit_edit(edit)
                self.staged = None
            digest = state_digest(self.weights, self._merged_digests())
            if self.header.target_digest is not None and digest != self.header.target_digest:
                raise PatchApplyError(
                    "state digest after apply does not match the patch's target "
                    "(weights restored to the base version)")
        except BaseException:
            self.rollback()
            raise
        self._undo.clear()
        if self.known is not None:
            for name in [n for n in self.known if n not in self.weights]:
                del self.known[name]
            self.known.update(self._digests)
        return ApplyReport(total, self._changed, digest)

    def staged_changes(self) -> list[tuple[str, str, np.ndarray | None]]:
        """What a staged patch will change, before ``finish``: one ``(name, kind, flat)``
        per record, ``kind`` one of ``sparse`` / ``dense`` / ``put`` / ``delete`` and
        ``flat`` the int64 flat indices of the changed elements (``None`` for ``put``
        and ``delete``). For engines that load only what changed."""
        if self.staged is None:
            raise PatchApplyError("staged_changes needs a staged, not yet finished, patch")
        out: list[tuple[str, str, np.ndarray | None]] = []
        for edit in self.staged:
            name = edit.entry.name
            if edit.kind == "sparse":
                out.append((name, "sparse", np.asarray(edit.data[0], dtype=np.int64)))  # type: ignore[index]
            elif edit.kind == "xor":
                # DENSE records stay as (itemsize, count) byte planes of the XOR:
                # element j changed iff any of its bytes differs
                planes = np.asarray(edit.data)
                changed = np.any(planes != 0, axis=0) if planes.ndim == 2 else planes != 0
                out.append((name, "dense", np.flatnonzero(changed).astype(np.int64)))
            else:
                out.append((name, edit.kind, None))
        return out

    def _merged_digests(self) -> dict[str, bytes]:
        merged = dict(self.known) if self.known is not None else {}
        merged.update(self._digests)
        return merged

    def rollback(self) -> None:
        """Undo every applied record, newest first. Idempotent."""
        while self._undo:
            u = self._undo.pop()
            if u.kind == "sparse":
                idx, old = u.data  # type: ignore[misc]
                _scatter(self.weights[u.name], idx, old)
            elif u.kind == "xor":
                _xor_planes(self.weights[u.name], u.data)  # type: ignore[arg-type]
            elif u.kind == "put":
                if u.data is None:
                    self.weights.pop(u.name, None)
                else:
                    self.weights[u.name] = u.data  # type: ignore[assignment]
        self._failed = True

    # ---------------------------------------------------------------- internals

    def _ready(self) -> bool:
        """Whether the buffered bytes complete the header or the next record (or
        run past the last record, which ``_drain`` reports)."""
        if self.header is None:
            need = header_size_needed(self._buf)
            return need is not None and len(self._buf) >= need
        if self._next >= len(self.header.entries):
            return True
        return record_extent(self._buf, 0, self.header.entries[self._next]) is not None

    def _drain(self, view: memoryview) -> None:
        """Apply every record complete in ``view`` (the bytes after those consumed
        so far); keep the incomplete rest in ``self._buf``."""
        offset = 0
        if self.header is None:
            need = header_size_needed(view)
            if need is None or len(view) < need:
                self._buf += view
                return
            self.header = decode_header(view)
            offset = self.header.header_bytes
            base = self.header.base_digest
            if self.check_base and base is not None and state_digest(self.weights, self.known) != base:
                raise PatchApplyError(
                    "patch does not apply to these weights (base state digest differs: "
                    "wrong base version or foreign model)")
        while self._next < len(self.header.entries):
            entry = self.header.entries[self._next]
            got = split_record(view, offset, entry)
            if got is None:
                break
            body, offset = got
            self._apply_record(entry, body)
            self._next += 1
        rest = len(view) - offset
        if self._next == len(self.header.entries) and rest:
            raise PatchFormatError(f"{rest} trailing bytes after the last record")
        if rest:
            self._buf += view[offset:]

    def _apply_record(self, entry: TableEntry, body: memoryview) -> None:
        edit = self._decode_record(entry, body)
        if self.staged is None:
            self._commit_edit(edit)
        else:
            self.staged.append(edit)

    def _decode_record(self, entry: TableEntry, body: memoryview) -> _Edit:
        """Decode one record against the current weights, without changing them."""
        what = f"record {self._next} ({entry.name})"
        r = BodyReader(body, what)
        if entry.op == Op.DELETE:
            r.done()
            if entry.name not in self.weights:
                raise PatchApplyError(f"{what}: tensor to delete is not in the weights")
            return _Edit(entry, what, b"", "delete", None)
        digest = bytes(r.take(DIGEST_BYTES))
        dt = entry.dtype
        if entry.op == Op.FULL:
            bits = records.decode_blob(r, entry.numel, dt)  # a new, writable array
            new = torch.from_numpy(bits).view(dt.torch_dtype).reshape(entry.shape)
            return _Edit(entry, what, digest, "put", new)
        t = self._base_tensor(entry, what)
        if entry.op == Op.DENSE:
            # Kept as byte planes: un-shuffled block by block while XORed in (commit).
            return _Edit(entry, what, digest, "xor", records.decode_planes(r, entry.numel, dt))
        reader = _block_reader(t) if entry.op == Op.SPARSE_CTX else None
        idx, head = records.decode_sparse_positions(r, entry.numel, dt, reader)
        old = _gather(t, idx)
        new = records.decode_sparse_values(head, old, dt, what)
        return _Edit(entry, what, digest, "sparse", (idx, old, new))

    def _commit_edit(self, edit: _Edit) -> None:
        """Apply a decoded record in place, logging its undo, then check its digest."""
        name = edit.entry.name
        if edit.kind == "delete":
            self._undo.append(_Undo(name, "put", self.weights.pop(name)))
            return
        if edit.kind == "put":
            old = self.weights.get(name)
            device = old.device if old is not None else _default_device(self.weights)
            t = edit.data.to(device)  # type: ignore[union-attr]
            self.weights[name] = t
            self._undo.append(_Undo(name, "put", old))
            self._changed += edit.entry.numel
        else:
            t = self._base_tensor(edit.entry, edit.what)
            if edit.kind == "xor":
                hasher = xxhash.xxh3_64() if t.device.type == "cpu" else None
                changed = _xor_planes(t, edit.data, hasher)  # type: ignore[arg-type]
                self._undo.append(_Undo(name, "xor", edit.data))
                self._changed += changed
                if hasher is not None:  # hashed block by block during the XOR
                    got = hasher.digest()
                    self._check_digest(edit, got)
                    return
            else:
                idx, old, new = edit.data  # type: ignore[misc]
                _scatter(t, idx, new)
                self._undo.append(_Undo(name, "sparse", (idx, old)))
                self._changed += int(idx.size)
        self._check_digest(edit, tensor_digest(t))

    def _check_digest(self, edit: _Edit, got: bytes) -> None:
        if got[:DIGEST_BYTES] != edit.digest:
            raise PatchApplyError(
                f"{edit.what}: tensor digest after apply does not match (wrong base tensor)")
        self._digests[edit.entry.name] = got

    def _base_tensor(self, entry: TableEntry, what: str) -> torch.Tensor:
        t = self.weights.get(entry.name)
        if t is None:
            raise PatchApplyError(f"{what}: tensor missing from the base weights")
        if t.dtype != entry.dtype.torch_dtype or tuple(t.shape) != entry.shape:
            raise PatchApplyError(
                f"{what}: base tensor is {t.dtype} {tuple(t.shape)}, patch expects "
                f"{entry.dtype.name} {entry.shape}")
        if not t.is_contiguous():
            raise PatchApplyError(f"{what}: base tensor is not contiguous")
        return t


@dataclass
class _Edit:
    """One decoded record, ready to be applied: ``kind`` is sparse, xor, put or delete."""

    entry: TableEntry
    what: str
    digest: bytes
    kind: str
    data: object


def _default_device(weights: MutableMapping[str, torch.Tensor]) -> torch.device:
    for t in weights.values():
        return t.device
    return torch.device("cpu")


def _block_reader(t: torch.Tensor):
    """Host bit patterns of ``t`` one block at a time (a bounded copy on CUDA)."""
    flat = bits_view(t, dtype_of(t))
    if flat.device.type == "cpu":
        arr = flat.numpy()
        return lambda start, stop: arr[start:stop]
    return lambda start, stop: flat[start:stop].cpu().numpy()


def _gather(t: torch.Tensor, idx: np.ndarray) -> np.ndarray:
    flat = bits_view(t, dtype_of(t))
    if flat.device.type == "cpu":
        return flat.numpy()[idx]
    return flat[torch.from_numpy(idx).to(flat.device)].cpu().numpy()


def _scatter(t: torch.Tensor, idx: np.ndarray, values: np.ndarray) -> None:
    flat = bits_view(t, dtype_of(t))
    if flat.device.type == "cpu":
        flat.numpy()[idx] = values
    else:
        flat[torch.from_numpy(idx).to(flat.device)] = torch.from_numpy(values).to(flat.device)


def _xor_planes(t: torch.Tensor, planes: np.ndarray, hasher=None) -> int:
    """XOR the byte-shuffled ``planes`` into ``t`` in place; returns how many
    elements changed. On the CPU this is one blocked pass (un-shuffle, XOR, count,
    and feeding ``hasher`` the new bytes, all on one block in cache)."""
    dt = dtype_of(t)
    flat = bits_view(t, dt)
    if flat.device.type == "cpu":
        return records.xor_planes_into(flat.numpy(), planes, hasher)
    xor = records.unshuffle_bytes(planes, flat.numel(), dt)
    flat.bitwise_xor_(torch.from_numpy(xor).to(flat.device))
    return int(np.count_nonzero(xor))


def stage_patch(weights: MutableMapping[str, torch.Tensor], patch: bytes | memoryview, *,
                check_base: bool = True,
                digests: MutableMapping[str, bytes] | None = None) -> PatchApplier:
    """Decode a whole patch against ``weights`` without changing them (may run while
    they are served); ``.finish()`` on the result applies it, all or nothing."""
    applier = PatchApplier(weights, check_base=check_base, stage=True, digests=digests)
    try:
        applier.feed(patch)
    except BaseException:
        applier.staged = None
        raise
    return applier


def apply_patch(weights: MutableMapping[str, torch.Tensor], patch: bytes | memoryview, *,
                check_base: bool = True,
                digests: MutableMapping[str, bytes] | None = None) -> ApplyReport:
    """Apply a whole patch in place; on any error the weights are left at the base."""
    applier = PatchApplier(weights, check_base=check_base, digests=digests)
    applier.feed(patch)
    return applier.finish()
