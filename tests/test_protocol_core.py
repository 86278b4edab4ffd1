"""NodeCore sessions wired together in memory (swarm/protocol/testing.py)."""

from __future__ import annotations

import random
from collections import Counter

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.handshake import READY
from swarm.protocol.peer import ORIGIN
from swarm.protocol.testing import MemHost as Host
from swarm.protocol.testing import Net, Signer


def fleet(regions: int, per: int, *, seed: int = 0, start: bool = True, peer_boot: bool = True,
          **knobs) -> tuple[Signer, Net, Host, list[Host]]:
    """An origin plus ``regions x per`` nodes that all hold base version 1.

    With ``peer_boot=False`` the origin (the tracker) is every node's only bootstrap address.
    """
    s = Signer()
    net = Net(s, seed=seed)
    base = s.manifest(1, 4, kind="full")
    o = net.add("origin", "trainer", role="origin", active_version=1, **knobs)
    net.start(o)
    hosts = []
    for r in range(regions):
        for k in range(per):
            boot = (o.addr, *tuple(f"r{r}n{j}:1" for j in range(k))[-3:]) if peer_boot else (o.addr,)
            hosts.append(net.add(f"r{r}n{k}", f"reg{r}", bootstrap=boot, active_version=1, **knobs))
    if start:
        for h in hosts:
            net.start(h)
            net.deliver(h, ev.LocalChunks(net.now, base, tuple(range(4))))
        net.run(net.now + 3.0)
    return s, net, o, hosts


def corrupt_first_copies(bad: set[int], first: set[int]):  # type: ignore[no-untyped-def]
    """A ``Host.corrupt`` predicate: the first copy of each chunk in ``bad`` of version 2
    is sent corrupt (recorded in ``first``), every later one is good."""

    def corrupt_once(v: int, i: int) -> bool:
        if v == 2 and i in bad and i not in first:
            first.add(i)
            return True
        return False

    return corrupt_once


def publish(s: Signer, net: Net, o: Host, v: int, chunks: int) -> None:
    net.deliver(o, ev.Publish(net.now, s.manifest(v, chunks)))


def publish_and_kill(s: Signer, net: Net, o: Host, hosts: list[Host],
                     kills: list[tuple[float, int]], keep: int) -> list[Host]:
    """Publish version 2 (12 chunks); at each ``(seconds after, k)`` kill host ``k`` unless
    its region would keep fewer than ``keep`` live nodes. The live hosts."""
    t0 = net.now
    publish(s, net, o, 2, 12)
    for at, k in sorted(kills):
        net.run(t0 + at)
        h = hosts[k % len(hosts)]
        if h.alive and sum(x.alive for x in hosts if x.region == h.region) > keep:
            net.kill(h)
    return [h for h in hosts if h.alive]


def inflow(net: Net, v: int) -> Counter:
    """Chunks of version ``v`` that entered each region from outside."""
    c: Counter = Counter()
    for a, b, ver, _i in net.sent_chunks:
        if ver == v and net.host(a).region != net.host(b).region:
            c[net.host(b).region] += 1
    return c


def test_handshake_two_cores() -> None:
    s = Signer()
    net = Net(s)
    a = net.add("a", "r")
    b = net.add("b", "r", bootstrap=("a:1",))
    net.start(a)
    net.start(b)
    net.run(1.0)
    assert "b" in a.core.by_id and "a" in b.core.by_id
    assert all(p.state == READY for p in a.core.peers.values())
    assert a.core.peer_list()[0]["region"] == "r"


def test_bad_hmac_is_refused() -> None:
    s = Signer()
    net = Net(s)
    a = net.add("a", "r")
    b = net.add("b", "r", bootstrap=("a:1",), secret=b"wrong")
    net.start(a)
    net.start(b)
    net.run(1.0)
    assert not a.core.by_id and not b.core.by_id
    reasons = [log.fields.get("reason", "") for _n, log in net.logs if log.event == "peer_closed"]
    assert any("HMAC" in r for r in reasons)


