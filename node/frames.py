"""The data plane's frames: AES-256-GCM over whole link messages, keys from an X25519
exchange inside the mutual-TLS handshake's channel (round 51).

TLS 1.3 carries at most 16 KiB of plaintext a record; Python's ``ssl`` costs a call, a
BIO copy and an exception at the end of each wake-up for them, 1.8 CPU-s per GB on this
project's VM at 100 Mbit/s, where the kernel's whole receive path costs 0.9 and AES-GCM
on 256 KiB frames 0.7 (``benchmarks/bench_link_rx.py``, docs/benchmarks.md round 51).
So once TLS has authenticated both ends, a link whose peers both speak it (ALPN
``patchswarm-frames/1``) moves its bytes in frames of one link message each:

- **Key exchange.** Each side sends, as its last TLS record, ``HELLO_MAGIC`` and a fresh
  X25519 public key. The hellos travel inside the authenticated TLS channel, so only
  the two certified ends know them. Each direction's key is HKDF-SHA256 of the shared
  secret, salted with both public keys (the dialer's first), 32 bytes each
  (``derive_keys``). After its hello a side sends nothing more in TLS; the peer reads
  exactly that one record and takes every later byte of that direction as frames.
- **A frame** is a big-endian u32, the ciphertext's length, and the ciphertext: a
  piece of the link's byte stream (a whole message, or a block's header or body)
  under AES-256-GCM, nonce = 4 zero bytes and the frame's 8-byte count in
  this direction (keys differ per direction, so no nonce repeats). A length past the
  link's largest message (plus the tag) closes the link before anything is
  allocated; a frame that does not authenticate closes it too.
- **Key use.** A direction stops at ``KEY_LIMIT`` bytes (64 GiB; AES-GCM's bound on
  data under one key is far above): the link closes with that reason and the driver
  dials a fresh one with fresh keys.

``FrameReader`` and ``FrameWriter`` are sans-I/O (bytes in, plaintext out), used by
``node.tls_layer``; the receiver knows each frame's length from its header, so it can
ask the kernel to wake it once the frame's rest is there (``wants``).

**No copies a frame does not need** (round 52). The frames are a byte stream to the link,
so a message may go in several frames: the link writes a chunk block's small header and
its body as two, and the receiver, once the header's frame is open and the link has
placed the body, opens the body's frame straight into the chunk's slice (``into``): no
join of header and body before sealing, no copy of the plaintext after opening. A frame
that fails authentication may leave unverified bytes in that slice; the link closes at
once, and a slice whose message never completed is never taken (as when a link dies
mid-message). Each frame's ciphertext goes into one buffer a reader keeps (up to
``REUSE_BYTES``), not a fresh, zeroed one per frame.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.errors import ProtocolError

ALPN = "patchswarm-frames/1"
HELLO_MAGIC = b"PSF1"
HELLO_BYTES = len(HELLO_MAGIC) + 32
HEADER = struct.Struct(">I")
TAG = 16
KEY_LIMIT = 64 << 30  # bytes of plaintext one direction's key seals at most
SEAL_INTO = 16 * 1024  # a part this large is sealed into an unzeroed buffer (FrameWriter.seal)
REUSE_BYTES = (1 << 20) + TAG  # a reader keeps buffers up to this size; larger: one per frame
AHEAD = 4096  # a read may take this much past the frame being received (FrameReader)
_INFO = b"patchswarm frames v1"


class KeyShare:
    """One side's ephemeral X25519 key for one connection."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes_raw()

    def hello(self) -> bytes:
        return HELLO_MAGIC + self.public

    def keys(self, peer_hello: bytes, *, dialer: bool) -> tuple[bytes, bytes]:
        """(key to send with, key to receive with) from the peer's hello."""
        if len(peer_hello) != HELLO_BYTES or not peer_hello.startswith(HELLO_MAGIC):
            raise ProtocolError("frames: the peer's key hello is malformed")
        peer = peer_hello[len(HELLO_MAGIC):]
        try:
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(peer))
        except ValueError as exc:  # an all-zero result: a low-order point
            raise ProtocolError(f"frames: the peer's key is unusable ({exc})") from None
        dialer_pub, server_pub = (self.public, peer) if dialer else (peer, self.public)
        to_server, to_dialer = derive_keys(shared, dialer_pub, server_pub)
        return (to_server, to_dialer) if dialer else (to_dialer, to_server)


def derive_keys(shared: bytes, dialer_pub: bytes, server_pub: bytes) -> tuple[bytes, bytes]:
    """(dialer-to-server key, server-to-dialer key)."""
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=dialer_pub + server_pub,
               info=_INFO).derive(shared)
    return okm[:32], okm[32:]


def _nonce(n: int) -> bytes:
    return b"\0\0\0\0" + n.to_bytes(8, "big")


