"""The link's own TLS layer (``node.tls_layer``): the record tracker under any split of
the stream (Hypothesis), and real mutual-TLS links on loopback: it speaks the same TLS as
the loop's layer both ways and frames with itself (back-pressure through it:
``test_link.py``), a byte changed on the wire closes the link as a frame that failed
authentication, a failed handshake surfaces as the TLS error, and a
connection that never finishes its handshake is cut at the guard's deadline and counted."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.guard import ConnectionGuard
from node.link import Link, LinkServer, dial
from node.tls_layer import MARKS, RecordTracker
from tests.test_link import _tls
from tests.test_link_lowat import HoldBack

MAX = 5 * 1024 * 1024


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 17_000), max_size=8),
       cuts=st.lists(st.integers(1, 40_000), max_size=12), data=st.data())
def test_the_record_tracker_knows_the_trailing_records_part_however_the_stream_is_split(
        lengths: list[int], cuts: list[int], data: Any) -> None:
    stream, ends = bytearray(), []
    for n in lengths:
        kind = data.draw(st.sampled_from([20, 21, 22, 23]))
        stream += bytes([kind, 3, 3]) + n.to_bytes(2, "big") + os.urandom(n)
        ends.append(len(stream))
    tail = data.draw(st.integers(0, 4))  # a header cut short at the very end
    stream += bytes([23, 3, 3, 0x40, 0x00])[:tail]
    t, pos = RecordTracker(), 0
    for c in [*cuts, len(stream)]:
        piece = stream[pos:pos + c]
        t.feed(memoryview(piece))
        pos += len(piece)
        last_end = max([0, *[e for e in ends if e <= pos]])
        assert t.partial == pos - last_end  # bytes since the last whole record
        if pos >= len(stream):
            break


async def _server(on_link: Any, ctx: ssl.SSLContext, layer: str = "own",
                  guard: ConnectionGuard | None = None) -> tuple[LinkServer, int]:
    server = LinkServer(on_link, ssl_context=ctx, max_message=MAX, tls_layer=layer,
                        guard=guard or ConnectionGuard(max_total=16, max_per_ip=16,
                                                       upgrade_timeout_s=5))
    await server.start("127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize(("server_layer", "dial_layer"), [("own", "loop"), ("loop", "own"),
                                                          ("own", "own")])
def test_both_layers_speak_the_same_tls(tmp_path: Path, server_layer: str,
                                        dial_layer: str) -> None:
    ctx = _tls(tmp_path)
    msgs = [b"", b"x", os.urandom(16 * 1024 + 3), os.urandom(256 * 1024 + 24),
            os.urandom(3 * 1024 * 1024)]

    async def run() -> None:
        async def echo(link: Link) -> None:
            assert link.get_extra_info("ssl_object").getpeercert(binary_form=True)
            while (m := await link.recv()) is not None:
                await link.send(b"re:", m)

        server, port = await _server(echo, ctx["server"], server_layer)
        try:
            link = await dial("127.0.0.1", port, ssl_context=ctx["client"], max_message=MAX,
                              timeout=5, tls_layer=dial_layer)
            # frames where both ends offer them (ALPN), plain TLS records with the loop's
            assert bool(link.get_extra_info("frames")) is (server_layer == dial_layer == "own")
            assert link.get_extra_info("peercert") is not None
            assert link.get_extra_info("socket") is not None
            for m in msgs:
                await link.send(m)
            for m in msgs:
                got = await asyncio.wait_for(link.recv(), 10)
                assert got is not None and bytes(got) == b"re:" + m
            await link.close("done")
        finally:
            await server.close()

    asyncio.run(run())


async def _no_link(link: Link) -> None:
    raise AssertionError("a peer that should have been refused got a link")


def test_a_failed_handshake_is_the_dialers_tls_error(tmp_path: Path) -> None:
    ctx = _tls(tmp_path)

    async def run() -> None:
        server, port = await _server(_no_link, ctx["server"])
        try:
            with pytest.raises(ssl.SSLError):  # a foreign CA: the TLS error, not a timeout
                await dial("127.0.0.1", port, ssl_context=ctx["rogue"], max_message=MAX,
                           timeout=5)
        finally:
            await server.close()

    asyncio.run(run())


def test_a_connection_that_never_finishes_its_handshake_is_cut_at_the_deadline(
        tmp_path: Path) -> None:
    ctx = _tls(tmp_path)

    async def run() -> None:
        guard = ConnectionGuard(max_total=16, max_per_ip=16, upgrade_timeout_s=0.3)
        server, port = await _server(_no_link, ctx["server"], guard=guard)
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            silent = await asyncio.open_connection("127.0.0.1", port)
            garbage = await asyncio.open_connection("127.0.0.1", port)
            garbage[1].write(b"GET / HTTP/1.1\r\n\r\n" * 4)  # not TLS: cut at once
            try:
                left = await asyncio.wait_for(garbage[0].read(), 0.2)
            except ConnectionResetError:
                left = b""
            assert left == b""
            assert await asyncio.wait_for(silent[0].read(), 3) == b""
            assert 0.2 < loop.time() - t0 < 2.0
            assert guard.stats.timed_out == 1 and guard.stats.open == 0
            for _, w in (silent, garbage):
                w.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_a_byte_changed_on_the_wire_closes_the_link_as_a_failed_frame(tmp_path: Path) -> None:
    ctx = _tls(tmp_path)

    async def run() -> None:
        links: list[Link] = []

        async def keep(link: Link) -> None:
            links.append(link)
            await asyncio.sleep(3600)

        server, port = await _server(keep, ctx["server"])
        proxy = HoldBack(port, flip_at=200_000)  # past the handshake: inside the block below
        try:
            link = await dial("127.0.0.1", await proxy.start(), ssl_context=ctx["client"],
                              max_message=MAX, timeout=5)
            assert link.get_extra_info("frames")
            await link.send(os.urandom(256 * 1024))
            for _ in range(100):
                if links and links[0].closed:
                    break
                await asyncio.sleep(0.05)
            far = links[0]
            assert await asyncio.wait_for(far.recv(), 5) is None  # nothing of it came out
            assert "failed authentication" in far.reason
        finally:
            await proxy.close()
            await server.close()

    asyncio.run(run())


def _layer(link: Link) -> Any:
    return link._p.transport._layer  # the TlsProtocol under a link (frames: its reader)


@pytest.mark.parametrize("flip", [False, True])
def test_a_placed_blocks_body_is_opened_straight_into_its_slice(tmp_path: Path,
                                                                  flip: bool) -> None:
    """A block message goes as two frames, its header and its body, and the body's frame
    is opened straight into the slice the link's placer named: every frame opened in
    place, none copied. A byte changed inside the body closes the link and the block
    never counts as written (the placer's ``filled`` is not called)."""
    ctx = _tls(tmp_path)
    block = 256 * 1024
    bodies = [os.urandom(block) for _ in range(4)]
    target = bytearray(len(bodies) * block)

    def placer(header: bytes, n: int) -> memoryview | None:
        i = header[3]
        return memoryview(target)[i * n:(i + 1) * n] if header[:3] == b"BLK" else None

    async def run() -> None:
        got: list[Any] = []
        filled: list[bytes] = []
        links: list[Link] = []

        async def take(link: Link) -> None:
            links.append(link)
            link.place_with(placer, 4, filled=lambda p: filled.append(p.header) or True)
            while (m := await link.recv()) is not None:
                got.append(m)

        server, port = await _server(take, ctx["server"])
        proxy = HoldBack(port, flip_at=300_000 if flip else None)  # inside the second body
        try:
            link = await dial("127.0.0.1", await proxy.start(), ssl_context=ctx["client"],
                              max_message=MAX, timeout=5)
            for i, body in enumerate(bodies):
                await link.send(b"BLK" + bytes([i]), memoryview(body))
            await link.send(b"the end")
            for _ in range(200):
                if len(got) == len(bodies) + 1 or (links and links[0].closed):
                    break
                await asyncio.sleep(0.025)
            reader = _layer(links[0]).reader
            if flip:
                assert "failed authentication" in links[0].reason
                assert len(got) <= 1 and filled == [b"BLK\0"] * len(got)
            else:
                assert [bytes(m.header) for m in got[:-1]] == [b"BLK" + bytes([i])
                                                                for i in range(4)]
                assert bytes(got[-1]) == b"the end" and bytes(target) == b"".join(bodies)
                assert reader.direct == reader.count > 2 * len(bodies)
            await link.close("done")
        finally:
            await proxy.close()
            await server.close()

    asyncio.run(run())


class _CountingSock:
    """Stands in for a layer's mark socket: counts what it is asked, then asks the real one."""

    def __init__(self, sock: Any) -> None:
        self.sock, self.gets, self.sets = sock, 0, 0

    def getsockopt(self, *a: Any) -> Any:
        self.gets += 1
        return self.sock.getsockopt(*a)

    def setsockopt(self, *a: Any) -> Any:
        self.sets += 1
        return self.sock.setsockopt(*a)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("who_closes", ["dialer", "server", "failed frame"])
def test_the_mark_socket_is_the_connections_and_goes_with_it(tmp_path: Path,
                                                              who_closes: str) -> None:
    """Frames set the wake-up mark through a socket of the layer's own on a duplicate of
    the connection's descriptor (not uvloop's pseudo socket, ~4x the system call): its
    options are the connection's, SO_RCVBUF is read again at most every RCVBUF_TTL_S, and
    the duplicate is closed with the link whoever ends it (a close, the peer's close, a
    frame that fails authentication), without holding the connection open: the other
    side sees the end at once."""
    ctx = _tls(tmp_path)
    block = 256 * 1024

    async def run() -> None:
        links: list[Link] = []
        got: list[Any] = []

        async def take(link: Link) -> None:
            links.append(link)
            while (m := await link.recv()) is not None:
                got.append(m)

        server, port = await _server(take, ctx["server"])
        proxy = HoldBack(port, flip_at=6 * block if who_closes == "failed frame" else None)
        try:
            link = await dial("127.0.0.1", await proxy.start(), ssl_context=ctx["client"],
                              max_message=MAX, timeout=5)
            for _ in range(100):
                if links:
                    break
                await asyncio.sleep(0.01)
            mine, theirs = _layer(link), _layer(links[0])
            for layer in (mine, theirs):
                raw = layer.raw.get_extra_info("socket")
                assert isinstance(layer.sock, socket.socket)
                assert layer.sock.fileno() not in (-1, raw.fileno())
            fds = [layer.sock.fileno() for layer in (mine, theirs)]
            counting = theirs.sock = _CountingSock(theirs.sock)
            set_before = MARKS["set"]
            for _ in range(4):
                await link.send(b"B", memoryview(os.urandom(block)))
            for _ in range(200):
                if len(got) == 4:
                    break
                await asyncio.sleep(0.01)
            assert len(got) == 4 and MARKS["set"] > set_before and counting.sets > 0
            assert counting.gets <= 2  # ~0.1 s of frames: SO_RCVBUF read once or twice
            assert theirs.mark == counting.sock.getsockopt(socket.SOL_SOCKET,
                                                           socket.SO_RCVLOWAT)
            t0 = time.monotonic()
            if who_closes == "dialer":
                await link.close("done")
            elif who_closes == "server":
                await links[0].close("done")
            else:
                for _ in range(4):
                    await link.send(b"B", memoryview(os.urandom(block)))
            for _ in range(200):
                if link.closed and links[0].closed:
                    break
                if who_closes == "failed frame" and links[0].closed:
                    # the test's proxy drops a reset without passing it on: close ours
                    assert "failed authentication" in links[0].reason
                    await link.close("done")
                await asyncio.sleep(0.01)
            assert link.closed and links[0].closed and time.monotonic() - t0 < 1.5
            assert mine.sock is None and theirs.sock is None
            for fd in fds:
                with pytest.raises(OSError):
                    os.fstat(fd)
        finally:
            await proxy.close()
            await server.close()

    asyncio.run(run())
