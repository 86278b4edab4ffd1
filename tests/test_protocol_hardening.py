"""Hardening of the core (issue #10): nothing but the handshake is read from an
unauthenticated peer, a transport-proven identity binds the HELLO, and local
faults are never blamed on a peer."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.protocol import events as ev
from swarm.protocol import handshake as hs
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.testing import MODEL, SECRET, Script, Signer


def _core(node_id: str = "a", region: str = "r", signer: Signer | None = None, **knobs) -> NodeCore:
    s = signer or Signer()
    cfg = CoreConfig(node_id=node_id, region=region, model=MODEL, listen_addr=f"{node_id}:1",
                     swarm_secret=SECRET, **knobs)
    core = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    core.raise_internal_errors = True
    return core


def _hello(node_id: str, region: str = "r", role: str = "node") -> bytes:
    return hs.hello_frame(model=MODEL, node_id=node_id, region=region, addr=f"{node_id}:1",
                          role=role, nonce=bytes(wire.NONCE_LEN))


def test_chunks_before_the_handshake_ban_nobody():
    """Attack 1 of the audit: HELLO claiming "trainer", no AUTH, two garbage chunks."""
    s = Signer()
    n = _core(signer=s, active_version=1)
    n.handle(ev.LocalChunks(0.0, s.manifest(2, 4), ()))
    n.handle(ev.PeerConnected(0.0, 7, False, "evil:1"))
    n.handle(ev.FrameReceived(0.0, 7, _hello("trainer", "trainer", "origin")))
    assert not n.authenticated(7)
    acts = n.handle(ev.ChunkReceived(0.0, 7, 2, 0, False))
    assert ev.Close(7, "chunk before the handshake") in acts
    n.handle(ev.PeerDisconnected(0.0, 7, "closed"))
    for conn in (8, 9):  # and again on fresh connections
        n.handle(ev.PeerConnected(0.0, conn, False, "evil:1"))
        n.handle(ev.FrameReceived(0.0, conn, _hello("trainer", "trainer", "origin")))
        n.handle(ev.ChunkReceived(0.0, conn, 2, 1, False))
    assert not n.banned("trainer")
    assert n.counters.bad_chunks == 0


def test_a_ready_peer_sending_bad_chunks_is_still_banned():
    s = Signer()
    n = _core(signer=s, active_version=1)
    n.handle(ev.LocalChunks(0.0, s.manifest(2, 4), ()))
    liar = Script(n, 2, node_id="liar", region="r")
    liar.handshake()
    assert n.authenticated(2)
    liar.send(wire.Bitfield(2, wire.bits_to_bytes(0b1111, 4)))
    for i in range(n.cfg.max_bad_chunks):
        n.handle(ev.ChunkReceived(n.now, 2, 2, i, False))
    assert n.banned("liar")


def test_hello_must_match_the_transport_identity():
    n = _core()
    acts = n.handle(ev.PeerConnected(0.0, 1, False, "x:1", identity=("b", "r", "node")))
    assert any(isinstance(a, ev.SendFrame) for a in acts)
    acts = n.handle(ev.FrameReceived(0.0, 1, _hello("trainer", "trainer", "origin")))
    closes = [a for a in acts if isinstance(a, ev.Close)]
    assert closes and "certificate" in closes[0].reason
    # the same identity, claimed honestly, is admitted
    n.handle(ev.PeerConnected(0.0, 2, False, "x:1", identity=("b", "r", "node")))
    acts = n.handle(ev.FrameReceived(0.0, 2, _hello("b", "r", "node")))
    assert [type(wire.decode(a.frame)) for a in acts if isinstance(a, ev.SendFrame)] == [wire.Auth]


@settings(max_examples=100, deadline=None)
@given(st.tuples(st.sampled_from(["b", "trainer", "c"]), st.sampled_from(["r", "trainer"]),
                 st.sampled_from(["node", "origin"])))
def test_any_mismatch_with_the_certificate_closes(claim):
    n = _core()
    n.handle(ev.PeerConnected(0.0, 1, False, "x:1", identity=("b", "r", "node")))
    acts = n.handle(ev.FrameReceived(0.0, 1, _hello(*claim)))
    closed = any(isinstance(a, ev.Close) for a in acts)
    assert closed == (claim != ("b", "r", "node"))


def test_a_local_store_fault_blames_nobody_and_backs_off():
    s = Signer()
    n = _core(signer=s, active_version=1)
    n.handle(ev.LocalChunks(0.0, s.manifest(2, 4), ()))
    peer = Script(n, 2, node_id="p", region="r")
    peer.handshake()
    acts = n.handle(ev.FrameReceived(n.now, 2, wire.Bitfield(2, wire.bits_to_bytes(0b1111, 4)).encode()))
    asked = [wire.decode(a.frame) for a in acts if isinstance(a, ev.SendFrame)]
    first = next(f for f in asked if isinstance(f, wire.Request))
    i = first.indices[0]
    for _ in range(5):  # the disk stays full: never a strike, never a ban
        acts = n.handle(ev.ChunkNotStored(n.now, 2, 2, i, "No space left on device"))
        assert not any(isinstance(a, ev.Close) for a in acts)
        assert not any(isinstance(a, ev.SendFrame) and isinstance(wire.decode(a.frame), wire.Request)
                       for a in acts), "no new requests while holding back"
    assert not n.banned("p") and n.counters.bad_chunks == 0
    assert n.counters.local_faults == 5
    hold = n.exchange.hold_until
    assert hold is not None and hold - n.now == 16.0  # 1, 2, 4, 8, 16 s (doubling, cap 30)
    assert n.next_wakeup() <= hold
    acts = n.handle(ev.Tick(hold + 0.001))  # after the hold, requests resume
    assert any(isinstance(a, ev.SendFrame) and isinstance(wire.decode(a.frame), wire.Request)
               for a in acts)


def test_redials_back_off_exponentially_with_jitter_and_reset_once_ready():
    n = _core(redial_s=1.0)
    delays = []
    for k in range(8):
        n.now = float(k * 1000)
        n.dial("x:1")
        n.handle(ev.ConnectFailed(n.now, "x:1", "refused"))
        delays.append(n.retry_at["x:1"] - n.now)
    for k, d in enumerate(delays):
        base = min(2.0**k, 60.0)
        assert 0.5 * base <= d <= 1.5 * base, (k, d)
    assert len(set(delays)) == len(delays)  # jittered
    n.dial("x:1")
    n.handle(ev.PeerConnected(n.now, 5, True, "x:1"))  # connected, no handshake: no reset
    n.handle(ev.PeerDisconnected(n.now, 5, "bye"))
    n.dial("x:1")
    n.handle(ev.ConnectFailed(n.now, "x:1", "refused"))
    assert n.retry_at["x:1"] - n.now >= 30.0
    n.dial("x:1")
    x = Script(n, 6, node_id="x", region="r", outbound=True)
    x.handshake()  # a dial succeeds once the handshake does: that resets the count
    assert n.authenticated(6)
    n.handle(ev.PeerDisconnected(n.now, 6, "bye"))
    n.dial("x:1")
    n.handle(ev.ConnectFailed(n.now, "x:1", "refused"))
    assert n.retry_at["x:1"] - n.now <= 1.5


def test_bootstrap_addresses_keep_redial_s_jittered():
    n = _core(redial_s=2.0, bootstrap=("origin:1",))
    for k in range(6):
        n.now = float(k * 100)
        n.dial("origin:1")
        n.handle(ev.ConnectFailed(n.now, "origin:1", "refused"))
        assert 1.0 <= n.retry_at["origin:1"] - n.now <= 3.0


def test_a_border_that_cannot_keep_a_pushed_chunk_steps_down_and_it_is_re_planned():
    """The origin pushes each chunk into a region once and waits for the border's HAVE:
    a border whose disk is full must let go of the link, so the origin hands the chunk
    to another border at once instead of waiting for a HAVE that never comes."""
    s = Signer()
    # the pushes below leave at the instant they were made: without fast_startup_s = 0 the
    # uplink window's start-up would open on those departures and give b pushes of its
    # own first, leaving it room for only one of a's (round 43)
    o = _core("origin", "trainer", signer=s, role="origin", border_nodes=2,
              fast_startup_s=0.0)
    a = Script(o, 1, node_id="a", region="r")
    b = Script(o, 2, node_id="b", region="r")
    a.handshake()
    b.handshake()
    acts = o.handle(ev.Publish(o.now, s.manifest(2, 4)))
    for x in (a, b):  # both borders show the version (echo its ANNOUNCE)
        x.send(wire.Announce(s.manifest(2, 4)))
        acts += x.actions
    pushed = {(x.conn, x.index) for x in acts if isinstance(x, ev.SendChunk)}
    to_a = sorted(i for c, i in pushed if c == 1)
    assert to_a, pushed
    for conn, i in sorted(pushed):  # every push went out; a's never come back as HAVEs
        o.handle(ev.ChunkSent(o.now, conn, 2, i))
    # node a's side: the pushed chunk could not be stored -> it closes its origin link
    n = _core("a", "r", signer=s, active_version=1)
    n.handle(ev.LocalChunks(0.0, s.manifest(2, 4), ()))
    origin = Script(n, 9, node_id="origin", region="trainer", role="origin", outbound=True)
    origin.handshake()
    acts = n.handle(ev.ChunkNotStored(n.now, 9, 2, to_a[0], "No space left on device"))
    assert ev.Close(9, "local store fault: not taking pushed chunks") in acts
    assert not n.banned("origin")
    # the origin sees the border leave and re-plans its chunks to b without waiting
    acts = o.handle(ev.PeerDisconnected(o.now, 1, "local store fault"))
    again = {x.index for x in acts if isinstance(x, ev.SendChunk) and x.conn == 2}
    assert set(to_a) <= again, (to_a, again)


def test_a_bug_in_a_handler_is_logged_not_raised(monkeypatch):
    """With ``raise_internal_errors`` off (as nodes run), an exception inside a handler
    comes back as one error log naming the event; the core keeps handling events.
    (The log once passed ``event=`` twice and raised a TypeError of its own.)"""
    from swarm.protocol import core as core_mod

    n = _core()
    n.raise_internal_errors = False

    def broken(self, e):
        raise RuntimeError("boom")

    monkeypatch.setitem(core_mod._HANDLERS, ev.PeerConnected, broken)
    out = n.handle(ev.PeerConnected(0.0, 7, False, "b:1"))
    errors = [a for a in out if isinstance(a, ev.Log) and a.level == "error"]
    assert len(errors) == 1, out
    assert errors[0].event == "internal_error"
    assert errors[0].fields["on"] == "PeerConnected" and "boom" in errors[0].fields["error"]
    n.handle(ev.Tick(1.0))  # still handling events
