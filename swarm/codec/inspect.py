"""Read a patch's header and per-record sizes without applying it."""

from __future__ import annotations

from swarm.codec.format import DIGEST_BYTES, BodyReader, Op, decode_header, split_record
from swarm.errors import PatchFormatError


def read_patch_info(patch: bytes | memoryview) -> dict:
    """Header fields and one row per record: name, op, dtype, shape, bytes, changed."""
    data = memoryview(patch)
    header = decode_header(data)
    offset = header.header_bytes
    rows = []
    for i, entry in enumerate(header.entries):
        got = split_record(data, offset, entry)
        if got is None:
            raise PatchFormatError(f"truncated patch: record {i} ({entry.name}) incomplete")
        body, end = got
        r = BodyReader(body, f"record {i} ({entry.name})")
        changed = None
        if entry.op in (Op.SPARSE, Op.SPARSE_CTX):
            r.take(DIGEST_BYTES)
            changed = r.varint()
        elif entry.op == Op.FULL:
            changed = entry.numel
        rows.append({
            "name": entry.name, "op": entry.op.name, "dtype": entry.dtype.name,
            "shape": list(entry.shape), "elements": entry.numel, "changed": changed,
            "bytes": end - offset,
        })
        offset = end
    if offset != len(data):
        raise PatchFormatError(f"{len(data) - offset} trailing bytes after the last record")
    return {
        "format_version": header.version,
        "header_bytes": header.header_bytes,
        "patch_bytes": len(data),
        "base_digest": header.base_digest.hex() if header.base_digest else None,
        "target_digest": header.target_digest.hex() if header.target_digest else None,
        "records": rows,
    }