class FrameWriter:
    """Seals messages into frames."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.count = 0
        self.sealed = 0  # plaintext bytes under this key

    def seal(self, data: bytes | bytearray | memoryview) -> list:
        """The frame for ``data``: its header and its ciphertext, bytes-like objects (the
        ciphertext of a large part a numpy buffer of its own) to write in order."""
        self.sealed += len(data)
        if self.sealed > KEY_LIMIT:
            raise ProtocolError(f"frames: this key sealed {KEY_LIMIT >> 30} GiB; "
                                "a new link gets fresh keys")
        if len(data) >= SEAL_INTO:
            # a fresh buffer the cipher writes: ``encrypt`` would zero its output first, a
            # pass over the block that costs as much as a tenth of the cipher's
            ct: bytes | np.ndarray = np.empty(len(data) + TAG, dtype=np.uint8)
            self._aead.encrypt_into(_nonce(self.count), data, None, ct)
        else:
            ct = self._aead.encrypt(_nonce(self.count), data, None)
        self.count += 1
        return [HEADER.pack(len(ct)), ct]

    def seal_parts(self, parts: list) -> list:
        """Each non-empty part in a frame of its own (a link message's header and body:
        no join of the two; the receiver sees one stream)."""
        out: list = []
        for part in parts:
            if len(part):
                out += self.seal(part)
        return out


class FrameReader:
    """Opens frames from a byte stream fed in pieces of any size, the way a buffered
    protocol is fed: ``get_buffer()`` says where the next bytes go, ``took(n)`` that
    ``n`` came. Each whole frame's plaintext goes where ``into(n)`` says, when it offers a
    buffer of at least the frame's ``n`` plaintext bytes (opened straight into its first
    ``n``, then ``wrote(n)``), else to ``deliver`` (a view, valid only during the call).
    ``ProtocolError`` on a frame too large (before any allocation), one that does not
    authenticate (nothing is said written or delivered then), or a key used up.

    **Reads past a frame's end** (round 55). The buffer offered always has ``AHEAD`` bytes
    of room past what the frame being received still wants, so one read takes the rest of
    a frame and what follows it: the next frame's header, and small frames (a block's
    header message, haves, requests) whole. Read exactly, every frame cost a read of its
    4-byte header and one of its body: a system call, a call into the layer and a change
    of ``SO_RCVLOWAT`` each (on the WAN, 44 % of a node's reads were 4-byte headers). What
    lies past a frame's end (at most ``AHEAD`` bytes) is copied to where it belongs before
    the frame is opened (so a frame opened straight into its consumer's buffer never has
    its bytes moved), then taken as if just read."""

    def __init__(self, key: bytes, max_plain: int,
                 deliver: Callable[[memoryview], None], *,
                 into: Callable[[int], memoryview | None] | None = None,
                 wrote: Callable[[int], None] | None = None) -> None:
        if (into is None) is not (wrote is None):
            raise ValueError("into and wrote come together")
        self._aead = AESGCM(key)
        self.max_cipher = max_plain + TAG
        self.deliver, self.into, self.wrote = deliver, into, wrote
        self.count = 0
        self.opened = 0
        self.direct = 0  # frames opened straight into ``into``'s buffer
        self._head = bytearray(HEADER.size + AHEAD)
        self._hview = memoryview(self._head)
        self._hgot = 0
        self._size = 0  # the frame being received (0: a header is)
        self._fview = memoryview(b"")  # its ciphertext's buffer, ``AHEAD`` bytes longer
        self._fgot = 0
        self._cipher = _Kept()
        self._plain = _Kept()

    def get_buffer(self) -> memoryview:
        if self._size:
            return self._fview[self._fgot:]
        return self._hview[self._hgot:]

    def wants(self) -> int:
        """Bytes still to come for the frame being received (0 at a header)."""
        return max(self._size - self._fgot, 0)

    def took(self, n: int) -> None:
        if self._size:
            self._fgot += n
        else:
            self._hgot += n
        while True:
            if not self._size:
                if self._hgot < HEADER.size:
                    return
                self._start_frame()
            if self._fgot < self._size:
                return
            # past the frame's end: the next bytes' own place, before the frame is opened
            size, got = self._size, self._fgot
            self._size = self._fgot = 0
            if got > size:
                self._hview[:got - size] = self._fview[size:got]
                self._hgot = got - size
            self._open(self._fview[:size])

    def _start_frame(self) -> None:
        (size,) = HEADER.unpack_from(self._head)
        if size < TAG or size > self.max_cipher:
            raise ProtocolError(f"frames: a frame of {size} bytes, outside 16.."
                                f"{self.max_cipher}")
        extra = self._hgot - HEADER.size
        self._fview = self._cipher.view(size + AHEAD)
        if extra:
            self._fview[:extra] = self._hview[HEADER.size:self._hgot]
        self._size, self._fgot, self._hgot = size, extra, 0

    def _open(self, frame: memoryview) -> None:
        plain = len(frame) - TAG
        self.opened += plain
        if self.opened > KEY_LIMIT:
            raise ProtocolError(f"frames: the peer's key sealed over {KEY_LIMIT >> 30} GiB")
        dest = self.into(plain) if self.into is not None and plain else None
        direct = dest is not None and len(dest) >= plain
        out = dest[:plain] if direct else self._plain.view(plain)  # type: ignore[index]
        try:
            self._aead.decrypt_into(_nonce(self.count), frame, None, out)
        except InvalidTag:
            raise ProtocolError("frames: a frame failed authentication") from None
        self.count += 1
        if direct:
            self.direct += 1
            self.wrote(plain)  # type: ignore[misc]
        else:
            self.deliver(out)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take ``data`` as if it had been read into the buffers in turn."""
        view, i = memoryview(data), 0
        while i < len(view):
            buf = self.get_buffer()
            k = min(len(buf), len(view) - i)
            buf[:k] = view[i:i + k]
            i += k
            self.took(k)


class _Kept:
    """A buffer a reader keeps for frames: grown to fit, up to ``REUSE_BYTES``; a larger
    frame gets one of its own."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray(0)

    def view(self, n: int) -> memoryview:
        if n > REUSE_BYTES:
            return memoryview(bytearray(n))
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


def random_key() -> bytes:
    """A key for tests and benchmarks."""
    return os.urandom(32)
