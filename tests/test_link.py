"""Peer links (``node.link``): the framing under any split of the byte stream, its limits,
the read pacer's pauses, and real links on loopback (mutual TLS, flow control, close
reasons, outsiders refused)."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.guard import ConnectionGuard
from node.link import (
    FIRST_HOLD_S,
    HEADER,
    PREFACE,
    READ_BATCH,
    SMALL_MESSAGE,
    STREAM_GAP_S,
    Link,
    LinkClosed,
    LinkProtocol,
    LinkServer,
    Placed,
    dial,
)
from swarm.trust import ca

MAX = 5 * 1024 * 1024


class _Transport:
    """What a protocol sees of its transport, recorded."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False
        self.pauses = 0
        self.aborted = False
        self.closed = False
        self.limits: tuple = ()

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def set_read_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.limits = (high, low)

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _feed(proto: Any, data: bytes, steps: list[int]) -> None:
    """Hand ``data`` to a buffered protocol the way a transport does, in reads of the
    given sizes (cycled), each capped by the buffer the protocol offers."""
    pos, k = 0, 0
    while pos < len(data) and not getattr(proto, "closed", False):
        buf = proto.get_buffer(-1)
        n = min(len(buf), steps[k % len(steps)], len(data) - pos)
        k += 1
        assert n > 0
        buf[:n] = data[pos:pos + n]
        pos += n
        proto.buffer_updated(n)


def _frame(msg: bytes) -> bytes:
    return HEADER.pack(len(msg)) + msg


def _collect(proto: LinkProtocol) -> list[bytes]:
    return [bytes(m) for m in proto.queue]


sizes = st.one_of(st.integers(0, 64), st.integers(SMALL_MESSAGE - 8, SMALL_MESSAGE + 8),
                  st.integers(0, 70_000))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(sizes, min_size=1, max_size=8),
       steps=st.lists(st.integers(1, 90_000), min_size=1, max_size=6), seed=st.integers(0, 255))
def test_messages_come_out_whole_and_in_order_however_the_stream_is_split(
        lengths: list[int], steps: list[int], seed: int) -> None:
    msgs = [bytes([(seed + i + j) % 256 for j in range(n)]) if n < 200 else os.urandom(n)
            for i, n in enumerate(lengths)]

    async def run() -> list[bytes]:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        _feed(p, PREFACE + b"".join(_frame(m) for m in msgs), steps)
        assert p.ready.done() and not p.closed
        return _collect(p)

    assert asyncio.run(run()) == msgs


def test_a_close_message_ends_the_link_with_its_reason() -> None:
    async def run() -> LinkProtocol:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        reason = b"banned: bad chunk"
        _feed(p, PREFACE + _frame(b"one") + HEADER.pack(0x8000_0000 | len(reason)) + reason
              + _frame(b"after the close"), [7])
        return p

    p = asyncio.run(run())
    assert _collect(p) == [b"one"]
    assert p.closed and p.reason == "closed by peer: banned: bad chunk"
    assert p.transport.closed


@pytest.mark.parametrize("header", [HEADER.pack(MAX + 1), HEADER.pack(0xFFFF_FFFF),
                                    HEADER.pack(0x8000_0000 | 5000)])
def test_an_oversized_message_closes_the_link_before_anything_is_allocated(header: bytes) -> None:
    async def run() -> LinkProtocol:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        _feed(p, PREFACE + header + b"x" * 100, [1000])
        return p

    p = asyncio.run(run())
    assert p.closed and "over the limit" in p.reason and p.transport.aborted
    assert p.body is None and not p.queue


@pytest.mark.parametrize(("first", "why"), [
    (b"GET /swarm HTTP/1.1\r\n", "same release"),  # an older release's websocket dial
    (b"\x16\x03\x01\x02\x00", "no link preface"),  # TLS where the port has none
    (b"PSL2", "no link preface")])
