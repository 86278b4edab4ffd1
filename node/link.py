"""Peer links: length-prefixed messages over mutual TLS on plain TCP, read in batches.

The swarm port's transport (it replaced aiohttp websockets in round 12; the HTTP API
keeps aiohttp). Two reasons, both measured (docs/benchmarks.md, "round 12"):

- **Reads in batches.** On a WAN link a TLS stream arrives a TCP segment at a time
  (a 100 Mbit uplink delivers one every ~0.1 ms) and every segment woke the event
  loop: a read, a TLS read attempt that fails until its record is whole, and the
  Python around them. A receiver spent 21-22 CPU-s per GB at 100 Mbit, ~3x what the
  same bytes cost at 1 Gbit (``benchmarks/bench_link_rx.py``). After a read that drained the
  socket and was not large, a link stops reading for as long as ``READ_BATCH`` (192
  KiB) takes to come in at the rate it has been delivering, 2 ms at least and
  ``read_coalesce_s`` at most (shipped: 2 ms, so a fixed 2 ms hold; round 21 measured
  16 ms on the emulated WAN: -10 % node CPU, +7 % time to all): the kernel gathers the segments meanwhile and
  the next read takes them at once (with TLS the socket itself is paused: the TLS
  layer's read limit drops to one byte while the link holds). The first read after a
  quiet spell is handled at once: a lone control frame is never held; one that arrives
  in the middle of a stream waits at most the hold.
- **Inside a large message, the kernel gathers** (round 47, ``[network] read_lowat_kib``):
  a link in the middle of a message's body sets the socket's receive low-water mark
  (``SO_RCVLOWAT``) to the bytes the message still needs, less what the TLS layer may
  hold of them, at most ``read_lowat`` and a quarter of the receive buffer; the kernel
  wakes the loop once they are there (or earlier when its buffer or the window runs
  short, or on a FIN), without timers and without waiting for bytes that are not
  coming: the peer wrote the message whole. Between messages the mark is 1 and the
  timed hold above applies. A receiver at 100 Mbit/s: 8 wake-ups per 256 KiB block
  instead of ~20, -35 to -45 % CPU per GB (``bench_link_rx.py``, docs/benchmarks.md).
- **No websocket layer.** RFC 6455 makes a client mask (copy and XOR) every frame it
  sends, aiohttp reassembles every message into new bytes, and each message costs
  Python on both sides. Here a message is a 4-byte length and its bytes; a large one
  is decrypted straight into its own buffer, a chunk block into its chunk's buffer
  (``Link.place_with``).

Per connection: the link's own TLS layer (``node.tls_layer``, round 51: TLS 1.3, mutual,
over memory BIOs, then, where both ends offer it, each message one AES-256-GCM frame,
``node.frames``) under ``LinkProtocol``, a buffered protocol; ``tls_layer = "loop"``
puts the event loop's TLS transport there instead (uvloop's where it is installed; the
layer before round 51, kept to measure against). In frames the TLS layer sets the wake-up
marks itself and the link neither marks nor holds. Without TLS (tests, demos on
loopback) a server hands a connection that starts with anything but the preface to
its HTTP protocol (the API may share the swarm port then; with TLS it has its own,
node.config).

Wire, after TLS (or inside the frames): the dialer sends ``PREFACE``, the server answers with it; then
messages, each a big-endian u32 and that many bytes. A u32 with the top bit set is the
last message: the low bits give the length of a UTF-8 reason for closing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from node.tls_layer import LOWAT_MIN as LOWAT_MIN  # a smaller mark is not worth its calls
from node.tls_layer import MARKS, TlsProtocol, set_mark, wake_mark
from swarm.errors import ProtocolError

PREFACE = b"PSL1"
# a dialer's preface for an extra connection of a striped link (a lane,
# swarm.protocol.stripes); the server answers PREFACE either way
LANE_PREFACE = b"PSLN"
HEADER = struct.Struct(">I")
CLOSE_BIT = 0x8000_0000
MAX_REASON = 1024
READ_COALESCE_S = 0.002  # shipped default of [network] read_coalesce_ms: the longest hold
READ_BATCH = 192 * 1024  # bytes a hold lets gather at the link's measured rate
FIRST_HOLD_S = 0.002  # a hold before the rate is measured (and at most at 1 Gbit/s and up)
STREAM_GAP_S = 0.2  # holds further apart than this: a new stream, its rate unknown
LARGE_READ = 64 * 1024  # a read this large found a backlog: read again at once
SMALL_MESSAGE = 16 * 1024  # assembled in the scratch buffer; larger ones get their own
READ_LOWAT = 256 * 1024  # shipped default of [network] read_lowat_kib: bytes the kernel gathers
# before it wakes a link that is inside a large message (SO_RCVLOWAT; 0: off)
# TLS bytes a link may hold undecrypted (a record's ciphertext read in part: 16 KiB of
# plaintext, its header, type and tag), which count toward the message's rest but are no
# longer in the socket: a wake-up mark is set this much below the bytes still to come
TLS_RECORD_SLACK = 16384 + 256 + 512
# a mark not reached this long is dropped to 1: whatever the kernel or a TLS layer does,
# a link never sits on bytes it has (at 100 Mbit/s, 256 KiB take 21 ms)
LOWAT_GUARD_S = 0.1
SCRATCH_BYTES = 64 * 1024
RECV_QUEUE_BYTES = 8 * 1024 * 1024  # received, not yet taken: reading pauses beyond it
CLOSE_WAIT_S = 2.0


class LinkClosed(ConnectionError):
    """The link is closed (by either side, or the connection was lost)."""


class Placed:
    """A message whose payload was written where the link's placer said (``header``: its
    first ``len(header)`` bytes, which the placer saw; ``n``: the payload bytes placed)."""

    __slots__ = ("diverted", "header", "info", "n", "settled")

    def __init__(self, header: bytes, n: int) -> None:
        self.header = header
        self.n = n
        self.diverted = False  # ``Link.divert``: its payload went elsewhere, not placed
        # the link's ``filled`` hook took it as it completed (``Link.place_with``): the
        # placer's state already counts it, and ``info`` is what the hook left for ``recv``
        self.settled = False
        self.info: Any = None

    def __len__(self) -> int:
        return len(self.header) + self.n


class LinkProtocol(asyncio.BufferedProtocol):
    """The framing on top of TLS: messages in, messages out, flow control both ways,
    reads batched (module docstring). On a server it also keeps the guard's count
    (``admit`` / ``release``) and the deadline for the dialer's preface."""

    def __init__(self, max_message: int, *, server_side: bool = False,
                 tls: bool = False, coalesce_s: float = 0.0, lowat: int = 0,
                 on_ready: Callable[[Link], None] | None = None,
                 fallback: Callable[[LinkProtocol, bytes], bool] | None = None,
                 placer: Callable[[bytes, int], memoryview | None] | None = None,
                 place_header: int = 0,
                 admit: Callable[[str], bool] | None = None,
                 release: Callable[[str], None] | None = None,
                 deadline_s: float | None = None,
                 on_deadline: Callable[[], None] | None = None,
                 preface: bytes = PREFACE) -> None:
        self.max_message = max_message
        self.preface = preface  # what a dialer sends (PREFACE, or LANE_PREFACE for a lane)
        self.lane = False  # server: the dialer opened this connection as a lane
        self.server_side = server_side
        self.tls = tls
        self.coalesce_s = coalesce_s
        self.lowat_max = lowat  # SO_RCVLOWAT inside a large message (0: never)
        self.lowat = 1  # the socket's mark now (1: the kernel's default)
        self.rcvbuf = 0  # the socket's receive buffer as of the message's start
        self.lowat_guard: asyncio.TimerHandle | None = None
        self.sock: Any = None
        self.on_ready = on_ready
        self.fallback = fallback  # (self, first bytes) -> True if another protocol took them
        # (first place_header bytes of a large message, bytes after them) -> where those
        # bytes go, or None (a buffer of its own); the message then comes out as ``Placed``
        self.placer = placer
        self.place_header = place_header
        # (Link.place_with) a placed message complete: settle it now (True), or leave it
        # to whoever takes it from the queue; and which queued messages leave the
        # placer's state alone. The placer is asked while no queued message is
        # ``unsettled``: every one before is settled or neutral.
        self.filled: Callable[[Placed], bool] | None = None
        self.neutral: Callable[[bytes | bytearray], bool] | None = None
        self.unsettled = 0
        self.admit, self.release = admit, release
        self.deadline_s, self.on_deadline = deadline_s, on_deadline
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.ip = "?"
        self.admitted = admit is None
        self.deadline: asyncio.TimerHandle | None = None
        self.link = Link(self)
        self.scratch = bytearray(SCRATCH_BYTES)
        self.sview = memoryview(self.scratch)
        self.sfill = 0
        self.offered = 0  # length of the buffer the last get_buffer handed out
        self.body: memoryview | None = None
        self.body_obj: bytearray | Placed | None = None
        self.bpos = 0
        self.preface_seen = False
        self.queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.held_full = False  # reading paused: the receive queue is full
        self.held_batch: asyncio.TimerHandle | None = None  # reading paused to gather a batch
        self.rx_bytes = 0  # bytes read since the last hold began
        self.hold_at: float | None = None  # when the last hold began
        self.rx_rate: float | None = None  # bytes/s the link delivers while streaming (EWMA)
        self.reading = True
        self.waiter: asyncio.Future | None = None
        self.write_paused = False
        self.drainers: list[asyncio.Future] = []
        self.closed = False
        self.handed_over = False
        self.reason = ""
        self.lost = self.loop.create_future()
        self.ready = self.loop.create_future()

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self.ip = peer[0] if peer else "?"
        if self.admit is not None:
            if not self.admit(self.ip):
                self.closed = True
                self.reason = "refused: too many connections"
                transport.abort()
                return
            self.admitted = True
        self.transport = transport
        if getattr(transport, "frames", False):
            # a frame is a message: the TLS layer wakes the link once it is all there
            # (node.tls_layer), so no marks and no holds of the link's own
            self.lowat_max, self.coalesce_s = 0, 0.0
        if self.lowat_max > 1:
            self.sock = transport.get_extra_info("socket")
            if self.sock is None:
                self.lowat_max = 0
        if self.deadline_s is not None:
            self.deadline = self.loop.call_later(self.deadline_s, self._expire)
        if not self.server_side:  # a server answers the dialer's preface (so it can hand
            transport.write(self.preface)  # type: ignore[attr-defined]  # anything else to HTTP)

    def _expire(self) -> None:
        self.deadline = None
        t = self.transport
        if t is not None and not t.is_closing() and (self.handed_over or not self.preface_seen):
            if self.on_deadline is not None:
                self.on_deadline()
            self.reason = "no link preface in time"
            t.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        buf = self.body[self.bpos:] if self.body is not None else self.sview[self.sfill:]
        self.offered = len(buf)
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.rx_bytes += nbytes
        if self.body is not None:
            self.bpos += nbytes
            if self.bpos == len(self.body):
                msg = self.body_obj
                self.body = self.body_obj = None
                self.rcvbuf = 0
                if (isinstance(msg, Placed) and not msg.diverted and self.filled is not None
                        and not self.closed):
                    try:
                        msg.settled = self.filled(msg)
                    except ProtocolError as exc:
                        self._fail(str(exc))
                        return
                self._deliver(msg)  # type: ignore[arg-type]
        else:
            self.sfill += nbytes
            try:
                self._parse()
            except ProtocolError as exc:
                self._fail(str(exc))
                return
        if self.lowat_max > 1 and self._gather():
            return
        # The read drained what was there and was not large: data trickles in. Hold the
        # socket for coalesce_s so the next read takes what gathered meanwhile at once.
        if (self.coalesce_s > 0 and nbytes < self.offered and nbytes < LARGE_READ
                and self.held_batch is None and not self.closed):
            self.held_batch = self.loop.call_later(self._hold_s(), self._batch_done)
            self._update_reading()

    def _gather(self) -> bool:
        """Inside a large message, let the kernel gather the bytes before it wakes the
        link: the socket's receive low-water mark (``SO_RCVLOWAT``) becomes the bytes the
        message still needs (less what the TLS layer may hold of them), at most
        ``lowat_max``; outside one, or near its end, it is 1 again. Unlike a timed hold
        this cannot wait for bytes that will never come (the peer wrote the message
        whole: its rest is on its way), the kernel wakes the link early when its
        buffer or the receive window runs short (``tcp_epollin_ready``), and a FIN or an
        error wakes it at once. True while a mark above 1 is set (no timed hold then)."""
        want = 1
        try:
            if self.body is not None and not self.closed and self.reading:
                if self.rcvbuf == 0:  # once a message (the kernel grows it as it goes)
                    self.rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                want = wake_mark(len(self.body) - self.bpos - self._tls_held(),
                                 self.lowat_max, self.rcvbuf)
            self.lowat = set_mark(self.sock, want, self.lowat)
        except (OSError, AttributeError):
            self.lowat_max, self.lowat = 0, 1  # not this platform's: timed holds only
            return False
        if self.lowat_guard is not None:
            self.lowat_guard.cancel()
            self.lowat_guard = None
        if want > 1:
            self.lowat_guard = self.loop.call_later(LOWAT_GUARD_S, self._mark_expired)
        return want > 1

    def _tls_held(self) -> int:
        """Ciphertext of the message's rest that the TLS layer holds already: exact under
        the link's own layer (``node.tls_layer``), a record's worth under the loop's."""
        if not self.tls:
            return 0
        pending = getattr(self.transport, "tls_pending", None)
        return pending() if pending is not None else TLS_RECORD_SLACK

    def _mark_expired(self) -> None:
        """The mark was not reached in ``LOWAT_GUARD_S``: wake on any byte again (a slow
        flow; the next read sets a mark for what is left)."""
        self.lowat_guard = None
        if self.lowat > 1 and not self.closed:
            MARKS["expired"] += 1
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                self.lowat = 1
            except (OSError, AttributeError):
                self.lowat_max = 0

    def _hold_s(self) -> float:
        """How long this hold lasts: as long as ``READ_BATCH`` bytes take to come in at
        the rate the link has been delivering (bytes read between the starts of holds),
        at most ``coalesce_s``. A fixed hold was either short on a thin link (2 ms at 100
        Mbit/s: ~17 wake-ups per 256 KiB block) or, long, held a fast one back (5 ms at
        1 Gbit/s: 62-89 MB/s against 98; ``bench_link_rx.py``, docs/benchmarks.md round 21).
        Bounded in bytes, a hold never asks the kernel to buffer more than a 2 ms hold at
        1 Gbit/s did (250 KB): a cap above 2 ms lets a thin link batch and keeps a fast
        one at its 2 ms floor (100 Mbit/s: 16 ms with a cap of 16)."""
        now = self.loop.time()
        last, self.hold_at = self.hold_at, now
        n, self.rx_bytes = self.rx_bytes, 0
        if last is None or now - last > STREAM_GAP_S:
            self.rx_rate = None  # a new stream: its rate is not known yet
        elif now > last:
            r = n / (now - last)
            self.rx_rate = r if self.rx_rate is None else 0.5 * self.rx_rate + 0.5 * r
        if not self.rx_rate:
            return min(self.coalesce_s, FIRST_HOLD_S)
        return min(self.coalesce_s, max(FIRST_HOLD_S, READ_BATCH / self.rx_rate))

    def _batch_done(self) -> None:
        self.held_batch = None
        self._update_reading()

    def _update_reading(self) -> None:
        t = self.transport
        want = self.held_batch is None and not self.held_full
        if t is None or want == self.reading or self.handed_over or t.is_closing():
            return
        self.reading = want
        if want:
            if self.tls:  # the TLS layer reads the socket on its own limits again
                t.set_read_buffer_limits()
            t.resume_reading()
        else:
            t.pause_reading()
            if self.tls and self.held_full is False:
                # the TLS layer keeps reading the socket into its buffer while we hold,
                # up to its limit: one byte pauses the socket itself (uvloop, asyncio)
                t.set_read_buffer_limits(high=1, low=0)

    def _parse(self) -> None:
        buf, pos, fill = self.scratch, 0, self.sfill
        if not self.preface_seen:
            if fill < len(PREFACE) and any(x.startswith(bytes(buf[:fill]))
                                           for x in (PREFACE, LANE_PREFACE, b"HTTP", b"GET ")):
                return  # wait for four bytes to judge them
            if self.server_side and bytes(buf[:len(PREFACE)]) == LANE_PREFACE:
                self.lane = True
            elif bytes(buf[:len(PREFACE)]) != PREFACE:
                if self.fallback is not None and self.fallback(self, bytes(buf[:fill])):
                    self.closed = self.handed_over = True
                    return
                if bytes(buf[:4]) in (b"HTTP", b"GET "):
                    raise ProtocolError(
                        "the peer speaks HTTP, not the link protocol: a patchswarm release "
                        "from before peer links (websockets)? every node and the trainer must "
                        "run the same release")
                raise ProtocolError("not a patchswarm peer (no link preface)")
            self.preface_seen = True
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            if self.server_side:
                self.transport.write(PREFACE)
            pos = len(PREFACE)
            if not self.ready.done():
                self.ready.set_result(None)
            if self.on_ready is not None:
                self.on_ready(self.link)
        while fill - pos >= HEADER.size and not self.closed:
            (word,) = HEADER.unpack_from(buf, pos)
            n = word & ~CLOSE_BIT
            closing = bool(word & CLOSE_BIT)
            if n > (MAX_REASON if closing else self.max_message):
                raise ProtocolError(f"message of {n} bytes, over the limit")
            avail = fill - pos - HEADER.size
            start = pos + HEADER.size
            if avail >= n:
                data = bytes(buf[start:start + n])
                pos = start + n
                if closing:
                    self._peer_closed(data)
                else:
                    self._deliver(data)
                continue
            if n <= SMALL_MESSAGE or closing:
                break  # wait for the rest in the scratch buffer
            if self.placer is not None and not self.unsettled and n > self.place_header:
                # every earlier message was taken, settled or neutral: the placer's
                # state is current
                if avail < self.place_header:
                    break  # wait for the header in the scratch buffer
                hl = self.place_header
                header = bytes(buf[start:start + hl])
                dest = self.placer(header, n - hl)
                if dest is not None:
                    if len(dest) != n - hl:
                        raise ValueError(f"placer gave {len(dest)} bytes for {n - hl}")
                    dest[:avail - hl] = buf[start + hl:fill]
                    self.body_obj, self.body, self.bpos = Placed(header, n - hl), dest, avail - hl
                    pos = fill
                    break
            body = bytearray(n)
            body[:avail] = buf[start:fill]
            self.body_obj, self.body, self.bpos = body, memoryview(body), avail
            pos = fill
            break
        if pos:
            rest = fill - pos
            if rest:
                buf[:rest] = buf[pos:fill]
            self.sfill = rest

    def _counts(self, msg: bytes | bytearray | Placed) -> bool:
        """Whether ``msg``, while queued, keeps the placer from being asked."""
        if isinstance(msg, Placed):
            return not msg.settled
        return self.neutral is None or not self.neutral(msg)

    def _deliver(self, msg: bytes | bytearray | Placed) -> None:
        self.queue.append(msg)
        self.queued_bytes += len(msg)
        if self._counts(msg):
            self.unsettled += 1
        if self.queued_bytes > RECV_QUEUE_BYTES and not self.held_full:
            self.held_full = True
            self._update_reading()
        self._wake()

    def _taken(self, msg: bytes | bytearray | Placed) -> None:
        self.queued_bytes -= len(msg)
        if self._counts(msg):
            self.unsettled -= 1
        if self.held_full and self.queued_bytes <= RECV_QUEUE_BYTES // 2 and not self.closed:
            self.held_full = False
            self._update_reading()

    def _wake(self) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _peer_closed(self, reason: bytes) -> None:
        self.reason = "closed by peer" + (
            f": {reason.decode('utf-8', 'replace')}" if reason else "")
        self.closed = True
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _fail(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
        self.closed = True
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        for h in (self.held_batch, self.deadline, self.lowat_guard):
            if h is not None:
                h.cancel()
        self.held_batch = self.deadline = self.lowat_guard = None
        if self.release is not None:
            self.release(self.ip)
        if not self.reason:
            self.reason = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
        self.closed = True
        self._wake()
        for d in self.drainers:
            if not d.done():
                d.set_exception(LinkClosed(self.reason))
        self.drainers.clear()
        if not self.ready.done():
            self.ready.set_exception(LinkClosed(self.reason))
            self.ready.exception()  # retrieved: a dial that timed out does not log it
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for d in self.drainers:
            if not d.done():
                d.set_result(None)
        self.drainers.clear()


class Link:
    """One peer connection as the driver uses it: ``send``, ``recv``, ``close``."""

    def __init__(self, proto: LinkProtocol) -> None:
        self._p = proto

    @property
    def reason(self) -> str:
        """Why the link closed ("" while it is open)."""
        return self._p.reason if self._p.closed else ""

    @property
    def closed(self) -> bool:
        return self._p.closed

    @property
    def is_lane(self) -> bool:
        """The dialer opened this connection as a lane of a striped link (server side)."""
        return self._p.lane

    @property
    def writable(self) -> bool:
        """Whether a message written now goes out without waiting for the socket to drain."""
        p = self._p
        return not p.write_paused and not p.closed

    def buffered(self) -> int:
        """Bytes written and not yet handed to the socket (the transport's buffer)."""
        t = self._p.transport
        return t.get_write_buffer_size() if t is not None else 0

    def drained(self) -> asyncio.Future:
        """A future done once the link takes writes again (at once if it does now); it
        fails with ``LinkClosed`` if the link closes first."""
        p = self._p
        fut = asyncio.get_running_loop().create_future()
        if p.closed:
            fut.set_exception(LinkClosed(p.reason or "link closed"))
        elif not p.write_paused:
            fut.set_result(None)
        else:
            p.drainers.append(fut)
        return fut

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        t = self._p.transport
        return t.get_extra_info(name, default) if t is not None else default

    def place_with(self, placer: Callable[[bytes, int], memoryview | None],
                   header_len: int, *, filled: Callable[[Placed], bool] | None = None,
                   neutral: Callable[[bytes | bytearray], bool] | None = None) -> None:
        """From now on, a large message's first ``header_len`` bytes go to ``placer``
        with the count of bytes after them; where it answers with a buffer of that size,
        those bytes are written straight there (no message buffer, no copy) and the
        message comes out of ``recv`` as ``Placed``. A ``ProtocolError`` from the placer
        closes the link with its text as the reason.

        The placer is asked only when its state counts every earlier message. Without
        ``filled`` and ``neutral`` that is when every earlier message was taken by
        ``recv``. ``filled(placed)`` runs as a placed message completes, before it is
        queued: True settles it there (the placer's state has taken it; ``placed.info``
        carries what the taker needs). ``neutral(message)`` says that a queued message
        of another kind leaves the placer's state alone (a control frame). A reader that
        lags a message or two behind the socket then still gets its blocks placed: with
        a 2 ms read hold, most blocks arrive while the one before still waits in the
        queue, and each unplaced one cost a zeroed allocation and two copies."""
        p = self._p
        p.placer = placer
        p.place_header = header_len
        p.filled = filled
        p.neutral = neutral
        p.unsettled = sum(map(p._counts, p.queue))  # what is queued already, by the new rule

    def placing(self) -> bytes | None:
        """The header of the placed message being received now, if one is."""
        obj = self._p.body_obj
        return obj.header if isinstance(obj, Placed) else None

    def divert(self) -> bool:
        """The placed message being received now: write the rest of it into a buffer of
        its own, not where the placer said, and mark it ``diverted`` (a striped block
        stuck on a lane in loss recovery, asked for again on another: the chunk may then
        be whole and handed on while this one is still arriving, and nothing may write
        into its buffer after that). False if no placed message is being received."""
        p = self._p
        if not isinstance(p.body_obj, Placed) or p.body is None:
            return False
        p.body_obj.diverted = True
        p.body = memoryview(bytearray(len(p.body)))
        return True

    async def recv(self) -> bytes | bytearray | Placed | None:
        """The next message, or None once the link closed (``reason`` says why)."""
        p = self._p
        while not p.queue:
            if p.closed:
                return None
            p.waiter = asyncio.get_running_loop().create_future()
            await p.waiter
        msg = p.queue.popleft()
        p._taken(msg)
        return msg

    async def send(self, *parts: bytes | bytearray | memoryview) -> int:
        """Send one message made of ``parts``; waits while the socket is backed up.
        Returns the message's length (its 4-byte header not counted)."""
        n = self.send_nowait(*parts)
        if self._p.write_paused:
            await self.drained()
        return n

    def send_nowait(self, *parts: bytes | bytearray | memoryview) -> int:
        """Write one message made of ``parts`` without waiting for the socket (``drained``
        says when it takes more); its length, as ``send``."""
        p = self._p
        if p.closed or p.transport is None or p.transport.is_closing():
            raise LinkClosed(p.reason or "link closed")
        n = sum(len(x) for x in parts)
        if n > p.max_message:
            raise ValueError(f"message of {n} bytes, over the link's limit")
        if n <= SMALL_MESSAGE or (len(parts) == 1 and not isinstance(parts[0], memoryview)):
            p.transport.write(b"".join((HEADER.pack(n), *parts)))
        else:
            # the small leading parts (a block's header) with the length, the large ones as
            # they are: no copy of a chunk block into a new message (TLS writes each piece
            # as its own records; without TLS one writev)
            head = [HEADER.pack(n)]
            rest = list(parts)
            while rest and len(rest[0]) <= 64:
                head.append(bytes(rest.pop(0)))
            p.transport.writelines([b"".join(head), *rest])
        return n

    async def close(self, reason: str = "") -> None:
        """Tell the peer why (best effort), close, and wait (bounded) until it is closed."""
        p = self._p
        t = p.transport
        if t is not None and not t.is_closing():
            msg = reason.encode("utf-8", "replace")[:MAX_REASON]
            with contextlib.suppress(Exception):
                t.write(HEADER.pack(CLOSE_BIT | len(msg)) + msg)
            if not p.reason:
                p.reason = f"closed here: {reason}" if reason else "closed here"
            p.closed = True
            p._wake()
            t.close()
        if t is not None:
            try:
                await asyncio.wait_for(asyncio.shield(p.lost), CLOSE_WAIT_S)
            except TimeoutError:
                t.abort()

    def abort(self) -> None:
        if self._p.transport is not None:
            self._p.transport.abort()


async def dial(host: str, port: int, *, ssl_context: ssl.SSLContext | None, max_message: int,
               timeout: float, read_coalesce_s: float = READ_COALESCE_S,
               read_lowat: int = READ_LOWAT, lane: bool = False,
               tls_layer: str = "own", frames: bool = True) -> Link:
    """Connect, run the TLS handshake, exchange prefaces; bounded by ``timeout`` as a whole.
    ``lane``: open it as an extra connection of a striped link (``LANE_PREFACE``).
    ``tls_layer``: "own" (``node.tls_layer``, shipped) or "loop" (the event loop's TLS
    transport, the layer before round 51; kept to measure against). ``frames``: offer
    the data plane's frames (``node.frames``; the own layer only).
    Raises ``OSError`` (``ConnectionError``, ``ssl.SSLError``) or ``TimeoutError``."""
    loop = asyncio.get_running_loop()
    proto = LinkProtocol(max_message, tls=ssl_context is not None, coalesce_s=read_coalesce_s,
                         lowat=read_lowat, preface=LANE_PREFACE if lane else PREFACE)
    layer: TlsProtocol | None = None
    if ssl_context is not None and tls_layer == "own":
        layer = TlsProtocol(proto, ssl_context, server_side=False, handshake_timeout_s=timeout,
                            max_message=max_message + HEADER.size, lowat=read_lowat,
                            frames=frames)

    async def connect() -> None:
        if layer is not None:
            await loop.create_connection(lambda: layer, host, port)
            await layer.handshake_done  # raises what ended it (ssl.SSLError, TimeoutError, ...)
        else:
            extra: dict[str, Any] = {}
            if ssl_context is not None:
                extra = {"ssl": ssl_context, "server_hostname": "",
                         "ssl_handshake_timeout": timeout}
            await loop.create_connection(lambda: proto, host, port, **extra)
        await proto.ready

    try:
        await asyncio.wait_for(connect(), timeout)
    except BaseException:
        if proto.transport is not None:
            proto.transport.abort()
        elif layer is not None:
            layer.abort()
        raise
    return proto.link


class LinkServer:
    """Accepts links on ``host:port``: the guard's caps and deadline, TLS, prefaces;
    ``on_link(link)`` runs (as a task) for every peer that sent its preface."""

    def __init__(self, on_link: Callable[[Link], Awaitable[None]], *,
                 ssl_context: ssl.SSLContext | None, max_message: int, guard: Any,
                 http: Callable[[], asyncio.Protocol] | None = None,
                 read_coalesce_s: float = READ_COALESCE_S, read_lowat: int = READ_LOWAT,
                 tls_layer: str = "own", frames: bool = True) -> None:
        self.frames = frames
        self.on_link = on_link
        self.ssl_context = ssl_context
        self.own_tls = ssl_context is not None and tls_layer == "own"  # as dial's
        self.max_message = max_message
        self.guard = guard
        self.http = http if ssl_context is None else None
        self.read_coalesce_s = read_coalesce_s
        self.read_lowat = read_lowat
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = {}
        if self.ssl_context is not None and not self.own_tls:
            # the handshake has the guard's deadline too
            extra = {"ssl": self.ssl_context,
                     "ssl_handshake_timeout": self.guard.upgrade_timeout_s}
        self.server = await loop.create_server(self._tls_connection if self.own_tls
                                               else self._connection, host, port,
                                               reuse_address=True, **extra)

    @property
    def sockets(self) -> Any:
        return self.server.sockets if self.server is not None else ()

    def _connection(self) -> LinkProtocol:
        g = self.guard

        def ready(link: Link) -> None:
            t = asyncio.ensure_future(self.on_link(link))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

        return LinkProtocol(self.max_message, server_side=True, tls=self.ssl_context is not None,
                            coalesce_s=self.read_coalesce_s, lowat=self.read_lowat,
                            on_ready=ready,
                            fallback=self._to_http if self.http is not None else None,
                            admit=g.admit, release=g.release, deadline_s=g.upgrade_timeout_s,
                            on_deadline=g.note_timed_out)

    def _tls_connection(self) -> TlsProtocol:
        """The link's own TLS layer under a link's protocol; the handshake has the
        guard's deadline (and counts as timed out past it), as the preface has."""
        assert self.ssl_context is not None
        g = self.guard
        return TlsProtocol(self._connection(), self.ssl_context, server_side=True,
                           handshake_timeout_s=g.upgrade_timeout_s,
                           max_message=self.max_message + HEADER.size,
                           lowat=self.read_lowat, frames=self.frames,
                           on_timeout=g.note_timed_out)

    def _to_http(self, proto: LinkProtocol, first: bytes) -> bool:
        """No TLS, and the first bytes are not a preface: serve them as HTTP (the API).
        The guard's count and the deadline stay with the connection."""
        t = proto.transport
        if self.http is None or t is None:
            return False
        if proto.held_batch is not None:
            proto.held_batch.cancel()
            proto.held_batch = None
        if not proto.reading:
            t.resume_reading()
            proto.reading = True
        http = _Handover(proto, self.http())
        t.set_protocol(http)
        http.connection_made(t)
        if first:
            http.data_received(first)
        return True

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=2.0)


class _Handover(asyncio.Protocol):
    """An HTTP connection taken over from a link: it ends as the link would have."""

    def __init__(self, link: LinkProtocol, inner: asyncio.Protocol) -> None:
        self.link = link
        self.inner = inner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.connection_lost(exc)  # the guard's count, the deadline
        self.inner.connection_lost(exc)
