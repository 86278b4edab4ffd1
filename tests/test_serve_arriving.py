"""``serve_arriving``: a chunk may be asked for by the region's peers while it still arrives.

Scripted single-core tests (``testing.Script``) check the exact frames and actions:
the COMING notice and who gets it, who may ask, the answer sent while the chunk
arrives, the HAVE once stored, and the requester's side of COMING (a REJECT or a
withdrawal takes it back; blame nobody, ask elsewhere). In-memory fleets (``testing.Net``)
check that whole versions still arrive, with corrupt first copies and nodes dying
mid-transfer (Hypothesis), and the simulator's pacing of a chunk sent on while it
arrives.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.testing import MODEL, SECRET, Script, Signer
from tests.test_protocol_core import corrupt_first_copies, fleet, publish, publish_and_kill

V = 2  # the version in flight; 4 chunks of 1000 bytes


def _node(**knobs) -> tuple[NodeCore, dict[str, Script]]:
    """Node ``a`` (region ``r``) wanting version 2, linked to ``b`` (region ``r``, holds
    chunk 1), ``c`` and ``d`` (region ``r``, hold nothing), ``x`` (region ``r2``) and
    the origin. Every peer has shown version 2."""
    s = Signer()
    knobs.setdefault("serve_arriving_region", 0)  # offered in a region of any size
    cfg = CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1", swarm_secret=SECRET,
                     active_version=1, **knobs)
    n = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    n.raise_internal_errors = True
    n.handle(ev.LocalChunks(0.0, s.manifest(V, 4), ()))
    peers = {}
    for conn, (name, region, role) in enumerate(
            [("origin", "trainer", "origin"), ("b", "r", "node"), ("c", "r", "node"),
             ("d", "r", "node"), ("x", "r2", "node")], start=1):
        p = Script(n, conn, node_id=name, region=region, role=role, outbound=role == "origin")
        p.handshake()
        peers[name] = p
    for name, p in peers.items():
        bits = 0b0010 if name == "b" else 0
        p.send(wire.Bitfield(V, wire.bits_to_bytes(bits, 4)))
    return n, peers


def _haves(p: Script, actions: list[ev.Action]) -> list[wire.Have]:
    return [f for f in p.frames(actions) if isinstance(f, wire.Have)]


def _comings(p: Script, actions: list[ev.Action]) -> list[wire.Coming]:
    return [f for f in p.frames(actions) if isinstance(f, wire.Coming)]


def _chunks(actions: list[ev.Action]) -> list[ev.SendChunk]:
    return [a for a in actions if isinstance(a, ev.SendChunk)]


def test_an_arriving_chunk_is_told_early_to_region_peers_that_lack_it_only() -> None:
    n, p = _node(serve_arriving=True)
    got = n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    assert _comings(p["c"], got) == [wire.Coming(V, (1,))] == _comings(p["d"], got)
    # not the sender, not another region, not the origin (it plans by stored chunks)
    assert _comings(p["b"], got) == _comings(p["x"], got) == _comings(p["origin"], got) == []
    assert not [h for s in p.values() for h in _haves(s, got)]


def test_by_default_only_a_node_that_knows_a_large_region_offers_arriving_chunks() -> None:
    """The shipped default offers arriving chunks once the node knows 48 nodes of its
    region (the start-up it shortens grows with the region; small regions lose by it)."""
    n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region)
    assert CoreConfig.serve_arriving and CoreConfig.serve_arriving_region == 48
    got = n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    assert _comings(p["c"], got) == []  # it knows 4 of its region (itself included)
    p["b"].send(wire.Peers(tuple((f"m{k}", "r", f"m{k}:1", 0) for k in range(44))))
    got = n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 2))
    assert _comings(p["c"], got) == [wire.Coming(V, (2,))]
    # a request for a chunk offered this way is answered even in a small region
    assert p["c"].send(wire.Request(V, (1,))) == []
    assert _chunks(p["c"].actions) == [ev.SendChunk(p["c"].conn, V, 1, 1000, True)]


def test_without_the_knob_nothing_is_told_before_the_chunk_is_stored() -> None:
    n, p = _node(serve_arriving=False)
    got = n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    assert not [a for a in got if isinstance(a, ev.SendFrame)]
    assert p["c"].send(wire.Request(V, (1,))) == [wire.Reject(V, (1,))]


def test_a_region_peer_asking_for_an_arriving_chunk_gets_it_sent_while_it_arrives() -> None:
    n, p = _node(serve_arriving=True)
    n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    assert p["c"].send(wire.Request(V, (1,))) == []
    assert _chunks(p["c"].actions) == [ev.SendChunk(p["c"].conn, V, 1, 1000, True)]
    # another region may not: a cross-region copy is the origin's to plan
    assert p["x"].send(wire.Request(V, (1,))) == [wire.Reject(V, (1,))]
    # a chunk nobody is sending us is still refused
    assert p["d"].send(wire.Request(V, (2,))) == [wire.Reject(V, (2,))]


def test_once_stored_the_region_peers_get_the_have_as_ever() -> None:
    n, p = _node(serve_arriving=True, have_batch_s=0.0)
    n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    got = n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))
    assert _haves(p["c"], got) == [wire.Have(V, (1,))] == _haves(p["d"], got)
    assert not n.is_arriving(V, 1)


def test_a_chunk_that_arrives_corrupt_is_not_told_as_held_and_blames_its_sender() -> None:
    n, p = _node(serve_arriving=True, have_batch_s=0.0, max_bad_chunks=5)
    n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    got = n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, False))
    assert n.counters.bad_chunks == 1 and not n.is_arriving(V, 1)
    assert not [h for s in p.values() for h in _haves(s, got)]
    # the answer already going to c is the driver's to withdraw: its ChunkSent says so
    n.handle(ev.ChunkSent(n.now, p["c"].conn, V, 1, withdrawn=True))
    assert n.uploading == 0


def test_coming_makes_a_region_peer_a_source_but_not_a_holder_for_our_haves() -> None:
    n, p = _node(serve_arriving=True, have_batch_s=0.0)
    assert p["c"].send(wire.Coming(V, (2,))) == [wire.Request(V, (2,))]
    # another region's COMING is not for us; nor a version the peer has not shown
    assert p["x"].send(wire.Coming(V, (3,))) == []
    assert p["x"].send(wire.Coming(9, (0,))) == [] and not p["x"].closed()
    # chunk 2 reaches us from b before c's copy: c still gets our HAVE (it only said
    # the chunk was coming there, and it may never come)
    p["b"].send(wire.Have(V, (2,)))
    got = n.handle(ev.ChunkReceived(n.now, p["c"].conn, V, 2, True))
    assert _haves(p["c"], got) == [wire.Have(V, (2,))]


def test_without_the_knob_coming_is_ignored() -> None:
    _n, p = _node(serve_arriving=False)
    assert p["c"].send(wire.Coming(V, (2,))) == [] and not p["c"].closed()


def test_an_answer_paced_by_its_arrival_does_not_time_the_peer() -> None:
    """A chunk asked for while it arrives at a peer comes at the arrival's pace there
    (a slow cross-region relay): its time says nothing of the peer, and counted it
    would make the region's border look like a slow outlier to evict."""
    n, p = _node(serve_arriving=True)
    assert p["c"].send(wire.Coming(V, (2,))) == [wire.Request(V, (2,))]
    n.handle(ev.ChunkReceived(n.now + 3.0, p["c"].conn, V, 2, True))
    c = n.peers[p["c"].conn]
    assert c.samples == 0 and c.ewma == 0.0 and not n.requests.early
    # an ordinary answer is timed as ever
    p["b"].send(wire.Have(V, (3,)))
    c_frames = p["c"].send(wire.Have(V, (0,)))
    assert c_frames == [wire.Request(V, (0,))]
    n.handle(ev.ChunkReceived(n.now + 0.5, p["c"].conn, V, 0, True))
    assert c.samples == 1 and c.ewma == 0.5