def test_a_server_refuses_anything_but_the_preface(first: bytes, why: str) -> None:
    async def run() -> LinkProtocol:
        p = LinkProtocol(MAX, server_side=True)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        _feed(p, first, [3])
        return p

    p = asyncio.run(run())
    assert p.closed and why in p.reason and p.transport.aborted
    assert p.transport.written == []  # a server says nothing before the dialer's preface


def test_a_dialer_answered_by_an_older_release_says_so() -> None:
    async def run() -> LinkProtocol:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        _feed(p, b"HTTP/1.1 400 Bad Request\r\n\r\n", [64])
        return p

    p = asyncio.run(run())
    assert p.closed and "same release" in p.reason and p.transport.aborted


def test_a_small_read_that_drained_the_socket_holds_reading_for_a_batch() -> None:
    async def run() -> None:
        p = LinkProtocol(MAX, tls=True, coalesce_s=0.01)
        t = _Transport()
        p.connection_made(t)  # type: ignore[arg-type]
        _feed(p, PREFACE + _frame(b"hello"), [100])  # small, drained: hold 10 ms
        assert t.paused and t.limits == (1, 0)  # with TLS the socket itself pauses
        assert _collect(p) == [b"hello"]  # what came is handed on at once
        await asyncio.sleep(0.03)
        assert not t.paused and t.limits == (None, None)
        big = _frame(b"z" * 70_000)  # a large read: read on at once
        _feed(p, big, [len(big)])
        assert not t.paused
        # a read that filled the buffer offered (more may wait) does not hold either
        buf = p.get_buffer(-1)
        buf[:] = (_frame(b"y" * 100_000) * 2)[:len(buf)]
        p.buffer_updated(len(buf))
        assert not t.paused

    asyncio.run(run())


def test_a_hold_lasts_as_long_as_a_batch_takes_at_the_links_measured_rate() -> None:
    """``LinkProtocol._hold_s``: 192 KiB at the rate measured between holds, 2 ms at least
    and ``coalesce_s`` at most; a stream's first hold, and one after a quiet spell, is
    2 ms (round 21: a fixed 2 ms woke a 100 Mbit/s receiver ~17 times per 256 KiB block,
    a fixed 5 ms held a 1 Gbit/s one back)."""
    async def run() -> None:
        p = LinkProtocol(MAX, tls=True, coalesce_s=0.016)
        clock = [100.0]
        p.loop = type("L", (), {"time": lambda _self: clock[0]})()  # type: ignore[assignment]

        def hold_after(dt: float, nbytes: int) -> float:
            clock[0] += dt
            p.rx_bytes += nbytes
            return p._hold_s()

        assert hold_after(0.0, 0) == FIRST_HOLD_S  # rate unknown
        # 12.5 MB/s (100 Mbit/s): 192 KiB takes 15.7 ms
        assert hold_after(0.02, 250_000) == pytest.approx(READ_BATCH / 12.5e6)
        # then 125 MB/s (1 Gbit/s): the EWMA (68.75 MB/s) first, 2.9 ms ...
        assert hold_after(0.002, 250_000) == pytest.approx(READ_BATCH / 68.75e6)
        for _ in range(4):
            h = hold_after(0.002, 250_000)
        assert h == FIRST_HOLD_S  # ... then 1.6 ms, held for the 2 ms floor
        # 2 MB/s: 98 ms, capped at coalesce_s
        for _ in range(6):
            h = hold_after(0.05, 100_000)
        assert h == 0.016
        assert hold_after(STREAM_GAP_S + 0.01, 10) == FIRST_HOLD_S  # a quiet spell: unknown
        assert p.rx_rate is None
        q = LinkProtocol(MAX, tls=True, coalesce_s=0.001)  # a cap under the floor wins
        assert q._hold_s() == 0.001

    asyncio.run(run())


def test_a_full_receive_queue_pauses_reading_until_it_drains() -> None:
    async def run() -> None:
        p = LinkProtocol(MAX)
        t = _Transport()
        p.connection_made(t)  # type: ignore[arg-type]
        block = b"q" * (1 << 20)
        _feed(p, PREFACE + _frame(block) * 9, [1 << 22])
        assert t.paused  # 9 MiB waiting > 8 MiB
        for _ in range(5):
            assert await p.link.recv() == block
        assert not t.paused

    asyncio.run(run())


