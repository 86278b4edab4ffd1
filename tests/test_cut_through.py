"""Cut-through relays in the node driver, over a real peer link on loopback.

A border relays a chunk while it still arrives: the driver's writer sends each block
as it comes in and the last one only once the whole chunk was verified and stored
here; a chunk that does not arrive whole and verified is withdrawn (the receiver drops
its blocks) and the core hears ``ChunkSent(withdrawn=True)``. The far end here is a
plain link reader with the receiver's own ``BlockAssembler``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from node.driver import MAX_LINK_MESSAGE, Arrival, Conn, Driver
from node.guard import ConnectionGuard
from node.link import Link, LinkServer, dial
from swarm.errors import ChunkError
from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from tests.waiting import eventually

N = 3 * wire.BLOCK_BYTES + 1000  # four blocks, the last one short
PAYLOAD = os.urandom(N)


class _NoStore:
    """A store that holds nothing: an arriving chunk that failed cannot be read back."""

    def read_chunk(self, v: int, i: int) -> bytes:
        raise ChunkError(f"chunk {i} of version {v} is not held")


async def _link(messages: asyncio.Queue) -> tuple[LinkServer, Link]:
    async def reader(link: Link) -> None:
        while (msg := await link.recv()) is not None:
            await messages.put(bytes(msg))

    server = LinkServer(reader, ssl_context=None, max_message=MAX_LINK_MESSAGE,
                        guard=ConnectionGuard(max_total=8, max_per_ip=8, upgrade_timeout_s=5))
    await server.start("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = await dial("127.0.0.1", port, ssl_context=None, max_message=MAX_LINK_MESSAGE,
                      timeout=5)
    return server, link


def _driver(sent: list[ev.ChunkSent], store: Any = None) -> Driver:
    """A driver whose core hears nothing (never started), ``ChunkSent`` events kept in ``sent``."""
    core = NodeCore(CoreConfig(node_id="a", region="r", model="m", listen_addr="127.0.0.1:1"),
                    verify_manifest=lambda raw: None, rng=random.Random(0))
    drv = Driver(core, store or _NoStore(), None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
    drv.loop = asyncio.get_running_loop()  # the writer runs on it (Driver.start sets it)
    feed = drv.feed

    def spy(e: ev.Event) -> None:
        if isinstance(e, ev.ChunkSent):
            sent.append(e)
        feed(e)

    drv.feed = spy  # type: ignore[method-assign]
    return drv


async def _quiet(messages: asyncio.Queue, s: float = 0.15) -> bool:
    try:
        await asyncio.wait_for(messages.get(), s)
    except TimeoutError:
        return True
    return False


async def _take(messages: asyncio.Queue, asm: wire.BlockAssembler, upto: int) -> Any:
    """Feed the receiver's assembler until it has ``upto`` bytes (or the chunk)."""
    out = None
    while out is None and asm.received < upto:
        out = asm.feed(await asyncio.wait_for(messages.get(), 5))
    return out


@contextlib.asynccontextmanager
async def _running(drv: Driver, c: Conn, server: LinkServer) -> AsyncIterator[None]:
    """``drv``'s writer sending on ``c`` while the block runs; then ``c``'s link and the far
    end's server closed."""
    writer = asyncio.create_task(drv._writer(c))
    try:
        yield
    finally:
        c.closing = True
        writer.cancel()
        await c.link.close()
        await server.close()


@contextlib.asynccontextmanager
async def _relaying(arriving: bool = True) -> AsyncIterator[tuple[asyncio.Queue, Arrival | None, list]]:
    """A driver whose writer relays chunk 0 of version 2 over a real link: yields
    what the far end received (a queue), the chunk's arrival (None: not arriving any
    more) and the ``ChunkSent`` events the core got."""
    messages: asyncio.Queue = asyncio.Queue()
    server, link = await _link(messages)
    sent: list[ev.ChunkSent] = []
    drv = _driver(sent)
    a = None
    if arriving:
        a = drv.arrivals[(2, 0)] = Arrival(conn=99, buf=memoryview(bytearray(PAYLOAD)), length=N)
    c = Conn(id=7, link=link, outbound=True, addr="peer")
    c.data.append((2, 0, True))
    async with _running(drv, c, server):
        yield messages, a, sent


def test_blocks_go_on_as_they_arrive_and_the_last_once_the_chunk_is_stored() -> None:
    asyncio.run(_stream_then_store())


async def _stream_then_store() -> None:
    async with _relaying() as (messages, a, sent):
        assert a is not None
        asm = wire.BlockAssembler()
        assert await _quiet(messages)  # nothing arrived yet: nothing goes
        a.got = wire.BLOCK_BYTES
        a.changed()
        assert await _take(messages, asm, wire.BLOCK_BYTES) is None
        assert asm.received == wire.BLOCK_BYTES
        a.got = N  # every byte is here, but it is not verified yet: the last block waits
        a.changed()
        assert await _take(messages, asm, 3 * wire.BLOCK_BYTES) is None
        assert await _quiet(messages)
        assert asm.received == 3 * wire.BLOCK_BYTES and not sent
        a.state = "stored"
        a.changed()
        out = await _take(messages, asm, N)
        assert out is not None and out[:2] == (2, 0) and bytes(out[2]) == PAYLOAD
        await eventually(lambda: sent, "the chunk's ChunkSent")
        assert sent == [ev.ChunkSent(sent[0].now, 7, 2, 0)]
        assert not a.watchers


