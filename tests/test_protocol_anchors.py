"""Anchors and joiners: the chain a node fetches (swarm/protocol/versions.py)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.testing import MODEL, SECRET, Net, Script, Signer
from swarm.protocol.versions import VersionSet
from tests.test_protocol_core import fleet

PATCH, ANCHOR = 4, 10  # chunks of a patch and of an anchor (1000 bytes each)


def anchor(s: Signer, v: int) -> bytes:
    """A full checkpoint of version ``v - 1``'s weights, published as version ``v``."""
    return s.manifest(v, ANCHOR, kind="full", target_digest=Signer.digest(v - 1))


def publish_history(s: Signer, net: Net, o, upto: int, anchors: set[int]) -> None:
    for v in range(2, upto + 1):
        raw = anchor(s, v) if v in anchors else s.manifest(v, PATCH)
        net.deliver(o, ev.Publish(net.now, raw))
        net.run(net.now + 2.0)


def chunks_fetched(net: Net, node_id: str) -> dict[int, int]:
    """Distinct chunks per version that reached ``node_id`` (endgame twins counted once)."""
    got = {(v, i) for _a, b, v, i in net.sent_chunks if b == node_id}
    out: dict[int, int] = {}
    for v, _i in got:
        out[v] = out.get(v, 0) + 1
    return out


def test_up_to_date_nodes_step_over_an_anchor_without_fetching_it() -> None:
    s, net, o, hosts = fleet(2, 3, border_nodes=1)
    publish_history(s, net, o, 6, anchors={4})
    assert all(h.core.active_version == 6 for h in hosts)
    assert all(4 in h.applied for h in hosts)
    borders = {h.core.cfg.node_id for h in hosts if h.core.is_border}
    for h in hosts:
        got = chunks_fetched(net, h.core.cfg.node_id)
        if h.core.cfg.node_id not in borders:
            assert 4 not in got, got  # only the borders keep the region's copy for joiners


def test_a_joiner_takes_the_newest_anchor_and_the_patches_after_it() -> None:
    s, net, o, hosts = fleet(1, 3, keep_versions=2)
    publish_history(s, net, o, 8, anchors={5})
    j = net.add("joiner", "reg0", bootstrap=(o.addr, hosts[0].addr), active_version=None,
                keep_versions=2)
    net.start(j)
    net.run(net.now + 20.0, stop=lambda: j.core.active_version == 8)
    assert j.core.active_version == 8
    assert j.applied == [5, 6, 7, 8]
    assert sum(chunks_fetched(net, "joiner").values()) == ANCHOR + 3 * PATCH


def test_a_node_far_behind_chooses_by_bytes() -> None:
    s = Signer()
    vs = VersionSet()
    for v in range(2, 9):
        raw = anchor(s, v) if v == 6 else s.manifest(v, PATCH)
        vs.add(s.verify(raw), raw)
    # from 4: patch 5 (4 chunks) + anchor 6 free + 7, 8 beats anchor 6 (10) + 7, 8
    vs.replan(4)
    assert vs.chain == [5, 6, 7, 8] and vs.free == {6} and vs.wanted == [5, 7, 8]
    # from 1: patches 2..5 (16 chunks) > anchor (10): the anchor
    vs.replan(1)
    assert vs.chain == [6, 7, 8] and vs.free == set()


def _node_at_1(peer_region: str) -> tuple[Signer, NodeCore, Script]:
    """A node of region r at version 1 (``unavailable_s`` 5) linked to one peer."""
    s = Signer()
    cfg = CoreConfig(node_id="n", region="r", model=MODEL, listen_addr="n:1",
                     swarm_secret=SECRET, active_version=1, unavailable_s=5.0)
    core = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    core.raise_internal_errors = True
    a = Script(core, 1, node_id="a", region=peer_region)
    a.handshake()
    return s, core, a


