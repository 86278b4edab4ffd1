"""The link's own TLS layer: TLS 1.3 over memory BIOs, then the data plane's frames
(round 51).

A link used to run on the event loop's TLS transport (uvloop's, or asyncio's). At the
rate of a WAN uplink (100 Mbit/s) a receiver spent ~6 CPU-s per GB there, where the
kernel's own receive path costs 0.9 (``benchmarks/bench_link_rx.py``, docs/benchmarks.md
round 51): TLS's 16 KiB records through Python's ``ssl`` cost 1.8 of it, and the link's
wake-ups (a mark a record short of each message's end, because that layer's held
ciphertext cannot be seen) most of the rest. ``TlsProtocol`` is the protocol of a plain
TCP transport:

- it runs the TLS 1.3 handshake (mutual, the fleet's CA: the contexts of
  ``swarm.trust.ca``), bounded by ``handshake_timeout_s``; nothing else is read from the
  peer before it succeeds, and a handshake that fails or runs late aborts the
  connection without the link's protocol ever seeing it;
- where both ends offer ALPN ``patchswarm-frames/1``, it exchanges keys inside the TLS
  channel and from then on carries the link's messages in AES-256-GCM frames
  (``node.frames``): a message in one, a chunk block's header and body in two (round
  52), the body's opened straight into the slice the link placed it in; the kernel is
  asked to wake the link once the frame's rest is there (``SO_RCVLOWAT``), exactly,
  since the frame's length is known. A peer of an older release offers no ALPN and gets
  plain TLS;
- under plain TLS it decrypts records straight into the link's buffers and follows the
  stream's record headers (``RecordTracker``), so the link's marks count exactly the
  ciphertext it holds (OpenSSL pulls a record's first bytes out of the BIO, so the
  BIO's own count does not say).

The link's protocol gets a ``TlsTransport``, a transport of plaintext, and sees
``connection_made`` once the handshake (and the key exchange) is done, as it did on the
loop's TLS transport. When it pauses reading, the socket pauses; what was read stays
(in the BIO, or as the frame being received), so its flow control holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import Callable
from typing import Any

from node.frames import ALPN, HELLO_BYTES, FrameReader, FrameWriter, KeyShare
from swarm.errors import ProtocolError

# ciphertext read from the socket at once: a wake-up's worth at 1 Gbit/s and more
CIPHER_BUFFER = 256 * 1024
RECORD_MAX = 16384 + 256 + 5  # a TLS 1.3 record's ciphertext at most (RFC 8446 5.2)
LOWAT_MIN = 16 * 1024  # a smaller mark is not worth its system calls: 1 (wake at once)
RCVBUF_TTL_S = 0.25  # SO_RCVBUF is read again at most this often (TlsProtocol._frame_mark)
# process-wide: wake-up marks set (by node.link under TLS records, here in frames), and
# marks node.link's guard dropped (/status transport.read_marks)
MARKS = {"set": 0, "expired": 0}
_SSL_INFO = ("ssl_object", "peercert", "cipher", "compression", "sslcontext")


def wake_mark(rest: int, most: int, rcvbuf: int) -> int:
    """The receive low-water mark for ``rest`` bytes still coming: at most ``most`` and a
    quarter of the receive buffer (Linux may clamp TCP's window to a larger mark); 1 (wake
    at once) where that is under ``LOWAT_MIN``."""
    want = min(rest, most, rcvbuf // 4)
    return want if want >= LOWAT_MIN else 1


def mark_socket(transport: Any) -> socket.socket | None:
    """A socket object of our own on a duplicate of ``transport``'s descriptor, to set its
    options with: uvloop's pseudo socket builds a new socket object for every option it
    sets or reads, ~4x the system call itself (1.5 against 0.35 us here, more with the
    caches cold), and a frame takes one to three. Options belong to the socket, so the
    duplicate's are the connection's. The owner closes it with the connection (it holds
    no more than a descriptor: the connection's FIN waits only for the transport's
    close). None where the transport has no socket or the descriptor cannot be copied."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        fd = os.dup(sock.fileno())
    except (OSError, AttributeError, ValueError):
        return None
    try:
        return socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None


