"""Decompression bombs: no zstd frame from the network or disk can make us allocate
more than the tensor table allows (issue #13, attack 6 of issue #10)."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import apply_patch, encode_patch, read_patch_info
from swarm.codec.dtypes import BY_TORCH
from swarm.codec.format import (
    DIGEST_BYTES,
    HEADER,
    MAGIC,
    MAX_TABLE_BYTES,
    Op,
    TableEntry,
    check32,
    encode_header,
    frame_record,
)
from swarm.codec.zstd_bounded import HARD_CEILING, decompress_bounded
from swarm.errors import PatchFormatError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def frame_declaring(size: int, block: bytes = b"\x00") -> bytes:
    """A single-segment zstd frame whose header declares ``size`` bytes of content,
    followed by one last RLE block of 128 KiB (so the content does not match)."""
    descriptor = 0b1110_0000  # FCS field 8 bytes, single segment, no checksum, no dict
    rle_block = (1 | (1 << 1) | ((128 << 10) << 3)).to_bytes(3, "little") + block
    return ZSTD_MAGIC + bytes([descriptor]) + struct.pack("<Q", size) + rle_block


def test_crafted_full_record_declaring_8_tib_is_refused_without_allocating():
    """The 133-byte patch from the audit: a FULL uint8 record of 2^43 elements."""
    n = 1 << 43
    entry = TableEntry("bomb", Op.FULL, BY_TORCH[torch.uint8], (n,))
    patch = encode_header(None, None, [entry]) + frame_record(bytes(DIGEST_BYTES) + frame_declaring(n))
    assert len(patch) < 200
    with pytest.raises(PatchFormatError, match=r"bomb.*declares 8796093022208 bytes"):
        apply_patch({}, patch)


def test_frame_declaring_more_than_its_tensor_is_refused():
    old = {"w": torch.zeros(1000, dtype=torch.float32)}
    new = {"w": torch.arange(1000, dtype=torch.float32)}  # every element changes: a DENSE/FULL record
    patch = bytearray(encode_patch(old, new, threads=1).patch)
    at = bytes(patch).find(ZSTD_MAGIC, read_patch_info(bytes(patch))["header_bytes"])
    assert at > 0
    descriptor = patch[at + 4]
    single_segment = bool(descriptor & 0x20)
    width = {0: 1 if single_segment else 0, 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    assert width == 2, "4,000 bytes of content: a 2-byte size field"
    start = at + 5 + (0 if single_segment else 1)
    patch[start:start + width] = b"\xff\xff"  # declares 65,791 bytes where the table allows 4,000
    weights = {"w": old["w"].clone()}
    with pytest.raises(PatchFormatError, match="declares"):
        apply_patch(weights, bytes(patch))
    assert torch.equal(weights["w"], old["w"])


def test_tensor_table_bomb_is_refused():
    table = frame_declaring(MAX_TABLE_BYTES + 1)
    head = HEADER.pack(MAGIC, 1, 0, len(table), 0, 0)[:16]
    patch = head + struct.pack("<I", check32(head, table)) + table
    with pytest.raises(PatchFormatError, match="tensor table: compressed frame declares"):
        apply_patch({}, patch)


def test_frame_without_declared_size_is_capped_while_streaming():
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(256 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(PatchFormatError, match="decompresses to more than 1048576 bytes"):
        decompress_bounded(bomb, 1 << 20, "rec", PatchFormatError)


def test_hard_ceiling_caps_any_limit():
    with pytest.raises(PatchFormatError, match="declares"):
        decompress_bounded(frame_declaring(HARD_CEILING + 1), 1 << 50, "rec", PatchFormatError,
                           exact=False)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.integers(0, 5000), st.booleans(), st.booleans())
def test_decompress_bounded_returns_the_exact_frame_or_refuses(content, limit, sized, exact):
    frame = zstandard.ZstdCompressor(write_content_size=sized).compress(content)
    try:
        out = decompress_bounded(frame, limit, "rec", PatchFormatError, exact=exact)
    except PatchFormatError:
        assert len(content) > limit or (exact and len(content) != limit)
    else:
        assert out == content


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.integers(0, 1 << 40))
def test_decompress_bounded_on_garbage_only_raises_format_errors(data, limit):
    try:
        out = decompress_bounded(ZSTD_MAGIC + data, limit, "rec", PatchFormatError, exact=False)
    except PatchFormatError:
        return
    assert len(out) <= limit