def test_an_unavailable_patch_falls_back_to_the_anchor() -> None:
    """Patch 2 is cheaper than anchor 3 (4 chunks, then 3 is free), but nobody holds
    it: after ``unavailable_s`` the node takes the anchor; it takes 2 back if shown."""
    s, core, a = _node_at_1("r")
    for raw in (s.manifest(2, PATCH), anchor(s, 3), s.manifest(4, PATCH)):
        a.send(wire.Announce(raw))
    assert core.versions.chain == [2, 3, 4] and core.versions.wanted == [2, 4]
    a.send(wire.Bitfield(3, wire.bits_to_bytes((1 << ANCHOR) - 1, ANCHOR)))
    got = a.send(wire.Bitfield(4, wire.bits_to_bytes((1 << PATCH) - 1, PATCH)))
    assert {f.version for f in got if isinstance(f, wire.Request)} <= {4}
    requested: set[int] = set()
    for t in range(1, 12):
        for f in a.frames(core.handle(ev.Tick(float(t)))):
            if isinstance(f, wire.Request):
                requested.add(f.version)
    assert 2 in core.versions.unavailable
    assert core.versions.chain == [3, 4] and 3 in requested
    # somebody holds patch 2 after all: it is cheaper again
    a.send(wire.Bitfield(2, wire.bits_to_bytes((1 << PATCH) - 1, PATCH)))
    assert 2 not in core.versions.unavailable


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.booleans(), min_size=1, max_size=14),
       keep=st.integers(1, 4), start=st.integers(1, 15))
def test_from_any_retained_point_the_newest_version_is_reachable(history, keep, start) -> None:
    """Whatever a node at version ``start`` still finds announced (the versions the
    fleet retains: the last ``keep`` and everything from the newest anchor), a chain
    reaches the newest version; a fresh joiner too when there is an anchor."""
    s = Signer()
    newest = len(history) + 1
    full = VersionSet()
    for v, is_anchor in zip(range(2, newest + 1), history, strict=True):
        raw = anchor(s, v) if is_anchor else s.manifest(v, PATCH)
        full.add(s.verify(raw), raw)
    lo = full.retained_from(newest, keep)
    node = VersionSet()
    for v in sorted(full.states):
        if v >= lo:
            st_ = full.states[v]
            node.add(st_.manifest, st_.raw)
    active = min(start, newest)
    node.replan(active)
    if active >= newest:
        assert node.chain == []
        return
    reachable = active >= lo - 1 or any(st_.manifest.kind == "full" for st_ in node.states.values())
    if reachable:
        assert node.chain and node.chain[-1] == newest
    joiner = VersionSet()
    for st_ in node.states.values():
        joiner.add(st_.manifest, st_.raw)
    joiner.replan(None)
    if any(h for h in history):
        assert joiner.chain[-1] == newest


def test_a_version_given_up_on_while_its_last_chunk_was_on_its_way_is_applied_when_it_comes() -> None:
    """A border takes a patch by push (nobody shows it: there is nothing to ask for).
    Its last chunk crawls over a slow path for longer than ``unavailable_s``, so the node
    gives up on the version; when the chunk comes whole, the version is whole: it goes
    back into the chain and is applied. (It was held whole and never applied: the
    simulator's 1 % loss over 150 ms, a node of region b.)"""
    s, core, a = _node_at_1("q")
    a.send(wire.Announce(s.manifest(2, PATCH)))
    assert core.versions.chain == [2]
    for i in range(PATCH - 1):  # pushed: whole chunks, nothing asked for
        core.handle(ev.ChunkReceived(core.now + 0.5, 1, 2, i, True))
    for _t in range(10):
        core.handle(ev.Tick(core.now + 1.0))
    assert 2 in core.versions.unavailable and core.versions.chain == []
    acts = core.handle(ev.ChunkReceived(core.now + 1.0, 1, 2, PATCH - 1, True))
    assert 2 not in core.versions.unavailable and core.versions.chain == [2]
    assert [a.version for a in acts if isinstance(a, ev.ApplyVersion)] == [2]