def test_malformed_and_out_of_order_frames_close_the_peer() -> None:
    s = Signer()
    net = Net(s)
    a = net.add("a", "r")
    core = a.core
    for k, frame in enumerate([b"\xc1garbage", wire.encode(wire.HAVE, 1, [0]),
                               wire.encode(wire.HELLO, 1, "other-model", "x", "r", "x:1", "node", b"n" * 16)]):
        core.handle(ev.PeerConnected(0.0, k + 1, False, "x"))
        acts = core.handle(ev.FrameReceived(0.0, k + 1, frame))
        assert any(isinstance(x, ev.Close) and x.conn == k + 1 for x in acts)
        assert any(isinstance(x, ev.Log) and x.level == "warning" for x in acts)
        assert k + 1 not in core.peers


def test_transfer_of_a_version_with_signed_manifests() -> None:
    s, net, o, hosts = fleet(1, 1)
    (n,) = hosts
    assert n.core.is_border
    publish(s, net, o, 2, 10)
    net.run(net.now + 20, stop=lambda: 2 in n.applied)
    assert n.applied == [2] and n.core.active_version == 2
    assert n.core.have(2) == set(range(10))
    assert n.core.counters.recv_chunks[ORIGIN] == 10
    assert o.core.counters.region_sent[("trainer", "reg0")] == 10 * 1000


def test_fifty_peers_three_regions_each_region_takes_each_chunk_once() -> None:
    # push_slots=2: an origin uplink thinner than the borders' (else relaying never pays)
    s, net, o, hosts = fleet(3, 17, push_slots=2)
    publish(s, net, o, 2, 30)
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(h.core.active_version == 2 for h in hosts)
    assert inflow(net, 2) == {"reg0": 30, "reg1": 30, "reg2": 30}
    # the nodes' own accounting agrees: cross-region bytes = one copy per region
    cross = sum(n for h in hosts for (a, b), n in h.core.counters.region_recv.items() if a != b)
    assert cross == 3 * 30 * 1000
    # the origin did not feed every region everything itself: regions relayed
    assert sum(o.core.counters.sent_chunks.values()) < 3 * 30


def test_chunk_pushed_before_the_neighbours_know_the_manifest_is_announced() -> None:
    """The origin pushes at publication, so the border holds a chunk before its
    neighbours have shown the version; its HAVE skipped them. They get the border's
    bitfield when they show the version, else the region stalls one chunk short."""
    for seed in range(3):
        s, net, o, hosts = fleet(1, 12, seed=seed, border_nodes=1)
        publish(s, net, o, 2, 40)
        net.run(net.now + 30, stop=lambda hosts=hosts: all(2 in h.applied for h in hosts))
        assert all(h.core.active_version == 2 for h in hosts), seed
        assert inflow(net, 2) == {"reg0": 40}


def test_per_region_and_direct_and_flat_strategies_converge() -> None:
    for knobs, check in (({"relay": False}, "per-region"), ({"origin_only": True}, "direct"),
                         ({"region_aware": False}, "flat")):
        s, net, o, hosts = fleet(2, 6, **knobs)
        publish(s, net, o, 2, 12)
        net.run(net.now + 60, stop=lambda hosts=hosts: all(2 in h.applied for h in hosts))
        assert all(h.core.active_version == 2 for h in hosts), check
        if check == "per-region":
            assert sum(o.core.counters.sent_chunks.values()) == 2 * 12
            assert inflow(net, 2) == {"reg0": 12, "reg1": 12}
        if check == "direct":
            assert sum(o.core.counters.sent_chunks.values()) == 12 * 12