def test_a_withdrawal_blames_nobody_and_the_chunk_is_asked_of_someone_else() -> None:
    n, p = _node(serve_arriving=True)
    # c says chunk 2 arrives there; we ask it (the only source)
    assert p["c"].send(wire.Coming(V, (2,))) == [wire.Request(V, (2,))]
    p["d"].send(wire.Coming(V, (2,)))  # d gets it too: a second source, not asked yet
    got = n.handle(ev.ChunkWithdrawn(n.now, p["c"].conn, V, 2))
    assert _chunks(got) == [] and not p["c"].closed(got)
    assert p["d"].frames(got) == [wire.Request(V, (2,))]  # asked elsewhere at once
    assert p["c"].frames(got) == []  # c no longer shows it: not asked again
    assert n.counters.withdrawn == 1 and n.counters.bad_chunks == 0
    assert not n.banned("c") and n.bans.strike("c", n.now) == 1  # no strike was counted before
    # c's HAVE once it holds the chunk makes it a source again
    p["c"].send(wire.Have(V, (2,)))
    assert n.peers[p["c"].conn].bits[V] & 0b0100


def test_a_reject_of_a_chunk_said_to_be_coming_takes_it_back() -> None:
    n, p = _node(serve_arriving=True)
    assert p["c"].send(wire.Coming(V, (3,))) == [wire.Request(V, (3,))]
    p["c"].send(wire.Reject(V, (3,)))  # its arrival failed before our request came
    peer = n.peers[p["c"].conn]
    assert not peer.bits[V] & 0b1000 and not peer.coming
    assert n.versions.states[V].avail[3] == 0


