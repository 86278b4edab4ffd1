"""The kernel's wake-up mark inside a large message (``node.link.LinkProtocol._gather``
under TLS records, ``node.tls_layer`` in frames; ``SO_RCVLOWAT``), on real mutual-TLS
links over loopback, through a proxy that holds back
the tail of the dialer's stream: the mark is set while a message streams in and dropped
after it; a message whose last TLS record came in part is never stranded waiting for bytes
that are not coming; a message stopped at any byte completes once its rest arrives; and a
mark not reached in time is dropped. All but the last run with the guard timer out of the
way (``NO_GUARD``), so that the mark's own rule, not the safety net, is what they check."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node import link as link_mod
from node.guard import ConnectionGuard
from node.link import (
    LOWAT_GUARD_S,
    LOWAT_MIN,
    MARKS,
    READ_LOWAT,
    SMALL_MESSAGE,
    TLS_RECORD_SLACK,
    Link,
    LinkServer,
    dial,
)
from swarm.trust import ca

MAX = 5 * 1024 * 1024
RECORD = 16384  # TLS plaintext per full record (OpenSSL's fragment size)
NO_GUARD = mock.patch.object(link_mod, "LOWAT_GUARD_S", 3600.0)


def _contexts(tmp: Path) -> tuple[Any, Any]:
    ca.init_ca(tmp / "ca")
    for name in ("a", "b"):
        ca.issue(tmp / "ca", name, region="r", out_dir=tmp / "certs")
    c = tmp / "certs"
    return (ca.server_context(tmp / "ca" / "ca.crt", c / "a.crt", c / "a.key"),
            ca.client_context(tmp / "ca" / "ca.crt", c / "b.crt", c / "b.key"))


class HoldBack:
    """A loopback TCP proxy. Bytes from the dialer pass to the server except the last
    ``hold`` it has taken in, which wait until ``hold`` is lowered; bytes back pass at
    once. ``held`` is what it keeps now. ``flip_at``: the offset in the dialer's stream of
    a byte it changes on the way (a tampered wire)."""

    def __init__(self, target_port: int, flip_at: int | None = None) -> None:
        self.target_port = target_port
        self.hold = 0
        self.held = 0
        self.flip_at = flip_at
        self.passed = 0  # bytes of the dialer's stream let through
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection("127.0.0.1", self.target_port)
        for t in (self._up(r, tw), self._down(tr, w)):
            task = asyncio.ensure_future(t)
            self.tasks.add(task)

    async def _up(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        buf = bytearray()
        while True:
            try:
                data = await asyncio.wait_for(r.read(65536), 0.01)
            except TimeoutError:
                data = None
            if data == b"":
                w.close()
                return
            if data:
                buf += data
            n = max(0, len(buf) - self.hold)
            if n:
                if self.flip_at is not None and self.passed <= self.flip_at < self.passed + n:
                    buf[self.flip_at - self.passed] ^= 0x40
                w.write(bytes(buf[:n]))
                del buf[:n]
                self.passed += n
                await w.drain()
            self.held = len(buf)

    async def _down(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


async def _linked(tmp: Path, lowat: int, body: Callable[[Link, Link, HoldBack],
                                                         Awaitable[None]],
                  layer: str = "own", frames: bool = True) -> None:
    """A server link and a dialer's link to it through a ``HoldBack``; runs ``body``.
    ``layer``: the TLS layer both ends use (``node.link.dial``'s ``tls_layer``);
    ``frames``: whether they offer the data plane's frames (the own layer's)."""
    server_ctx, client_ctx = _contexts(tmp)
    links: list[Link] = []

    async def keep(link: Link) -> None:
        links.append(link)
        await asyncio.sleep(3600)

    server = LinkServer(keep, ssl_context=server_ctx, max_message=MAX,
                        guard=ConnectionGuard(max_total=8, max_per_ip=8, upgrade_timeout_s=5),
                        read_coalesce_s=0.002, read_lowat=lowat, tls_layer=layer,
                        frames=frames)
    await server.start("127.0.0.1", 0)
    proxy = HoldBack(server.sockets[0].getsockname()[1])
    try:
        port = await proxy.start()
        near = await dial("127.0.0.1", port, ssl_context=client_ctx, max_message=MAX,
                          timeout=5, read_lowat=lowat, tls_layer=layer, frames=frames)
        await _wait_for(lambda: bool(links))
        await body(near, links[0], proxy)
        await near.close("done")
    finally:
        await proxy.close()
        await server.close()


def _mark(link: Link) -> tuple[int, int]:
    sock = link.get_extra_info("socket")
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def _run(factory: Callable[[], asyncio.AbstractEventLoop] | None, coro: Awaitable[None]) -> None:
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)  # type: ignore[arg-type]


LOOPS = pytest.mark.parametrize("factory", [None, uvloop.new_event_loop],
                                ids=["asyncio", "uvloop"])
LAYERS = pytest.mark.parametrize("layer", ["own", "loop"])


@LOOPS
@NO_GUARD
def test_a_block_streaming_in_sets_the_mark_and_its_end_clears_it(tmp_path: Path,
                                                                   factory: Any) -> None:
    block = os.urandom(256 * 1024 + 24)
    held = 160 * 1024

    async def body(near: Link, far: Link, proxy: HoldBack) -> None:
        proxy.hold = held
        await near.send(block)
        await _wait_for(lambda: proxy.held == held)
        await asyncio.sleep(0.2)  # the server read all it got
        mark, rcvbuf = _mark(far)
        # never more than the bytes still on their way (the proxy's); a quarter of the
        # receive buffer at most (a larger mark would clamp TCP's window)
        assert LOWAT_MIN <= mark <= min(held, rcvbuf // 4, READ_LOWAT)
        proxy.hold = 0
        got = await asyncio.wait_for(far.recv(), 5)
        assert got is not None and bytes(got) == block
        assert _mark(far)[0] == 1

    _run(factory, _linked(tmp_path, READ_LOWAT, body, frames=False))


@NO_GUARD
def test_with_the_mark_off_a_link_never_sets_it(tmp_path: Path) -> None:
    block = os.urandom(256 * 1024 + 24)

    async def body(near: Link, far: Link, proxy: HoldBack) -> None:
        proxy.hold = 160 * 1024
        await near.send(block)
        await _wait_for(lambda: proxy.held == proxy.hold)
        await asyncio.sleep(0.2)
        assert _mark(far)[0] == 1
        proxy.hold = 0
        got = await asyncio.wait_for(far.recv(), 5)
        assert got is not None and bytes(got) == block

    _run(None, _linked(tmp_path, 0, body))


@LOOPS
@LAYERS
@pytest.mark.parametrize("frames", [True, False], ids=["frames", "records"])
@NO_GUARD
def test_a_message_whose_last_record_came_in_part_is_not_stranded(tmp_path: Path,
                                                                  factory: Any,
                                                                  layer: str,
                                                                  frames: bool) -> None:
    """Four full TLS records of message; all but the last 50 bytes of the stream come in,
    then the sender falls silent. A full record's plaintext (16 KiB) is still to come, yet
    only 50 bytes are on their way: a mark set to the plaintext still missing would never
    be reached, and the link would wait for good."""
    msg = os.urandom(4 * RECORD - 4)  # its 4-byte length and it fill four records exactly

    async def body(near: Link, far: Link, proxy: HoldBack) -> None:
        proxy.hold = 50
        await near.send(msg)
        await _wait_for(lambda: proxy.held == 50)
        await asyncio.sleep(0.2)
        with pytest.raises(TimeoutError):  # the record is not whole yet
            await asyncio.wait_for(far.recv(), 0.1)
        proxy.hold = 0
        got = await asyncio.wait_for(far.recv(), 3)
        assert got is not None and bytes(got) == msg

    _run(factory, _linked(tmp_path, READ_LOWAT, body, layer, frames))


@LOOPS
@pytest.mark.parametrize("frames", [True, False], ids=["frames", "records"])
@NO_GUARD
def test_under_the_links_own_tls_a_mark_asks_for_all_that_is_coming(
        tmp_path: Path, factory: Any, frames: bool) -> None:
    """With 30,000 bytes of the stream held back, the bytes still coming are those and
    what waits unread in the socket. In frames (``node.frames``) the mark is exactly that:
    the frame's length is known. Under plain TLS records it is that less at most the
    overhead of the records they carry (22 bytes each under TLS 1.3's AES-GCM): the own
    layer knows how much of a record it holds (``node.tls_layer``). The loop's layer had
    to leave a whole record of slack (``TLS_RECORD_SLACK``)."""
    block = os.urandom(256 * 1024 + 24)
    held = 30_000

    async def body(near: Link, far: Link, proxy: HoldBack) -> None:
        assert far.get_extra_info("frames") is frames
        proxy.hold = held
        await near.send(block)
        await _wait_for(lambda: proxy.held == held)
        await asyncio.sleep(0.2)  # the server read all it was woken for
        mark, rcvbuf = _mark(far)
        sock = far.get_extra_info("socket")
        unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD,
                                                b"\0\0\0\0"))[0]
        coming = held + unread
        assert coming < rcvbuf // 4  # the buffer's cap is not what sets it here
        if frames:
            assert mark == coming, (mark, coming)
        else:
            assert coming - 3 * 22 <= mark <= coming, (mark, coming)
        proxy.hold = 0
        got = await asyncio.wait_for(far.recv(), 5)
        assert got is not None and bytes(got) == block
        assert _mark(far)[0] == 1

    _run(factory, _linked(tmp_path, READ_LOWAT, body, frames=frames))


SIZES = st.one_of(
    st.sampled_from([0, 1, SMALL_MESSAGE, SMALL_MESSAGE + 1, RECORD * 4 - 4, RECORD * 2 + 7,
                     256 * 1024 + 24, LOWAT_MIN + TLS_RECORD_SLACK, 600 * 1024]),
    st.integers(0, 700 * 1024))


@NO_GUARD
@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(SIZES, st.integers(0, 800 * 1024)), min_size=1, max_size=6),
       uv=st.booleans(), layer=st.sampled_from(["own", "loop"]), frames=st.booleans())
def test_a_message_stopped_at_any_byte_completes_once_the_rest_arrives(
        tmp_path: Path, steps: list[tuple[int, int]], uv: bool, layer: str,
        frames: bool) -> None:
    """Each message is sent with the proxy holding back some tail of the stream (any
    count of bytes: mid-record, mid-header, whole messages); once the proxy lets the rest
    through, the message arrives whole, in order, without any later bytes to wake it."""
    with contextlib.suppress(FileExistsError):
        (tmp_path / "h").mkdir()
    tmp = Path(os.path.join(tmp_path, "h", os.urandom(4).hex()))
    tmp.mkdir()

    async def body(near: Link, far: Link, proxy: HoldBack) -> None:
        for size, hold in steps:
            msg = os.urandom(size)
            proxy.hold = hold
            await near.send(msg)
            await asyncio.sleep(0.03)  # the receiver takes what passed and sets its mark
            proxy.hold = 0
            got = await asyncio.wait_for(far.recv(), 5)
            assert got is not None and bytes(got) == msg

    _run(uvloop.new_event_loop if uv else None, _linked(tmp, READ_LOWAT, body, layer, frames))


def test_a_mark_not_reached_in_time_is_dropped(tmp_path: Path) -> None:
    """The safety net: the rest of a block held back past ``LOWAT_GUARD_S``; the link
    drops its mark to 1 (a slow flow gets a wake-up per guard period at worst) and
    counts it."""
    block = os.urandom(256 * 1024 + 24)

    async def body(near: Link, far: Link, proxy: HoldBack) -> None:
        before = dict(MARKS)
        proxy.hold = 160 * 1024
        await near.send(block)
        await _wait_for(lambda: proxy.held == proxy.hold)
        await asyncio.sleep(LOWAT_GUARD_S + 0.2)
        assert _mark(far)[0] == 1
        assert MARKS["set"] > before["set"] and MARKS["expired"] > before["expired"]
        proxy.hold = 0
        got = await asyncio.wait_for(far.recv(), 5)
        assert got is not None and bytes(got) == block

    _run(None, _linked(tmp_path, READ_LOWAT, body, frames=False))
