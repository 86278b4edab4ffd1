"""The data plane's frames (``node.frames``), sans-I/O: messages come out as they went in
under any split of the stream; any changed, dropped, repeated or reordered byte or frame
fails authentication (or leaves the reader waiting), never a wrong message; a message
sealed in parts and opened in place or delivered makes the same stream, and a frame opened
in place that fails is never said written; a read takes the next frame's header and small
frames with a frame's rest (a frame in one read, not two); a length past the limit fails
before anything is allocated; both ends of a key exchange agree, and a malformed or
low-order key is refused."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from node.frames import (
    HEADER,
    HELLO_BYTES,
    HELLO_MAGIC,
    SEAL_INTO,
    TAG,
    FrameReader,
    FrameWriter,
    KeyShare,
)
from swarm.errors import ProtocolError

MAX = 300_000


def _pair() -> tuple[FrameWriter, FrameReader, list[bytes]]:
    key = os.urandom(32)
    got: list[bytes] = []
    return FrameWriter(key), FrameReader(key, MAX, lambda v: got.append(bytes(v))), got


def _stream(w: FrameWriter, msgs: list[bytes]) -> bytes:
    return b"".join(b"".join(w.seal(m)) for m in msgs)


MESSAGES = st.lists(st.one_of(st.binary(max_size=64), st.integers(0, MAX).map(os.urandom)),
                    min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(msgs=MESSAGES, cuts=st.lists(st.integers(1, 70_000), max_size=20))
def test_messages_come_out_as_they_went_in_however_the_stream_is_split(
        msgs: list[bytes], cuts: list[int]) -> None:
    w, r, got = _pair()
    data, pos = _stream(w, msgs), 0
    for c in [*cuts, len(data)]:
        r.feed(data[pos:pos + c])
        pos += c
        if pos >= len(data):
            break
    r.feed(data[pos:])
    assert got == msgs and r.wants() == 0


class _Sink:
    """A consumer like the link: ``into`` offers room of a drawn size where the stream
    goes on (or nothing), ``wrote`` / ``deliver`` take what came."""

    def __init__(self, rooms: list[int | None]) -> None:
        self.out = bytearray()
        self.rooms, self.asked, self.fits = rooms, 0, 0
        self.area = memoryview(bytearray(MAX + 64))

    def into(self, n: int) -> memoryview | None:
        room = self.rooms[self.asked % len(self.rooms)]
        self.asked += 1
        if room is None:
            return None
        self.fits += room >= n
        return self.area[:room]

    def wrote(self, n: int) -> None:
        self.out += self.area[:n]

    def deliver(self, view: memoryview) -> None:
        self.out += view


@settings(max_examples=60, deadline=None)
@given(msgs=MESSAGES, data=st.data(),
       rooms=st.lists(st.one_of(st.none(), st.integers(0, MAX + 64)), min_size=1, max_size=6))
def test_frames_opened_in_place_or_delivered_make_the_stream_that_was_sent(
        msgs: list[bytes], data: st.DataObject, rooms: list[int | None]) -> None:
    """Messages sealed in parts of any split (``seal_parts``, as a block's header and
    body), each frame opened into the room the consumer offers when it fits, else
    delivered: the consumer's stream is the sender's, whatever the rooms and reads."""
    key = os.urandom(32)
    w, sink = FrameWriter(key), _Sink(rooms)
    r = FrameReader(key, MAX, sink.deliver, into=sink.into, wrote=sink.wrote)
    stream = bytearray()
    for m in msgs:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(m)), max_size=3)))
        ends = [0, *cuts, len(m)]
        stream += b"".join(w.seal_parts([m[a:b] for a, b in itertools.pairwise(ends)]))
    step = data.draw(st.integers(1, 100_000))
    for i in range(0, len(stream), step):
        r.feed(stream[i:i + step])
    assert bytes(sink.out) == b"".join(msgs)
    assert r.direct == sink.fits and r.wants() == 0


def test_a_frame_opened_in_place_that_fails_authentication_is_never_said_written() -> None:
    key = os.urandom(32)
    sink = _Sink([MAX])
    r = FrameReader(key, MAX, sink.deliver, into=sink.into, wrote=sink.wrote)
    frame = bytearray(b"".join(FrameWriter(key).seal(os.urandom(5000))))
    frame[-1] ^= 1
    with pytest.raises(ProtocolError, match="authentication"):
        r.feed(frame)
    assert sink.out == b"" and r.direct == 0
    with pytest.raises(ValueError, match="together"):
        FrameReader(key, MAX, sink.deliver, into=sink.into)


@settings(max_examples=120, deadline=None)
@given(msgs=MESSAGES, data=st.data())
def test_a_changed_byte_never_yields_a_wrong_message(msgs: list[bytes], data: st.DataObject) -> None:
    w, r, got = _pair()
    stream = bytearray(_stream(w, msgs))
    i = data.draw(st.integers(0, len(stream) - 1))
    stream[i] ^= data.draw(st.integers(1, 255))
    try:
        r.feed(stream)
    except ProtocolError as exc:
        assert "authentication" in str(exc) or "outside" in str(exc)
    # whatever came out before the change is a prefix of what was sent, nothing else
    assert got == msgs[:len(got)]
    assert len(got) < len(msgs)


def test_a_dropped_repeated_or_reordered_frame_fails_authentication() -> None:
    key = os.urandom(32)
    w = FrameWriter(key)
    frames = [b"".join(w.seal(m)) for m in (b"one", b"two", b"three")]
    for order in ([frames[0], frames[2]], [frames[0], frames[0]], [frames[1], frames[0]]):
        got: list[bytes] = []
        r = FrameReader(key, MAX, lambda v, got=got: got.append(bytes(v)))
        with pytest.raises(ProtocolError, match="authentication"):
            for f in order:
                r.feed(f)
        assert got in ([], [b"one"])


def test_a_length_past_the_limit_fails_before_anything_is_allocated() -> None:
    r = FrameReader(os.urandom(32), MAX, lambda v: None)
    with pytest.raises(ProtocolError, match="outside"):
        r.feed(HEADER.pack(0xFFFF_FFFF))
    r = FrameReader(os.urandom(32), MAX, lambda v: None)
    with pytest.raises(ProtocolError, match="outside"):
        r.feed(HEADER.pack(MAX + TAG + 1))
    r = FrameReader(os.urandom(32), MAX, lambda v: None)
    with pytest.raises(ProtocolError, match="outside"):
        r.feed(HEADER.pack(TAG - 1))  # shorter than its tag


def test_the_reader_says_how_much_of_the_frame_is_still_coming() -> None:
    w, r, got = _pair()
    frame = b"".join(w.seal(os.urandom(1000)))
    r.feed(frame[:2])
    assert r.wants() == 0  # a header in part: the length is not known yet
    r.feed(frame[2:10])
    assert r.wants() == len(frame) - 10
    r.feed(frame[10:])
    assert r.wants() == 0 and len(got) == 1


def test_both_ends_of_a_key_exchange_agree_and_each_direction_has_its_own_key() -> None:
    dialer, server = KeyShare(), KeyShare()
    d_tx, d_rx = dialer.keys(server.hello(), dialer=True)
    s_tx, s_rx = server.keys(dialer.hello(), dialer=False)
    assert d_tx == s_rx and d_rx == s_tx and d_tx != d_rx
    assert len(d_tx) == 32 and len(dialer.hello()) == HELLO_BYTES
    other = KeyShare()  # a third party's hello gives other keys
    assert dialer.keys(other.hello(), dialer=True) != (d_tx, d_rx)


@pytest.mark.parametrize("hello", [b"", HELLO_MAGIC, b"XXXX" + bytes(32),
                                   HELLO_MAGIC + bytes(31), HELLO_MAGIC + bytes(33),
                                   HELLO_MAGIC + bytes(32)],  # the last: a low-order point
                         ids=["empty", "magic only", "wrong magic", "short", "long", "zero"])
def test_a_malformed_or_unusable_hello_is_refused(hello: bytes) -> None:
    with pytest.raises(ProtocolError, match="frames"):
        KeyShare().keys(hello, dialer=True)


@pytest.mark.parametrize("size", [0, 1, SEAL_INTO - 1, SEAL_INTO, 256 * 1024 + 3])
def test_a_large_part_is_sealed_into_a_buffer_of_its_own_with_the_same_bytes(size: int) -> None:
    """Parts from ``SEAL_INTO`` up are sealed with ``encrypt_into`` into a fresh, unzeroed
    buffer: the same frame as AES-GCM's ``encrypt`` gives, and no two frames share one
    (the transport may still hold the last when the next is sealed)."""
    key = os.urandom(32)
    w = FrameWriter(key)
    data = os.urandom(size)
    first, second = w.seal(data), w.seal(data)
    want = [AESGCM(key).encrypt(b"\0" * 4 + n.to_bytes(8, "big"), data, None) for n in (0, 1)]
    for (head, ct), expected in zip((first, second), want, strict=True):
        assert bytes(head) == HEADER.pack(len(expected)) and bytes(ct) == expected
    if size >= SEAL_INTO:
        assert isinstance(first[1], np.ndarray)
        assert not np.shares_memory(first[1], second[1])


class _Socket:
    """A socket's receive queue as a buffered protocol sees it: each read takes all that
    is queued, up to the room the reader offers."""

    def __init__(self, r: FrameReader) -> None:
        self.r, self.queued, self.reads = r, bytearray(), 0

    def arrive(self, data: bytes) -> None:
        self.queued += data
        while self.queued:
            buf = self.r.get_buffer()
            k = min(len(buf), len(self.queued))
            buf[:k] = self.queued[:k]
            del self.queued[:k]
            self.reads += 1
            self.r.took(k)


def test_a_read_takes_the_next_frames_header_and_small_frames_with_the_rest() -> None:
    """A block's header message and its 256 KiB body, then three small messages, all
    queued at once: read as offered, that is one read of the first header (and what
    fits behind it), one of the body's rest with the small frames after it. Read
    exactly, it took two reads a frame (a header's 4 bytes, then the ciphertext)."""
    key = os.urandom(32)
    w, got = FrameWriter(key), []
    sink = _Sink([None, MAX, None, None, None])
    r = FrameReader(key, MAX, lambda v: got.append(bytes(v)), into=sink.into, wrote=sink.wrote)
    body, small = os.urandom(256 * 1024), [os.urandom(40) for _ in range(3)]
    stream = b"".join(w.seal_parts([b"h" * 30, body]) + [b"".join(w.seal(m)) for m in small])
    sock = _Socket(r)
    sock.arrive(stream)
    assert got == [b"h" * 30, *small] and bytes(sink.out) == body and r.direct == 1
    assert sock.reads == 2 and r.wants() == 0


@settings(max_examples=80, deadline=None)
@given(msgs=st.lists(st.one_of(st.binary(max_size=64), st.integers(0, 9000).map(os.urandom)),
                     min_size=1, max_size=12),
       cuts=st.lists(st.integers(1, 20_000), max_size=12))
def test_frames_read_past_their_end_come_out_whole_and_in_order(
        msgs: list[bytes], cuts: list[int]) -> None:
    """Bytes arriving in bursts of any size, each read taking all it is offered: every
    message comes out once, in order, and the reader never asks for a read it does not
    need (it wants nothing once the stream is through)."""
    w, r, got = _pair()
    stream, pos = _stream(w, msgs), 0
    sock = _Socket(r)
    for c in [*cuts, len(stream)]:
        sock.arrive(stream[pos:pos + c])
        pos += c
        if pos >= len(stream):
            break
    assert got == msgs and r.wants() == 0 and r.get_buffer().nbytes >= HEADER.size
    # at most a read a frame, plus one for each burst that ended inside a frame: a reader
    # that read each header apart (two reads a frame) fails this
    assert sock.reads <= len(msgs) + len(cuts) + 1