@pytest.mark.parametrize("blocks_first", [0, 2])
def test_a_chunk_that_fails_here_is_withdrawn_from_the_receiver(blocks_first) -> None:
    asyncio.run(_stream_then_fail(blocks_first))


async def _stream_then_fail(blocks_first: int) -> None:
    async with _relaying() as (messages, a, sent):
        assert a is not None
        asm = wire.BlockAssembler()
        a.got = blocks_first * wire.BLOCK_BYTES
        a.changed()
        if blocks_first:
            await _take(messages, asm, a.got)
        a.state = "failed"  # corrupt, or its link closed, or a local fault
        a.changed()
        # the receiver is told to drop what it got (with no block yet: that it will not come)
        msg = await asyncio.wait_for(messages.get(), 5)
        assert asm.withdraw(msg) == (2, 0) and asm.pending is None
        assert await _quiet(messages)  # and nothing else
        assert sent == [ev.ChunkSent(sent[0].now, 7, 2, 0, withdrawn=True)]


def test_an_arriving_chunk_gone_before_its_turn_is_withdrawn_without_a_block() -> None:
    # the arrival failed and left the registry before the writer got to the relay: the
    # withdrawal alone goes (a requester waits for the chunk, serve_arriving)
    asyncio.run(_gone_before_its_turn())


async def _gone_before_its_turn() -> None:
    async with _relaying(arriving=False) as (messages, _a, sent):
        msg = await asyncio.wait_for(messages.get(), 5)
        assert wire.is_withdraw_message(msg) and wire.BlockAssembler().withdraw(msg) == (2, 0)
        assert await _quiet(messages)
        assert sent == [ev.ChunkSent(sent[0].now, 7, 2, 0, withdrawn=True)]


def test_a_fleet_relays_chunks_while_they_arrive_and_ends_bitwise_equal() -> None:
    """Real node processes, three regions, chunks of four blocks: the borders relay
    chunks on while they arrive (RELAY orders come ahead of their chunk), and every
    node ends on the trainer's digest with one copy per region."""
    from lab.fleet import LoopbackFleet

    with LoopbackFleet(3, 2, chunk_size=1 << 20, lr=1e-4, swarm={"cut_through": True,
                                                                         "cut_through_after_s": 0}) as fleet:
        fleet.start(timeout=120)
        cut = 0
        for _ in range(2):
            pub = fleet.publish()
            statuses = fleet.wait_version(pub["version"], timeout=120)
            assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
            assert all(st["bad_chunks"] == 0 for st in statuses.values())
            cut = sum(st["relays"]["cut_through"] for st in statuses.values())
        relayed_in = sum(st["chunks"]["received"]["cross_region"] for st in statuses.values())
        carried = sum(st["relays"]["at_once"] + st["relays"]["on_arrival"]
                      + st["relays"]["cut_through"] for st in statuses.values())
        assert carried >= relayed_in > 0
        assert cut > 0
        assert sum(st["relays"]["failed"] for st in statuses.values()) == 0
        metrics = fleet.http(fleet.nodes[0].addr, "/metrics").decode()
        assert 'outcome="cut_through"' in metrics


def test_the_core_timer_survives_a_loop_that_hands_back_a_plain_handle() -> None:
    """uvloop keeps time in whole milliseconds and turns a ``call_at`` whose delay rounds
    to 0 into ``call_soon``: a plain Handle, no ``when()``. On a loaded box the driver's
    timer, armed a millisecond ahead, became one, and the next ``_arm_timer`` died on
    ``when()`` inside a reader task (CI, round 49). The driver keeps the wake-up it armed
    for itself: the same wake-up again keeps the timer, another one replaces it."""
    import uvloop

    async def run() -> None:
        drv = _driver([])
        loop = asyncio.get_running_loop()
        drv.loop = loop
        armed: list[float] = []

        def call_at(when: float, cb: Any, *args: Any) -> asyncio.Handle:
            armed.append(when)
            return loop.call_soon(cb, *args)  # what uvloop returns for a 0 ms delay

        drv.loop = type("L", (), {"call_at": staticmethod(call_at), "time": loop.time})()  # type: ignore[assignment]
        wake = [loop.time() + 0.0004]
        drv.core.next_wakeup = lambda: wake[0]  # type: ignore[method-assign]
        drv._arm_timer()
        drv._arm_timer()  # the same wake-up: the timer is kept, nothing re-armed
        assert len(armed) == 1 and not hasattr(drv._timer, "when")  # a plain Handle
        wake[0] += 1.0
        drv._arm_timer()  # another wake-up: the plain Handle is cancelled and replaced
        assert len(armed) == 2
        drv._timer.cancel()  # type: ignore[union-attr]

    uvloop.run(run())