# ------------------------------------------------------------------ real links on loopback


def _tls(tmp: Path) -> dict[str, ssl.SSLContext]:
    ca.init_ca(tmp / "ca")
    ca.issue(tmp / "ca", "a", region="r", out_dir=tmp / "certs")
    ca.issue(tmp / "ca", "b", region="r", out_dir=tmp / "certs")
    ca.init_ca(tmp / "rogue")
    ca.issue(tmp / "rogue", "b", region="r", out_dir=tmp / "evil")
    c = tmp / "certs"
    return {"server": ca.server_context(tmp / "ca" / "ca.crt", c / "a.crt", c / "a.key"),
            "client": ca.client_context(tmp / "ca" / "ca.crt", c / "b.crt", c / "b.key"),
            "rogue": ca.client_context(tmp / "rogue" / "ca.crt", tmp / "evil" / "b.crt",
                                       tmp / "evil" / "b.key")}


async def _server(on_link: Any, ctx: ssl.SSLContext | None,
                  coalesce: float = 0.002) -> tuple[LinkServer, int]:
    server = LinkServer(on_link, ssl_context=ctx, max_message=MAX,
                        guard=ConnectionGuard(max_total=16, max_per_ip=16, upgrade_timeout_s=5),
                        read_coalesce_s=coalesce)
    await server.start("127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_messages_cross_mutual_tls_both_ways_and_an_outsider_gets_no_link(tmp_path: Path) -> None:
    ctx = _tls(tmp_path)
    msgs = [b"", b"h", os.urandom(SMALL_MESSAGE), os.urandom(SMALL_MESSAGE + 1),
            os.urandom(256 * 1024 + 24), os.urandom(4 * 1024 * 1024 + 24)]

    async def run() -> None:
        got: list[bytes] = []
        peer_cn: list[Any] = []

        async def echo(link: Link) -> None:
            peer_cn.append(link.get_extra_info("ssl_object").getpeercert(binary_form=True))
            while (m := await link.recv()) is not None:
                got.append(bytes(m))
                await link.send(b"re:", m)

        server, port = await _server(echo, ctx["server"])
        try:
            link = await dial("127.0.0.1", port, ssl_context=ctx["client"], max_message=MAX,
                              timeout=5)
            for m in msgs:
                await link.send(m)
            back = [bytes(await asyncio.wait_for(link.recv(), 10)) for _ in msgs]  # type: ignore[arg-type]
            assert got == msgs and back == [b"re:" + m for m in msgs] and peer_cn[0]
            await link.close("done")
            assert link.closed
            for outsider in (ctx["rogue"], None):  # a foreign CA; no TLS at all
                with pytest.raises((ssl.SSLError, OSError, TimeoutError)):
                    await dial("127.0.0.1", port, ssl_context=outsider, max_message=MAX,
                               timeout=3)
        finally:
            await server.close()

    asyncio.run(run())


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls-frames"])
def test_a_reader_that_falls_behind_holds_the_sender_back_and_loses_nothing(
        tmp_path: Path, tls: bool) -> None:
    ctx = _tls(tmp_path) if tls else {"server": None, "client": None}

    async def run() -> None:
        links: list[Link] = []
        arrived = asyncio.Event()

        async def keep(link: Link) -> None:
            links.append(link)
            arrived.set()
            await asyncio.sleep(3600)

        server, port = await _server(keep, ctx["server"])
        try:
            link = await dial("127.0.0.1", port, ssl_context=ctx["client"], max_message=MAX,
                              timeout=5)
            assert bool(link.get_extra_info("frames")) is tls
            await asyncio.wait_for(arrived.wait(), 5)
            block = os.urandom(256 * 1024)
            sent = 0

            async def flood() -> None:
                nonlocal sent
                for i in range(200):  # 50 MiB: more than the reader's queue and the kernel hold
                    await link.send(i.to_bytes(4, "big"), block)
                    sent += 1

            task = asyncio.create_task(flood())
            await asyncio.sleep(1.0)
            assert not task.done() and sent < 200  # held back: the reader paused its socket
            far = links[0]
            for i in range(200):
                m = await asyncio.wait_for(far.recv(), 10)
                assert m is not None and int.from_bytes(m[:4], "big") == i and m[4:] == block
            await asyncio.wait_for(task, 10)
            await link.close("bye")
            assert await asyncio.wait_for(far.recv(), 5) is None
            assert far.reason == "closed by peer: bye"
            with pytest.raises(LinkClosed):
                await link.send(b"after the close")
        finally:
            await server.close()

    asyncio.run(run())


def test_a_placer_gets_large_messages_written_where_it_says() -> None:
    """``place_with``: a large message's bytes after its header go straight into the
    buffer the placer names; only when every earlier message was taken."""
    target = bytearray(300_000)
    asked: list[tuple[bytes, int]] = []

    def placer(header: bytes, n: int) -> memoryview | None:
        asked.append((header, n))
        return memoryview(target)[:n] if header.startswith(b"BLK") else None

    big = b"BLK:" + os.urandom(200_000)
    other = b"RAW:" + os.urandom(30_000)

    async def run() -> list[Any]:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        p.link.place_with(placer, 4)
        _feed(p, PREFACE + _frame(big), [5000])  # the header first comes in a small read
        got = [await p.link.recv()]
        _feed(p, _frame(other) + _frame(b"small") + _frame(big), [70_000])
        got += [await p.link.recv() for _ in range(3)]
        return got

    got = asyncio.run(run())
    placed, raw, small, unplaced = got
    assert isinstance(placed, Placed) and placed.header == b"BLK:" and len(placed) == len(big)
    assert bytes(target[:200_000]) == big[4:]
    assert bytes(raw) == other and small == b"small"
    # the second big message came while "other" and "small" were still queued: not placed
    assert bytes(unplaced) == big
    assert asked == [(b"BLK:", 200_000)]  # "other" came whole in one read: nothing to place


def test_a_placed_message_can_be_diverted_mid_way() -> None:
    """``divert``: the rest of the placed message being received goes to a buffer of its
    own; the placer's buffer keeps what came before, and the message comes out marked."""
    target = bytearray(200_000)
    big = b"BLK:" + os.urandom(150_000)

    async def run() -> tuple[Any, bool, bytes | None, bool]:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        p.link.place_with(lambda header, n: memoryview(target)[:n], 4)
        assert p.link.placing() is None and not p.link.divert()
        frame = PREFACE + _frame(big)
        _feed(p, frame[:60_000], [60_000])
        header = p.link.placing()
        diverted = p.link.divert()
        _feed(p, frame[60_000:], [40_000])
        msg = await p.link.recv()
        return msg, diverted, header, p.link.divert()

    msg, diverted, header, again = asyncio.run(run())
    assert diverted and header == b"BLK:" and not again
    assert isinstance(msg, Placed) and msg.diverted and len(msg) == len(big)
    cut = 60_000 - len(PREFACE) - 4 - 4  # payload bytes placed before the divert
    assert bytes(target[:cut]) == big[4:4 + cut]
    assert bytes(target[cut:150_000]) == bytes(150_000 - cut)  # nothing after it


def test_a_placer_that_refuses_a_block_closes_the_link_with_its_reason() -> None:
    from swarm.errors import ProtocolError

    def placer(header: bytes, n: int) -> memoryview | None:
        raise ProtocolError("block of chunk 3 interrupts chunk 2")

    async def run() -> LinkProtocol:
        p = LinkProtocol(MAX)
        p.connection_made(_Transport())  # type: ignore[arg-type]
        p.link.place_with(placer, 4)
        _feed(p, PREFACE + _frame(b"x" * 100_000), [65536])
        return p

    p = asyncio.run(run())
    assert p.closed and p.transport.aborted and "interrupts" in p.reason
