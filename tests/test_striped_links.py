"""Striped links (``[network] lanes``, docs/striped-links.md) in the node driver.

Over real links on loopback: the writer spreads a chunk's blocks over the link's
connections and keeps at most ``stripes.WINDOW`` chunks unfinished at the peer, a
cut-through chunk that fails is withdrawn by seq; a TLS fleet with lanes moves versions
bitwise equal, and a lane the acceptor cannot tie to a link it offered is refused
without harm to the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from node.driver import MAX_LINK_MESSAGE, Arrival, Conn, Driver, Lane
from node.guard import ConnectionGuard
from node.link import Link, LinkServer, dial
from swarm.protocol import events as ev
from swarm.protocol import stripes
from swarm.protocol.wire import BLOCK_BYTES
from tests.test_cut_through import _driver

N = 5 * BLOCK_BYTES + 1000  # six blocks, the last one short
CHUNKS = {(2, i): os.urandom(N) for i in range(stripes.WINDOW + 2)}


class _Store:
    def read_chunk(self, v: int, i: int) -> bytes:
        return CHUNKS[(v, i)]


@contextlib.asynccontextmanager
async def _striped(lanes: int) -> AsyncIterator[tuple[Driver, Conn, asyncio.Queue, list]]:
    """A driver's writer on a link of ``lanes`` connections to a plain server that puts
    ``(connection number, message)`` on a queue."""
    messages: asyncio.Queue = asyncio.Queue()
    count = 0

    async def reader(link: Link) -> None:
        nonlocal count
        me, count = count, count + 1
        while (msg := await link.recv()) is not None:
            await messages.put((me, bytes(msg)))

    server = LinkServer(reader, ssl_context=None, max_message=MAX_LINK_MESSAGE,
                        guard=ConnectionGuard(max_total=32, max_per_ip=32, upgrade_timeout_s=5))
    await server.start("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    links = [await dial("127.0.0.1", port, ssl_context=None, max_message=MAX_LINK_MESSAGE,
                        timeout=5) for _ in range(lanes)]
    sent: list[ev.ChunkSent] = []
    drv = _driver(sent, _Store())
    c = Conn(id=7, link=links[0], outbound=True, addr="peer")
    c.sock = links[0].get_extra_info("socket")
    c.lanes = [Lane(n, link, link.get_extra_info("socket")) for n, link in enumerate(links[1:], 1)]
    writer = asyncio.create_task(drv._writer(c))
    try:
        yield drv, c, messages, sent
    finally:
        c.closing = True
        c.wake.set()
        writer.cancel()
        for link in links:
            await link.close()
        await server.close()


async def _drain(messages: asyncio.Queue, quiet_s: float = 0.3) -> list[tuple[int, bytes]]:
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(messages.get(), quiet_s))
        except TimeoutError:
            return out


def test_blocks_spread_over_the_lanes_and_the_window_holds_the_sender() -> None:
    asyncio.run(_spread_and_window())


async def _spread_and_window() -> None:
    async with _striped(lanes=3) as (_drv, c, messages, sent):
        for i in range(stripes.WINDOW + 2):
            c.data.append((2, i, False))
        c.wake.set()
        got = await _drain(messages)
        # the peer finished none: WINDOW chunks went, whole, and then the writer waits
        asm = stripes.StripedAssembler()
        whole = [w for _, m in got if (w := asm.feed(m)) is not None]
        assert [(seq, v, i) for seq, v, i, _ in whole] == [(s, 2, s) for s in range(stripes.WINDOW)]
        assert all(bytes(p) == CHUNKS[(2, i)] for _, _, i, p in whole)
        assert len(sent) == stripes.WINDOW and c.unfinished == set(range(stripes.WINDOW))
        assert {lane for lane, _ in got} == {0, 1, 2}  # every connection carried blocks
        # the peer says two are done: the last two chunks go
        for seq in (0, 1):
            await c_done(c, seq)
        rest = await _drain(messages)
        whole = [w for _, m in rest if (w := asm.feed(m)) is not None]
        assert [(seq, i) for seq, _, i, _ in whole] == [(4, 4), (5, 5)]
        assert [e.index for e in sent] == list(range(stripes.WINDOW + 2))


async def c_done(c: Conn, seq: int) -> None:
    """What the driver does with a DONE from the peer (``_on_striped``)."""
    c.unfinished.discard(seq)
    c.wake.set()
    await asyncio.sleep(0)


def test_a_cut_through_chunk_that_fails_is_withdrawn_by_its_seq() -> None:
    asyncio.run(_withdrawn())


async def _withdrawn() -> None:
    async with _striped(lanes=2) as (drv, c, messages, sent):
        a = drv.arrivals[(2, 0)] = Arrival(conn=99, buf=memoryview(bytearray(CHUNKS[(2, 0)])),
                                          length=N)
        c.data.append((2, 0, True))
        a.got = 2 * BLOCK_BYTES
        a.watchers.append(c)
        c.wake.set()
        got = await _drain(messages)
        assert len(got) == 2 and all(stripes.magic_of(m) == stripes.STRIPE_MAGIC for _, m in got)
        a.state = "failed"
        a.changed()
        got = await _drain(messages)
        assert [(lane, stripes.unpack_withdraw(m)) for lane, m in got] == [(0, (0, 2, 0))]
        assert sent == [ev.ChunkSent(sent[0].now, 7, 2, 0, withdrawn=True)]
        assert c.unfinished == {0}  # until the peer's DONE


def _node_logs(fleet: Any) -> str:
    return "".join(n.log.read_text(errors="replace") for n in fleet.nodes)


@pytest.mark.parametrize("tls", [True, False])
def test_a_fleet_with_lanes_moves_versions_and_refuses_stray_lanes(tls: bool) -> None:
    """Two regions, every cross-region link with 3 lanes: versions arrive bitwise equal,
    chunks cross striped, and a lane with a token nobody offered is refused while the
    node goes on."""
    from lab.fleet import LoopbackFleet
    from swarm.trust import ca

    with LoopbackFleet(2, 2, chunk_size=1 << 20, lr=1e-4, tls=tls, network={"lanes": 3},
                       node_log_level="debug") as fleet:
        fleet.start(timeout=120)
        for _ in range(2):
            pub = fleet.publish()
            statuses = fleet.wait_version(pub["version"], timeout=120)
            assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
            assert all(st["bad_chunks"] == 0 for st in statuses.values())
        # links that carried chunks between regions got 2 lanes each, counted at both ends
        opened = {k: st["transport"]["lanes_opened"] for k, st in statuses.items()}
        trainer = fleet.trainer_status()
        assert trainer is not None and trainer["transport"]["lanes_opened"] >= 2, opened
        assert sum(opened.values()) >= 4 and all(n % 2 == 0 for n in opened.values()), opened
        assert all(st["transport"]["lanes_refused"] == 0 for st in statuses.values())
        assert "lanes=3" in _node_logs(fleet) or "'lanes': 3" in _node_logs(fleet)
        target = fleet.nodes[0]
        ctx = None
        if tls:
            w = fleet.workdir
            ctx = ca.client_context(w / "ca" / "ca.crt", w / "certs" / "n1-1.crt",
                                    w / "certs" / "n1-1.key")
        for first in (stripes.pack_lane(os.urandom(16), 1), b"\x93\x01\x02\x03"):
            reason = asyncio.run(_stray_lane(target.addr, ctx, first))
            assert "lane refused" in reason, reason
        st = fleet.status(target)
        assert st is not None and st["transport"]["lanes_refused"] == 2
        metrics = fleet.http(target.api_addr if tls else target.addr, "/metrics").decode()
        assert "patchswarm_lanes_opened_total{" in metrics
        assert "patchswarm_lanes_refused_total{" in metrics
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=120)
        assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}


async def _stray_lane(addr: str, ctx: Any, first: bytes) -> str:
    host, _, port = addr.rpartition(":")
    link = await dial(host, int(port), ssl_context=ctx, max_message=MAX_LINK_MESSAGE,
                      timeout=10, lane=True)
    try:
        await link.send(first)
        msg = await asyncio.wait_for(link.recv(), 10)
        return link.reason if msg is None else f"answered {bytes(msg)[:8]!r}"
    finally:
        await link.close()