def set_mark(sock: Any, want: int, now: int) -> int:
    """Set the socket's ``SO_RCVLOWAT`` to ``want`` unless it is ``now`` already (counted
    in ``MARKS``); returns ``want``. ``OSError`` where the platform has none."""
    if want != now:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        if want > 1:
            MARKS["set"] += 1
    return want


class RecordTracker:
    """Follows the TLS record headers of a byte stream fed in pieces of any size: a
    record is a 5-byte header (type, version, length) and ``length`` bytes. ``partial``:
    bytes of the trailing record not yet whole (its header's included). Garbage only
    makes it wrong, never slow (OpenSSL rejects the stream then anyway)."""

    __slots__ = ("head", "need", "partial")

    def __init__(self) -> None:
        self.partial = 0  # bytes of the record being received so far
        self.need = 0  # bytes that record still needs (0: at a header)
        self.head = bytearray()  # its header's bytes so far

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.need:
                step = min(self.need, n - i)
                self.need -= step
                self.partial += step
                i += step
                if not self.need:
                    self.partial = 0  # the record is whole: a boundary
                continue
            take = min(5 - len(self.head), n - i)
            self.head += data[i:i + take]
            i += take
            self.partial = len(self.head)
            if len(self.head) == 5:
                self.need = int.from_bytes(self.head[3:5], "big")
                self.head.clear()
                if not self.need:
                    self.partial = 0


class TlsTransport(asyncio.Transport):
    """Plaintext to and from the link's protocol over a ``TlsProtocol``."""

    def __init__(self, layer: TlsProtocol) -> None:
        super().__init__()
        self._layer = layer

    # ------------------------------------------------------------------ reading

    def is_reading(self) -> bool:
        return self._layer.app_reading

    def pause_reading(self) -> None:
        self._layer.pause_app_reading()

    def resume_reading(self) -> None:
        self._layer.resume_app_reading()

    def set_read_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Nothing to set: while the link's protocol pauses, the socket itself pauses."""

    def tls_pending(self) -> int:
        """Ciphertext read from the socket and not yet decrypted: the trailing record's
        part once every whole record was decrypted, else a bound no mark goes past."""
        return self._layer.held()

    @property
    def frames(self) -> bool:
        """The link's messages go in frames (``node.frames``): the layer sets the
        socket's wake-up marks itself, one frame at a time."""
        return self._layer.state == "frames"

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._layer.write_app((data,))

    def writelines(self, list_of_data: Any) -> None:
        self._layer.write_app(list_of_data)

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        raw = self._layer.raw
        return raw.get_write_buffer_size() if raw is not None else 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self._layer.raw is not None:
            self._layer.raw.set_write_buffer_limits(high, low)

    # ------------------------------------------------------------------ the rest

    def is_closing(self) -> bool:
        raw = self._layer.raw
        return self._layer.closing or raw is None or raw.is_closing()

    def close(self) -> None:
        self._layer.close()

    def abort(self) -> None:
        self._layer.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        layer = self._layer
        if name == "frames":
            return self.frames
        if name in _SSL_INFO:
            obj = layer.sslobj
            if name == "ssl_object":
                return obj
            if name == "peercert":
                return obj.getpeercert()
            if name == "cipher":
                return obj.cipher()
            if name == "compression":
                return obj.compression()
            return obj.context
        return layer.raw.get_extra_info(name, default) if layer.raw is not None else default

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._layer.app

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        raise NotImplementedError("a TLS link keeps its protocol")


