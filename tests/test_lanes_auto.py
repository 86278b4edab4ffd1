"""``[network] lanes = "auto"``: a link gets lanes once its sender finds it capped by
random loss (``node.tcp.RandomLoss``, docs/striped-links.md).

The rule against a plain model (Hypothesis); ``path_sample`` on a live socket; the
driver's writer over real loopback links, with the kernel's loss figures fed in (loopback
loses nothing): the dialer offers a token, an acceptor asks the dialer with ``PSA2``, a
full queue keeps the lanes shut, and only a cross-region link under a loss-based
congestion control is looked at; a dialer answers an ask by offering, unless it stripes
nothing. The emulated lossy and clean WANs check the rule on real loss
(``bench_wan.py --lanes auto``, docs/striped-links.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import node.striping as driver_mod
from node.driver import Conn, Driver
from node.tcp import LOSS_PROBE_S, QUEUE_FACTOR, RandomLoss, loss_share, path_sample
from swarm.protocol import stripes, wire
from swarm.protocol.wire import BLOCK_BYTES
from tests.test_cut_through import _driver, _link
from tests.waiting import eventually

# ------------------------------------------------------------------- the rule

_looks = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 3), st.integers(1, 400),
                            st.integers(0, 200), st.booleans()), max_size=40)


@given(_looks, st.integers(1, 4))
def test_random_loss_follows_its_model(looks: list[tuple[float, int, int, int, bool]],
                                       need: int) -> None:
    """Looks ``every_s`` apart; a look with new retransmissions within ``QUEUE_FACTOR`` of
    the floor counts, one with them above it resets the count; ``need`` decide, once. A
    chunk's first look only notes the count (losses between chunks do not count)."""
    probe = RandomLoss(every_s=LOSS_PROBE_S, need=need)
    now, retrans, seen, decided, last, queued = 0.0, 0, 0, False, None, 0
    for dt, new, srtt, floor, fresh in looks:
        now += dt
        due = probe.due(now)
        assert due == (not decided and (last is None or now >= last + LOSS_PROBE_S))
        if not due:
            continue
        retrans += new
        first = last is None or fresh
        last = now
        got = probe.sample(now, retrans, srtt, floor, fresh=fresh)
        want = False
        if not first and new > 0:
            if floor > 0 and srtt <= QUEUE_FACTOR * floor:
                seen += 1
                want = seen >= need
            else:
                seen = 0
                queued += new  # a full queue's: left out of the share that sizes lanes
        assert got == want
        assert probe.queued == queued
        decided = decided or want
    assert probe.decided == decided


def test_path_sample_reads_a_live_socket() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    done = threading.Event()

    def drain() -> None:
        while peer.recv(1 << 20):
            pass
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        cli.sendall(b"x" * (8 << 20))
        sample = path_sample(cli)
        assert sample is not None
        retrans, srtt, floor = sample
        assert retrans >= 0 and srtt > 0 and 0 < floor <= srtt + 1_000_000
        share = loss_share(cli)
        assert share is not None and 0.0 <= share < 1.0
        assert loss_share(cli, queued=10**9) == 0.0  # never below nothing lost
    finally:
        cli.close()
        done.wait(5)
        peer.close()
        srv.close()
    assert path_sample(None) is None


# ------------------------------------------------------------- the driver's writer

N = 3 * BLOCK_BYTES
CHUNKS = {(2, i): bytes([i]) * N for i in range(8)}


class _Store:
    def read_chunk(self, v: int, i: int) -> bytes:
        return CHUNKS[(v, i)]


@contextlib.contextmanager
def _kernel_says(srtt_us: int, floor_us: int, share: float | None = 0.001) -> Iterator[None]:
    """``path_sample`` as a lossy socket would answer: one more retransmission per look;
    looks at every block (loopback sends a chunk's blocks within the probe's period);
    ``share`` of its segments retransmitted (``loss_share``)."""
    count = itertools.count()
    real = driver_mod.path_sample, driver_mod.RandomLoss, driver_mod.loss_share
    driver_mod.path_sample = lambda sock: (next(count), srtt_us, floor_us)  # type: ignore[assignment]
    driver_mod.RandomLoss = functools.partial(RandomLoss, every_s=0.0)  # type: ignore[assignment,misc]
    driver_mod.loss_share = lambda sock, queued=0: share  # type: ignore[assignment]
    try:
        yield
    finally:
        driver_mod.path_sample, driver_mod.RandomLoss, driver_mod.loss_share = real  # type: ignore[assignment,misc]


