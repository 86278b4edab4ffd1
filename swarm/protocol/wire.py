"""Wire format: msgpack control frames and the binary chunk-payload header.

Every control frame is one msgpack array ``[type, field, ...]``. Decoding
checks the frame size, then the shape and bounds of every field, and raises
``ProtocolError`` for anything else, so the core never sees a malformed value.
Chunk payloads travel outside msgpack (the real driver sends them as binary
messages ``CHUNK_MAGIC + header + payload``); a chunk message starts with the
magic ``b"PSC1"``, which is never a valid msgpack array, so a driver can tell
the two apart by their first byte.

Frames that go to many peers (announcements, HAVE batches) are encoded once by
the core and the same ``bytes`` object is sent to each of them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from swarm.errors import ProtocolError

# ---- protocol versions. A release speaks every version from MIN_PROTOCOL_VERSION to
# PROTOCOL_VERSION; its HELLO names the newest, and a link speaks the older of the two
# ends' newest, if both ends still speak it (``handshake.negotiate``; the HELLOs are in
# the AUTH transcript, so a man in the middle cannot talk a link down).
#   1: rounds 1-26. HELLO had to match exactly, so a release from before round 27
#      refuses every other (rounds 25 and 26 added frames an older node took for
#      malformed, and a chunk restarted over lanes that it misread).
#   2: round 27: the same frames and link messages as 1, and the negotiation.
#   3: round 42: the warm-up padding link message (``PAD_MAGIC``).
# A release that adds a frame or a link message raises PROTOCOL_VERSION, keeps
# MIN_PROTOCOL_VERSION at the version before, and sends the new one only on links that
# speak it (``Peer.proto``): nodes one release apart then keep every link during a
# rolling upgrade (docs/operations.md).
PROTOCOL_VERSION = 3
MIN_PROTOCOL_VERSION = 2

# ---- limits (every field is bounded; see docs/protocol.md)
MAX_CHUNKS = 262_144  # = swarm.trust.manifest.MAX_CHUNK_COUNT
MAX_VERSION = 2**63 - 1
MAX_MANIFEST_BYTES = 9 * 1024 * 1024
MAX_FRAME_BYTES = MAX_MANIFEST_BYTES + 64
MAX_SMALL_FRAME_BYTES = 64 * 1024  # every frame type except ANNOUNCE and BITFIELD
MAX_ID_LEN = 128
MAX_REGION_LEN = 64
MAX_MODEL_LEN = 256
MAX_ADDR_LEN = 256
MAX_INDICES = 1024  # indices in one HAVE / REQUEST / CANCEL / REJECT
MAX_PEERS = 64  # entries in one PEERS frame
NONCE_LEN = 16
MAC_LEN = 32

# ---- frame types: one frozen dataclass per frame, fields in wire order.
# On the wire a frame is the msgpack array ``[TYPE, field, ...]`` (tuples and
# lists pack alike), so the bytes are those of the untyped encoder.

PEER_ORIGIN = 1
PEER_BORDER = 2
ROLE_KEEP = 1

_pack = msgpack.Packer(use_bin_type=True).pack

#: a PEERS entry: (node_id, region, addr, flags)  flags: PEER_ORIGIN | PEER_BORDER
PeerEntry = tuple[str, str, str, int]


class Frame:
    """Base of every control frame; ``TYPE`` is the first element on the wire."""

    __slots__ = ()
    TYPE: ClassVar[int] = 0
    NAME: ClassVar[str] = ""

    def encode(self) -> bytes:
        return _pack([self.TYPE, *(getattr(self, n) for n in self.__slots__)])

    @classmethod
    def pack(cls, *fields: Any) -> bytes:
        """``cls(*fields).encode()`` without building the object (hot paths)."""
        return _pack([cls.TYPE, *fields])


@dataclass(frozen=True, slots=True)
class Hello(Frame):
    TYPE: ClassVar[int] = 1
    NAME: ClassVar[str] = "HELLO"
    proto: int
    model: str
    node_id: str
    region: str
    listen_addr: str
    role: str
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Auth(Frame):
    TYPE: ClassVar[int] = 2
    NAME: ClassVar[str] = "AUTH"
    mac: bytes


@dataclass(frozen=True, slots=True)
class Ping(Frame):
    TYPE: ClassVar[int] = 3
    NAME: ClassVar[str] = "PING"


@dataclass(frozen=True, slots=True)
class Peers(Frame):
    TYPE: ClassVar[int] = 4
    NAME: ClassVar[str] = "PEERS"
    entries: tuple[PeerEntry, ...]


@dataclass(frozen=True, slots=True)
class Role(Frame):
    """origin -> node: ``flags & ROLE_KEEP``: keep this link (border / served peer)."""

    TYPE: ClassVar[int] = 5
    NAME: ClassVar[str] = "ROLE"
    flags: int


@dataclass(frozen=True, slots=True)
class Announce(Frame):
    TYPE: ClassVar[int] = 6
    NAME: ClassVar[str] = "ANNOUNCE"
    manifest: bytes  # signed manifest bytes


@dataclass(frozen=True, slots=True)
class Bitfield(Frame):
    TYPE: ClassVar[int] = 7
    NAME: ClassVar[str] = "BITFIELD"
    version: int
    bits: bytes  # little-endian: bit i = chunk i


@dataclass(frozen=True, slots=True)
class Have(Frame):
    TYPE: ClassVar[int] = 8
    NAME: ClassVar[str] = "HAVE"
    version: int
    indices: tuple[int, ...] | list[int]


@dataclass(frozen=True, slots=True)
class Request(Frame):
    TYPE: ClassVar[int] = 9
    NAME: ClassVar[str] = "REQUEST"
    version: int
    indices: tuple[int, ...] | list[int]


@dataclass(frozen=True, slots=True)
class Cancel(Frame):
    TYPE: ClassVar[int] = 10
    NAME: ClassVar[str] = "CANCEL"
    version: int
    indices: tuple[int, ...] | list[int]


@dataclass(frozen=True, slots=True)
class Reject(Frame):
    TYPE: ClassVar[int] = 11
    NAME: ClassVar[str] = "REJECT"
    version: int
    indices: tuple[int, ...] | list[int]


@dataclass(frozen=True, slots=True)
class Relay(Frame):
    """origin -> border: send chunk ``index`` of ``version`` to the border ``target``: now
    if the border holds it, else as soon as it is stored (``relays``: relay on arrival)."""

    TYPE: ClassVar[int] = 12
    NAME: ClassVar[str] = "RELAY"
    version: int
    index: int
    target: str


@dataclass(frozen=True, slots=True)
class RelayFail(Frame):
    """border -> origin: the RELAY order could not be carried out."""

    TYPE: ClassVar[int] = 13
    NAME: ClassVar[str] = "RELAY_FAIL"
    version: int
    index: int
    target: str


@dataclass(frozen=True, slots=True)
class Links(Frame):
    """border -> origin: the cross-region borders it holds links to."""

    TYPE: ClassVar[int] = 14
    NAME: ClassVar[str] = "LINKS"
    ids: tuple[str, ...] | list[str]


@dataclass(frozen=True, slots=True)
class Report(Frame):
    """node -> origin: I banned this node (it sent corrupt chunks)."""

    TYPE: ClassVar[int] = 15
    NAME: ClassVar[str] = "REPORT"
    node_id: str


STATUS_FORMAT = 1  # the STATUS layout this code writes; readers accept later ones


@dataclass(frozen=True, slots=True)
class Status(Frame):
    """node -> origin: the version the node is active on and the one its engine serves.

    Versioned: ``[STATUS, format, active, served, ...]``. Format 1 has exactly these
    fields; a later format may append fields, which a format-1 reader ignores, so a
    fleet can be upgraded node by node. ``None`` (msgpack nil): no version yet.
    """

    TYPE: ClassVar[int] = 16
    NAME: ClassVar[str] = "STATUS"
    format: int
    active: int | None
    served: int | None


@dataclass(frozen=True, slots=True)
class Coming(Frame):
    """node -> region peer: these chunks are arriving here; ask for them now, they are
    sent as they come (``serve_arriving``). Not a HAVE: a REJECT or a withdrawal takes
    it back, and a HAVE follows once each is stored."""

    TYPE: ClassVar[int] = 17
    NAME: ClassVar[str] = "COMING"
    version: int
    indices: tuple[int, ...] | list[int]


@dataclass(frozen=True, slots=True)
class RelayAlive(Frame):
    """border -> origin: the relay of chunk ``index`` of ``version`` to ``target`` is on
    its way (the target's TCP is acknowledging its bytes): do not time it out yet.
    On a long lossy path one chunk may take longer than the relay's deadline."""

    TYPE: ClassVar[int] = 18
    NAME: ClassVar[str] = "RELAY_ALIVE"
    version: int
    index: int
    target: str


FRAME_TYPES: dict[int, type[Frame]] = {
    cls.TYPE: cls for cls in (Hello, Auth, Ping, Peers, Role, Announce, Bitfield, Have, Request,
                              Cancel, Reject, Relay, RelayFail, Links, Report, Status, Coming,
                              RelayAlive)
}
# the integer type codes, for tests and tools that build raw frames
HELLO, AUTH, PING, PEERS, ROLE, ANNOUNCE, BITFIELD, HAVE, REQUEST, CANCEL, REJECT, RELAY, \
    RELAY_FAIL, LINKS, REPORT, STATUS, COMING, RELAY_ALIVE = range(1, 19)
MAX_STATUS_FIELDS = 16  # a later STATUS format may append up to this many fields
NAMES = {t: cls.NAME for t, cls in FRAME_TYPES.items()}


def encode(*fields: Any) -> bytes:
    """Encode a raw frame ``[type, field, ...]`` (tests and tools; the core uses ``Frame.encode``)."""
    return _pack(list(fields))


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError("extension types are not allowed")


def _str(v: Any, limit: int, what: str) -> str:
    if type(v) is not str or not v or len(v) > limit:
        raise ProtocolError(f"{what}: expected a non-empty string of at most {limit} characters")
    return v


def _uint(v: Any, limit: int, what: str) -> int:
    if type(v) is not int or v < 0 or v > limit:
        raise ProtocolError(f"{what}: expected an integer in 0..{limit}")
    return v


def _opt_version(v: Any, what: str) -> int | None:
    return None if v is None else _uint(v, MAX_VERSION, what)


def _bin(v: Any, length: int | None, limit: int, what: str) -> bytes:
    if type(v) is not bytes or (length is not None and len(v) != length) or len(v) > limit:
        raise ProtocolError(f"{what}: expected {length or f'<= {limit}'} bytes")
    return v


def _indices(v: Any, what: str) -> tuple[int, ...]:
    if type(v) is not tuple or not v or len(v) > MAX_INDICES:
        raise ProtocolError(f"{what}: expected 1..{MAX_INDICES} chunk indices")
    for i in v:
        if type(i) is not int or i < 0 or i >= MAX_CHUNKS:
            raise ProtocolError(f"{what}: chunk index out of range")
    return v


def _arity(f: tuple, n: int, name: str) -> None:
    if len(f) != n:
        raise ProtocolError(f"{name}: expected {n - 1} fields, got {len(f) - 1}")


_CACHE: dict[bytes, Frame] = {}  # small frames decoded before (frames are immutable)
_CACHE_MAX = 4096
_CACHE_FRAME_BYTES = 256


def decode(frame: bytes) -> Frame:
    """Decode and validate one control frame into its ``Frame`` dataclass.

    ``ProtocolError`` on anything malformed. The same bytes always decode to
    an equal frozen frame, so small frames seen before (a HAVE sent to many
    peers) are returned from a bounded cache.
    """
    if type(frame) is bytes and len(frame) <= _CACHE_FRAME_BYTES:
        f = _CACHE.get(frame)
        if f is None:
            f = _decode(frame)
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.clear()
            _CACHE[frame] = f
        return f
    return _decode(frame)


def _decode(frame: bytes) -> Frame:
    n = len(frame)
    if n == 0 or n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes (limit {MAX_FRAME_BYTES})")
    try:
        f = msgpack.unpackb(
            frame, raw=False, use_list=False, strict_map_key=True, ext_hook=_reject_ext,
            max_str_len=MAX_MODEL_LEN, max_bin_len=MAX_MANIFEST_BYTES,
            max_array_len=MAX_INDICES, max_map_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types on hostile input
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
    if type(f) is not tuple or not f or type(f[0]) is not int:
        raise ProtocolError("frame is not an array starting with a type")
    t = f[0]
    cls = FRAME_TYPES.get(t)
    if cls is None:
        raise ProtocolError(f"unknown frame type {t}")
    name = cls.NAME
    if n > MAX_SMALL_FRAME_BYTES and cls is not Announce and cls is not Bitfield:
        raise ProtocolError(f"{name} frame of {n} bytes (limit {MAX_SMALL_FRAME_BYTES})")
    if cls in _INDEX_FRAMES:
        _arity(f, 3, name)
        _uint(f[1], MAX_VERSION, "version")
        _indices(f[2], name)
    elif cls is Ping:
        _arity(f, 1, name)
    elif cls is Hello:
        _arity(f, 8, name)
        _uint(f[1], 2**16, "protocol version")
        _str(f[2], MAX_MODEL_LEN, "model")
        _str(f[3], MAX_ID_LEN, "node id")
        _str(f[4], MAX_REGION_LEN, "region")
        _str(f[5], MAX_ADDR_LEN, "listen addr")
        if f[6] not in ("node", "origin"):
            raise ProtocolError("role: expected 'node' or 'origin'")
        _bin(f[7], NONCE_LEN, NONCE_LEN, "nonce")
    elif cls is Auth:
        _arity(f, 2, name)
        _bin(f[1], MAC_LEN, MAC_LEN, "mac")
    elif cls is Peers:
        _arity(f, 2, name)
        if type(f[1]) is not tuple or len(f[1]) > MAX_PEERS:
            raise ProtocolError(f"PEERS: expected at most {MAX_PEERS} entries")
        for e in f[1]:
            if type(e) is not tuple or len(e) != 4:
                raise ProtocolError("PEERS: malformed entry")
            _str(e[0], MAX_ID_LEN, "peer id")
            _str(e[1], MAX_REGION_LEN, "peer region")
            _str(e[2], MAX_ADDR_LEN, "peer addr")
            _uint(e[3], 3, "peer flags")
    elif cls is Role:
        _arity(f, 2, name)
        _uint(f[1], 1, "role flags")
    elif cls is Announce:
        _arity(f, 2, name)
        _bin(f[1], None, MAX_MANIFEST_BYTES, "manifest")
        if not f[1]:
            raise ProtocolError("ANNOUNCE: empty manifest")
    elif cls is Bitfield:
        _arity(f, 3, name)
        _uint(f[1], MAX_VERSION, "version")
        _bin(f[2], None, MAX_CHUNKS // 8, "bitfield")
    elif cls is Relay or cls is RelayFail or cls is RelayAlive:
        _arity(f, 4, name)
        _uint(f[1], MAX_VERSION, "version")
        _uint(f[2], MAX_CHUNKS - 1, "index")
        _str(f[3], MAX_ID_LEN, "target")
    elif cls is Links:
        _arity(f, 2, name)
        if type(f[1]) is not tuple or len(f[1]) > MAX_PEERS:
            raise ProtocolError(f"LINKS: expected at most {MAX_PEERS} ids")
        for e in f[1]:
            _str(e, MAX_ID_LEN, "link id")
    elif cls is Report:
        _arity(f, 2, name)
        _str(f[1], MAX_ID_LEN, "reported id")
    elif cls is Status:
        if len(f) < 4 or len(f) > 1 + MAX_STATUS_FIELDS:
            raise ProtocolError(f"STATUS: expected 3..{MAX_STATUS_FIELDS} fields, got {len(f) - 1}")
        fmt = _uint(f[1], 2**16, "status format")
        if fmt < 1 or (fmt == STATUS_FORMAT and len(f) != 4):
            raise ProtocolError(f"STATUS: format {fmt} with {len(f) - 1} fields")
        _opt_version(f[2], "active version")
        _opt_version(f[3], "served version")
        return Status(fmt, f[2], f[3])  # fields a later format appends are not ours to read
    return cls(*f[1:])


_INDEX_FRAMES = frozenset((Have, Request, Cancel, Reject, Coming))


# ---- bitfields: Python ints, bit i = chunk i


def bits_to_bytes(bits: int, count: int) -> bytes:
    return bits.to_bytes((count + 7) // 8, "little")


def bits_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "little")


# ---- chunk payload messages (real driver)

CHUNK_MAGIC = b"PSC1"
_CHUNK_HEADER = struct.Struct(">4sQII")  # magic, version, index, length
CHUNK_HEADER_LEN = _CHUNK_HEADER.size
MAX_CHUNK_BYTES = 64 * 1024 * 1024


def is_chunk_message(data: bytes | memoryview) -> bool:
    return bytes(data[:4]) == CHUNK_MAGIC


def pack_chunk_header(version: int, index: int, length: int) -> bytes:
    """The header the real driver puts before a chunk payload on the wire."""
    return _CHUNK_HEADER.pack(CHUNK_MAGIC, version, index, length)


def pack_chunk(version: int, index: int, payload: bytes) -> bytes:
    return pack_chunk_header(version, index, len(payload)) + payload


def unpack_chunk(data: bytes | memoryview) -> tuple[int, int, memoryview]:
    """Split a chunk message into ``(version, index, payload)``; ``ProtocolError`` if malformed."""
    if len(data) < CHUNK_HEADER_LEN:
        raise ProtocolError("chunk message shorter than its header")
    magic, version, index, length = _CHUNK_HEADER.unpack_from(data)
    if magic != CHUNK_MAGIC:
        raise ProtocolError("chunk message without the PSC1 magic")
    if version > MAX_VERSION or index >= MAX_CHUNKS or length > MAX_CHUNK_BYTES:
        raise ProtocolError("chunk header out of range")
    if len(data) - CHUNK_HEADER_LEN != length:
        raise ProtocolError(f"chunk {index}: header says {length} bytes, got {len(data) - CHUNK_HEADER_LEN}")
    return version, index, memoryview(data)[CHUNK_HEADER_LEN:]


# ---- chunk blocks (real driver): a chunk goes on the wire as consecutive blocks, so
# control frames queued behind it wait for one block, not for the whole chunk (a 4 MiB
# message takes ~0.35 s on 100 Mbit/s; heartbeats behind it made links time out).

BLOCK_MAGIC = b"PSB1"
_BLOCK_HEADER = struct.Struct(">4sQIII")  # magic, version, index, chunk length, offset
BLOCK_HEADER_LEN = _BLOCK_HEADER.size
BLOCK_BYTES = 256 * 1024  # block payload the driver sends (a receiver takes any size)


def is_block_message(data: bytes | memoryview) -> bool:
    return bytes(data[:4]) == BLOCK_MAGIC


# A sender that relays a chunk while it still arrives (cut-through) sends its last
# block only once the chunk was verified; if it is not, it sends this instead: "drop
# the blocks of this chunk you got from me" (or, before any block of it: "it will not come").
WITHDRAW_MAGIC = b"PSW1"
_WITHDRAW = struct.Struct(">4sQI")  # magic, version, index


def is_withdraw_message(data: bytes | memoryview) -> bool:
    return bytes(data[:4]) == WITHDRAW_MAGIC


def pack_withdraw(version: int, index: int) -> bytes:
    return _WITHDRAW.pack(WITHDRAW_MAGIC, version, index)


def unpack_withdraw(data: bytes | memoryview) -> tuple[int, int]:
    """``(version, index)`` of a withdrawal; ``ProtocolError`` if malformed."""
    if len(data) != _WITHDRAW.size:
        raise ProtocolError(f"withdrawal of {len(data)} bytes (expected {_WITHDRAW.size})")
    magic, version, index = _WITHDRAW.unpack(data)
    if magic != WITHDRAW_MAGIC:
        raise ProtocolError("withdrawal without the PSW1 magic")
    if version > MAX_VERSION or index >= MAX_CHUNKS:
        raise ProtocolError("withdrawal header out of range")
    return version, index


# Warm-up padding (protocol 3): filler a sender writes on an idle long link before any
# version flows on it, so that TCP's congestion window is open when the first chunk
# goes (node.warm_up). The receiver drops it unread, counting it against ``PAD_LIMIT``
# per link; it is sent only on links that speak ``PAD_PROTOCOL`` and only after the
# handshake.
PAD_MAGIC = b"PSP1"
PAD_PROTOCOL = 3
PAD_MESSAGE_BYTES = 64 * 1024  # what a sender writes at a time (a receiver takes any size)
PAD_LIMIT = 64 * 1024 * 1024  # padding one link may carry in all, each way
_PAD_FILL = bytes(PAD_MESSAGE_BYTES)


def is_pad_message(data: bytes | memoryview) -> bool:
    return bytes(data[:4]) == PAD_MAGIC


def pack_pad(n: int) -> bytes:
    """A padding message of ``n`` bytes in all (4..``PAD_MESSAGE_BYTES``)."""
    if not len(PAD_MAGIC) <= n <= PAD_MESSAGE_BYTES:
        raise ValueError(f"padding message of {n} bytes")
    return PAD_MAGIC + _PAD_FILL[: n - len(PAD_MAGIC)]


def pack_block_header(version: int, index: int, length: int, offset: int) -> bytes:
    return _BLOCK_HEADER.pack(BLOCK_MAGIC, version, index, length, offset)


def unpack_block_header(header: bytes | memoryview, n: int) -> tuple[int, int, int, int]:
    """``(version, index, chunk length, offset)`` of a block whose payload is ``n`` bytes.

    ``ProtocolError`` if malformed: out-of-range fields, an empty block (one
    that makes no progress), or a block reaching past the chunk's length.
    """
    if len(header) < BLOCK_HEADER_LEN:
        raise ProtocolError("block message shorter than its header")
    magic, version, index, length, offset = _BLOCK_HEADER.unpack_from(header)
    if magic != BLOCK_MAGIC:
        raise ProtocolError("block message without the PSB1 magic")
    if version > MAX_VERSION or index >= MAX_CHUNKS or length > MAX_CHUNK_BYTES:
        raise ProtocolError("block header out of range")
    if (n == 0 and length > 0) or offset + n > length:
        raise ProtocolError(f"chunk {index}: block of {n} bytes at {offset} of {length}")
    return version, index, length, offset


def unpack_block(data: bytes | memoryview) -> tuple[int, int, int, int, memoryview]:
    """Split a block message into ``(version, index, chunk length, offset, payload)``
    (``ProtocolError`` as ``unpack_block_header``)."""
    v, i, length, offset = unpack_block_header(data, len(data) - BLOCK_HEADER_LEN)
    return v, i, length, offset, memoryview(data)[BLOCK_HEADER_LEN:]


class BlockAssembler:
    """Reassemble one connection's chunk blocks (sans-I/O; the driver owns one per link).

    A sender sends one chunk's blocks in order before starting the next, so a
    connection has at most one chunk in progress and every block must continue it:
    anything else is a ``ProtocolError`` (the link is closed, the partial chunk
    dropped). Memory is bounded by one chunk per connection.

    ``alloc(n)`` makes the buffer a chunk of ``n`` bytes is reassembled in (default
    ``bytearray``, zero-filled). It may hand back uninitialised memory (a driver
    passes ``numpy.empty``, to skip zero-filling 4 MiB per chunk): a chunk is
    returned only once consecutive blocks covered every byte from 0 to its
    length, so no byte of the buffer's old contents is ever part of it.

    ``hasher()`` (optional) makes an object with ``update(bytes)`` and ``digest()``:
    each block is hashed as it is taken, while its bytes are still in the cache, and
    ``digest`` is then the hash of the chunk the last ``feed``/``placed`` returned whole
    (a driver hands it to the store's check instead of a second pass over the chunk).
    Every byte is written once, in order, before it is taken, and never after: the
    hash is of exactly the bytes returned.
    """

    __slots__ = ("_alloc", "_buf", "_got", "_hash", "_hasher", "_key", "_length",
                 "_placing", "digest")

    def __init__(self, alloc: Callable[[int], Any] | None = None,
                 hasher: Callable[[], Any] | None = None) -> None:
        self._alloc = alloc or bytearray
        self._hasher = hasher
        self._hash: Any = None  # the chunk in progress's hasher (bytes taken so far)
        self._key: tuple[int, int] | None = None
        self._buf: Any = None  # a writable buffer of the chunk's length, from alloc
        self._length = 0
        self._got = 0
        self._placing = 0  # bytes of the block handed out by ``place``, not yet ``placed``
        self.digest: bytes | None = None  # of the chunk last returned whole (``hasher``)

    @property
    def pending(self) -> tuple[int, int] | None:
        """(version, index) of the chunk in progress, if any."""
        return self._key

    @property
    def received(self) -> int:
        """Bytes of the chunk in progress received so far (from its start, in order)."""
        return self._got if self._key is not None else 0

    @property
    def length(self) -> int:
        """Length of the chunk in progress (0 if none)."""
        return self._length if self._key is not None else 0

    @property
    def buffer(self) -> memoryview | None:
        """The buffer the chunk in progress is assembled in: its first ``received``
        bytes are final (a cut-through relay sends them on before the chunk is whole)."""
        return self._buf if self._key is not None else None

    def withdraw(self, data: bytes | memoryview) -> tuple[int, int]:
        """Take a withdrawal (``pack_withdraw``): drop the chunk in progress it names.

        With no chunk in progress it names one whose first block never left (a
        requested chunk the sender could not start). ``ProtocolError`` if another
        chunk is in progress: its blocks are the last on the link, a withdrawal of
        anything else breaks the order.
        """
        key = unpack_withdraw(data)
        if self._key is None:
            return key
        if key != self._key:
            raise ProtocolError(f"withdrawal of chunk {key[1]} v{key[0]}, not in progress")
        self._key, self._buf, self._length, self._got, self._hash = None, None, 0, 0, None
        return key

    def _begin(self, v: int, i: int, length: int, offset: int, n: int) -> None:
        """Check that a block continues the chunk in progress (or starts one)."""
        if self._placing:
            raise RuntimeError("a placed block was not finished (placed) first")
        if self._key is None:
            if offset != 0:
                raise ProtocolError(f"chunk {i}: first block at offset {offset}")
            self._key, self._length, self._got = (v, i), length, 0
            self._buf = None
            self._hash = self._hasher() if self._hasher is not None else None
            if n < length:
                self._buf = memoryview(self._alloc(length)).cast("B")
                if len(self._buf) != length:
                    raise ValueError(f"alloc({length}) made a buffer of {len(self._buf)} bytes")
        elif (v, i) != self._key or length != self._length or offset != self._got:
            raise ProtocolError(f"block of chunk {i} v{v} at {offset} interrupts chunk "
                                f"{self._key[1]} v{self._key[0]} at {self._got}")

    def _advance(self, n: int, whole: memoryview | None) -> tuple[int, int, memoryview] | None:
        """Take the ``n`` bytes from ``received`` on (written, final): the chunk once whole
        (``whole``: a chunk that is this one block, its own bytes)."""
        h = self._hash
        if h is not None:
            h.update(whole if whole is not None else self._buf[self._got:self._got + n])
        self._got += n
        if self._got < self._length:
            return None
        key, out = self._key, whole if whole is not None else self._buf
        self._key, self._buf, self._hash = None, None, None
        self.digest = h.digest() if h is not None else None
        return key[0], key[1], out  # type: ignore[index]

    def feed(self, data: bytes | memoryview) -> tuple[int, int, memoryview] | None:
        """Take one block message; ``(version, index, payload)`` once a chunk is whole."""
        v, i, length, offset, payload = unpack_block(data)
        n = len(payload)
        self._begin(v, i, length, offset, n)
        if self._buf is None:  # the whole chunk in one block: no copy
            return self._advance(n, payload)
        self._buf[offset:offset + n] = payload
        return self._advance(n, None)

    def place(self, header: bytes | memoryview, n: int) -> memoryview | None:
        """Where the payload of a block (its header, ``n`` payload bytes) belongs: the
        slice of the chunk's buffer it fills, to be written as its bytes arrive (no copy
        through a message buffer); ``placed`` then takes the block. None for a chunk
        that is one block (it has no buffer: ``feed`` the message). Checks as ``feed``
        (``ProtocolError``). Every block before it must have been fed or placed."""
        v, i, length, offset = unpack_block_header(header, n)
        if self._key is None and offset == 0 and n == length:
            return None
        self._begin(v, i, length, offset, n)
        self._placing = n
        return self._buf[offset:offset + n]  # type: ignore[index]

    def placed(self) -> tuple[int, int, memoryview] | None:
        """The block ``place`` handed out is filled: as ``feed``'s result."""
        if not self._placing:
            raise RuntimeError("placed() without place()")
        n, self._placing = self._placing, 0
        return self._advance(n, None)

    def abandon_place(self) -> None:
        """The link closed while a placed block was arriving: forget it (the chunk in
        progress stays as it was; the link's end drops it)."""
        self._placing = 0