def test_corrupt_sender_is_dropped_and_chunks_come_from_elsewhere() -> None:
    # a small mesh, so the liar (the last to join, holding only what it fetched) is the
    # one peer some nodes can fetch from now and then; one corrupt chunk is enough for a
    # ban, so whoever fetched from it drops it
    s, net, o, hosts = fleet(1, 12, border_nodes=2, mesh_degree=6, max_bad_chunks=1)
    liar = hosts[11]
    assert not liar.core.is_border
    liar.corrupt = lambda v, i: True
    publish(s, net, o, 2, 120)
    honest = [h for h in hosts if h is not liar]
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in honest))
    assert all(h.core.active_version == 2 for h in honest)
    bad = sum(h.core.counters.bad_chunks for h in hosts)
    assert bad >= 1
    dropped = [log for _n, log in net.logs if log.event == "peer_closed" and "corrupt" in log.fields["reason"]]
    assert dropped and all(log.fields["peer"] == liar.core.cfg.node_id for log in dropped)
    # banned by node id: the liar cannot come back through a new connection
    banned_by = [h for h in honest if h.core.banned(liar.core.cfg.node_id)]
    assert banned_by
    assert all(liar.core.cfg.node_id not in h.core.by_id for h in banned_by)
    assert all(h.core.counters.bad_chunks <= h.core.cfg.max_bad_chunks for h in honest)


def test_tracker_only_nodes_learn_their_region_from_the_origin() -> None:
    s, net, o, hosts = fleet(2, 5, peer_boot=False, border_nodes=4)
    for h in hosts:
        same = [p for p in h.core.peers.values() if p.state == READY and p.region == h.region
                and not p.is_origin]
        assert same, h.core.cfg.node_id  # even the nodes the origin told "tracker only"
    assert sum(h.core.is_border for h in hosts) == 2 * hosts[0].core.cfg.border_nodes
    publish(s, net, o, 2, 20)
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(h.core.active_version == 2 for h in hosts)
    assert inflow(net, 2) == {"reg0": 20, "reg1": 20}


def test_corrupt_border_is_banned_reported_and_its_chunks_resent() -> None:
    """A border that corrupts every chunk it sends holds chunks its region got from
    nowhere else: its peers ban it by node id and report it; the origin bans it too and
    sends those chunks into the region again, so the region does not stall."""
    s, net, o, hosts = fleet(2, 6)
    liar = next(h for h in hosts if h.core.is_border and h.region == "reg0")
    liar.corrupt = lambda v, i: True
    publish(s, net, o, 2, 30)
    honest = [h for h in hosts if h is not liar]
    net.run(net.now + 120, stop=lambda: all(2 in h.applied for h in honest))
    assert all(h.core.active_version == 2 for h in honest)
    lid = liar.core.cfg.node_id
    events = [(n, log) for n, log in net.logs if log.event in ("peer_reported", "region_resend")]
    assert any(log.event == "peer_reported" and log.fields["peer"] == lid for _n, log in events)
    assert any(log.event == "region_resend" and log.fields["region"] == "reg0" for _n, log in events)
    assert o.core.banned(lid) and lid not in o.core.by_id
    assert lid not in {b.node_id for b in o.core.role.borders["reg0"]}
    # the exception to "exactly once" stays small: at most the liar's chunks come again
    flow = inflow(net, 2)
    assert 30 < flow["reg0"] <= 2 * 30 and flow["reg1"] <= 2 * 30
    # the honest nodes hold the liar off after the ban, across its reconnect attempts
    net.run(net.now + 20)
    assert all(h.core.counters.bad_chunks <= h.core.cfg.max_bad_chunks for h in honest)
    banned_by = [h for h in honest if h.core.banned(lid)]
    assert banned_by and all(lid not in h.core.by_id for h in banned_by)


