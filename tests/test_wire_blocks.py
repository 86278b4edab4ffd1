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


@given(payloads=st.lists(st.binary(max_size=3000), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 3000), max_size=6), fill=st.integers(0, 255))
def test_uninitialised_buffers_never_leak_old_bytes(payloads, cuts, fill) -> None:
    """``alloc`` may hand back dirty memory (the driver's ``numpy.empty``): every chunk
    returned is exactly its blocks, whatever the buffer held before."""
    made: list[bytearray] = []

    def dirty(n: int) -> bytearray:
        made.append(bytearray([fill]) * n)
        return made[-1]

    asm = wire.BlockAssembler(alloc=dirty)
    for idx, payload in enumerate(payloads):
        got = None
        for m in blocks(1, idx, payload, cuts):
            got = asm.feed(m)
        assert got is not None and got[:2] == (1, idx) and bytes(got[2]) == payload


def test_alloc_of_the_wrong_size_is_refused() -> None:
    asm = wire.BlockAssembler(alloc=lambda n: bytearray(n + 1))
    with pytest.raises(ValueError, match="alloc"):
        asm.feed(blocks(1, 0, b"x" * 100, [50])[0])


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


# ---- withdrawals (cut-through relays: a chunk the sender could not verify is dropped)


@given(payload=st.binary(min_size=2, max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6),
       sent=st.integers(1, 8), after=st.binary(max_size=2000))
def test_a_withdrawn_chunk_is_dropped_and_the_link_goes_on(payload, cuts, sent, after) -> None:
    """Any prefix of a chunk's blocks, then its withdrawal: nothing of it is returned,
    and the next chunk on the link reassembles exactly."""
    asm = wire.BlockAssembler()
    msgs = blocks(1, 5, payload, cuts)[:-1][:sent]
    if not msgs:  # a one-block chunk cannot be withdrawn: its only block completes it
        return
    for m in msgs:
        assert asm.feed(m) is None
    assert asm.received == sum(len(m) - wire.BLOCK_HEADER_LEN for m in msgs)
    assert bytes(asm.buffer[:asm.received]) == payload[:asm.received]
    assert asm.withdraw(wire.pack_withdraw(1, 5)) == (1, 5)
    assert asm.pending is None and asm.received == 0 and asm.buffer is None
    got = None
    for m in blocks(1, 5, after, [len(after) // 2]):
        got = asm.feed(m)
    assert got is not None and bytes(got[2]) == after


@pytest.mark.parametrize("msg", [
    wire.pack_withdraw(1, 6),  # not the chunk in progress
    wire.pack_withdraw(2, 5),
    wire.pack_withdraw(1, 5) + b"x",  # malformed
    b"PSW1" + bytes(3),
    b"PSB1" + bytes(8),
])
def test_a_withdrawal_of_anything_but_the_chunk_in_progress_is_refused(msg) -> None:
    asm = wire.BlockAssembler()
    asm.feed(wire.pack_block_header(1, 5, 100, 0) + b"x" * 10)
    with pytest.raises(ProtocolError):
        asm.withdraw(msg)


@given(payload=st.binary(min_size=1, max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6))
def test_a_withdrawal_before_any_block_names_its_chunk_and_changes_nothing(payload, cuts) -> None:
    """A requested chunk whose first block never left is withdrawn with no chunk in
    progress: the assembler says which, and the link's next chunk reassembles exactly."""
    asm = wire.BlockAssembler()
    assert asm.withdraw(wire.pack_withdraw(1, 5)) == (1, 5)
    assert asm.pending is None and asm.received == 0
    got = None
    for m in blocks(2, 7, payload, cuts):
        got = asm.feed(m)
    assert got is not None and got[:2] == (2, 7) and bytes(got[2]) == payload


def test_a_malformed_withdrawal_with_no_chunk_in_progress_is_refused() -> None:
    with pytest.raises(ProtocolError):
        wire.BlockAssembler().withdraw(wire.pack_withdraw(1, 5)[:-1])


def test_withdrawals_are_told_apart_from_blocks_chunks_and_frames() -> None:
    w = wire.pack_withdraw(3, 4)
    assert wire.is_withdraw_message(w) and not wire.is_block_message(w)
    assert not wire.is_chunk_message(w)
    assert wire.unpack_withdraw(w) == (3, 4)
    with pytest.raises(ProtocolError):
        wire.unpack_withdraw(wire.pack_withdraw(3, 4)[:-1])


def _take(asm: wire.BlockAssembler, m: bytes, place: bool):
    """One block message taken as a link takes it: placed (its body written into the
    slice ``place`` hands out) where asked and the assembler gives a slice, else fed."""
    header, body = m[:wire.BLOCK_HEADER_LEN], m[wire.BLOCK_HEADER_LEN:]
    dest = asm.place(header, len(body)) if place else None
    if dest is None:
        return asm.feed(m)
    assert len(dest) == len(body)
    dest[:] = body
    return asm.placed()


@given(payloads=st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 3000), max_size=6),
       how=st.lists(st.booleans(), min_size=1, max_size=12), fill=st.integers(0, 255))
