"""Striped links (lanes): a chunk's blocks spread over several connections to one peer.

On a long lossy path one loss-based TCP flow is held near the Mathis ceiling (~3 Mbit/s
at 150 ms and 0.1 % loss), so a link to a peer in another region may carry extra
connections, *lanes* (docs/striped-links.md). Lane 0 is the ordinary link (handshake,
control frames); every lane, lane 0 included, carries blocks of the chunks being sent,
each lane's writer taking the next block when its socket has room. Blocks therefore
arrive in any order, and the next chunk's first blocks may overtake the last blocks of
the one before it.

Messages (sans-I/O: formats and the receiver's state machine; ``node.driver`` moves them):

- ``PSB2`` block: ``seq`` (the sender's count of chunks sent on this link, never reused),
  version, chunk index and block number packed in one u32 (index < 2**18, block < 2**14),
  the chunk's length, then the payload: ``BLOCK_BYTES`` at offset ``block x BLOCK_BYTES``
  (the last block shorter). Fixed blocks make a chunk's coverage a bitset.
- ``PSD2`` done (receiver -> sender, lane 0): chunk ``seq`` is finished here (whole, or
  dropped on a withdrawal). A sender keeps at most ``WINDOW`` chunks unfinished, so a
  receiver holds at most ``WINDOW`` chunk buffers per link.
- ``PSW2`` withdraw (sender -> receiver, lane 0): drop chunk ``seq`` (v, i); blocks of it
  still in flight on other lanes are dropped on arrival, blaming nobody.
- ``PST2`` offer (dialer -> acceptor, lane 0, after the handshake): a 16-byte token.
- ``PSL2`` lane (first message on a new connection): the token and the lane's number.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from swarm.errors import ProtocolError
from swarm.protocol.wire import BLOCK_BYTES, MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_VERSION

STRIPE_MAGIC = b"PSB2"
_STRIPE = struct.Struct(">4sIQII")  # magic, seq, version, index << 14 | block, chunk length
STRIPE_HEADER_LEN = _STRIPE.size  # 24: the same as PSB1's, so one placer serves both
BLOCK_BITS = 14
MAX_BLOCKS = 1 << BLOCK_BITS
DONE_MAGIC = b"PSD2"
_DONE = struct.Struct(">4sI")
WITHDRAW_MAGIC = b"PSW2"
_WITHDRAW = struct.Struct(">4sIQI")  # magic, seq, version, index
OFFER_MAGIC = b"PST2"
LANE_MAGIC = b"PSL2"
TOKEN_BYTES = 16
_OFFER = struct.Struct(f">4s{TOKEN_BYTES}s")
_LANE = struct.Struct(f">4s{TOKEN_BYTES}sB")
MAX_LANES = 16  # connections a link may have, lane 0 included
WINDOW = 4  # chunks a sender may have unfinished on one link
REMEMBER_DROPPED = 256  # withdrawn seqs kept, to drop their late blocks without blame
MAX_SEQ = 2**32 - 1

assert MAX_CHUNKS <= 1 << (32 - BLOCK_BITS) and MAX_CHUNK_BYTES <= MAX_BLOCKS * BLOCK_BYTES


def magic_of(data: bytes | memoryview) -> bytes:
    return bytes(data[:4])


def pack_stripe_header(seq: int, version: int, index: int, block: int, length: int) -> bytes:
    return _STRIPE.pack(STRIPE_MAGIC, seq, version, index << BLOCK_BITS | block, length)


def unpack_stripe_header(header: bytes | memoryview, n: int) -> tuple[int, int, int, int, int]:
    """``(seq, version, index, length, offset)`` of a block whose payload is ``n`` bytes;
    ``ProtocolError`` unless the block is the full block at its place in the chunk."""
    if len(header) < STRIPE_HEADER_LEN:
        raise ProtocolError("striped block shorter than its header")
    magic, seq, version, where, length = _STRIPE.unpack_from(header)
    if magic != STRIPE_MAGIC:
        raise ProtocolError("striped block without the PSB2 magic")
    index, block = where >> BLOCK_BITS, where & (MAX_BLOCKS - 1)
    if version > MAX_VERSION or index >= MAX_CHUNKS or not 0 < length <= MAX_CHUNK_BYTES:
        raise ProtocolError("striped block header out of range")
    offset = block * BLOCK_BYTES
    if offset >= length or n != min(BLOCK_BYTES, length - offset):
        raise ProtocolError(f"chunk {index}: striped block {block} of {n} bytes "
                            f"in a chunk of {length}")
    return seq, version, index, length, offset


def unpack_where(header: bytes | memoryview) -> tuple[int, int, int]:
    """``(seq, version, index << BLOCK_BITS | block)`` of a header ``place`` or ``feed``
    already checked (no checks here)."""
    _, seq, version, where, _ = _STRIPE.unpack_from(header)
    return seq, version, where


def pack_done(seq: int) -> bytes:
    return _DONE.pack(DONE_MAGIC, seq)


def unpack_done(data: bytes | memoryview) -> int:
    if len(data) != _DONE.size or magic_of(data) != DONE_MAGIC:
        raise ProtocolError("malformed PSD2 (done) message")
    return _DONE.unpack(data)[1]


def pack_withdraw(seq: int, version: int, index: int) -> bytes:
    return _WITHDRAW.pack(WITHDRAW_MAGIC, seq, version, index)


def unpack_withdraw(data: bytes | memoryview) -> tuple[int, int, int]:
    """``(seq, version, index)``; ``ProtocolError`` if malformed."""
    if len(data) != _WITHDRAW.size or magic_of(data) != WITHDRAW_MAGIC:
        raise ProtocolError("malformed PSW2 (withdraw) message")
    _, seq, version, index = _WITHDRAW.unpack(data)
    if version > MAX_VERSION or index >= MAX_CHUNKS:
        raise ProtocolError("PSW2 header out of range")
    return seq, version, index


def pack_offer(token: bytes) -> bytes:
    return _OFFER.pack(OFFER_MAGIC, token)


def unpack_offer(data: bytes | memoryview) -> bytes:
    if len(data) != _OFFER.size or magic_of(data) != OFFER_MAGIC:
        raise ProtocolError("malformed PST2 (lane offer) message")
    return _OFFER.unpack(data)[1]


def pack_lane(token: bytes, lane: int) -> bytes:
    return _LANE.pack(LANE_MAGIC, token, lane)


def unpack_lane(data: bytes | memoryview) -> tuple[bytes, int]:
    """``(token, lane number)`` of a lane's first message; ``ProtocolError`` if malformed."""
    if len(data) != _LANE.size or magic_of(data) != LANE_MAGIC:
        raise ProtocolError("malformed PSL2 (lane) message")
    _, token, lane = _LANE.unpack(data)
    if not 1 <= lane < MAX_LANES:
        raise ProtocolError(f"lane number {lane} out of range")
    return token, lane