class TlsProtocol(asyncio.BufferedProtocol):
    """A plain TCP connection's protocol: TLS over memory BIOs, then frames where both
    ends offer them; the link's protocol (``app``) on top. ``handshake_timeout_s``
    bounds the handshake and the key exchange; ``max_message``: the largest plaintext a
    frame may carry; ``lowat``: the most bytes the kernel gathers before it wakes the
    link inside a frame (``SO_RCVLOWAT``; 0: never); ``frames``: offer them (ALPN).
    ``server_hostname``: what a client checks (None: the context's own checks, as the
    links' contexts do, which pin the fleet's CA)."""

    def __init__(self, app: asyncio.BufferedProtocol, context: ssl.SSLContext, *,
                 server_side: bool, handshake_timeout_s: float, max_message: int,
                 lowat: int = 0, frames: bool = True, server_hostname: str | None = None,
                 on_timeout: Callable[[], None] | None = None) -> None:
        self.app = app
        self.server_side = server_side
        self.on_timeout = on_timeout
        self.max_message = max_message
        self.lowat_max = lowat
        if frames:
            context.set_alpn_protocols([ALPN])
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.sslobj = context.wrap_bio(self.incoming, self.outgoing, server_side=server_side,
                                       server_hostname=server_hostname)
        self.handshake_timeout_s = handshake_timeout_s
        self.loop = asyncio.get_running_loop()
        self.raw: Any = None
        self.sock: socket.socket | None = None  # ``mark_socket``'s, while frames are on
        self.transport = TlsTransport(self)
        self.cipher = bytearray(CIPHER_BUFFER)
        self.cview = memoryview(self.cipher)
        # "handshake" -> "hello" (keys: waiting for the peer's) -> "frames"; or -> "tls"
        self.state = "handshake"
        self.share: KeyShare | None = None
        self.writer: FrameWriter | None = None
        self.reader: FrameReader | None = None
        self.mark = 1  # the socket's SO_RCVLOWAT now (frames)
        self.rcvbuf = 0
        self.rcvbuf_at = -RCVBUF_TTL_S  # loop time SO_RCVBUF was read (rcvbuf)
        self.app_reading = True  # the link's protocol takes plaintext
        self.closing = False
        self.eof = False  # the peer's close_notify came
        self.deadline: asyncio.TimerHandle | None = None
        self.resume_handle: asyncio.Handle | None = None
        self.error: BaseException | None = None
        self.records = RecordTracker()  # the record headers of the stream fed to the BIO
        self.settled = True  # every whole record fed in was decrypted and handed on
        # the handshake's end: a result once done, the reason if the connection ended first
        self.handshake_done: asyncio.Future = self.loop.create_future()

    @property
    def handshaken(self) -> bool:
        """The link's protocol has its transport (handshake and key exchange done)."""
        return self.state in ("tls", "frames")

    # ---------------------------------------------------------------- the raw socket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.raw = transport
        self.deadline = self.loop.call_later(self.handshake_timeout_s, self._handshake_expired)
        self._handshake()  # a client's hello goes out now

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.reader is not None:
            return self.reader.get_buffer()
        return self.cview

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        if self.reader is not None:
            try:
                self.reader.took(nbytes)
            except ProtocolError as exc:
                self._fail(exc)
                return
            self._frame_mark()
            return
        data = self.cview[:nbytes]
        self.incoming.write(data)
        self.records.feed(data)
        if self.state == "handshake":
            self._handshake()
        if self.state == "hello":
            self._read_hello()
        if self.state == "tls":
            self._decrypt()

    def eof_received(self) -> bool | None:
        if not self.handshaken:
            return False  # the connection closes; connection_lost says why
        return self.app.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        for h in (self.deadline, self.resume_handle):
            if h is not None:
                h.cancel()
        self.deadline = self.resume_handle = None
        self.closing = True
        self._drop_sock()
        if self.handshaken:
            self.app.connection_lost(exc if exc is not None else self.error)
        elif not self.handshake_done.done():
            why = self.error or exc or ConnectionError("closed during the TLS handshake")
            if not isinstance(why, OSError):  # a malformed key hello: dialers catch OSError
                why = ConnectionError(f"link setup failed: {why}")
            self.handshake_done.set_exception(why)
            self.handshake_done.exception()  # retrieved: a server's failed handshake is no error

    def pause_writing(self) -> None:
        if self.handshaken:
            self.app.pause_writing()

    def resume_writing(self) -> None:
        if self.handshaken:
            self.app.resume_writing()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.abort()

    # ---------------------------------------------------------------- the handshake

    def _handshake(self) -> None:
        try:
            self.sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, ssl.CertificateError) as exc:
            self._flush()  # the alert, if there is one
            self._fail(exc)
            return
        if self.sslobj.selected_alpn_protocol() == ALPN:
            # keys for the frames: our hello is our last TLS record
            self.share = KeyShare()
            self.sslobj.write(self.share.hello())
            self._flush()
            self.state = "hello"
            return
        self._flush()  # a client's Finished
        self._ready("tls")

    def _read_hello(self) -> None:
        """The peer's key hello: exactly one record, the last of its TLS; every byte after
        it in the BIO is already frames."""
        assert self.share is not None
        try:
            hello = self.sslobj.read(HELLO_BYTES)
        except ssl.SSLWantReadError:
            return
        except ssl.SSLError as exc:
            self._fail(exc)
            return
        try:
            if self.sslobj.pending():
                raise ProtocolError("frames: the peer's key hello came with more after it")
            tx, rx = self.share.keys(hello, dialer=not self.server_side)
        except ProtocolError as exc:
            self._fail(exc)
            return
        self.share = None
        self.writer = FrameWriter(tx)
        reader = FrameReader(rx, self.max_message, self._to_app, into=self._app_room,
                             wrote=self._app_wrote)
        after = self.incoming.read()
        self._ready("frames")
        self.reader = reader
        if self.lowat_max > 1:
            self.sock = mark_socket(self.raw)
        if after:
            try:
                reader.feed(after)
            except ProtocolError as exc:
                self._fail(exc)
                return
        self._frame_mark()

    def _ready(self, state: str) -> None:
        self.state = state
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if not self.handshake_done.done():
            self.handshake_done.set_result(None)
        self.app.connection_made(self.transport)

    def _handshake_expired(self) -> None:
        self.deadline = None
        if not self.handshaken:
            if self.on_timeout is not None:
                self.on_timeout()
            self._fail(TimeoutError("TLS handshake timed out"))

    # ---------------------------------------------------------------- plaintext in

    def held(self) -> int:
        """Plain TLS: ciphertext the layer holds that the link's protocol has not had as
        plaintext. Exact (the trailing record's part) once every whole record was
        decrypted and handed on; otherwise everything in the BIO and a record more."""
        if self.settled:
            return self.records.partial
        return self.incoming.pending + RECORD_MAX

    def _decrypt(self) -> None:
        """Plain TLS: decrypt what the BIO holds into the link protocol's buffers, as far
        as it reads: each buffer it offers filled with as many records as fit, then
        handed over. The hand-over after the last whole record comes with ``settled``
        set, so the link's mark then counts exactly what the layer holds."""
        app, obj = self.app, self.sslobj
        self.settled, handed = False, False
        while self.app_reading and not self.closing:
            buf = app.get_buffer(-1)
            size, got = len(buf), 0
            if not size:
                raise RuntimeError("the link protocol offered an empty buffer")
            try:
                while got < size:
                    n = obj.read(size - got, buf[got:])
                    if not n:
                        break
                    got += n
            except ssl.SSLWantReadError:
                self.settled = True  # no whole record is left undecrypted
            except ssl.SSLZeroReturnError:  # the peer's close_notify
                self.eof = True
            except ssl.SSLError as exc:
                if got:
                    app.buffer_updated(got)
                self._fail(exc)
                return
            if got or (self.settled and handed):
                # (nothing more came after a full buffer: the link looks at its mark again,
                # now that the count of what the layer holds is exact)
                app.buffer_updated(got)
                handed = True
            if self.eof:
                if not self.closing and not app.eof_received():
                    self.close()
                return
            if self.settled or got < size:
                return

    def _app_room(self, n: int) -> memoryview | None:
        """Frames: the link protocol's buffer, where it has room for a frame's ``n``
        plaintext bytes whole (a placed block's body: its slice of the chunk)."""
        if self.closing:
            return None
        buf = self.app.get_buffer(-1)
        return buf if len(buf) >= n else None

    def _app_wrote(self, n: int) -> None:
        self.app.buffer_updated(n)

    def _to_app(self, data: memoryview) -> None:
        """Frames: a frame's plaintext into the link protocol's buffers."""
        app, i, n = self.app, 0, len(data)
        while i < n and not self.closing:
            buf = app.get_buffer(-1)
            k = min(len(buf), n - i)
            if not k:
                raise RuntimeError("the link protocol offered an empty buffer")
            buf[:k] = data[i:i + k]
            i += k
            app.buffer_updated(k)

    def _frame_mark(self) -> None:
        """Frames: wake once the frame's rest is there (its length is known, and the peer
        wrote it whole), at most ``lowat`` and a quarter of the receive buffer (a larger
        mark would clamp TCP's window); 1 at a frame's header."""
        if self.sock is None or self.reader is None or self.closing:
            return
        rest = self.reader.wants()
        try:
            if rest and (self.rcvbuf == 0 or rest > self.rcvbuf // 4):
                # the kernel grows the buffer as the connection goes: read it again, at
                # most every RCVBUF_TTL_S (an old, smaller figure only lowers the mark)
                now = self.loop.time()
                if now >= self.rcvbuf_at + RCVBUF_TTL_S:
                    self.rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                    self.rcvbuf_at = now
            self.mark = set_mark(self.sock, wake_mark(rest, self.lowat_max, self.rcvbuf),
                                 self.mark)
        except OSError:
            self._drop_sock()  # not this platform's: a wake-up per read

    def _drop_sock(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def pause_app_reading(self) -> None:
        if self.app_reading:
            self.app_reading = False
            if self.resume_handle is not None:
                self.resume_handle.cancel()
                self.resume_handle = None
            if self.raw is not None and not self.raw.is_closing():
                self.raw.pause_reading()

    def resume_app_reading(self) -> None:
        if not self.app_reading:
            self.app_reading = True
            if self.raw is not None and not self.raw.is_closing():
                self.raw.resume_reading()
            if self.state == "tls" and self.incoming.pending and self.resume_handle is None:
                # records that came before the pause: not from inside the caller's frame
                self.resume_handle = self.loop.call_soon(self._resume_decrypt)

    def _resume_decrypt(self) -> None:
        self.resume_handle = None
        if self.state == "tls":
            self._decrypt()

    # ---------------------------------------------------------------- plaintext out

    def write_app(self, parts: Any) -> None:
        """Seal and send; as a transport's ``write``, nothing once it is closing."""
        if self.closing or not self.handshaken:
            return
        if self.writer is not None:
            try:  # a block's header and body each in a frame: not joined first
                frames = self.writer.seal_parts(parts)
            except ProtocolError as exc:  # this key is used up: a new link gets new keys
                self._fail(exc)
                return
            self.raw.writelines(frames)
            return
        obj = self.sslobj
        try:
            for part in parts:
                if len(part):
                    obj.write(part)
        except ssl.SSLError as exc:  # the session ended under us: a local fault, no peer's
            self._fail(exc)
            return
        self._flush()

    def _flush(self) -> None:
        if self.outgoing.pending and self.raw is not None and not self.raw.is_closing():
            self.raw.write(self.outgoing.read())

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Close after what was written (under plain TLS with close_notify first)."""
        if self.closing:
            return
        self.closing = True
        self._drop_sock()
        if self.state == "tls":
            # our close_notify goes into the BIO; the peer's is not waited for
            with contextlib.suppress(ssl.SSLError):
                self.sslobj.unwrap()
            self._flush()
        if self.raw is not None:
            self.raw.close()

    def abort(self) -> None:
        self.closing = True
        self._drop_sock()
        if self.raw is not None:
            self.raw.abort()
