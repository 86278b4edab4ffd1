"""Chunk blocks on the wire (wire.BlockAssembler): a chunk in consecutive blocks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.errors import ProtocolError
from swarm.protocol import wire


def blocks(v: int, i: int, payload: bytes, cuts: list[int]) -> list[bytes]:
    edges = sorted({0, len(payload), *(c % (len(payload) + 1) for c in cuts)})
    return [wire.pack_block_header(v, i, len(payload), a) + payload[a:b]
            for a, b in itertools.pairwise(edges)] or [
        wire.pack_block_header(v, i, 0, 0)]


@given(payload=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=8),
       v=st.integers(0, wire.MAX_VERSION), i=st.integers(0, wire.MAX_CHUNKS - 1))
def test_any_split_reassembles_exactly(payload, cuts, v, i) -> None:
    asm = wire.BlockAssembler()
    msgs = blocks(v, i, payload, cuts)
    for m in msgs[:-1]:
        assert asm.feed(m) is None
        assert asm.pending == (v, i)
    got = asm.feed(msgs[-1])
    assert got is not None and got[:2] == (v, i) and bytes(got[2]) == payload
    assert asm.pending is None


def test_blocks_of_two_chunks_one_after_the_other() -> None:
    asm = wire.BlockAssembler()
    out = []
    for idx, data in ((3, b"a" * 700), (4, b"b" * 10)):
        for m in blocks(1, idx, data, [300]):
            r = asm.feed(m)
            if r is not None:
                out.append((r[1], bytes(r[2])))
    assert out == [(3, b"a" * 700), (4, b"b" * 10)]


@pytest.mark.parametrize("second", [
    wire.pack_block_header(1, 2, 100, 10) + b"x" * 10,  # another chunk interrupts
    wire.pack_block_header(1, 1, 100, 20) + b"x" * 10,  # a gap
    wire.pack_block_header(1, 1, 99, 10) + b"x" * 10,  # the length changes
    wire.pack_block_header(1, 1, 100, 10),  # no progress
    wire.pack_block_header(1, 1, 100, 95) + b"x" * 10,  # past the end
])
def test_a_block_that_does_not_continue_the_chunk_is_refused(second) -> None:
    asm = wire.BlockAssembler()
    asm.feed(wire.pack_block_header(1, 1, 100, 0) + b"x" * 10)
    with pytest.raises(ProtocolError):
        asm.feed(second)


@pytest.mark.parametrize("msg", [
    b"PSB1",
    wire.pack_block_header(1, 1, 10, 5) + b"x",  # the first block must start the chunk
    wire.pack_block_header(1, wire.MAX_CHUNKS, 10, 0) + b"x",
    wire.pack_block_header(1, 1, wire.MAX_CHUNK_BYTES + 1, 0) + b"x",
    b"PSC1" + bytes(20),
])
def test_malformed_blocks_are_refused(msg) -> None:
    with pytest.raises(ProtocolError):
        wire.BlockAssembler().feed(msg)