class _Chunk:
    __slots__ = ("buf", "have", "key", "length", "nblocks", "placing", "prefix")

    def __init__(self, key: tuple[int, int], length: int, buf: Any) -> None:
        self.key = key
        self.length = length
        self.buf = buf
        self.nblocks = -(-length // BLOCK_BYTES)
        self.have = 0  # bit b: block b is here
        self.placing = 0  # bit b: block b is being written in place (``place``)
        self.prefix = 0  # blocks 0 .. prefix-1 are all here


Whole = tuple[int, int, int, memoryview]  # (seq, version, index, payload)


class StripedAssembler:
    """Reassemble a striped link's chunks from blocks in any order (receiver side).

    At most ``window`` chunks are in progress; a block of a chunk already whole, a
    block twice, or a ``window + 1``-th chunk is a ``ProtocolError`` (the link is
    closed). Blocks of a withdrawn chunk are dropped (``None``): they were in flight
    on other lanes when the withdrawal came. ``alloc(n)`` makes a chunk's buffer; it
    may hand back uninitialised memory, since a chunk is returned only once every block
    of it was written.
    """

    def __init__(self, alloc: Callable[[int], Any] | None = None, window: int = WINDOW) -> None:
        self._alloc = alloc or bytearray
        self.window = window
        self.open: dict[int, _Chunk] = {}
        self._finished: set[int] = set()  # seqs done or dropped, above ``_floor``
        self._floor = -1  # every seq <= floor is finished
        self._dropped: deque[int] = deque(maxlen=REMEMBER_DROPPED)

    def _chunk(self, seq: int, v: int, i: int, length: int) -> _Chunk | None:
        """The chunk ``seq`` names (started now if new); None if it was withdrawn."""
        c = self.open.get(seq)
        if c is not None:
            if c.key != (v, i) or c.length != length:
                raise ProtocolError(f"striped chunk {seq}: block of chunk {i} v{v} in chunk "
                                    f"{c.key[1]} v{c.key[0]}")
            return c
        if seq <= self._floor or seq in self._finished:
            if seq in self._dropped:
                return None
            raise ProtocolError(f"block of striped chunk {seq}, which is already whole")
        if len(self.open) >= self.window:
            raise ProtocolError(f"more than {self.window} striped chunks in flight")
        buf = memoryview(self._alloc(length)).cast("B")
        if len(buf) != length:
            raise ValueError(f"alloc({length}) made a buffer of {len(buf)} bytes")
        c = self.open[seq] = _Chunk((v, i), length, buf)
        return c

    def _finish(self, seq: int) -> None:
        self.open.pop(seq, None)
        self._finished.add(seq)
        while self._floor + 1 in self._finished:
            self._floor += 1
            self._finished.discard(self._floor)

    def _got(self, seq: int, c: _Chunk, block: int) -> Whole | None:
        bit = 1 << block
        c.have |= bit
        while c.prefix < c.nblocks and (c.have >> c.prefix) & 1:
            c.prefix += 1
        if c.prefix < c.nblocks:
            return None
        self._finish(seq)
        return seq, c.key[0], c.key[1], c.buf

    def _claim(self, header: bytes | memoryview, n: int) -> tuple[int, _Chunk, int] | None:
        seq, v, i, length, offset = unpack_stripe_header(header, n)
        c = self._chunk(seq, v, i, length)
        if c is None:
            return None
        block = offset // BLOCK_BYTES
        bit = 1 << block
        if (c.have | c.placing) & bit:
            raise ProtocolError(f"striped chunk {seq}: block {block} twice")
        return seq, c, block

    def feed(self, data: bytes | memoryview) -> Whole | None:
        """Take one block message; ``(seq, version, index, payload)`` once its chunk is whole."""
        claim = self._claim(data, len(data) - STRIPE_HEADER_LEN)
        if claim is None:
            return None
        seq, c, block = claim
        off = block * BLOCK_BYTES
        c.buf[off:off + len(data) - STRIPE_HEADER_LEN] = memoryview(data)[STRIPE_HEADER_LEN:]
        return self._got(seq, c, block)

    def place(self, header: bytes | memoryview, n: int) -> memoryview | None:
        """Where a block's ``n`` payload bytes go: its slice of the chunk's buffer, to be
        written as they arrive; ``placed(header)`` then takes it. None: a block of a
        withdrawn chunk (deliver it whole; ``feed`` drops it). Several blocks (one per
        lane) may be in placement at once."""
        claim = self._claim(header, n)
        if claim is None:
            return None
        _, c, block = claim
        c.placing |= 1 << block
        off = block * BLOCK_BYTES
        return c.buf[off:off + n]

    def placed(self, header: bytes | memoryview) -> Whole | None:
        """The block ``place`` handed out for ``header`` is written: as ``feed``'s result."""
        _, seq, _, where, _ = _STRIPE.unpack_from(header)
        block = where & (MAX_BLOCKS - 1)
        c = self.open.get(seq)
        if c is None or not (c.placing >> block) & 1:
            if seq in self._dropped:
                return None  # withdrawn while it was being written
            raise RuntimeError("placed() without place()")
        c.placing &= ~(1 << block)
        return self._got(seq, c, block)

    def withdraw(self, seq: int) -> tuple[int, int] | None:
        """Drop chunk ``seq`` (``PSW2``); its key if it was in progress. A withdrawal of
        a chunk already whole is a ``ProtocolError``; of one not begun, it is finished
        before its first block (which may still come, late, on another lane)."""
        c = self.open.get(seq)
        if c is None and (seq <= self._floor or seq in self._finished):
            if seq in self._dropped:
                return None
            raise ProtocolError(f"withdrawal of striped chunk {seq}, which is already whole")
        self._dropped.append(seq)
        self._finish(seq)
        return c.key if c is not None else None

    def prefix(self, seq: int) -> int:
        """Bytes of chunk ``seq`` that are here from its start on, without a gap."""
        c = self.open.get(seq)
        return 0 if c is None else min(c.length, c.prefix * BLOCK_BYTES)

    def seq_of(self, v: int, i: int) -> int | None:
        """The seq of chunk ``(v, i)`` if it is in progress here."""
        for seq, c in self.open.items():
            if c.key == (v, i):
                return seq
        return None