@contextlib.asynccontextmanager
async def _sender(outbound: bool, congestion: str = "cubic", other_region: bool = True,
                  auto: bool = True) -> AsyncIterator[tuple[Driver, Conn, asyncio.Queue]]:
    """A driver (``lanes = "auto"``) whose writer sends chunks on a real link to a plain
    server that queues what it gets."""
    drv = _driver([], _Store())
    drv.lanes, drv.lanes_auto = stripes.AUTO_LANES, auto
    drv.congestion_in_use = congestion
    drv._other_region = lambda c: other_region  # type: ignore[method-assign]
    async with _writing(drv, 7, outbound) as (c, messages):
        yield drv, c, messages


@contextlib.asynccontextmanager
async def _writing(drv: Driver, cid: int, outbound: bool) -> AsyncIterator[tuple[Conn, asyncio.Queue]]:
    """Link ``cid`` of ``drv`` to a plain server that queues what it gets, its writer running."""
    messages: asyncio.Queue = asyncio.Queue()
    server, link = await _link(messages)
    c = Conn(id=cid, link=link, outbound=outbound, addr=f"peer{cid}" if cid != 7 else "peer")
    c.sock = link.get_extra_info("socket")
    writer = asyncio.create_task(drv._writer(c))
    try:
        yield c, messages
    finally:
        c.closing = True
        c.wake.set()
        writer.cancel()
        await link.close()
        await server.close()