def test_a_withdrawal_before_the_handshake_is_ignored() -> None:
    n, _p = _node(serve_arriving=True)
    s = Script(n, 42, node_id="y", region="r")
    n.handle(ev.PeerConnected(n.now, 42, False, "y:1"))
    assert n.handle(ev.ChunkWithdrawn(n.now, 42, V, 0)) == []
    assert n.counters.withdrawn == 0 and not s.closed()


def _arrive_from(n: NodeCore, p: Script, i: int) -> list[ev.Action]:
    return n.handle(ev.ChunkArriving(n.now, p.conn, V, i))


def test_a_small_region_is_offered_a_version_s_last_chunks_arriving_from_outside() -> None:
    """Shipped defaults: a node of a small region offers nothing while chunks arrive,
    until it lacks at most ``serve_arriving_endgame`` (2) chunks, none of them held
    whole by a region peer. Then the ones arriving from outside the region are offered
    to the region's peers that lack them, at once and once each."""
    n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region)
    assert CoreConfig.serve_arriving_endgame == 2
    got = _arrive_from(n, p["x"], 0)  # lacks 0, 1, 2, 3: four
    assert _comings(p["c"], got) == []
    got = n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))  # three
    assert _comings(p["c"], got) == []
    # chunk 3 stored: it lacks 0 (arriving from x) and 2 (nobody holds it)
    got = n.handle(ev.ChunkReceived(n.now, p["origin"].conn, V, 3, True))
    assert _comings(p["c"], got) == [wire.Coming(V, (0,))] == _comings(p["d"], got)
    assert _comings(p["b"], got) == [wire.Coming(V, (0,))]  # b lacks 0 too
    assert _comings(p["x"], got) == _comings(p["origin"], got) == []
    assert n.counters.endgame_coming == 1
    # the origin's push of 2 arriving: offered too; 0 is not offered again
    got = _arrive_from(n, p["origin"], 2)
    assert _comings(p["c"], got) == [wire.Coming(V, (2,))]
    # a region peer asking for an offered chunk gets it while it arrives
    assert p["c"].send(wire.Request(V, (0,))) == []
    assert _chunks(p["c"].actions) == [ev.SendChunk(p["c"].conn, V, 0, 1000, True)]


def test_no_endgame_offer_while_a_region_peer_holds_a_missing_chunk_whole() -> None:
    n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region, have_batch_s=0.0)
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))
    n.handle(ev.ChunkReceived(n.now, p["origin"].conn, V, 3, True))
    p["c"].send(wire.Have(V, (2,)))  # c holds 2 whole: there is something to fetch
    assert _comings(p["d"], _arrive_from(n, p["x"], 0)) == []
    # 2 stored here: only 0 (from x) is left, offered now
    got = n.handle(ev.ChunkReceived(n.now, p["c"].conn, V, 2, True))
    assert _comings(p["d"], got) == [wire.Coming(V, (0,))] == _comings(p["c"], got)


