"""Patch container: header, tensor table, and framed per-tensor records.

The layout (all integers little-endian; see docs/patch-format.md)::

    header  : magic "PSWP" | u16 version | u16 flags | u32 table_len
              | u32 record_count | u32 check
    table   : zstd(msgpack {"base": bytes|nil, "target": bytes|nil,
                            "records": [[name, op, dtype_code, shape], ...]})
    records : record_count x ( varint body_len | body )

``check`` is the low 32 bits of XXH3-64 over header bytes 0..15 plus the
table. Records appear in table order; each decodes with its table entry
alone, so a receiver can apply record i as soon as its bytes have arrived.
A record's body starts with the 4-byte digest of its target tensor (none for
DELETE), which the applier checks; records carry no separate checksum
because the signed manifest's chunk hashes already guard the bytes and the
digest catches the rest before the apply is committed. Every length and count read from the input is bounded before it
is used; any violation raises ``PatchFormatError`` naming the place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import msgpack
import xxhash
import zstandard

from swarm.codec.dtypes import DType, dtype_by_code
from swarm.codec.zstd_bounded import decompress_bounded
from swarm.errors import PatchFormatError

MAGIC = b"PSWP"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHIII")

DIGEST_BYTES = 4  # record target digest: the first bytes of the tensor digest
MAX_TABLE_BYTES = 64 << 20  # decompressed tensor table
MAX_RECORDS = 1 << 20
MAX_NAME_BYTES = 1024
MAX_NDIM = 16
MAX_ELEMENTS = 1 << 48
MAX_RECORD_BYTES = 1 << 40


class Op(IntEnum):
    SPARSE = 1  # scattered changes: positions + ULP deltas (same dtype and shape)
    DENSE = 2  # XOR of old and new bit patterns, byte-shuffled, zstd (same dtype and shape)
    FULL = 3  # the whole new tensor, byte-shuffled, zstd (added, reshaped or re-typed)
    DELETE = 4  # the tensor is gone in the new version
    SPARSE_CTX = 5  # SPARSE with positions coded per magnitude bucket (context.py)


@dataclass(frozen=True)
class TableEntry:
    name: str
    op: Op
    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class PatchHeader:
    version: int
    base_digest: bytes | None
    target_digest: bytes | None
    entries: tuple[TableEntry, ...]
    header_bytes: int  # bytes before the first record


def check32(*parts: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest() & 0xFFFFFFFF


# ------------------------------------------------------------------ writing


def encode_header(base_digest: bytes | None, target_digest: bytes | None,
                  entries: list[TableEntry]) -> bytes:
    table = {
        "base": base_digest,
        "target": target_digest,
        "records": [[e.name, int(e.op), e.dtype.code, list(e.shape)] for e in entries],
    }
    packed = zstandard.ZstdCompressor(level=19).compress(msgpack.packb(table, use_bin_type=True))
    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(packed), len(entries), 0)[:16]
    return head + struct.pack("<I", check32(head, packed)) + packed


def record_prefix(body_len: int) -> bytes:
    head = bytearray()
    put_varint(head, body_len)
    return bytes(head)


def frame_record(body: bytes) -> bytes:
    return record_prefix(len(body)) + body


# ------------------------------------------------------------------ reading


def header_size_needed(prefix: bytes | memoryview) -> int | None:
    """Total header length once the fixed part is available, else None."""
    if len(prefix) < HEADER.size:
        return None
    magic, version, flags, table_len, _count, _check = HEADER.unpack_from(prefix)
    _check_fixed(magic, version, flags, table_len)
    return HEADER.size + table_len


def _check_fixed(magic: bytes, version: int, flags: int, table_len: int) -> None:
    if magic != MAGIC:
        raise PatchFormatError("not a patchswarm patch (bad magic)")
    if version != FORMAT_VERSION:
        raise PatchFormatError(
            f"unsupported patch format version {version} (this build reads {FORMAT_VERSION})"
        )
    if flags != 0:
        raise PatchFormatError(f"unknown header flags 0x{flags:04x}")
    if table_len > MAX_TABLE_BYTES:
        raise PatchFormatError(f"tensor table of {table_len} bytes exceeds the limit")


def decode_header(data: bytes | memoryview) -> PatchHeader:
    """Parse and check the header and tensor table at the start of ``data``."""
    data = memoryview(data)
    if len(data) < HEADER.size:
        raise PatchFormatError(f"truncated patch: {len(data)} bytes, header needs {HEADER.size}")
    magic, version, flags, table_len, count, check = HEADER.unpack_from(data)
    _check_fixed(magic, version, flags, table_len)
    end = HEADER.size + table_len
    if len(data) < end:
        raise PatchFormatError(f"truncated patch: tensor table needs {end} bytes, have {len(data)}")
    table_raw = data[HEADER.size:end]
    if check32(data[:16], table_raw) != check:
        raise PatchFormatError("corrupt patch header (checksum mismatch)")
    if count > MAX_RECORDS:
        raise PatchFormatError(f"record count {count} exceeds the limit")
    raw = decompress_bounded(table_raw, MAX_TABLE_BYTES, "tensor table", PatchFormatError,
                             exact=False)
    try:
        table = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise PatchFormatError(f"corrupt tensor table: {exc}") from None
    if not isinstance(table, dict) or not isinstance(table.get("records"), list):
        raise PatchFormatError("corrupt tensor table: not a map with a record list")
    entries = tuple(_parse_entry(i, r) for i, r in enumerate(table["records"]))
    if len(entries) != count:
        raise PatchFormatError(f"tensor table lists {len(entries)} records, header says {count}")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise PatchFormatError("tensor table names a tensor twice")
    base = _digest_field(table.get("base"), "base")
    target = _digest_field(table.get("target"), "target")
    return PatchHeader(version, base, target, entries, end)


def _digest_field(value: object, what: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) != 32:
        raise PatchFormatError(f"corrupt tensor table: {what} digest is not 32 bytes")
    return value


def _parse_entry(i: int, r: object) -> TableEntry:
    if not (isinstance(r, list) and len(r) == 4):
        raise PatchFormatError(f"corrupt tensor table entry {i}")
    name, op, code, shape = r
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME_BYTES:
        raise PatchFormatError(f"tensor table entry {i}: bad tensor name")
    try:
        op = Op(op)
    except ValueError:
        raise PatchFormatError(f"tensor {name!r}: unknown record op {op!r}") from None
    if not isinstance(code, int):
        raise PatchFormatError(f"tensor {name!r}: bad dtype code")
    dtype = dtype_by_code(code)
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(s, int) and 0 <= s < MAX_ELEMENTS for s in shape)):
        raise PatchFormatError(f"tensor {name!r}: bad shape {shape!r}")
    entry = TableEntry(name, op, dtype, tuple(shape))
    if entry.numel > MAX_ELEMENTS:
        raise PatchFormatError(f"tensor {name!r}: {entry.numel} elements exceed the limit")
    return entry


def record_extent(data: bytes | bytearray | memoryview, offset: int,
                  entry: TableEntry) -> tuple[int, int] | None:
    """(body start, body end) of the record at ``offset``, or None if the record
    is not complete yet. Takes no buffer views, so it may peek into a growing
    bytearray."""
    got = record_span(data, offset, entry)
    if got is None or got[1] > len(data):
        return None
    return got


MAX_PREFIX_BYTES = 10  # a record's length prefix: a varint that ``record_span`` ends by 9 bytes


def record_span(data: bytes | bytearray | memoryview, offset: int,
                entry: TableEntry) -> tuple[int, int] | None:
    """(body start, body end) of the record at ``offset`` once its length prefix is
    complete (the body may not be), else None; the length is checked against
    ``MAX_RECORD_BYTES``."""
    length = shift = 0
    pos = offset
    while True:
        if pos >= len(data):
            return None
        b = data[pos]
        pos += 1
        length |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
        if shift > 56:
            raise PatchFormatError(f"record for {entry.name!r}: bad length prefix")
    if length > MAX_RECORD_BYTES:
        raise PatchFormatError(f"record for {entry.name!r}: length {length} exceeds the limit")
    return pos, pos + length


def split_record(data: memoryview, offset: int, entry: TableEntry) -> tuple[memoryview, int] | None:
    """The body of the record at ``offset`` and the offset after it, or None if the
    record is not complete yet."""
    got = record_extent(data, offset, entry)
    if got is None:
        return None
    start, end = got
    return data[start:end], end


def record_layout(data: bytes | bytearray | memoryview) -> list[int]:
    """The byte sizes of a whole patch's parts, in order: the header, then each record
    (its length prefix included). Where each part begins is the running sum. A
    manifest carries this (``Manifest.records``) so that a node can decode any record
    whose bytes it holds, before the ones ahead of it arrived."""
    view = memoryview(data).cast("B")
    header = decode_header(view)
    sizes = [header.header_bytes]
    offset = header.header_bytes
    for i, entry in enumerate(header.entries):
        got = record_extent(view, offset, entry)
        if got is None:
            raise PatchFormatError(f"truncated patch: record {i} ({entry.name!r}) incomplete")
        sizes.append(got[1] - offset)
        offset = got[1]
    if offset != len(view):
        raise PatchFormatError(f"{len(view) - offset} trailing bytes after the last record")
    return sizes


# ------------------------------------------------------------------ varints


def put_varint(out: bytearray, value: int) -> None:
    if value < 0:
        raise ValueError("varint must be non-negative")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class BodyReader:
    """Bounds-checked reader over a record body."""

    def __init__(self, body: memoryview, what: str) -> None:
        self.body, self.pos, self.what = body, 0, what

    def varint(self, limit: int = 1 << 63) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.body):
                raise PatchFormatError(f"{self.what}: record truncated")
            b = self.body[self.pos]
            self.pos += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise PatchFormatError(f"{self.what}: varint too long")
        if value > limit:
            raise PatchFormatError(f"{self.what}: field value {value} exceeds {limit}")
        return value

    def u8(self) -> int:
        return self.take(1)[0]

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.body):
            raise PatchFormatError(f"{self.what}: record truncated")
        out = self.body[self.pos:self.pos + n]
        self.pos += n
        return out

    def rest(self) -> memoryview:
        return self.take(len(self.body) - self.pos)

    def done(self) -> None:
        if self.pos != len(self.body):
            raise PatchFormatError(f"{self.what}: {len(self.body) - self.pos} trailing bytes in record")