def test_restarted_origin_is_redialled_and_seeds_the_next_version() -> None:
    """The one-shot ``patchswarm publish``: the origin goes away between versions and a
    fresh one (same address, knows only its store) publishes the next version."""
    s, net, o, hosts = fleet(2, 4, peer_boot=False, border_nodes=4)
    publish(s, net, o, 2, 12)
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in hosts))
    net.kill(o)
    net.run(net.now + 10)
    assert not any(h.core.is_border for h in hosts)
    o2 = net.add("origin", "trainer", role="origin", active_version=2)
    net.start(o2)
    net.deliver(o2, ev.LocalChunks(net.now, s.manifest(2, 12), tuple(range(12))))
    net.run(net.now + 10)  # ex-borders come back within redial_s
    assert sum(h.core.is_border for h in hosts) == 2 * hosts[0].core.cfg.border_nodes
    net.deliver(o2, ev.Publish(net.now, s.manifest(3, 12)))
    net.run(net.now + 60, stop=lambda: all(3 in h.applied for h in hosts))
    assert all(h.core.active_version == 3 for h in hosts)


def test_forged_announcement_is_refused_and_not_forwarded() -> None:
    s, net, o, hosts = fleet(1, 6)
    evil = Ed25519PrivateKey.from_private_bytes(random.Random(99).randbytes(32))
    forged = s.manifest(2, 5, key=evil)
    victim = hosts[2]
    conn = next(iter(victim.core.peers))
    sender = victim.core.peers[conn]
    # the forged frame comes from one of its peers
    peer_host = net.host(sender.node_id)
    peer_conn = next(c for c, (h, pc) in peer_host.conns.items() if h is victim and pc == conn)
    peer_host.core.handle(ev.Tick(net.now))
    net._do(peer_host, ev.SendFrame(peer_conn, wire.encode(wire.ANNOUNCE, forged)))
    net.run(net.now + 2)
    assert all(2 not in h.core.manifests for h in hosts)
    assert any(log.event == "manifest_refused" for _n, log in net.logs)
    # nobody else saw it: the victim did not forward it
    refused_by = {n for n, log in net.logs if log.event == "manifest_refused"}
    assert refused_by == {victim.core.cfg.node_id}
    # the genuine version still flows
    publish(s, net, o, 2, 5)
    net.run(net.now + 30, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(h.core.active_version == 2 for h in hosts)


def test_border_leaving_mid_transfer_the_rest_converge() -> None:
    s, net, o, hosts = fleet(2, 8)
    publish(s, net, o, 2, 40)
    net.run(net.now + 0.01)
    border = next(h for h in hosts if h.core.is_border)
    net.kill(border)
    rest = [h for h in hosts if h is not border]
    net.run(net.now + 120, stop=lambda: all(2 in h.applied for h in rest))
    assert all(h.core.active_version == 2 for h in rest)
    flow = inflow(net, 2)
    assert flow[border.region] <= 2 * 40  # re-sent only what left with the border


def test_node_several_versions_behind_catches_up_in_order() -> None:
    s, net, o, hosts = fleet(1, 6, start=False)
    base = s.manifest(1, 4, kind="full")
    late = hosts[-1]
    for h in hosts[:-1]:
        net.start(h)
        net.deliver(h, ev.LocalChunks(net.now, base, tuple(range(4))))
    net.run(net.now + 3)
    for v in (2, 3, 4):
        publish(s, net, o, v, 8)
        net.run(net.now + 30, stop=lambda v=v: all(v in h.applied for h in hosts[:-1]))
    assert all(h.core.active_version == 4 for h in hosts[:-1])
    net.start(late)
    net.deliver(late, ev.LocalChunks(net.now, base, tuple(range(4))))
    net.run(net.now + 60, stop=lambda: 4 in late.applied)
    assert late.applied == [2, 3, 4]


def test_replayed_old_manifest_is_ignored() -> None:
    s, net, o, hosts = fleet(1, 3)
    publish(s, net, o, 2, 4)
    net.run(net.now + 30, stop=lambda: all(2 in h.applied for h in hosts))
    h = hosts[0]
    acts = h.core.handle(ev.FrameReceived(net.now, next(iter(h.core.peers)),
                                          wire.encode(wire.ANNOUNCE, s.manifest(2, 4))))
    assert not any(isinstance(a, (ev.AcceptManifest, ev.ApplyVersion)) for a in acts)


# ---------------------------------------------------------------- random event sequences

def _invariants(h: Host) -> None:
    c = h.core
    assert c.uploading <= c.cfg.upload_slots
    assert 0 <= c.requests.n <= c.cfg.max_requests + c.cfg.endgame_chunks
    assert c.requests.n == sum(len(p.req) for p in c.peers.values())
    for vs in c.versions.states.values():
        assert vs.have & ~vs.full == 0
    for p in c.peers.values():
        for (v, i) in p.req:
            assert not (c.versions.states[v].have >> i) & 1 or v not in c.versions.wanted


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "kill", "bad", "tick", "junk", "chunk", "dup"]),
                          st.integers(0, 100)), min_size=1, max_size=12))