def test_a_chunk_arriving_from_a_region_peer_is_not_offered_at_the_end() -> None:
    n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region)
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))
    n.handle(ev.ChunkReceived(n.now, p["origin"].conn, V, 3, True))
    assert not [f for s in p.values() for f in _comings(s, _arrive_from(n, p["d"], 2))]
    got = _arrive_from(n, p["x"], 0)  # 2 comes from d: that peer's to offer, not ours
    assert _comings(p["c"], got) == [wire.Coming(V, (0,))]
    assert n.counters.endgame_coming == 1


def test_the_endgame_offer_waits_until_that_few_chunks_are_missing() -> None:
    n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region,
                 serve_arriving_endgame=1)
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))
    n.handle(ev.ChunkReceived(n.now, p["origin"].conn, V, 3, True))
    got = _arrive_from(n, p["x"], 0)  # lacks 0 and 2: two, none held in the region
    assert not [f for s in p.values() for f in _comings(s, got)]
    got = n.handle(ev.ChunkReceived(n.now, p["origin"].conn, V, 2, True))  # one left
    assert _comings(p["c"], got) == [wire.Coming(V, (0,))]


def test_the_endgame_offer_is_off_at_zero_or_without_serve_arriving() -> None:
    for knobs in ({"serve_arriving_endgame": 0}, {"serve_arriving": False}):
        n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region, **knobs)
        n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))
        got = _arrive_from(n, p["x"], 0)
        assert not [f for s in p.values() for f in _comings(s, got)], knobs
        assert n.counters.endgame_coming == 0


def test_an_endgame_offer_whose_chunk_fails_is_made_again_for_the_next_copy() -> None:
    n, p = _node(serve_arriving_region=CoreConfig.serve_arriving_region, max_bad_chunks=5)
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 1, True))
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 3, True))
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 2, True))
    assert _comings(p["c"], _arrive_from(n, p["x"], 0)) == [wire.Coming(V, (0,))]
    n.handle(ev.ChunkReceived(n.now, p["x"].conn, V, 0, False))  # corrupt: x is blamed
    assert not n.is_arriving(V, 0) and not n.told_coming
    assert _comings(p["c"], _arrive_from(n, p["origin"], 0)) == [wire.Coming(V, (0,))]


# ---------------------------------------------------------------- in-memory fleets

def _done(hosts) -> bool:  # type: ignore[no-untyped-def]
    return all(2 in h.applied for h in hosts if h.alive)


def test_a_fleet_serving_arriving_chunks_gets_every_version_with_one_copy_per_region() -> None:
    s, net, o, hosts = fleet(2, 5, serve_arriving=True, serve_arriving_region=0)
    publish(s, net, o, 2, 16)
    net.run(net.now + 60, stop=lambda: _done(hosts))
    assert _done(hosts)
    cross = Counter(net.host(b).region for a, b, v, _i in net.sent_chunks
                    if v == 2 and net.host(a).region != net.host(b).region)
    assert cross == {"reg0": 16, "reg1": 16}
    assert sum(h.core.counters.bad_chunks for h in hosts) == 0


@settings(max_examples=25, deadline=None)
@given(st.sets(st.integers(0, 11), max_size=4), st.lists(st.tuples(st.floats(0.0, 0.5),
       st.integers(0, 9)), max_size=3), st.integers(0, 3), st.booleans())
def test_arriving_chunks_that_turn_out_corrupt_or_whose_sender_dies_are_withdrawn(
        bad: set[int], kills: list[tuple[float, int]], seed: int, endgame_only: bool) -> None:
    """The origin's first copy of some chunks is corrupt, and nodes die mid-transfer,
    while region peers already forward those chunks as they arrive (every chunk, or with
    the shipped region threshold only a version's last few: ``serve_arriving_endgame``).
    Every live node still gets the version; only the origin is ever blamed for a corrupt
    chunk; no request, arrival or offer is left behind in a live node."""
    s, net, o, hosts = fleet(2, 5, seed=seed, serve_arriving=True,
                             serve_arriving_region=48 if endgame_only else 0,
                             max_bad_chunks=100, request_timeout_s=2.0)
    first: set[int] = set()
    corrupt = corrupt_first_copies(bad, first)
    corrupted_at: list[float] = []

    def corrupt_and_note(v: int, i: int) -> bool:
        if corrupt(v, i):
            corrupted_at.append(net.now)
            return True
        return False

    killed_at: list[float] = []
    kill = net.kill

    def kill_and_note(h) -> None:  # type: ignore[no-untyped-def]
        killed_at.append(net.now)
        kill(h)

    o.corrupt = corrupt_and_note
    net.kill = kill_and_note  # type: ignore[method-assign]
    live = publish_and_kill(s, net, o, hosts, kills, keep=2)
    net.run(net.now + 120, stop=lambda: _done(live))
    assert _done(live)
    # every corrupt copy is found by the node it went to, unless that node died while
    # it was on the wire (the verdict comes ``latency`` after its last byte left)
    lost = sum(1 for t in corrupted_at for k in killed_at if t <= k <= t + net.latency)
    found = sum(h.core.counters.bad_chunks for h in hosts)
    assert len(first) - lost <= found <= len(first)
    net.run(net.now + 5)
    for h in live:
        assert not h.core.arriving and not h.core.told_coming
        assert all(not p.req for p in h.core.peers.values())