def test_placed_blocks_reassemble_as_fed_ones(payloads, cuts, how, fill) -> None:
    """``place`` / ``placed`` (the link writes a block's bytes straight into the slice it
    is given) and ``feed`` mix freely on one link and give the same chunks, whatever
    the buffers held before."""
    asm = wire.BlockAssembler(alloc=lambda n: bytearray([fill]) * n)
    k = 0
    for idx, payload in enumerate(payloads):
        got = None
        for m in blocks(2, idx, payload, cuts):
            got = _take(asm, m, how[k % len(how)])
            k += 1
        assert got is not None and got[:2] == (2, idx) and bytes(got[2]) == payload
        assert asm.pending is None


def test_a_placed_block_is_checked_like_a_fed_one() -> None:
    asm = wire.BlockAssembler()
    first, second = blocks(1, 0, b"x" * 100, [50])
    with pytest.raises(ProtocolError, match="first block"):
        asm.place(second[:wire.BLOCK_HEADER_LEN], 50)  # does not start the chunk
    with pytest.raises(ProtocolError):
        asm.place(first[:wire.BLOCK_HEADER_LEN], 101)  # reaches past the chunk
    dest = asm.place(first[:wire.BLOCK_HEADER_LEN], 50)
    assert dest is not None
    with pytest.raises(RuntimeError):  # the placed block must be finished first
        asm.feed(second)
    dest[:] = first[wire.BLOCK_HEADER_LEN:]
    assert asm.placed() is None
    with pytest.raises(ProtocolError, match="interrupts"):
        asm.place(wire.pack_block_header(1, 1, 100, 50), 50)
    fresh = wire.BlockAssembler()  # a chunk that is one block has no buffer: it is fed
    assert fresh.place(wire.pack_block_header(1, 5, 10, 0), 10) is None and fresh.pending is None


@given(payloads=st.lists(st.binary(max_size=3000), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 3000), max_size=6),
       how=st.lists(st.booleans(), min_size=1, max_size=12),
       withdraw_after=st.integers(0, 4), fill=st.integers(0, 255))
def test_the_hash_taken_block_by_block_is_the_hash_of_the_chunk_returned(
        payloads, cuts, how, withdraw_after, fill) -> None:
    """With a ``hasher`` each block is hashed as the assembler takes it, fed or placed:
    ``digest`` is then exactly ``chunk_hash`` of the chunk returned (the store compares
    it instead of hashing again), whatever the buffer held before, also after a chunk
    withdrawn part-way; without a hasher there is none."""
    from swarm.trust.chunks import chunk_hash, chunk_hasher

    asm = wire.BlockAssembler(alloc=lambda n: bytearray([fill]) * n, hasher=chunk_hasher)
    plain = wire.BlockAssembler()
    k = 0
    for idx, payload in enumerate(payloads):
        msgs = blocks(3, idx, payload, cuts)
        if len(msgs) > 1 and withdraw_after:  # a first copy withdrawn part-way
            for m in msgs[:min(withdraw_after, len(msgs) - 1)]:
                assert asm.feed(bytes(m[:wire.BLOCK_HEADER_LEN]) + bytes([fill ^ 1]) * (
                    len(m) - wire.BLOCK_HEADER_LEN)) is None  # other bytes: never hashed in
            assert asm.withdraw(wire.pack_withdraw(3, idx)) == (3, idx)
        got = None
        for m in msgs:
            got = _take(asm, m, how[k % len(how)])
            k += 1
            plain.feed(m)
        assert got is not None and bytes(got[2]) == payload
        assert asm.digest == chunk_hash(payload) == chunk_hash(got[2])
        assert plain.digest is None