def test_random_event_sequences_keep_invariants(script: list[tuple[str, int]]) -> None:
    s, net, o, hosts = fleet(2, 4, seed=len(script))
    publish(s, net, o, 2, 12)
    for op, k in script:
        h = hosts[k % len(hosts)]
        if op == "run":
            net.run(net.now + 0.01 * (k + 1))
        elif op == "kill" and h.alive:
            net.kill(h)
        elif op == "bad":
            h.corrupt = lambda v, i: True
        elif op == "tick":
            net.deliver(h, ev.Tick(net.now + 0.5))
        elif op == "junk" and h.core.peers:
            net.deliver(h, ev.FrameReceived(net.now, next(iter(h.core.peers)), bytes([k]) * 3))
        elif op == "chunk" and h.core.peers:
            net.deliver(h, ev.ChunkReceived(net.now, next(iter(h.core.peers)), 2, k % 14, k % 2 == 0))
        elif op == "dup":
            net.deliver(h, ev.ChunkSent(net.now, k, 2, k % 12))
        for x in hosts:
            if x.alive:
                _invariants(x)
    live = [h for h in hosts if h.alive and h.corrupt(2, 0) is False]
    net.run(net.now + 120, stop=lambda: all(2 in h.applied for h in live))
    for h in live:
        _invariants(h)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.4), st.integers(0, 8)), max_size=4), st.integers(0, 3),
       st.booleans())
def test_relays_on_arrival_survive_borders_dying_mid_transfer(kills: list[tuple[float, int]],
                                                              seed: int, cut_through: bool) -> None:
    """A thin origin uplink (``push_slots=1``), three regions: relays are ordered ahead of
    their chunk (relay on arrival; with ``cut_through`` they start with its first block).
    Borders die at random moments of the transfer; every live node still gets the version,
    and no order is left waiting in a live node."""
    s, net, o, hosts = fleet(3, 3, seed=seed, push_slots=1, request_timeout_s=2.0,
                             cut_through=cut_through, cut_through_after_s=0)
    live = publish_and_kill(s, net, o, hosts, kills, keep=1)
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in live))
    assert all(2 in h.applied for h in live)
    net.run(net.now + 5)  # orders still waiting expire within request_timeout_s
    assert all(len(h.core.role.pending) == 0 for h in live)


def test_relays_are_ordered_ahead_of_their_chunk_on_a_thin_uplink() -> None:
    s, net, o, hosts = fleet(3, 3, push_slots=1, cut_through=False)
    orders: list[tuple[str, int, int]] = []
    real = o.core.send

    def spy(p, frame):  # type: ignore[no-untyped-def]
        f = wire.decode(frame)
        if isinstance(f, wire.Relay):
            held = net.host(p.node_id).core.have(f.version)
            orders.append((p.node_id, f.index, f.index in held))
        real(p, frame)

    o.core.send = spy  # type: ignore[method-assign]
    publish(s, net, o, 2, 12)
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(2 in h.applied for h in hosts)
    assert inflow(net, 2) == {"reg0": 12, "reg1": 12, "reg2": 12}
    assert any(not held for _b, _i, held in orders)  # some relays were ordered ahead
    carried = Counter()
    for h in hosts:
        carried.update(h.core.counters.relays)
    assert carried["on_arrival"] > 0 and carried["cut_through"] == 0
    assert carried["at_once"] + carried["on_arrival"] <= len(orders)


