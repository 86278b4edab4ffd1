"""Apply a patch in place, on the tensors' own device, all or nothing.

``PatchApplier`` is fed the patch as it arrives (``feed``) and applies each
record as soon as it is complete, so a node can apply tensor by tensor while
later chunks are still downloading. Every mutation is recorded in an undo log
(the old values at the changed positions, which the decoder needs anyway), so
any failure — a corrupt or truncated record, a digest mismatch, a wrong base —
rolls the weights back to exactly the state before the first record, then
raises. Extra memory is bounded by the decoded records (positions plus old and
new values), never a full-size copy of a tensor, except that DENSE records
hold their XOR (their decoded size) until the apply ends.
Bytes fed in are not copied while they hold whole records; only an incomplete
tail is buffered, and copied once when its record completes.

Records out of order (stage mode): with the patch's layout (``format.record_layout``,
carried by the manifest) a caller may hand the header (``feed_header``) and then
whole records in any order (``feed_record``), e.g. each as soon as the chunks
holding it arrived. Decoding in stage mode reads only the base weights, which do
not change before the commit, and a patch names each tensor once, so the order of
decoding does not matter; ``finish`` commits the records in the patch's order.

Contract for callers: while an apply is in progress the weights must not be
served; after ``finish`` they are the target version, after an exception they
are the base version.

Digests ahead (stage mode, ``ahead=True``, the default there): the work that
does not change the weights is done when a record is decoded, not at commit.
A DENSE record on a CPU tensor is un-shuffled into its flat XOR, and the digest
its tensor will have after the commit is taken then, from ``base ^ xor`` block
by block (a scratch block, no full-size copy); a FULL record's digest is taken
of its decoded tensor. The commit of such records is then one XOR pass (or a
put), and ``finish`` combines digests instead of re-hashing. The ahead digest
is of exactly the bytes the commit writes: ``base ^ xor`` with the same ``xor``
array (owned by the applier) and the same base bits, which staging already
relies on (sparse records' undo values are gathered at decode). It is used
only if the base is still the very tensor it was taken from, with the same
storage and torch version counter, and no earlier record of this commit
touched it; otherwise the tensor is hashed at commit as before. SPARSE records
(their digest needs the post-scatter tensor) and tensors on other devices are
hashed at commit. The state digest is still checked against the target and any
failure still rolls back bitwise.
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
    MAX_PREFIX_BYTES,
    BodyReader,
    Op,
    PatchHeader,
    TableEntry,
    decode_header,
    header_size_needed,
    record_extent,
    record_span,
    split_record,
)
from swarm.codec.planes import Pieces, Planes, read_planes
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
                 digests: MutableMapping[str, bytes] | None = None,
                 ahead: bool = True) -> None:
        """``digests``: a cache of tensor digests of ``weights`` kept by the caller
        (e.g. the node's weight holder). Unchanged tensors are then never re-hashed,
        which matters on a GPU, where hashing means reading the tensor back. It is
        updated on success and left as it was on failure.

        ``ahead`` (stage mode only): take DENSE/FULL records' target digests and
        un-shuffle DENSE XORs when the record is decoded, so the commit only XORs
        (module docstring); ``False`` keeps all of it for the commit."""
        self.weights = weights
        self.check_base = check_base
        self.known = digests
        # stage=True: records are decoded as they arrive but applied only by commit().
        self.staged: list[_Edit] | None = [] if stage else None
        self.ahead = ahead and stage
        self._touched: set[str] = set()  # tensors changed so far by this commit
        self.header: PatchHeader | None = None
        self._buf = bytearray()  # the header, or a record whose length prefix is incomplete
        # a record whose length is known, filled in place as its bytes come (``_hold``)
        self._pend: memoryview | None = None
        self._fill = 0
        self._next = 0
        self._undo: list[_Undo] = []
        self._digests: dict[str, bytes] = {}
        self._changed = 0
        self._failed = False
        # records decoded out of order (``feed_header`` / ``feed_record``), by index
        self._by_index: dict[int, _Edit] | None = None

    # ---------------------------------------------------------------- public

    def feed_header(self, data: bytes | memoryview) -> PatchHeader:
        """Out of order (stage mode): the patch's header, exactly its bytes; then
        ``feed_record`` for each record, in any order. Checks the base like ``feed``."""
        if self._failed:
            raise PatchApplyError("apply already failed; weights were restored")
        if self.staged is None:
            raise PatchApplyError("records out of order need a staged apply")
        if self.header is not None or self._buf or self._pend is not None:
            raise PatchApplyError("the patch's header was fed already")
        try:
            view = memoryview(data).cast("B")
            need = header_size_needed(view)
            if need is None or need != len(view):
                raise PatchFormatError(
                    f"patch header: {len(view)} bytes given, the header is "
                    f"{'longer' if need is None else need}")
            self._take_header(view)
            self._by_index = {}
        except BaseException:
            self.rollback()
            raise
        return self.header  # type: ignore[return-value]

    def feed_record(self, index: int,
                    data: bytes | memoryview | list[memoryview] | tuple[memoryview, ...]) -> None:
        """Out of order (after ``feed_header``): record ``index``, whole, its length
        prefix included. Each record once; ``finish`` checks that all came.

        ``data`` may be a list of the buffers the record lies in, in order (views of
        the chunks that hold it): a DENSE or FULL record's planes are then read where
        they lie (``swarm.codec.planes``), any other record is joined first."""
        if self._failed:
            raise PatchApplyError("apply already failed; weights were restored")
        if self._by_index is None:
            raise PatchApplyError("feed_record needs feed_header first")
        try:
            entries = self.header.entries  # type: ignore[union-attr]
            if type(index) is not int or not 0 <= index < len(entries):
                raise PatchFormatError(f"record {index} of a patch of {len(entries)} records")
            if index in self._by_index:
                raise PatchApplyError(f"record {index} was fed twice")
            entry = entries[index]
            body = Pieces(data if isinstance(data, (list, tuple)) else [data])
            got = record_span(body.head(MAX_PREFIX_BYTES), 0, entry)
            if got is None or got[1] != len(body):
                raise PatchFormatError(
                    f"record {index} ({entry.name!r}): {len(body)} bytes are not one whole record")
            self._by_index[index] = self._decode_record(entry, body.slice(*got), index)
        except BaseException:
            self.rollback()
            raise

    @property
    def records_fed(self) -> int:
        """Records decoded so far (in order or not)."""
        return self._next if self._by_index is None else len(self._by_index)

    def feed(self, data: bytes | memoryview) -> int:
        """Consume more patch bytes; apply every record they complete.

        Returns the number of records applied so far. On any error the weights
        are rolled back and the error re-raised.
        """
        if self._failed:
            raise PatchApplyError("apply already failed; weights were restored")
        if self._by_index is not None:
            raise PatchApplyError("this patch is fed out of order (feed_record)")
        try:
            if self._pend is not None:
                view = memoryview(data).cast("B")
                n = min(len(view), len(self._pend) - self._fill)
                self._pend[self._fill:self._fill + n] = view[:n]
                self._fill += n
                if self._fill < len(self._pend):
                    return self._next
                whole, self._pend = self._pend, None
                self._drain(whole)  # exactly the one record
                data = view[n:]
                if not data:
                    return self._next
            if self._buf:
                if self.header is None:
                    self._buf += data
                    if not self._ready():
                        return self._next
                    data = bytes(self._buf)
                else:  # a record's length prefix split between feeds (a few bytes)
                    data = bytes(self._buf) + bytes(data)
                self._buf.clear()
            self._drain(memoryview(data))
        except BaseException:
            self.rollback()
            raise
        return self._next

    def finish(self) -> ApplyReport:
        """Check that the patch is complete and the result is the target; else roll back.

        In stage mode this is the commit: every decoded record is applied here,
        so the weights change only inside this call (the engine's pause). With
        digests ahead that is one XOR pass per DENSE record and a put per FULL one,
        then the state digest from the per-tensor digests (SPARSE records' tensors,
        and any whose ahead digest no longer holds, are hashed here)."""
        try:
            if self.header is None and self._buf:
                data = bytes(self._buf)
                self._buf.clear()
                self._drain(memoryview(data))
            if self.header is None:
                raise PatchFormatError(f"truncated patch: {len(self._buf)} bytes, no complete header")
            total = len(self.header.entries)
            if self._by_index is not None:
                missing = next((i for i in range(total) if i not in self._by_index), None)
                if missing is not None:
                    raise PatchFormatError(
                        f"truncated patch: {len(self._by_index)} of {total} records decoded "
                        f"(record for {self.header.entries[missing].name!r} missing)")
                self.staged = [self._by_index[i] for i in range(total)]
                self._by_index = None
                self._next = total
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
        edits = self.staged if self._by_index is None else \
            [self._by_index[i] for i in sorted(self._by_index)]
        for edit in edits:
            name = edit.entry.name
            if edit.kind == "sparse":
                out.append((name, "sparse", np.asarray(edit.data[0], dtype=np.int64)))  # type: ignore[index]
            elif edit.kind == "xorflat":
                out.append((name, "dense", np.flatnonzero(edit.data).astype(np.int64)))  # type: ignore[call-overload]
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
            elif u.kind == "xorflat":
                _xor_flat(self.weights[u.name], u.data)  # type: ignore[arg-type]
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
            offset = self._take_header(view)
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
            self._hold(view[offset:])

    def _take_header(self, view: memoryview) -> int:
        """Decode the header at the start of ``view`` and check the base; its length."""
        self.header = decode_header(view)
        base = self.header.base_digest
        if self.check_base and base is not None and state_digest(self.weights, self.known) != base:
            raise PatchApplyError(
                "patch does not apply to these weights (base state digest differs: "
                "wrong base version or foreign model)")
        return self.header.header_bytes

    def _hold(self, part: memoryview) -> None:
        """Keep the start of an incomplete record. Once its length prefix is complete
        the record gets a buffer of its full size, filled in place as bytes come: one
        copy of each record that spans feeds, not a growing buffer (each growth a copy
        into fresh memory) and a copy of it at the end."""
        got = record_span(part, 0, self.header.entries[self._next])  # type: ignore[union-attr]
        if got is None:
            self._buf += part
            return
        total = got[1]
        buf = memoryview(np.empty(total, dtype=np.uint8)).cast("B")  # not zero-filled
        buf[:len(part)] = part
        self._pend, self._fill = buf, len(part)

    def _apply_record(self, entry: TableEntry, body: memoryview) -> None:
        edit = self._decode_record(entry, body, self._next)
        if self.staged is None:
            self._commit_edit(edit)
        else:
            self.staged.append(edit)

    def _decode_record(self, entry: TableEntry, body: memoryview | Pieces, index: int) -> _Edit:
        """Decode one record against the current weights, without changing them."""
        what = f"record {index} ({entry.name})"
        if entry.op in (Op.DENSE, Op.FULL):
            return self._decode_planes_record(entry, body, what)
        if isinstance(body, Pieces):
            body = body.join()
        r = BodyReader(body, what)
        if entry.op == Op.DELETE:
            r.done()
            if entry.name not in self.weights:
                raise PatchApplyError(f"{what}: tensor to delete is not in the weights")
            return _Edit(entry, what, b"", "delete", None)
        digest = bytes(r.take(DIGEST_BYTES))
        dt = entry.dtype
        t = self._base_tensor(entry, what)
        reader = _block_reader(t) if entry.op == Op.SPARSE_CTX else None
        idx, head = records.decode_sparse_positions(r, entry.numel, dt, reader)
        old = _gather(t, idx)
        new = records.decode_sparse_values(head, old, dt, what)
        return _Edit(entry, what, digest, "sparse", (idx, old, new))

    def _decode_planes_record(self, entry: TableEntry, body: memoryview | Pieces,
                              what: str) -> _Edit:
        """A DENSE or FULL record: its digest, then its byte planes, read where they lie."""
        if not isinstance(body, Pieces):
            body = Pieces([body])
        digest = body.head(DIGEST_BYTES)
        if len(digest) < DIGEST_BYTES:
            raise PatchFormatError(f"{what}: record truncated")
        dt = entry.dtype
        rest = body.slice(DIGEST_BYTES, len(body))
        if entry.op == Op.FULL:
            planes = read_planes(rest, entry.numel, dt.itemsize, what)
            bits = records.unshuffle_planes(planes).view(dt.np_view)  # new, writable
            new = torch.from_numpy(bits).view(dt.torch_dtype).reshape(entry.shape)
            # the decoded tensor is the applier's own: its digest now is the committed one's
            return _Edit(entry, what, digest, "put", new,
                         ahead=tensor_digest(new) if self.ahead else None)
        t = self._base_tensor(entry, what)
        planes = read_planes(rest, entry.numel, dt.itemsize, what)
        if self.ahead and t.device.type == "cpu":
            return _dense_ahead(entry, what, digest, t, planes)
        # Kept as byte planes, in memory of their own: un-shuffled block by block while
        # XORed in (commit).
        return _Edit(entry, what, digest, "xor", planes.array())

    def _commit_edit(self, edit: _Edit) -> None:
        """Apply a decoded record in place, logging its undo, then check its digest
        (taken ahead where the record has one that still holds, else hashed now)."""
        name = edit.entry.name
        touched = name in self._touched
        self._touched.add(name)
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
            if edit.ahead is not None and t is edit.data:  # the very tensor hashed ahead
                self._check_digest(edit, edit.ahead)
                return
        elif edit.kind == "xorflat":
            t = self._base_tensor(edit.entry, edit.what)
            base, version, ptr = edit.base  # type: ignore[misc]
            sure = (not touched and t is base and t._version == version
                    and t.data_ptr() == ptr)
            _xor_flat(t, edit.data)  # type: ignore[arg-type]
            self._undo.append(_Undo(name, "xorflat", edit.data))
            self._changed += edit.changed
            if sure:  # base ^ xor, hashed when the record was decoded
                self._check_digest(edit, edit.ahead)  # type: ignore[arg-type]
                return
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
    # digests ahead: the tensor's full digest after this record's commit, taken at
    # decode; for "xorflat" also the elements it changes and the base it was taken
    # from (tensor, torch version counter, data pointer)
    ahead: bytes | None = None
    changed: int = 0
    base: tuple | None = None


def _dense_ahead(entry: TableEntry, what: str, digest: bytes, t: torch.Tensor,
                 planes: Planes) -> _Edit:
    """A DENSE record on a CPU tensor, decoded ahead: the byte planes un-shuffled into
    the flat XOR (as large as the planes, which are then dropped), the count of
    elements it changes, and the XXH3 of ``base ^ xor``, the tensor's bytes after
    the commit, block by block through a scratch block (the base is only read)."""
    u = bits_view(t, dtype_of(t)).numpy()
    u = u.view(np.dtype(f"u{u.dtype.itemsize}"))
    n = u.size
    xor = np.empty(n, dtype=u.dtype)
    hasher = xxhash.xxh3_64()
    changed = 0
    scratch = np.empty(min(n, records.BLOCK), dtype=u.dtype)
    whole = planes.single()  # one array (zstd's output, or a record in one raw block)
    for s in range(0, n, records.BLOCK):
        e = min(n, s + records.BLOCK)
        if whole is not None:
            new = scratch[:e - s]
            changed += records.unshuffle_count(whole, s, e, xor[s:e], u[s:e], new)
            hasher.update(new)
            continue
        for a, b, parts in planes.parts(s, e):  # each plane read where it lies
            new = scratch[:b - a]
            changed += records.unshuffle_parts(parts, xor[a:b], u[a:b], new)
            hasher.update(new)
    xor.flags.writeable = False  # hashed through: nothing may change it before the commit
    return _Edit(entry, what, digest, "xorflat", xor, ahead=hasher.digest(), changed=changed,
                 base=(t, t._version, t.data_ptr()))


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


def _xor_flat(t: torch.Tensor, xor: np.ndarray) -> None:
    """``t ^= xor`` in place (a CPU tensor; ``xor`` its flat unsigned bit patterns)."""
    u = bits_view(t, dtype_of(t)).numpy()
    u = u.view(xor.dtype)
    np.bitwise_xor(u, xor, out=u)


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
                digests: MutableMapping[str, bytes] | None = None,
                ahead: bool = True) -> PatchApplier:
    """Decode a whole patch against ``weights`` without changing them (may run while
    they are served); ``.finish()`` on the result applies it, all or nothing.
    ``ahead``: digests ahead (``PatchApplier``)."""
    applier = PatchApplier(weights, check_base=check_base, stage=True, digests=digests,
                           ahead=ahead)
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
