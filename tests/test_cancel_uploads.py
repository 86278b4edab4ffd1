"""Answers their requester cancelled are stopped, not sent whole for nothing.

An endgame twin (``[swarm] endgame_chunks``) asks a second peer for a chunk already in
flight; when one copy arrives the requester sends CANCEL to the other. Before round 28 a
CANCEL dropped only queued answers: one under way went on to its last byte, and on the
emulated WAN every node took in 6-44 % more chunk bytes than the patch (whole duplicate
chunks, `dup_chunks`). Now the core stops an answer under way (``ev.StopChunk``) and the
driver withdraws it at its next block. The requester cancels the twins as soon as one copy
is all there (``ev.ChunkWhole``), before it is hashed and stored, not after.

Scripted single-core tests check the core's side (what is stopped, what is not, the slot
freed, the requester's view of the withdrawal); in-memory fleets (Hypothesis) that
versions still arrive with twins stopped; real links on loopback that the node driver's
writer stops at a block and withdraws (``PSW1`` / ``PSW2``), and that its receiver keeps
the relays cut through from a stopped copy going from the verified one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.driver import Arrival
from swarm.protocol import events as ev
from swarm.protocol import stripes, wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.testing import MODEL, SECRET, Script, Signer
from swarm.protocol.wire import BLOCK_BYTES
from tests.test_cut_through import _driver
from tests.test_protocol_core import fleet, publish
from tests.test_striped_links import CHUNKS, N, _drain, _receiving, _spy, _striped, _until

V = 2  # 4 chunks of 1000 bytes


def _node(held: tuple[int, ...], peers: tuple[str, ...], peer_bits: int, chunks: int,
          **knobs) -> tuple[NodeCore, dict[str, Script]]:
    """Node ``a`` (region ``r``) holding ``held`` of version 2's ``chunks``, linked to region
    ``peers`` that each show ``peer_bits`` of it."""
    s = Signer()
    cfg = CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1", swarm_secret=SECRET,
                     active_version=1, **knobs)
    n = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    n.raise_internal_errors = True
    n.handle(ev.LocalChunks(0.0, s.manifest(V, chunks), held))
    out = {}
    for conn, name in enumerate(peers, start=1):
        p = Script(n, conn, node_id=name, region="r")
        p.handshake()
        p.send(wire.Bitfield(V, wire.bits_to_bytes(peer_bits, chunks)))
        out[name] = p
    return n, out


def _holder(**knobs) -> tuple[NodeCore, dict[str, Script]]:
    """Node ``a`` holding chunks 0-2 of version 2, linked to region peers ``c`` and ``d``."""
    return _node((0, 1, 2), ("c", "d"), 0, 4, **knobs)


def _stops(actions: list[ev.Action]) -> list[ev.StopChunk]:
    return [a for a in actions if isinstance(a, ev.StopChunk)]


def _chunks(actions: list[ev.Action]) -> list[tuple[int, int, int]]:
    return [(a.conn, a.version, a.index) for a in actions if isinstance(a, ev.SendChunk)]


def test_a_cancel_stops_the_answer_under_way_and_drops_the_queued_one() -> None:
    n, p = _holder(upload_slots=1, upload_queue=4)
    c = p["c"]
    c.send(wire.Request(V, (0, 1)))
    assert _chunks(c.actions) == [(c.conn, V, 0)]  # 1 waits for the slot
    c.send(wire.Cancel(V, (0, 1)))
    assert _stops(c.actions) == [ev.StopChunk(c.conn, V, 0)]
    assert n.counters.uploads_cancelled == 1
    got = n.handle(ev.ChunkSent(n.now, c.conn, V, 0, withdrawn=True))
    assert _chunks(got) == []  # the queued one went with the CANCEL
    assert n.exchange.uploads.active == set()
    assert n.counters.sent_chunks == dict.fromkeys(n.counters.sent_chunks, 0)  # none delivered


def test_a_stopped_answer_frees_its_slot_for_another_peer() -> None:
    n, p = _holder(upload_slots=1, upload_queue=4)
    c, d = p["c"], p["d"]
    c.send(wire.Request(V, (0,)))
    d.send(wire.Request(V, (1,)))
    assert _chunks(d.actions) == []  # queued behind c's
    c.send(wire.Cancel(V, (0,)))
    assert _stops(c.actions) == [ev.StopChunk(c.conn, V, 0)]
    got = n.handle(ev.ChunkSent(n.now, c.conn, V, 0, withdrawn=True))
    assert _chunks(got) == [(d.conn, V, 1)]


def test_a_cancel_stops_nothing_that_is_not_an_answer_under_way() -> None:
    n, p = _holder(upload_slots=2)
    c, d = p["c"], p["d"]
    c.send(wire.Cancel(V, (0, 3)))  # never asked for
    assert _stops(c.actions) == []
    c.send(wire.Request(V, (0,)))
    n.handle(ev.ChunkSent(n.now, c.conn, V, 0))
    c.send(wire.Cancel(V, (0,)))  # already gone whole
    assert _stops(c.actions) == []
    d.send(wire.Request(V, (1,)))
    c.send(wire.Cancel(V, (1,)))  # another peer's answer
    assert _stops(c.actions) == []
    c.send(wire.Cancel(V + 1, (1,)))  # another version
    assert _stops(c.actions) == [] and n.counters.uploads_cancelled == 0


def test_the_withdrawal_of_a_cancelled_twin_leaves_what_the_peer_holds() -> None:
    """The requester's side: the withdrawal of an answer it cancelled (it holds the
    chunk) changes nothing of what the sender holds; one of a chunk it still lacks
    drops the bit (the sender did not hold it after all), as before."""
    s = Signer()
    cfg = CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1", swarm_secret=SECRET,
                     active_version=1)
    n = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    n.raise_internal_errors = True
    n.handle(ev.LocalChunks(0.0, s.manifest(V, 4), ()))
    b = Script(n, 1, node_id="b", region="r")
    b.handshake()
    b.send(wire.Bitfield(V, wire.bits_to_bytes(0b0011, 4)))
    n.handle(ev.ChunkReceived(n.now, 1, V, 0, True))
    n.handle(ev.ChunkWithdrawn(n.now, 1, V, 0))  # held here: a stopped twin
    assert n.peers[1].bits[V] == 0b0011
    n.handle(ev.ChunkWithdrawn(n.now, 1, V, 1))  # not held here
    assert n.peers[1].bits[V] == 0b0001
    assert n.counters.withdrawn == 1  # the stopped twin is not a failed arrival


def _run_fleet(seed: int, per: int, twins: int, rate: float, twin_after: float = 0.0) -> list:
    """Two regions of ``per`` nodes take two versions; twins asked at once unless
    ``twin_after`` (``endgame_twin_after_s``) holds them back (tests/test_endgame_twins.py)."""
    s, net, o, hosts = fleet(2, per, seed=seed, endgame_chunks=twins, upload_slots=2,
                             endgame_twin_after_s=twin_after)
    net.rate = rate  # bytes/s: a 1000-byte chunk takes 1000 / rate s, a CANCEL 5 ms
    for v in (2, 3):
        publish(s, net, o, v, 12)
        net.run(net.now + 60)
        assert all(v in h.applied for h in hosts), v
    assert all(not h.sending and not h.stopped for h in hosts)  # every chunk out ended once
    assert all(h.core.exchange.uploads.active == set() for h in hosts)
    return hosts


def _wanting(**knobs) -> tuple[NodeCore, dict[str, Script]]:
    """Node ``a`` wanting version 2, region peers ``b`` and ``c`` holding every chunk,
    endgame from the start: chunk 0 asked of one and its twin of the other (at once:
    ``endgame_twin_after_s = 0``)."""
    return _node((), ("b", "c"), 0b1, 1, **{"endgame_chunks": 8, "pipeline": 1,
                                           "endgame_twin_after_s": 0.0, **knobs})


def _asked(n: NodeCore) -> list[int]:
    return sorted(n.requests.asked.get((V, 0), []))


def test_twins_are_cancelled_once_a_copy_is_whole_before_it_is_verified() -> None:
    n, p = _wanting()
    assert _asked(n) == [1, 2]  # asked of b, and its twin of c
    got = n.handle(ev.ChunkWhole(n.now, 1, V, 0))  # b's copy is all here, being hashed
    assert p["c"].frames(got) == [wire.Cancel(V, (0,))] and p["b"].frames(got) == []
    assert _asked(n) == [1] and (V, 0) not in n.peers[2].req
    n.handle(ev.ChunkWithdrawn(n.now, 2, V, 0))  # c stopped its answer
    assert n.peers[2].bits[V] == 0b1 and n.counters.withdrawn == 0  # c still holds it
    n.handle(ev.ChunkReceived(n.now, 1, V, 0, True))
    assert 0 in n.have(V) and n.requests.n == 0


def test_a_whole_copy_that_is_bad_gets_the_chunk_asked_for_again() -> None:
    n, p = _wanting()
    n.handle(ev.ChunkWhole(n.now, 1, V, 0))
    got = n.handle(ev.ChunkReceived(n.now, 1, V, 0, False))  # b's copy was corrupt
    assert p["c"].frames(got) == [wire.Request(V, (0,))]  # asked again, of c
    assert _asked(n) == [2]


def test_a_whole_copy_of_what_was_not_asked_twice_cancels_nothing() -> None:
    n, _ = _wanting(endgame_chunks=0)
    assert len(_asked(n)) == 1
    asker = _asked(n)[0]
    other = 3 - asker
    assert n.handle(ev.ChunkWhole(n.now, other, V, 0)) == []  # not asked of it: nothing
    got = n.handle(ev.ChunkWhole(n.now, asker, V, 0))
    assert [a for a in got if isinstance(a, ev.SendFrame)] == [] and _asked(n) == [asker]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 1000), per=st.integers(3, 6), twins=st.integers(1, 12),
       rate=st.sampled_from([2e4, 1e5, 1e6]), twin_after=st.sampled_from([0.0, 0.01, 0.1, 2.0]))
def test_fleets_with_stopped_twins_get_every_version(seed: int, per: int, twins: int,
                                                     rate: float, twin_after: float) -> None:
    """In-memory fleets with up to every chunk in endgame: the twins' answers are
    stopped (their slots freed), and every node still gets both versions, twins asked at
    once or held back."""
    _run_fleet(seed, per, twins, rate, twin_after)


def test_stopping_cancelled_answers_takes_in_fewer_duplicate_chunks(monkeypatch) -> None:
    """The same fleet with answers under way left to finish (the old CANCEL) and stopped:
    stopping takes in fewer whole duplicate chunks."""
    from swarm.protocol.uploads import UploadSlots

    hosts = _run_fleet(seed=3, per=5, twins=12, rate=2e4)
    stopped = sum(h.core.counters.uploads_cancelled for h in hosts)
    dups = sum(h.core.counters.dup_chunks for h in hosts)
    monkeypatch.setattr(UploadSlots, "sending", lambda self, conn, v, i: False)
    old = sum(h.core.counters.dup_chunks for h in _run_fleet(seed=3, per=5, twins=12, rate=2e4))
    assert stopped > 0 and dups < old, (stopped, dups, old)


def test_the_writer_stops_a_chunk_at_a_block_and_withdraws_it() -> None:
    """A chunk going on one connection: stopped after its second block, the peer gets
    ``PSW1`` and no further block; a queued one is dropped with nothing sent."""

    async def go() -> None:
        async with _striped(lanes=1) as (drv, c, messages, sent):
            drv.conns[7] = c
            a = drv.arrivals[(2, 0)] = Arrival(conn=99, buf=memoryview(bytearray(CHUNKS[(2, 0)])),
                                              length=N)
            a.got = 2 * BLOCK_BYTES  # comes no faster than it arrives here
            c.data.append((2, 0, True))
            c.data.append((2, 1, False))
            c.wake.set()
            got = await _drain(messages, at_least=2)
            assert [m[:4] for _, m in got] == [b"PSB1", b"PSB1"]
            drv._do(ev.StopChunk(7, 2, 1))  # still queued: dropped unsent
            assert list(c.data) == [] and sent == [ev.ChunkSent(sent[0].now, 7, 2, 1, withdrawn=True)]
            drv._do(ev.StopChunk(7, 2, 0))
            got = await _drain(messages, at_least=1)
            assert [m for _, m in got] == [wire.pack_withdraw(2, 0)]
            assert [(e.index, e.withdrawn) for e in sent] == [(1, True), (0, True)]
            assert drv.uploads_stopped == 2 and c not in a.watchers and c.sending is None
            a.got, a.state = N, "stored"  # the rest arriving here sends nothing more
            a.changed()
            assert await _drain(messages) == []

    asyncio.run(go())


def test_the_writer_stops_a_striped_chunk_by_its_seq() -> None:
    async def go() -> None:
        async with _striped(lanes=2) as (drv, c, messages, sent):
            drv.conns[7] = c
            a = drv.arrivals[(2, 0)] = Arrival(conn=99, buf=memoryview(bytearray(CHUNKS[(2, 0)])),
                                              length=N)
            a.got = 2 * BLOCK_BYTES
            c.data.append((2, 0, True))
            c.wake.set()
            got = await _drain(messages, at_least=2)
            assert len(got) == 2 and all(stripes.magic_of(m) == stripes.STRIPE_MAGIC for _, m in got)
            drv._do(ev.StopChunk(7, 2, 0))
            got = await _drain(messages, at_least=1)
            assert [(lane, stripes.unpack_withdraw(m)) for lane, m in got] == [(0, (0, 2, 0))]
            assert sent == [ev.ChunkSent(sent[0].now, 7, 2, 0, withdrawn=True)]
            assert 0 not in c.out and c.unfinished == {0}  # until the peer's DONE

    asyncio.run(go())


def _frame(msg: bytes) -> bytes:
    from node.link import HEADER

    return HEADER.pack(len(msg)) + msg


@contextlib.asynccontextmanager
async def _twin_arriving(twin: bytes, check: Any) -> AsyncIterator[SimpleNamespace]:
    """A receiving driver (verdicts from ``check``) that has the first two blocks of a
    chunk's copy ``twin`` from link 7 (PSB1), a relay cutting through from them (``watcher``),
    and link 8 (``other``) ready to bring another copy whole."""
    from node.link import PREFACE
    from tests.test_link import _feed
    from tests.test_striped_links import wire_block

    drv = _driver([])
    drv.core.authenticated = lambda cid: True  # type: ignore[method-assign]
    events = _spy(drv, ev.Event)
    drv._check_and_store = check  # type: ignore[method-assign]
    drv._prestage_kick = lambda v: None  # type: ignore[method-assign]
    c, p0, _p2, tasks = _receiving(drv)
    psb1 = [wire_block(2, 0, len(twin), k * BLOCK_BYTES, twin[k * BLOCK_BYTES:(k + 1) * BLOCK_BYTES])
            for k in range(len(twin) // BLOCK_BYTES)]
    try:
        _feed(p0, PREFACE + _frame(psb1[0]) + _frame(psb1[1]), [65536])
        await _until(lambda: c.blocks.received == 2 * BLOCK_BYTES)
        arrival = drv.arrivals[(2, 0)]

        watcher = type(c)(id=9, link=c.link, outbound=True, addr="relay")  # cutting through
        watcher.restart.chunk_started(drv.now(), paced=True)  # at the source's pace
        arrival.watchers.append(watcher)
        other = type(c)(id=8, link=c.link, outbound=True, addr="other")
        drv.conns[8] = other
        yield SimpleNamespace(drv=drv, c=c, events=events, arrival=arrival, watcher=watcher,
                              other=other, psb1=psb1,
                              feed=lambda msg: _feed(p0, _frame(msg), [65536]))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _twin_receiver(prefix_same: bool) -> None:
    """The receiver: chunk 0 arrives on link 7 (PSB1) with a relay cutting through from
    it, then comes whole and verified on another link. The relay goes on from the
    verified copy if what it sent so far is that copy's (a late block of link 7's copy
    then moves nothing), and is withdrawn if not; link 7's copy is then withdrawn (the
    twin stopped) without failing anything or blaming anyone."""
    good = os.urandom(4 * BLOCK_BYTES)
    twin = good if prefix_same else bytes([good[0] ^ 1]) + good[1:]

    async def go() -> None:
        async with _twin_arriving(twin, lambda v, i, payload, digest=None: None) as t:
            drv, c, events, arrival = t.drv, t.c, t.events, t.arrival
            verified = memoryview(bytearray(good))
            await drv._on_chunk(t.other, (2, 0, verified))
            assert t.watcher.wake.is_set()
            mine = [type(e) for e in events if getattr(e, "conn", None) == 8]
            assert mine == [ev.ChunkWhole, ev.ChunkReceived]  # twins cancelled before the hash
            if prefix_same:
                assert arrival.state == "stored" and arrival.buf is verified
                assert t.watcher.restart.free_from is not None  # now at the link's own pace
                assert arrival.got == len(good) and drv.arrivals[(2, 0)] is arrival
                t.feed(t.psb1[2])  # a late block of link 7's copy
                await _until(lambda: c.blocks.received == 3 * BLOCK_BYTES)
                assert arrival.buf is verified and arrival.got == len(good)  # moves nothing
                assert sum(isinstance(e, ev.ChunkArriving) for e in events) == 1
            else:
                assert arrival.state == "failed" and (2, 0) not in drv.arrivals
            t.feed(wire.pack_withdraw(2, 0))
            await _until(lambda: any(isinstance(e, ev.ChunkWithdrawn) for e in events))
            assert (2, 0) not in drv.arrivals and c.blocks.pending is None
            if prefix_same:
                assert arrival.state == "stored"  # the relay finishes from the verified copy
            assert 7 in drv.conns  # nobody blamed

    asyncio.run(go())


def test_relays_from_a_stopped_twin_go_on_from_the_verified_copy() -> None:
    _twin_receiver(prefix_same=True)


def test_relays_from_a_twin_that_differs_from_the_verified_copy_are_withdrawn() -> None:
    _twin_receiver(prefix_same=False)


@pytest.mark.parametrize("behind", [False, True])
def test_a_relay_cutting_through_goes_at_its_own_pace_once_the_chunk_is_all_here(
        behind: bool) -> None:
    """The relay's congestion restarts (``CongestionRestart``) leave it alone while the
    chunk arrives, however far behind it is, and judge it by its own pace from the
    chunk's last byte (before the hash's verdict)."""
    good = os.urandom(4 * BLOCK_BYTES)
    seen: list[float | None] = []
    box: list[Any] = []

    def check(v: int, i: int, payload: Any, digest: Any = None) -> None:  # what the hash sees
        seen.append(box[0].watcher.restart.free_from)

    async def go() -> None:
        async with _twin_arriving(good, check) as t:
            box.append(t)
            r = t.watcher.restart
            assert r.free_from is None and r.next_check() is None
            t.watcher.handed = 0 if behind else 2 * BLOCK_BYTES
            t.feed(t.psb1[2])
            await _until(lambda: t.c.blocks.received == 3 * BLOCK_BYTES)
            assert r.free_from is None and r.next_check() is None  # still arriving
            t.feed(t.psb1[3])
            await _until(lambda: t.arrival.state == "stored")
            assert seen and seen[0] is not None  # judged from before the verdict
            assert r.next_check() is not None

    asyncio.run(go())


def test_a_fleet_of_processes_with_every_chunk_twinned_ends_bitwise_equal() -> None:
    """Real node processes, one region of four, every chunk of the patch in endgame from
    the start (each asked of two peers, the loser cancelled and stopped): every node ends
    on the trainer's digest, nothing corrupt, no stopped twin counted as a failed arrival,
    and the new counters are served."""
    from lab.fleet import LoopbackFleet

    with LoopbackFleet(1, 4, chunk_size=1 << 20, lr=1e-4, tls=True,
                       swarm={"endgame_chunks": 1024}) as fleet:
        fleet.start(timeout=120)
        fleet.publish_converged()
        statuses = fleet.publish_converged()
        assert all(st["bad_chunks"] == 0 for st in statuses.values())
        assert sum(st["withdrawn_chunks"] for st in statuses.values()) == 0
        tr = [st["transport"] for st in statuses.values()]
        assert all(t["uploads_stopped"] <= t["uploads_cancelled"] for t in tr), tr
        print("cancelled / stopped:", [(t["uploads_cancelled"], t["uploads_stopped"]) for t in tr],
              "dup chunks:", [st["dup_chunks"] for st in statuses.values()])
        # blocks go straight into their chunk's buffer even while the reader lags
        # (Link.place_with's settling; before it ~18 % did on the loopback benchmark)
        placed = sum(t["blocks_placed"] for t in tr)
        copied = sum(t["blocks_copied"] for t in tr)
        print("blocks placed / copied:", placed, copied)
        assert placed >= 0.6 * (placed + copied), (placed, copied)
        metrics = fleet.http(fleet.nodes[0].api_addr, "/metrics").decode()
        assert "patchswarm_uploads_stopped_total" in metrics
        assert "patchswarm_blocks_placed_total" in metrics
        # the payload buffer pool (node.buffers) is served: nothing of it is out once
        # both versions are applied
        pools = [st["buffers"] for st in statuses.values()]
        print("buffer pools:", pools)
        assert all(p["out_bytes"] == 0 and p["taken"] == p["reused"] + p["allocated"]
                   for p in pools), pools
        assert 'patchswarm_buffers_taken_total{' in metrics
        assert 'patchswarm_buffer_pool_bytes{' in metrics
        # each apply says how much of its patch was decoded while it downloaded (the
        # trainer's manifests carry the layout, so records are decoded in any order)
        for st in statuses.values():
            split = st["apply_split"][str(st["active_version"])]
            assert 0 <= split["ahead_bytes"] <= st["store_bytes"], split
        print("decoded ahead:", [st["apply_split"][str(st["active_version"])]["ahead_bytes"]
                                 for st in statuses.values()])
        assert "patchswarm_apply_last_seconds{" in metrics
        assert "patchswarm_apply_last_ahead_bytes{" in metrics


def _withdrawn_while_verifying(good_copy: bool) -> None:
    """Chunk 0 arrives on link 7 with a relay cutting through from it; its twin on another
    link is whole and being hashed (so link 7's copy was cancelled at ``ChunkWhole``), and
    link 7's withdrawal lands during that hash. The relay waits for the verdict instead of
    failing: it goes on from the verified copy, or fails if that copy was bad."""
    import threading

    good = os.urandom(4 * BLOCK_BYTES)
    release = threading.Event()

    def slow_check(v: int, i: int, payload: Any, digest: Any = None) -> bool | None:
        release.wait(5)
        return None if good_copy else False

    async def go() -> None:
        try:
            async with _twin_arriving(good, slow_check) as t:
                drv, arrival = t.drv, t.arrival
                verified = memoryview(bytearray(good))
                verifying = asyncio.create_task(drv._on_chunk(t.other, (2, 0, verified)))
                await _until(lambda: drv.verifying.get((2, 0)))
                t.feed(wire.pack_withdraw(2, 0))  # the cancelled twin stops
                await _until(lambda: any(isinstance(e, ev.ChunkWithdrawn) for e in t.events))
                assert arrival.state == "arriving" and arrival.withdrawn  # waits for the verdict
                release.set()
                await verifying
                if good_copy:
                    assert arrival.state == "stored" and arrival.buf is verified
                else:
                    assert arrival.state == "failed" and (2, 0) not in drv.arrivals
                assert not drv.verifying and 7 in drv.conns
        finally:
            release.set()

    asyncio.run(go())


def test_relays_from_a_twin_withdrawn_during_the_hash_wait_for_the_verdict() -> None:
    _withdrawn_while_verifying(good_copy=True)


def test_relays_from_a_twin_withdrawn_during_a_bad_hash_fail() -> None:
    _withdrawn_while_verifying(good_copy=False)


def test_a_chunk_that_came_as_one_message_is_logged_as_received(
        caplog: pytest.LogCaptureFixture) -> None:
    """A patch's short last chunk comes as one message, not block by block (no arrival):
    at debug level it gets its ``chunk_received`` line too, with its verdict, so that the
    WAN timeline (``wan_timeline.last_chunk_waits``) sees when each node had every chunk.
    A copy whose hash does not match is logged as failed."""
    import logging

    from node.conn import Conn

    async def go() -> None:
        drv = _driver([])
        drv.core.authenticated = lambda cid: True  # type: ignore[method-assign]
        drv._prestage_kick = lambda v: None  # type: ignore[method-assign]
        verdicts = {3: None, 4: False}  # 4: its hash does not match
        drv._check_and_store = lambda v, i, payload, digest=None: verdicts[i]  # type: ignore[method-assign]
        c = Conn(id=5, link=None, outbound=True, addr="10.213.1.2:7400")
        drv.conns[5] = c
        await drv._on_chunk(c, (2, 3, memoryview(b"x" * 1800)))
        await drv._on_chunk(c, (2, 4, memoryview(b"y" * 10)))

    caplog.set_level(logging.DEBUG, logger="patchswarm.node")
    asyncio.run(go())
    seen = [r.fields for r in caplog.records if r.getMessage() == "chunk_received"]
    assert [(f["peer"], f["version"], f["index"], f["state"], f["s"]) for f in seen] == [
        ("10.213.1.2:7400", 2, 3, "stored", 0.0), ("10.213.1.2:7400", 2, 4, "failed", 0.0)]