# ---------------------------------------------------------------- real processes

def test_a_fleet_of_processes_serving_arriving_chunks_ends_bitwise_equal() -> None:
    """Real node processes, two regions of three, chunks of four blocks, with
    ``serve_arriving``: region peers ask for chunks while they still arrive at a
    neighbour and get them block by block; every node ends on the trainer's digest,
    one copy per region, nothing corrupt, nothing withdrawn. (On loopback a region's
    peers hold a chunk before the version's end, so the endgame offer of a region this
    small, ``serve_arriving_endgame``, is the scripted tests' and the emulated WAN's.)"""
    from lab.fleet import LoopbackFleet

    with LoopbackFleet(2, 3, chunk_size=1 << 20, lr=1e-4, swarm={"serve_arriving": True, "serve_arriving_region": 0}) as fleet:
        fleet.start(timeout=120)
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=120)
        assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
        assert all(st["bad_chunks"] == 0 for st in statuses.values())
        assert sum(st["served_arriving"] for st in statuses.values()) > 0
        assert sum(st["withdrawn_chunks"] for st in statuses.values()) == 0
        metrics = fleet.http(fleet.nodes[0].addr, "/metrics").decode()
        assert "patchswarm_chunks_served_arriving" in metrics
        assert "patchswarm_chunks_offered_endgame" in metrics
        assert "patchswarm_endgame_twins_total" in metrics
        assert "patchswarm_duplicate_chunks_total" in metrics


def test_an_answer_sent_while_its_chunk_arrives_takes_only_a_free_slot() -> None:
    """One upload slot: an answer sent while its chunk arrives takes it only if nothing
    else uses it, and keeps no chunk held here out of it (that one leaves at full speed)."""
    n, p = _node(serve_arriving=True, upload_slots=1)
    n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 1))
    n.handle(ev.ChunkArriving(n.now, p["b"].conn, V, 2))
    assert p["c"].send(wire.Request(V, (1,))) == []  # the slot was free: sent as it comes
    assert _chunks(p["c"].actions) == [ev.SendChunk(p["c"].conn, V, 1, 1000, True)]
    n.handle(ev.ChunkReceived(n.now, p["b"].conn, V, 0, True))  # a chunk held here
    assert p["d"].send(wire.Request(V, (0,))) == []  # not kept out by the early answer
    assert _chunks(p["d"].actions) == [ev.SendChunk(p["d"].conn, V, 0, 1000, False)]
    assert p["c"].send(wire.Request(V, (2,))) == [wire.Reject(V, (2,))]  # no free slot


def test_early_requests_bounds_the_arriving_chunks_asked_for_at_once() -> None:
    """``early_requests``: at most that many requests for chunks only arriving at their
    peer are out at once, one per peer; a chunk held whole is still asked for first."""
    for k in (1, 2):
        n, p = _node(serve_arriving=True, early_requests=k, max_requests=4, endgame_chunks=0)
        assert p["c"].send(wire.Coming(V, (2,))) == [wire.Request(V, (2,))]
        got = p["d"].send(wire.Coming(V, (3,)))
        assert got == ([wire.Request(V, (3,))] if k == 2 else [])
        assert len(n.requests.early) == k
        assert p["c"].send(wire.Coming(V, (0,))) == []  # one per peer