async def _send_chunks(c: Conn, messages: asyncio.Queue, k: int, gap_s: float) -> list[bytes]:
    """``k`` chunks, ``gap_s`` apart (the probe looks every ``LOSS_PROBE_S``); what the
    far end got that is not a block (every block of the ``k`` chunks must have come)."""
    for i in range(k):
        c.data.append((2, i, False))
        c.wake.set()
        await asyncio.sleep(gap_s)
    out, blocks = [], 0
    with contextlib.suppress(TimeoutError):
        while True:
            msg = await asyncio.wait_for(messages.get(), 0.3)
            if wire.is_block_message(msg):
                blocks += 1
            else:
                out.append(msg)
    assert blocks == k * (N // BLOCK_BYTES)
    return out


@pytest.mark.parametrize(("outbound", "share", "lanes"),
                         [(True, 0.001, 4), (False, 0.001, 4), (True, 0.01, 13), (False, 0.01, 13),
                          (False, None, 4)])
def test_a_lossy_link_gets_lanes_once(outbound: bool, share: float | None, lanes: int) -> None:
    """Retransmissions at the round-trip floor: the dialer offers a token, the acceptor
    asks the dialer to open lanes with one it holds for them; once, however long the
    link goes on losing. As many as its share of retransmitted segments calls for
    (``stripes.lanes_for_loss``): the acceptor names the count in its ask."""
    async def go() -> None:
        with _kernel_says(srtt_us=80_000, floor_us=79_000, share=share):
            async with _sender(outbound) as (drv, c, messages):
                got = await _send_chunks(c, messages, 6, 0.05)
        magic = stripes.OFFER_MAGIC if outbound else stripes.ASK_MAGIC
        assert [m[:4] for m in got] == [magic], got
        if outbound:
            assert stripes.unpack_offer(got[0]) == c.lane_token
        else:
            assert stripes.unpack_ask(got[0]) == (c.lane_token, lanes) and c.asked
            assert drv.lane_tokens == {c.lane_token: c.id}  # a lane with it is taken
        assert drv.loss_capped == 1 and c.want_lanes == lanes
    asyncio.run(go())


@pytest.mark.parametrize("outbound", [True, False])
def test_a_link_to_a_region_found_lossy_takes_lanes_with_its_first_chunk(outbound: bool) -> None:
    """Once one link to a region was found capped by random loss, the next link to that
    region asks for (or offers) as many lanes at its first block, although its own
    socket has shown no loss yet; a link to another region still waits for its probe."""
    async def go() -> None:
        with _kernel_says(srtt_us=80_000, floor_us=79_000, share=0.01):
            async with _sender(outbound) as (drv, c, messages):
                regions = {c.id: "far"}
                drv.core.peer_region = lambda cid: regions.get(cid)  # type: ignore[method-assign]
                await _send_chunks(c, messages, 3, 0.05)
                assert drv.loss_capped == 1 and drv.region_lanes["far"][0] == 13
                assert set(drv.region_lanes) == {"far"}
        driver_mod.path_sample = lambda sock: (0, 80_000, 79_000)  # no loss from here on
        try:
            for cid, region, learned in ((8, "far", True), (9, "near", False)):
                regions[cid] = region
                async with _writing(drv, cid, outbound) as (c2, got2):
                    out = await _send_chunks(c2, got2, 2, 0.05)
                if not learned:
                    assert out == [] and c2.lane_token is None and c2.loss is not None
                    continue
                magic = stripes.OFFER_MAGIC if outbound else stripes.ASK_MAGIC
                assert [m[:4] for m in out] == [magic], out
                assert c2.want_lanes == 13 and drv.lanes_learned == 1 and drv.loss_capped == 1
                if not outbound:
                    assert stripes.unpack_ask(out[0]) == (c2.lane_token, 13)
        finally:
            driver_mod.path_sample = path_sample
    asyncio.run(go())


@pytest.mark.parametrize("outbound", [True, False])
def test_a_region_found_lossy_gets_lanes_on_its_border_links_at_once(outbound: bool) -> None:
    """When one link to a region is found capped, our other links that carry chunks into
    that region (border links) ask for or offer as many lanes at once, with no chunk of
    their own; a link to that region that carries none (a tracker link) and a border link
    to another region do not."""
    async def go() -> None:
        with _kernel_says(srtt_us=80_000, floor_us=79_000, share=0.01):
            async with _sender(outbound) as (drv, c, messages):
                others: dict[int, tuple[str, bool]] = {8: ("far", True), 9: ("far", False),
                                                       10: ("near", True)}
                drv.core.peer_region = (  # type: ignore[method-assign]
                    lambda cid: "far" if cid == c.id else others[cid][0])
                drv.core.peer_border = (  # type: ignore[method-assign]
                    lambda cid: cid == c.id or others[cid][1])
                drv.core.authenticated = lambda cid: True  # type: ignore[method-assign]
                async with contextlib.AsyncExitStack() as stack:
                    links = {}
                    for cid in others:
                        links[cid] = await stack.enter_async_context(_writing(drv, cid, outbound))
                        drv.conns[cid] = links[cid][0]
                    await _send_chunks(c, messages, 2, 0.05)
                    assert drv.loss_capped == 1 and drv.lanes_learned == 1
                    magic = stripes.OFFER_MAGIC if outbound else stripes.ASK_MAGIC
                    for cid, (c2, q) in links.items():
                        got = await _send_chunks(c2, q, 0, 0)
                        if cid == 8:
                            assert [m[:4] for m in got] == [magic] and c2.want_lanes == 13
                            assert c2.loss_checked and c2.loss is None
                        else:
                            assert got == [] and c2.lane_token is None
    asyncio.run(go())


@pytest.mark.parametrize("outbound", [True, False])
def test_a_running_probe_takes_its_regions_lanes_once_learned(outbound: bool) -> None:
    """A link whose own probe has not decided (its losses came with a queue) takes the
    lanes another link to its region was found to need, at its next block."""
    async def go() -> None:
        with _kernel_says(srtt_us=180_000, floor_us=79_000, share=0.01):
            async with _sender(outbound) as (drv, c, messages):
                drv.core.peer_region = lambda cid: "far"  # type: ignore[method-assign]
                assert await _send_chunks(c, messages, 1, 0.05) == []
                assert c.loss is not None and c.loss.queued > 0 and c.lane_token is None
                drv.region_lanes["far"] = (9, drv.now() - driver_mod.REGION_LANES_S - 1)
                assert await _send_chunks(c, messages, 1, 0.05) == []  # too long ago
                drv.region_lanes["far"] = (9, drv.now())  # another link to "far" was found capped
                got = await _send_chunks(c, messages, 1, 0.05)
                magic = stripes.OFFER_MAGIC if outbound else stripes.ASK_MAGIC
                assert [m[:4] for m in got] == [magic], got
                assert c.loss is None and c.want_lanes == 9 and drv.lanes_learned == 1
                assert drv.loss_capped == 0
                assert await _send_chunks(c, messages, 1, 0.05) == []  # once
    asyncio.run(go())


@pytest.mark.parametrize("why", ["queue", "bbr", "same_region", "off"])
def test_no_lanes_where_they_would_not_pay(why: str) -> None:
    """Loss with the round trip over ``QUEUE_FACTOR`` x its floor (a full queue: more flows
    only take from the others), BBR (not capped by random loss), a link inside the
    region, or lanes not on "auto": nothing asked, nothing offered."""
    async def go() -> None:
        srtt = 180_000 if why == "queue" else 80_000
        with _kernel_says(srtt_us=srtt, floor_us=79_000):
            async with _sender(True, congestion="bbr" if why == "bbr" else "cubic",
                               other_region=why != "same_region",
                               auto=why != "off") as (drv, c, messages):
                got = await _send_chunks(c, messages, 5, 0.05)
                assert got == [] and drv.loss_capped == 0 and c.lane_token is None
                assert (c.loss is not None) == (why == "queue")
    asyncio.run(go())


def test_a_dialer_answers_an_ask() -> None:
    """An ask makes a dialer with lanes dial them with the asked token (once); one that
    offered a token of its own, or stripes nothing, lets it be; an ask that reaches an
    acceptor (dialers offer, they never ask) drops the link; an ask that crossed the
    dialer's offer gives way to the offer."""
    async def go() -> None:
        async with _sender(True) as (drv, c, messages):
            drv.core.authenticated = lambda cid: True  # type: ignore[method-assign]
            dialed: list[tuple[bytes, int]] = []

            async def open_lanes(conn: Any, token: bytes, lanes: int) -> None:
                dialed.append((token, lanes))

            drv._open_lanes = open_lanes  # type: ignore[method-assign]
            asked = os.urandom(stripes.TOKEN_BYTES)
            await drv._on_striped(c, stripes.pack_ask(asked))
            await drv._on_striped(c, stripes.pack_ask(os.urandom(stripes.TOKEN_BYTES)))
            await eventually(lambda: dialed, "the lanes dialed")
            await asyncio.sleep(0.05)  # and no second dial
            assert dialed == [(asked, stripes.AUTO_LANES)] and c.lane_token == asked
            assert await _send_chunks(c, messages, 0, 0) == []  # nothing to echo
            # an ask that names a count: auto dials that many, a fixed count its own
            for auto, want in ((True, 13), (False, stripes.AUTO_LANES)):
                drv.lanes_auto, c.lane_token, c.want_lanes = auto, None, 0
                n = len(dialed)
                await drv._on_striped(c, stripes.pack_ask(asked, 13))
                await eventually(lambda n=n: len(dialed) > n, "the lanes dialed")
                assert dialed[-1] == (asked, want)
            drv.lanes, c.lane_token = 1, None
            await drv._on_striped(c, stripes.pack_ask(asked))
            await asyncio.sleep(0.05)
            assert c.lane_token is None and len(dialed) == 3
        async with _sender(False) as (drv, c, messages):
            drv.core.authenticated = lambda cid: True  # type: ignore[method-assign]
            dropped: list[str] = []

            async def drop(conn: Any, reason: str) -> None:
                dropped.append(reason)

            drv._drop = drop  # type: ignore[method-assign]
            await drv._on_striped(c, stripes.pack_ask(os.urandom(stripes.TOKEN_BYTES)))
            assert dropped and "lane ask from the dialer" in dropped[0]
            # the acceptor asked; the dialer's own offer crossed it: the offer wins
            c.lane_token, c.asked = b"a" * 16, True
            drv.lane_tokens[c.lane_token] = c.id
            offered = os.urandom(stripes.TOKEN_BYTES)
            await drv._on_striped(c, stripes.pack_offer(offered))
            assert drv.lane_tokens == {offered: c.id} and c.lane_token == offered
            assert c.ctrl[-1] == stripes.pack_offer(offered)  # the echo
            await drv._on_striped(c, stripes.pack_offer(os.urandom(stripes.TOKEN_BYTES)))
            assert "a second lane offer" in dropped[-1]
            with pytest.raises(Exception, match="PSA2"):
                stripes.unpack_ask(stripes.ASK_MAGIC)
    asyncio.run(go())
