"""``swarm.protocol.stripes``: blocks of striped links in any order, chunks overtaking each
other within the window, withdrawals with blocks still in flight, and every malformed
or out-of-turn message refused."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ProtocolError
from swarm.protocol import stripes as S
from swarm.protocol.wire import BLOCK_BYTES

B = BLOCK_BYTES


def blocks(seq: int, v: int, i: int, payload: bytes) -> list[bytes]:
    """The PSB2 messages of one chunk, in block order."""
    n = len(payload)
    return [S.pack_stripe_header(seq, v, i, b, n) + payload[b * B:(b + 1) * B]
            for b in range(-(-n // B))]


def dirty(n: int) -> bytearray:
    return bytearray(b"\xee" * n)  # a reused buffer: old bytes everywhere


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5 * B + 7), min_size=1, max_size=8),
       seed=st.integers(0, 2**32), use_place=st.booleans())
def test_chunks_in_any_block_order_come_out_whole_and_in_seq(sizes, seed, use_place):
    """Up to WINDOW chunks in flight, their blocks shuffled together (as lanes deliver
    them): every chunk comes out exactly once, byte for byte, when its last block lands."""
    rng = random.Random(seed)
    payloads = [rng.randbytes(n) for n in sizes]
    asm = S.StripedAssembler(alloc=dirty)
    out: dict[int, bytes] = {}
    for start in range(0, len(payloads), S.WINDOW):  # the sender's window: W at a time
        msgs = [m for seq in range(start, min(start + S.WINDOW, len(payloads)))
                for m in blocks(seq, 7, seq % 5, payloads[seq])]
        rng.shuffle(msgs)
        for m in msgs:
            if use_place:
                view = asm.place(m[:S.STRIPE_HEADER_LEN], len(m) - S.STRIPE_HEADER_LEN)
                assert view is not None
                view[:] = m[S.STRIPE_HEADER_LEN:]
                whole = asm.placed(m[:S.STRIPE_HEADER_LEN])
            else:
                whole = asm.feed(m)
            if whole is not None:
                seq, v, i, data = whole
                assert seq not in out and (v, i) == (7, seq % 5)
                out[seq] = bytes(data)
    assert out == dict(enumerate(payloads))
    assert not asm.open


def test_prefix_is_what_a_cut_through_relay_may_send():
    payload = bytes(range(256)) * (3 * B // 256)
    asm = S.StripedAssembler()
    m0, m1, m2 = blocks(0, 1, 2, payload)
    assert asm.feed(m1) is None and asm.prefix(0) == 0
    assert asm.feed(m0) is None and asm.prefix(0) == 2 * B
    assert asm.seq_of(1, 2) == 0 and asm.seq_of(1, 3) is None
    assert asm.feed(m2)[3] == payload and asm.prefix(0) == 0


def test_a_block_twice_or_of_a_whole_chunk_is_refused():
    asm = S.StripedAssembler()
    m0, m1 = blocks(0, 1, 0, b"x" * (B + 1))
    asm.feed(m0)
    with pytest.raises(ProtocolError, match="twice"):
        asm.feed(m0)
    assert asm.feed(m1) is not None
    with pytest.raises(ProtocolError, match="already whole"):
        asm.feed(m1)
    with pytest.raises(ProtocolError, match="already whole"):
        asm.withdraw(0)


def test_a_block_in_placement_cannot_be_claimed_again():
    asm = S.StripedAssembler()
    m0, _ = blocks(0, 1, 0, b"x" * (B + 1))
    assert asm.place(m0[:24], B) is not None
    with pytest.raises(ProtocolError, match="twice"):
        asm.place(m0[:24], B)
    with pytest.raises(RuntimeError):
        asm.placed(S.pack_stripe_header(0, 1, 0, 1, B + 1))


def test_more_chunks_than_the_window_is_refused():
    asm = S.StripedAssembler(window=2)
    asm.feed(blocks(0, 1, 0, b"a" * (B + 1))[0])
    asm.feed(blocks(1, 1, 1, b"b" * (B + 1))[0])
    with pytest.raises(ProtocolError, match="more than 2"):
        asm.feed(blocks(2, 1, 2, b"c" * (B + 1))[0])


def test_a_seq_names_one_chunk():
    asm = S.StripedAssembler()
    asm.feed(blocks(0, 1, 0, b"a" * (B + 1))[0])
    with pytest.raises(ProtocolError, match="in chunk"):
        asm.feed(blocks(0, 1, 1, b"a" * (B + 1))[1])


@settings(max_examples=40, deadline=None)
@given(n_blocks=st.integers(2, 6), before=st.integers(0, 6), seed=st.integers(0, 2**32))
def test_a_withdrawal_drops_the_chunk_and_its_late_blocks(n_blocks, before, seed):
    """Blocks of a withdrawn chunk that were in flight on other lanes arrive after the
    withdrawal: dropped, blaming nobody. The next chunks are unaffected."""
    rng = random.Random(seed)
    payload = rng.randbytes(n_blocks * B - 3)
    msgs = blocks(0, 4, 9, payload)
    rng.shuffle(msgs)
    before = min(before, len(msgs) - 1)
    asm = S.StripedAssembler()
    for m in msgs[:before]:
        assert asm.feed(m) is None
    assert asm.withdraw(0) == ((4, 9) if before else None)
    for m in msgs[before:]:
        assert asm.feed(m) is None
        assert asm.place(m[:24], len(m) - 24) is None
    assert not asm.open
    nxt = rng.randbytes(B + 5)
    got = [asm.feed(m) for m in blocks(1, 4, 9, nxt)]  # the same chunk again, a new seq
    assert got[-1] is not None and bytes(got[-1][3]) == nxt


def test_a_withdrawal_while_a_block_is_placed():
    asm = S.StripedAssembler()
    m0, _ = blocks(0, 1, 0, b"x" * (B + 1))
    view = asm.place(m0[:24], B)
    assert view is not None
    asm.withdraw(0)
    view[:] = m0[24:]  # the lane was already writing it
    assert asm.placed(m0[:24]) is None


@pytest.mark.parametrize(("header", "n", "msg"), [
    (S.pack_stripe_header(0, 1, 0, 0, 0), 0, "out of range"),
    (S.pack_stripe_header(0, 1, 0, 2, 2 * B), B, "striped block 2"),
    (S.pack_stripe_header(0, 1, 0, 0, 2 * B), B - 1, "of 262143 bytes"),
    (S.pack_stripe_header(0, 1, 0, 1, B + 9), 10, "of 10 bytes"),
    (b"PSB1" + bytes(20), B, "PSB2 magic"),
    (b"PSB2", B, "shorter"),
])
def test_malformed_blocks_are_refused(header, n, msg):
    with pytest.raises(ProtocolError, match=msg):
        S.unpack_stripe_header(header, n)


def test_control_messages_round_trip_and_refuse_garbage():
    tok = bytes(range(16))
    assert S.unpack_offer(S.pack_offer(tok)) == tok
    assert S.unpack_ask(S.pack_ask(tok)) == (tok, None)
    assert S.unpack_ask(S.pack_ask(tok, 13)) == (tok, 13)
    for bad in (0, 1, S.MAX_LANES + 1):
        with pytest.raises(ProtocolError, match="PSA2"):
            S.unpack_ask(S.pack_ask(tok, bad))
    assert S.unpack_lane(S.pack_lane(tok, 3)) == (tok, 3)
    assert S.unpack_done(S.pack_done(2**32 - 1)) == 2**32 - 1
    assert S.unpack_withdraw(S.pack_withdraw(5, 2**40, 7)) == (5, 2**40, 7)
    for bad, fn in ((S.pack_lane(tok, 0), S.unpack_lane), (S.pack_offer(tok)[:-1], S.unpack_offer),
                    (b"PSD2", S.unpack_done), (S.pack_done(1), S.unpack_withdraw),
                    (S.pack_lane(tok, S.MAX_LANES), S.unpack_lane),
                    (S.pack_offer(tok), S.unpack_ask), (S.pack_ask(tok) + b"x", S.unpack_ask)):
        with pytest.raises(ProtocolError):
            fn(bad)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=64))
def test_any_bytes_are_a_clean_error_or_a_block(data):
    asm = S.StripedAssembler()
    with contextlib.suppress(ProtocolError):
        asm.feed(data)
    for parse in (S.unpack_ask, S.unpack_offer, S.unpack_lane, S.unpack_done, S.unpack_withdraw,
                  S.unpack_want):
        with contextlib.suppress(ProtocolError):
            parse(data)


def _placed_now(asm: S.StripedAssembler, msg: bytes, conn: int) -> S.Whole | None:
    """A block written in place on connection ``conn`` (as a lane does)."""
    dest = asm.place(msg[:S.STRIPE_HEADER_LEN], len(msg) - S.STRIPE_HEADER_LEN, conn)
    if dest is None:
        return asm.feed(msg)
    dest[:] = msg[S.STRIPE_HEADER_LEN:]
    return asm.placed(msg[:S.STRIPE_HEADER_LEN])


def test_a_chunk_stuck_on_a_lane_is_asked_again_and_second_copies_are_dropped():
    """Chunk 0 stops (a lane in loss recovery: block 1 mid-placement on connection 2,
    block 3 not begun) while chunk 1, sent after it, goes on: after ``STALL_S`` it is
    asked for once, block 1 turned away from its buffer, and every block asked for may
    come twice, whichever copy is second, before and after the chunk is whole; a block
    not asked for twice is still refused."""
    a, b = bytes(random.Random(1).randbytes(4 * B)), bytes(random.Random(2).randbytes(2 * B))
    m0, m1 = blocks(0, 3, 0, a), blocks(1, 3, 1, b)
    asm = S.StripedAssembler(alloc=dirty)
    for k in (0, 2):
        assert _placed_now(asm, m0[k], 0) is None
        asm.touch(0, 0.1)
    stuck = asm.place(m0[1][:S.STRIPE_HEADER_LEN], B, 2)  # lane 2 stops mid-block
    assert stuck is not None
    assert asm.stalled(5.0) == []  # nothing sent after it has come
    assert _placed_now(asm, m1[0], 1) is None
    asm.touch(1, 0.5)
    assert asm.stalled(1.0) == [] and asm.next_stall_check() == pytest.approx(1.1)
    turned: list[tuple[int, int, int]] = []
    assert asm.stalled(1.2, divert=lambda *x: turned.append(x) or True) == [(0, [1, 3])]
    assert turned == [(0, 1, 2)]
    assert asm.stalled(9.0) == [] and asm.next_stall_check() is None  # once a chunk
    assert _placed_now(asm, m0[3], 0) is None  # the stuck lane's next block, first copy
    assert _placed_now(asm, m0[3], 1) is None  # its second copy: dropped
    whole = _placed_now(asm, m0[1], 1)  # block 1 again, on another lane
    assert whole is not None and bytes(whole[3]) == a and whole[:3] == (0, 3, 0)
    stuck[:] = b"\x00" * B  # the stuck copy still lands (in a buffer of its own)
    assert _placed_now(asm, m0[1], 2) is None  # a late copy after the chunk is whole
    with pytest.raises(ProtocolError, match="already whole"):
        asm.feed(m0[1])  # a third copy
    with pytest.raises(ProtocolError, match="twice"):
        _placed_now(asm, m1[0], 2)  # chunk 1's block 0 again: never asked for
    assert _placed_now(asm, m1[1], 0)[3] == b  # type: ignore[index]


def test_want_messages_round_trip_and_refuse_garbage():
    assert S.unpack_want(S.pack_want(7, [0, 3, 255])) == (7, [0, 3, 255])
    for bad in (S.pack_want(1, []), S.pack_want(1, [3, 2]), S.pack_want(1, [2, 2]),
                S.pack_want(1, [0]) + b"x", S.pack_want(1, list(range(S.MAX_WANT + 1))),
                S.pack_want(1, [S.MAX_BLOCKS]), S.pack_done(1)):
        with pytest.raises(ProtocolError):
            S.unpack_want(bad)


def test_lanes_for_loss_follow_the_square_root_of_the_loss() -> None:
    """4 at 0.1 % loss or less (and when the share is unknown), 4 x sqrt(loss / 0.1 %)
    above, 16 at most: a flow's cap falls as 1 / sqrt(loss) (Mathis et al.)."""
    assert [S.lanes_for_loss(p) for p in (None, float("nan"), 0.0, 0.0005, 0.001)] == [4] * 5
    assert [S.lanes_for_loss(p) for p in (0.002, 0.004, 0.01, 0.016, 0.5)] == [6, 8, 13, 16, 16]


@given(st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0))
def test_lanes_for_loss_grow_with_the_loss_and_stay_in_range(a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert S.AUTO_LANES <= S.lanes_for_loss(lo) <= S.lanes_for_loss(hi) <= S.MAX_LANES
