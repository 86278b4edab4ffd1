"""Peer links: length-prefixed messages over mutual TLS on plain TCP, read in batches.

The swarm port's transport (it replaced aiohttp websockets in round 12; the HTTP API
keeps aiohttp). Two reasons, both measured (docs/benchmarks.md, "round 12"):

- **Reads in batches.** On a WAN link a TLS stream arrives a TCP segment at a time
  (a 100 Mbit uplink delivers one every ~0.1 ms) and every segment woke the event
  loop: a read, a TLS read attempt that fails until its record is whole, the
  collector running every few wake-ups. A receiving node spent ~20 CPU-s per GB at
  100 Mbit, ~4x what the same bytes cost at 1 Gbit. ``ReadPacer`` sits between the
  TCP transport and TLS: after a read that was not large it stops reading for
  ``read_coalesce_s`` (2 ms), so the kernel gathers the segments meanwhile and the
  next read takes them at once. The first read after a pause is handled at once: a
  lone control frame is never held; one that arrives in the middle of a stream waits
  at most ``read_coalesce_s``.
- **No websocket layer.** RFC 6455 makes a client mask (copy and XOR) every frame it
  sends, aiohttp reassembles every message into new bytes, and each message costs
  Python on both sides. Here a message is a 4-byte length and its bytes; a large one
  is decrypted straight into its own buffer.

Per connection: TCP transport (uvloop) -> ``ReadPacer`` -> ``asyncio.sslproto.SSLProtocol``
(TLS 1.3, mutual; the stdlib's implementation of asyncio's TLS, used here because
uvloop's own cannot be stacked on a protocol of ours) -> ``LinkProtocol``. Without TLS
(tests, demos on loopback) the pacer feeds ``LinkProtocol`` directly, and a server
hands a connection that starts with anything but the preface to its HTTP protocol
(the API may share the swarm port then; with TLS it has its own, node.config).

Wire, after TLS: the dialer sends ``PREFACE``, the server answers with it; then messages, each a big-endian
u32 and that many bytes. A u32 with the top bit set is the last message: the low bits
give the length of a UTF-8 reason for closing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
import struct
from asyncio import sslproto
from collections.abc import Awaitable, Callable
from typing import Any

from swarm.errors import ProtocolError

log = logging.getLogger("patchswarm.link")

PREFACE = b"PSL1"
HEADER = struct.Struct(">I")
CLOSE_BIT = 0x8000_0000
MAX_REASON = 1024
READ_COALESCE_S = 0.002  # shipped default of [network] read_coalesce_ms
LARGE_READ = 64 * 1024  # a read this large found a backlog: read again at once
SMALL_MESSAGE = 16 * 1024  # assembled in the scratch buffer; larger ones get their own
SCRATCH_BYTES = 64 * 1024
RECV_QUEUE_BYTES = 8 * 1024 * 1024  # received, not yet taken: reading pauses beyond it
CLOSE_WAIT_S = 2.0


class LinkClosed(ConnectionError):
    """The link is closed (by either side, or the connection was lost)."""


class _PacedTransport:
    """What TLS (or the link) sees of the TCP transport: its read pauses are combined
    with the pacer's own, everything else is the TCP transport's."""

    def __init__(self, pacer: ReadPacer, raw: asyncio.Transport) -> None:
        self._pacer = pacer
        self._raw = raw

    def pause_reading(self) -> None:
        self._pacer.held_above = True
        self._pacer.update_reading()

    def resume_reading(self) -> None:
        self._pacer.held_above = False
        self._pacer.update_reading()

    def is_reading(self) -> bool:
        return not self._pacer.held_above

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class ReadPacer(asyncio.BufferedProtocol):
    """Reads the TCP socket in batches (module docstring); forwards everything else.

    On the server side it also admits the connection (``admit``: the guard's caps) and
    aborts it if it is not ``established`` within ``deadline_s``.
    """

    def __init__(self, inner: Any, coalesce_s: float, *,
                 admit: Callable[[asyncio.Transport], bool] | None = None,
                 release: Callable[[], None] | None = None,
                 deadline_s: float | None = None,
                 on_deadline: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.coalesce_s = coalesce_s
        self.admit, self.release = admit, release
        self.deadline_s, self.on_deadline = deadline_s, on_deadline
        self.held_above = False  # paused by the layer above (TLS or link flow control)
        self.held_here = False  # paused to gather a batch
        self.reading = True
        self.raw: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.established = False
        self.detached = False
        self.admitted = False
        self.reads = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        raw: asyncio.Transport = transport  # type: ignore[assignment]
        if self.admit is not None and not self.admit(raw):
            raw.abort()
            return
        self.admitted = True
        self.raw = raw
        if self.deadline_s is not None:
            self.deadline = asyncio.get_running_loop().call_later(self.deadline_s, self._expire)
        self.inner.connection_made(_PacedTransport(self, raw))

    def _expire(self) -> None:
        self.deadline = None
        if not self.established and self.raw is not None and not self.raw.is_closing():
            if self.on_deadline is not None:
                self.on_deadline()
            self.raw.abort()

    def set_established(self) -> None:
        self.established = True
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def update_reading(self) -> None:
        want = not (self.held_above or self.held_here)
        raw = self.raw
        if raw is None or self.detached or want == self.reading or raw.is_closing():
            return
        self.reading = want
        if want:
            raw.resume_reading()
        else:
            raw.pause_reading()

    def get_buffer(self, sizehint: int) -> Any:
        return self.inner.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.reads += 1
        self.inner.buffer_updated(nbytes)
        if (self.coalesce_s > 0 and nbytes < LARGE_READ and self.timer is None
                and not self.detached and self.raw is not None):
            self.held_here = True
            self.update_reading()
            self.timer = asyncio.get_running_loop().call_later(self.coalesce_s, self._go_on)

    def _go_on(self) -> None:
        self.timer = None
        self.held_here = False
        self.update_reading()

    def detach(self) -> asyncio.Transport:
        """Give the TCP transport to another protocol (HTTP on a shared port), reading."""
        assert self.raw is not None
        self.detached = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.reading:
            self.raw.resume_reading()
            self.reading = True
        return self.raw

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        for t in (self.timer, self.deadline):
            if t is not None:
                t.cancel()
        self.timer = self.deadline = None
        if self.release is not None:
            self.release()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class LinkProtocol(asyncio.BufferedProtocol):
    """The framing on top of TLS: messages in, messages out, flow control both ways."""

    def __init__(self, max_message: int, *, server_side: bool = False,
                 on_ready: Callable[[Link], None] | None = None,
                 fallback: Callable[[LinkProtocol, bytes], bool] | None = None) -> None:
        self.max_message = max_message
        self.server_side = server_side
        self.on_ready = on_ready
        self.fallback = fallback  # (self, first bytes) -> True if another protocol took them
        self.pacer: ReadPacer | None = None
        self.transport: Any = None
        self.link = Link(self)
        self.scratch = bytearray(SCRATCH_BYTES)
        self.sview = memoryview(self.scratch)
        self.sfill = 0
        self.body: memoryview | None = None
        self.body_obj: bytearray | None = None
        self.bpos = 0
        self.preface_seen = False
        self.queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.read_paused = False
        self.waiter: asyncio.Future | None = None
        self.write_paused = False
        self.drainers: list[asyncio.Future] = []
        self.closed = False
        self.reason = ""
        self.lost = asyncio.get_running_loop().create_future()
        self.ready = asyncio.get_running_loop().create_future()

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.server_side:  # a server answers the dialer's preface (so it can hand
            transport.write(PREFACE)  # anything else to HTTP untouched)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None:
            return self.body[self.bpos:]
        return self.sview[self.sfill:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        if self.body is not None:
            self.bpos += nbytes
            if self.bpos == len(self.body):
                msg = self.body_obj
                self.body = self.body_obj = None
                self._deliver(msg)  # type: ignore[arg-type]
            return
        self.sfill += nbytes
        try:
            self._parse()
        except ProtocolError as exc:
            self._fail(str(exc))

    def _parse(self) -> None:
        buf, pos, fill = self.scratch, 0, self.sfill
        if not self.preface_seen:
            if fill < len(PREFACE) and PREFACE.startswith(bytes(buf[:fill])):
                return  # a preface so far: wait for the rest
            if bytes(buf[:len(PREFACE)]) != PREFACE:
                if self.fallback is not None and self.fallback(self, bytes(buf[:fill])):
                    self.closed = True
                    return
                raise ProtocolError("not a patchswarm peer (no link preface)")
            self.preface_seen = True
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

    def _deliver(self, msg: bytes | bytearray) -> None:
        self.queue.append(msg)
        self.queued_bytes += len(msg)
        if self.queued_bytes > RECV_QUEUE_BYTES and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake()

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

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        t = self._p.transport
        return t.get_extra_info(name, default) if t is not None else default

    def established(self) -> None:
        """The server accepted this peer: its admission deadline no longer applies."""
        if self._p.pacer is not None:
            self._p.pacer.set_established()

    async def recv(self) -> bytes | bytearray | None:
        """The next message, or None once the link closed (``reason`` says why)."""
        p = self._p
        while not p.queue:
            if p.closed:
                return None
            p.waiter = asyncio.get_running_loop().create_future()
            await p.waiter
        msg = p.queue.popleft()
        p.queued_bytes -= len(msg)
        if p.read_paused and p.queued_bytes <= RECV_QUEUE_BYTES // 2 and not p.closed:
            p.read_paused = False
            p.transport.resume_reading()
        return msg

    async def send(self, *parts: bytes | bytearray | memoryview) -> int:
        """Send one message made of ``parts``; waits while the socket is backed up.
        Returns the message's length (its 4-byte header not counted)."""
        p = self._p
        if p.closed or p.transport is None or p.transport.is_closing():
            raise LinkClosed(p.reason or "link closed")
        n = sum(len(x) for x in parts)
        if n > p.max_message:
            raise ValueError(f"message of {n} bytes, over the link's limit")
        p.transport.write(b"".join((HEADER.pack(n), *parts)))
        if p.write_paused:
            d = asyncio.get_running_loop().create_future()
            p.drainers.append(d)
            await d
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


def _stack(loop: asyncio.AbstractEventLoop, proto: LinkProtocol, ctx: ssl.SSLContext | None,
           coalesce_s: float, *, server_side: bool, waiter: asyncio.Future | None = None,
           handshake_timeout: float | None = None, **pacer_kw: Any) -> ReadPacer:
    inner: Any = proto
    if ctx is not None:
        inner = sslproto.SSLProtocol(loop, proto, ctx, waiter, server_side=server_side,
                                     ssl_handshake_timeout=handshake_timeout)
    pacer = ReadPacer(inner, coalesce_s, **pacer_kw)
    proto.pacer = pacer
    return pacer


async def dial(host: str, port: int, *, ssl_context: ssl.SSLContext | None, max_message: int,
               timeout: float, read_coalesce_s: float = READ_COALESCE_S) -> Link:
    """Connect, run the TLS handshake, exchange prefaces; bounded by ``timeout`` as a whole.
    Raises ``OSError`` (``ConnectionError``, ``ssl.SSLError``) or ``TimeoutError``."""
    loop = asyncio.get_running_loop()
    proto = LinkProtocol(max_message)
    handshake = loop.create_future() if ssl_context is not None else None
    pacer = _stack(loop, proto, ssl_context, read_coalesce_s, server_side=False,
                   waiter=handshake, handshake_timeout=timeout)

    async def connect() -> None:
        await loop.create_connection(lambda: pacer, host, port)
        if handshake is not None:
            await handshake
        await proto.ready

    try:
        await asyncio.wait_for(connect(), timeout)
    except BaseException:
        if pacer.raw is not None:
            pacer.raw.abort()
        raise
    return proto.link


class LinkServer:
    """Accepts links on ``host:port``: the guard's caps and deadline, TLS, prefaces;
    ``on_link(link)`` runs (as a task) for every peer that sent its preface."""

    def __init__(self, on_link: Callable[[Link], Awaitable[None]], *,
                 ssl_context: ssl.SSLContext | None, max_message: int, guard: Any,
                 http: Callable[[], asyncio.Protocol] | None = None,
                 read_coalesce_s: float = READ_COALESCE_S) -> None:
        self.on_link = on_link
        self.ssl_context = ssl_context
        self.max_message = max_message
        self.guard = guard
        self.http = http if ssl_context is None else None
        self.read_coalesce_s = read_coalesce_s
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._connection, host, port, reuse_address=True)

    @property
    def sockets(self) -> Any:
        return self.server.sockets if self.server is not None else ()

    def _connection(self) -> ReadPacer:
        loop = asyncio.get_running_loop()
        g = self.guard
        ip: list[str] = []

        def admit(raw: asyncio.Transport) -> bool:
            peer = raw.get_extra_info("peername")
            ip.append(peer[0] if peer else "?")
            return bool(g.admit(ip[0]))

        def release() -> None:
            g.release(ip[0])

        def ready(link: Link) -> None:
            link.established()
            t = asyncio.ensure_future(self.on_link(link))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

        proto = LinkProtocol(self.max_message, server_side=True, on_ready=ready,
                             fallback=self._to_http if self.http is not None else None)
        return _stack(loop, proto, self.ssl_context, self.read_coalesce_s, server_side=True,
                      handshake_timeout=g.upgrade_timeout_s, admit=admit, release=release,
                      deadline_s=g.upgrade_timeout_s, on_deadline=g.note_timed_out)

    def _to_http(self, proto: LinkProtocol, first: bytes) -> bool:
        """No TLS, and the first bytes are not a preface: serve them as HTTP (the API)."""
        pacer = proto.pacer
        if self.http is None or pacer is None or pacer.raw is None:
            return False
        raw = pacer.detach()
        http = _Handover(pacer, self.http())
        raw.set_protocol(http)
        http.connection_made(raw)
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
    """An HTTP connection taken over from a pacer: the guard's count and deadline stay."""

    def __init__(self, pacer: ReadPacer, inner: asyncio.Protocol) -> None:
        self.pacer = pacer
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
        p = self.pacer
        for t in (p.timer, p.deadline):
            if t is not None:
                t.cancel()
        if p.release is not None:
            p.release()
        self.inner.connection_lost(exc)
