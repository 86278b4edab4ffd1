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
- ``PSQ2`` want (receiver -> sender, lane 0): blocks of chunk ``seq`` to send again. A
  receiver asks once per chunk, for the blocks it lacks, when the chunk has had no block
  for ``STALL_S`` while a chunk sent after it did (a block of a later chunk is only sent
  once every block of the earlier one was handed to a lane, so the missing ones are stuck
  on a lane in loss recovery: a 150 ms lane in retransmission back-off held a chunk for
  5 s on the emulated lossy WAN). The sender sends them again on the lanes with the least
  load; the receiver drops the second copy of each block it asked for, whichever comes
  second, even after the chunk is whole, and refuses any other block twice.
- ``PST2`` offer (dialer -> acceptor, lane 0, after the handshake): a 16-byte token.
- ``PSA2`` ask (acceptor -> dialer, lane 0): a 16-byte token. The acceptor, sending chunks
  on a link it found capped by random loss (``[network] lanes = "auto"``,
  ``node.tcp.RandomLoss``), asks the dialer to open lanes with this token, which it holds
  as if the dialer had offered it; a dialer that stripes no links, or offered a token of
  its own already, lets it be (the acceptor then takes the dialer's offer).
- ``PSL2`` lane (first message on a new connection): the token and the lane's number.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict, deque
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
WANT_MAGIC = b"PSQ2"
_WANT = struct.Struct(">4sI")  # magic, seq; then the blocks, u16 each
MAX_WANT = MAX_CHUNK_BYTES // BLOCK_BYTES  # blocks of the largest chunk
STALL_S = 1.0  # a chunk without a block this long while a later one gets them: ask again
ASK_MAGIC = b"PSA2"
LANE_MAGIC = b"PSL2"
TOKEN_BYTES = 16
_OFFER = struct.Struct(f">4s{TOKEN_BYTES}s")
_LANE = struct.Struct(f">4s{TOKEN_BYTES}sB")
_ASK_N = _LANE  # PSA2 with the connections wanted: the same layout (magic, token, count)
MAX_LANES = 16  # connections a link may have, lane 0 included
# ``[network] lanes = "auto"``: connections a link gets once its sender finds it capped by
# random loss (node.tcp.RandomLoss; docs/striped-links.md)
AUTO_LANES = 4
# ... at a measured loss of 0.1 % (where 4 were measured as fast as 8); more where a flow's
# loss is higher (``lanes_for_loss``)
AUTO_LOSS_REF = 0.001
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


def pack_want(seq: int, blocks: list[int]) -> bytes:
    return _WANT.pack(WANT_MAGIC, seq) + struct.pack(f">{len(blocks)}H", *blocks)


def unpack_want(data: bytes | memoryview) -> tuple[int, list[int]]:
    """``(seq, blocks)``: 1..``MAX_WANT`` distinct block numbers, ascending."""
    k, odd = divmod(len(data) - _WANT.size, 2)
    if magic_of(data) != WANT_MAGIC or odd or not 1 <= k <= MAX_WANT:
        raise ProtocolError("malformed PSQ2 (want) message")
    seq = _WANT.unpack_from(data)[1]
    blocks = list(struct.unpack_from(f">{k}H", data, _WANT.size))
    if any(b >= a for a, b in zip(blocks[1:], blocks, strict=False)) or blocks[-1] >= MAX_BLOCKS:
        raise ProtocolError("PSQ2 blocks out of order or range")
    return seq, blocks


def pack_offer(token: bytes) -> bytes:
    return _OFFER.pack(OFFER_MAGIC, token)


def _unpack_token(data: bytes | memoryview, magic: bytes, what: str) -> bytes:
    if len(data) != _OFFER.size or magic_of(data) != magic:
        raise ProtocolError(f"malformed {magic.decode()} ({what}) message")
    return _OFFER.unpack(data)[1]


def unpack_offer(data: bytes | memoryview) -> bytes:
    return _unpack_token(data, OFFER_MAGIC, "lane offer")


def lanes_for_loss(loss: float | None) -> int:
    """Connections for a link found capped by random loss, from the share of its
    segments retransmitted: ``AUTO_LANES`` at ``AUTO_LOSS_REF`` or less, more as the
    square root of the loss above it (one flow's cap falls as 1 / sqrt(loss), Mathis et
    al.: the link's rate stays what ``AUTO_LANES`` give at the reference), at most
    ``MAX_LANES``."""
    if loss is None or not loss > AUTO_LOSS_REF:  # also NaN
        return AUTO_LANES
    return min(MAX_LANES, max(AUTO_LANES, round(AUTO_LANES * math.sqrt(loss / AUTO_LOSS_REF))))


def pack_ask(token: bytes, lanes: int | None = None) -> bytes:
    """An acceptor's lane ask: the token it registered, and how many connections it
    wants the link to have (lane 0 included; none: the dialer's own count)."""
    if lanes is None:
        return _OFFER.pack(ASK_MAGIC, token)
    return _ASK_N.pack(ASK_MAGIC, token, lanes)


def unpack_ask(data: bytes | memoryview) -> tuple[bytes, int | None]:
    """``(token, connections wanted or None)`` of a lane ask; ``ProtocolError`` if
    malformed (a count outside 2..``MAX_LANES`` included)."""
    if len(data) == _ASK_N.size and magic_of(data) == ASK_MAGIC:
        _, token, lanes = _ASK_N.unpack(data)
        if not 2 <= lanes <= MAX_LANES:
            raise ProtocolError(f"PSA2 (lane ask) for {lanes} connections")
        return token, lanes
    return _unpack_token(data, ASK_MAGIC, "lane ask"), None


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
    __slots__ = ("asked", "buf", "have", "key", "last_at", "length", "nblocks", "placing",
                 "placing_on", "prefix", "wanted")

    def __init__(self, key: tuple[int, int], length: int, buf: Any) -> None:
        self.key = key
        self.length = length
        self.buf = buf
        self.nblocks = -(-length // BLOCK_BYTES)
        self.have = 0  # bit b: block b is here
        self.placing = 0  # bit b: block b is being written in place (``place``)
        self.placing_on: dict[int, int] = {}  # block being written in place -> connection
        self.prefix = 0  # blocks 0 .. prefix-1 are all here
        self.wanted = 0  # bit b: asked for again (PSQ2); its second copy is dropped
        self.asked = False
        self.last_at: float | None = None  # when its last block came (``touch``)


Whole = tuple[int, int, int, memoryview]  # (seq, version, index, payload)


class StripedAssembler:
    """Reassemble a striped link's chunks from blocks in any order (receiver side).

    At most ``window`` chunks are in progress; a block of a chunk already whole, a
    block twice, or a ``window + 1``-th chunk is a ``ProtocolError`` (the link is
    closed). Blocks of a withdrawn chunk are dropped (``None``): they were in flight
    on other lanes when the withdrawal came. So is the second copy of a block asked for
    again (``stalled``, ``PSQ2``), whichever copy comes second, also after its chunk is
    whole. ``alloc(n)`` makes a chunk's buffer; it may hand back uninitialised memory,
    since a chunk is returned only once every block of it was written.
    """

    def __init__(self, alloc: Callable[[int], Any] | None = None, window: int = WINDOW) -> None:
        self._alloc = alloc or bytearray
        self.window = window
        self.open: dict[int, _Chunk] = {}
        self._finished: set[int] = set()  # seqs done or dropped, above ``_floor``
        self._floor = -1  # every seq <= floor is finished
        self._dropped: deque[int] = deque(maxlen=REMEMBER_DROPPED)
        # finished chunks whose asked-for blocks may still come twice: seq -> their bits
        self._late: OrderedDict[int, int] = OrderedDict()
        self._newest: tuple[int, float] | None = None  # the highest seq a block came for, when

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
        c = self.open.pop(seq, None)
        if c is not None and c.wanted and seq not in self._dropped:
            self._late[seq] = c.wanted
            while len(self._late) > REMEMBER_DROPPED:
                self._late.popitem(last=False)
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

    def _claim(self, header: bytes | memoryview, n: int,
               consume: bool = True) -> tuple[int, _Chunk, int] | None:
        """The chunk and block a block message is for; None: drop it (a withdrawn chunk's,
        or the second copy of a block asked for again; ``consume`` counts that copy)."""
        seq, v, i, length, offset = unpack_stripe_header(header, n)
        block = offset // BLOCK_BYTES
        bit = 1 << block
        late = self._late.get(seq)
        if late is not None and late & bit and seq not in self.open:
            if consume:
                if late & ~bit:
                    self._late[seq] = late & ~bit
                else:
                    del self._late[seq]
            return None
        c = self._chunk(seq, v, i, length)
        if c is None:
            return None
        if (c.have | c.placing) & bit:
            if not c.wanted & bit:
                raise ProtocolError(f"striped chunk {seq}: block {block} twice")
            if consume:
                c.wanted &= ~bit
            return None
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

    def place(self, header: bytes | memoryview, n: int, conn: int = 0) -> memoryview | None:
        """Where a block's ``n`` payload bytes go: its slice of the chunk's buffer, to be
        written as they arrive; ``placed(header)`` then takes it. None: a block of a
        withdrawn chunk (deliver it whole; ``feed`` drops it). Several blocks (one per
        lane: ``conn``) may be in placement at once."""
        claim = self._claim(header, n, consume=False)  # a dropped copy comes whole to ``feed``
        if claim is None:
            return None
        _, c, block = claim
        c.placing |= 1 << block
        c.placing_on[block] = conn
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
        c.placing_on.pop(block, None)
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

    def touch(self, seq: int, now: float) -> None:
        """A block of chunk ``seq`` came in at ``now`` (kept or dropped)."""
        c = self.open.get(seq)
        if c is not None:
            c.last_at = now
        if self._newest is None or seq >= self._newest[0]:
            self._newest = (seq, now)

    def stalled(self, now: float, after_s: float = STALL_S,
                divert: Callable[[int, int, int], bool] | None = None,
                ) -> list[tuple[int, list[int]]]:
        """Chunks to ask for again (``PSQ2``), each once: no block of it for ``after_s``,
        while a block of a chunk sent after it came since. Its blocks not here are asked
        for, and their second copy will be dropped: those not arriving, and those being
        written in place on a connection that ``divert(seq, block, conn)`` turned away
        from the chunk's buffer (``node.link.Link.divert``; the chunk may then be whole
        and handed on while the stuck copy still arrives). A block ``divert`` did not
        turn away is about to be ``placed``, and is not asked for."""
        out: list[tuple[int, list[int]]] = []
        if self._newest is None:
            return out
        newest, newest_at = self._newest
        for seq, c in self.open.items():
            if (c.asked or c.last_at is None or seq >= newest or newest_at <= c.last_at
                    or now - c.last_at < after_s):
                continue
            if divert is not None:
                for b, conn in list(c.placing_on.items()):
                    if divert(seq, b, conn):
                        c.placing &= ~(1 << b)
                        del c.placing_on[b]
            missing = [b for b in range(c.nblocks) if not ((c.have | c.placing) >> b) & 1]
            if missing:
                c.asked = True
                for b in missing:
                    c.wanted |= 1 << b
                out.append((seq, missing))
        return out

    def next_stall_check(self, after_s: float = STALL_S) -> float | None:
        """When ``stalled`` may next find a chunk (a chunk not yet asked for that a later
        one has overtaken), or None."""
        if self._newest is None:
            return None
        newest, newest_at = self._newest
        due = [c.last_at + after_s for seq, c in self.open.items()
               if not c.asked and c.last_at is not None and seq < newest
               and newest_at > c.last_at]
        return min(due) if due else None

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
