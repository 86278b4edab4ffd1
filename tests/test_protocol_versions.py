"""Protocol versions at the handshake: releases one version apart keep their links, a
release with no version in common is refused cleanly (no blame, a growing back-off),
and nobody in the middle can talk a link down to an older version."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ProtocolError
from swarm.protocol import events as ev
from swarm.protocol import handshake as hs
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.handshake import READY
from swarm.protocol.testing import MODEL, SECRET, Net, Script, Signer


def _core(**knobs) -> NodeCore:
    cfg = CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1", swarm_secret=SECRET,
                     **knobs)
    core = NodeCore(cfg, verify_manifest=Signer().verify, rng=random.Random(0))
    core.raise_internal_errors = True
    return core


def _ranges() -> st.SearchStrategy[tuple[int, int]]:
    return st.tuples(st.integers(1, 9), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(_ranges(), _ranges())
def test_both_ends_agree_on_the_version_or_the_link_closes(a: tuple[int, int], b: tuple[int, int]) -> None:
    """Each end checks the other's newest against its own range; the link is up exactly
    when the ranges overlap, and then both ends speak the same version, the newest both
    speak."""
    def accept(mine: tuple[int, int], theirs_newest: int) -> int | None:
        try:
            return hs.negotiate(theirs_newest, mine)
        except hs.VersionRefused:
            return None

    va, vb = accept(a, b[1]), accept(b, a[1])
    overlap = max(a[0], b[0]) <= min(a[1], b[1])
    assert (va is not None and vb is not None) == overlap
    if overlap:
        assert va == vb == min(a[1], b[1])


def test_this_release_refuses_rounds_before_negotiation() -> None:
    """Version 1 (rounds 1-26) took other frames and a restarted striped chunk for
    something else; this release does not speak it."""
    assert hs.SPEAKS == (wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION)
    with pytest.raises(hs.VersionRefused, match="protocol version 1 is too old"):
        hs.negotiate(1)
    assert issubclass(hs.VersionRefused, ProtocolError)
    assert hs.negotiate(wire.PROTOCOL_VERSION + 5) == wire.PROTOCOL_VERSION  # a newer release


def test_a_hello_from_an_old_release_closes_the_link_without_blame() -> None:
    n = _core()
    old = Script(n, 3, node_id="old", region="r")
    with pytest.raises(AssertionError):  # no AUTH comes back
        old.handshake(proto=1)
    assert old.closed()
    (close,) = [a for a in old.actions if isinstance(a, ev.Close)]
    assert "protocol version 1 is too old" in close.reason
    assert n.counters.version_refused == 1 and not n.banned("old")
    assert n.counters.bad_chunks == 0 and not n.by_id


def test_a_newer_release_is_spoken_to_in_our_version() -> None:
    n = _core()
    newer = Script(n, 3, node_id="newer", region="r")
    newer.handshake(proto=wire.PROTOCOL_VERSION + 1)
    assert n.authenticated(3)
    assert n.peers[3].proto == wire.PROTOCOL_VERSION
    assert n.peer_list()[0]["proto"] == wire.PROTOCOL_VERSION
    assert n.status()["protocol"] == list(hs.SPEAKS)


def test_an_altered_version_in_a_hello_fails_the_membership_proof() -> None:
    """The AUTH MAC covers both HELLOs as sent: a HELLO whose version was changed on the
    way (a downgrade) does not match the peer's proof, and the link closes."""
    n = _core()
    acts = n.handle(ev.PeerConnected(0.0, 4, False, "p:1"))
    core_hello = next(a.frame for a in acts if isinstance(a, ev.SendFrame))
    sent = hs.hello_frame(model=MODEL, node_id="p", region="r", addr="p:1", role="node",
                          nonce=bytes(wire.NONCE_LEN), proto=wire.PROTOCOL_VERSION + 1)
    seen = hs.hello_frame(model=MODEL, node_id="p", region="r", addr="p:1", role="node",
                          nonce=bytes(wire.NONCE_LEN), proto=wire.PROTOCOL_VERSION)
    n.handle(ev.FrameReceived(0.0, 4, seen))  # what reached the core
    acts = n.handle(ev.FrameReceived(0.0, 4, wire.Auth(hs.mac(SECRET, sent, core_hello)).encode()))
    assert any(isinstance(a, ev.Close) and "HMAC" in a.reason for a in acts)
    assert not n.authenticated(4)


def _pair(speaks_a: tuple[int, int], speaks_b: tuple[int, int]) -> tuple[Net, NodeCore, NodeCore]:
    net = Net(Signer())
    a = net.add("a", "r", redial_s=1.0)
    b = net.add("b", "r", bootstrap=("a:1",), redial_s=1.0)
    a.core.speaks, b.core.speaks = speaks_a, speaks_b
    net.start(a)
    net.start(b)
    return net, a.core, b.core


def test_releases_one_version_apart_keep_their_link() -> None:
    """A rolling upgrade: the next release (speaking this one's version too) and this one."""
    v = wire.PROTOCOL_VERSION
    net, a, b = _pair((v, v + 1), (v, v))
    net.run(2.0)
    assert "b" in a.by_id and "a" in b.by_id
    assert all(p.state is READY and p.proto == v for p in [*a.peers.values(), *b.peers.values()])
    assert a.counters.version_refused == b.counters.version_refused == 0


def test_releases_with_no_version_in_common_refuse_each_other_and_back_off() -> None:
    v = wire.PROTOCOL_VERSION
    net, a, b = _pair((v + 1, v + 1), (v, v))
    net.run(40.0)
    assert not a.by_id and not b.by_id
    assert a.counters.version_refused >= 1  # a refuses b's HELLO (b closes on AUTH_WAIT)
    reasons = [log.fields.get("reason", "") for _n, log in net.logs if log.event == "peer_closed"]
    assert any(f"protocol version {v} is too old" in r for r in reasons)
    assert not a.banned("b") and not b.banned("a")
    # a is b's bootstrap address (the trainer, say), which b keeps redialling: once a
    # redial_s (1 s here) and once when the link drops, never faster
    assert a.counters.version_refused <= 2 * 40 + 2


def test_a_refused_non_bootstrap_address_is_redialled_ever_later() -> None:
    n = _core(redial_s=1.0)
    delays = []
    for k in range(5):
        n.now = float(k * 1000)
        n.dial("old:1")
        old = Script(n, 10 + k, node_id="old", region="r", outbound=True)
        with pytest.raises(AssertionError):
            old.handshake(proto=1)
        assert old.closed()
        delays.append(n.retry_at["old:1"] - n.now)
    for k, d in enumerate(delays):
        assert 0.5 * 2.0**k <= d <= 1.5 * 2.0**k, (k, d)
    assert n.counters.version_refused == 5


def test_the_cli_names_the_protocol_versions(capsys) -> None:
    from patchswarm.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert f"swarm protocol {hs.SPEAKS[0]}..{hs.SPEAKS[1]}" in capsys.readouterr().out