def test_with_cut_through_relays_ordered_ahead_start_with_the_first_block() -> None:
    s, net, o, hosts = fleet(3, 3, push_slots=1, cut_through=True, cut_through_after_s=0)
    publish(s, net, o, 2, 12)
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(2 in h.applied for h in hosts)
    assert inflow(net, 2) == {"reg0": 12, "reg1": 12, "reg2": 12}
    carried = Counter()
    for h in hosts:
        carried.update(h.core.counters.relays)
    assert carried["cut_through"] > 0 and carried["failed"] == 0


@settings(max_examples=20, deadline=None)
@given(st.sets(st.integers(0, 11), min_size=1, max_size=4), st.integers(0, 3))
@example({0}, 0)
def test_cut_through_relays_of_chunks_that_arrive_corrupt_are_withdrawn(bad: set[int],
                                                                        seed: int) -> None:
    """The first copy of some chunks reaches its border corrupt while the border already
    relays it on (cut-through): that relay is withdrawn and fails loudly (RELAY_FAIL),
    the origin re-plans it, and every node still ends with the version."""
    s, net, o, hosts = fleet(3, 3, seed=seed, push_slots=1, max_bad_chunks=100, cut_through=True,
                             cut_through_after_s=0)
    first: set[int] = set()
    o.corrupt = corrupt_first_copies(bad, first)
    publish(s, net, o, 2, 12)
    net.run(net.now + 120, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(2 in h.applied for h in hosts)
    carried = Counter()
    for h in hosts:
        carried.update(h.core.counters.relays)
    assert carried["cut_through"] > 0
    withdrawn = [lg for _n, lg in net.logs if lg.event == "relay_withdrawn"]
    assert carried["failed"] >= len(withdrawn)
    # a withdrawn relay blames nobody: the only corrupt chunks counted came from the origin
    assert sum(h.core.counters.bad_chunks for h in hosts) == len(first)
    if bad == {0}:  # chunk 0 is relayed while it arrives on this schedule: it is withdrawn
        assert len(withdrawn) == 1


def test_nodes_meshed_before_the_trainer_was_up_still_find_it() -> None:
    """Bootstrap lists the region's peers and the trainer (docs/operations.md); the
    trainer comes up after the nodes meshed: they dial it (their first version report
    is due), so its first publish reaches them."""
    s = Signer()
    net = Net(s)
    o = net.add("origin", "trainer", role="origin", active_version=1)
    o.alive = False  # not up yet
    hosts = []
    for k in range(3):
        boot = (o.addr, *(f"r0n{j}:1" for j in range(3) if j != k))
        hosts.append(net.add(f"r0n{k}", "reg0", bootstrap=boot, active_version=1))
    base = s.manifest(1, 4, kind="full")
    for h in hosts:
        net.start(h)
        net.deliver(h, ev.LocalChunks(net.now, base, tuple(range(4))))
    net.run(net.now + 3.0)
    assert all(h.core.peer_list() for h in hosts)  # meshed with each other
    net.start(o)
    net.run(net.now + 12.0)  # a redial or two
    assert all(any(p["role"] == "origin" for p in h.core.peer_list()) or
               h.core.cfg.node_id in {e.node_id for e in o.core.fleet()} for h in hosts)
    publish(s, net, o, 2, 4)
    net.run(net.now + 10.0, stop=lambda: all(h.core.active_version == 2 for h in hosts))
    assert [h.core.active_version for h in hosts] == [2, 2, 2]
