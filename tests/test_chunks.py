"""Chunking and chunk verification."""

from __future__ import annotations

import hashlib

import blake3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ChunkError
from swarm.trust.chunks import (
    DEFAULT_CHUNK_SIZE,
    chunk_count,
    chunk_hash,
    hash_chunks,
    join_chunks,
    split_payload,
    verify_chunk,
)
from swarm.trust.keys import key_id
from swarm.trust.manifest import build_manifest

KEY = Ed25519PrivateKey.generate()


def manifest_for(payload: bytes, chunk_size: int):
    return build_manifest(
        payload,
        model="m",
        version=1,
        kind="full",
        parent_version=None,
        parent_digest=None,
        target_digest=b"\x00" * 32,
        chunk_size=chunk_size,
        key_id=key_id(KEY),
    )


def test_chunk_hash_is_blake3_256():
    assert chunk_hash(b"abc") == blake3.blake3(b"abc").digest()
    assert len(chunk_hash(b"")) == 32
    assert chunk_hash(b"abc") != hashlib.sha256(b"abc").digest()
    assert DEFAULT_CHUNK_SIZE == 4 * 1024 * 1024


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.integers(1, 700))
def test_split_is_a_partition(payload, size):
    parts = split_payload(payload, size)
    assert b"".join(parts) == payload
    assert len(parts) == chunk_count(len(payload), size)
    assert all(len(p) == size for p in parts[:-1])
    assert not parts or 1 <= len(parts[-1]) <= size
    m = manifest_for(payload, size)
    assert m.chunk_hashes == hash_chunks(payload, size)
    for i, p in enumerate(parts):
        verify_chunk(m, i, p)
        assert m.chunk_length(i) == len(p)
    assert join_chunks(m, [bytes(p) for p in parts]) == payload


def test_split_is_zero_copy():
    payload = bytearray(b"abcdefgh")
    parts = split_payload(payload, 3)
    payload[0] = ord("z")
    assert bytes(parts[0]) == b"zbc"


def test_verify_chunk_names_the_index():
    payload = bytes(range(256)) * 10
    m = manifest_for(payload, 1000)
    good = payload[1000:2000]
    with pytest.raises(ChunkError, match="chunk 1 hash mismatch"):
        verify_chunk(m, 1, good[:-1] + b"\x00")
    with pytest.raises(ChunkError, match="chunk 1 length mismatch"):
        verify_chunk(m, 1, good[:-1])
    with pytest.raises(ChunkError, match="chunk 2 length"):
        verify_chunk(m, 2, good)  # the last chunk is short
    with pytest.raises(ChunkError, match="chunk 0 hash mismatch"):
        verify_chunk(m, 0, good)  # right length, wrong place
    with pytest.raises(ChunkError, match="chunk 3 out of range"):
        verify_chunk(m, 3, b"")
    with pytest.raises(ChunkError, match="chunk -1 out of range"):
        verify_chunk(m, -1, b"")
    with pytest.raises(ChunkError):
        join_chunks(m, [payload[:1000], payload[1000:2000]])


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=3000), st.integers(1, 500), st.data())
def test_any_single_byte_change_is_caught(payload, size, data):
    m = manifest_for(payload, size)
    pos = data.draw(st.integers(0, len(payload) - 1))
    bad = bytearray(payload)
    bad[pos] ^= data.draw(st.integers(1, 255))
    index = pos // size
    with pytest.raises(ChunkError, match=f"chunk {index} "):
        verify_chunk(m, index, bytes(split_payload(bytes(bad), size)[index]))
