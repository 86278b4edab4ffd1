"""A long-running origin forgets versions it no longer announces (swarm/protocol/core.py
``_forget_old``), so the trainer's store can be collected while it runs; never one a
linked region still takes.

In-memory cores (``swarm.protocol.testing``): an origin, two regions of three nodes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.protocol import events as ev
from tests.test_protocol_anchors import PATCH, anchor, publish_history
from tests.test_protocol_core import fleet


def held(h) -> list[int]:
    return sorted(h.core.manifests)


def test_a_running_origin_forgets_what_it_no_longer_announces() -> None:
    s, net, o, hosts = fleet(2, 3, keep_versions=2)
    publish_history(s, net, o, 8, anchors={5})
    assert all(h.core.active_version == 8 for h in hosts)
    # the last 2 versions and everything from the newest anchor (VersionSet.retained_from)
    assert held(o) == [5, 6, 7, 8]
    assert sorted(o.core.role.plans) == [5, 6, 7, 8] and o.core.role.versions == [5, 6, 7, 8]
    net.deliver(o, ev.Publish(net.now, anchor(s, 9)))
    net.run(net.now + 3.0)
    assert held(o) == [8, 9]
    assert all(h.core.active_version == 9 for h in hosts)
    assert all(set(p.bits) <= {8, 9} for p in o.core.peers.values())
    # the origin still answers a new node with what it holds: a joiner reaches 9
    j = net.add("joiner", "reg0", bootstrap=(o.addr, hosts[0].addr), active_version=None,
                keep_versions=2)
    net.start(j)
    net.run(net.now + 20.0, stop=lambda: j.core.active_version == 9)
    assert j.core.active_version == 9


def test_the_origin_keeps_a_version_a_region_still_takes() -> None:
    """Versions published faster than they spread: each stays at the origin while a linked
    border lacks it and is not past it, so no region is left without a link of the chain
    (there is no anchor to fall back on)."""
    s, net, o, hosts = fleet(2, 3, keep_versions=1)
    for v in (2, 3, 4):  # at once: none has reached a region yet
        net.deliver(o, ev.Publish(net.now, s.manifest(v, PATCH)))
    assert held(o) == [2, 3, 4]  # outside the window, but the regions lack them
    net.run(net.now + 30.0, stop=lambda: all(h.core.active_version == 4 for h in hosts))
    assert all(h.core.active_version == 4 for h in hosts)
    net.run(net.now + 2 * o.core.cfg.heartbeat_s)  # the heartbeat after the last push
    assert held(o) == [4]
    assert sorted(o.core.role.plans) == [4]


def test_nodes_keep_their_own_window() -> None:
    """A node's window is its own, from the version it applied: the nodes here hold the
    base as a full checkpoint (version 1), so they keep everything from it, while the
    origin, which holds no full version, keeps its last 2."""
    s, net, o, hosts = fleet(1, 3, keep_versions=2)
    publish_history(s, net, o, 6, anchors=set())
    assert held(o) == [5, 6]
    assert all(held(h) == [1, 2, 3, 4, 5, 6] for h in hosts)


@settings(max_examples=50, deadline=None)
@given(gaps=st.lists(st.sampled_from([0.0, 0.05, 0.3, 2.0]), min_size=1, max_size=6),
       anchors=st.sets(st.integers(3, 7)), keep=st.integers(1, 3), seed=st.integers(0, 3))
def test_any_publish_schedule_reaches_every_node_and_leaves_the_window(gaps, anchors, keep, seed):
    """Publishes at any pace, with or without anchors: every node reaches the newest
    version, and once the fanout is done the origin holds exactly its window (the last
    ``keep`` versions and everything from the newest anchor)."""
    s, net, o, hosts = fleet(2, 2, keep_versions=keep, seed=seed)
    published: dict[int, bool] = {}  # version -> is an anchor
    for k, gap in enumerate(gaps):
        v = k + 2
        full = v in anchors
        net.deliver(o, ev.Publish(net.now, anchor(s, v) if full else s.manifest(v, PATCH)))
        published[v] = full
        net.run(net.now + gap)
    newest = max(published)
    net.run(net.now + 60.0, stop=lambda: all(h.core.active_version == newest for h in hosts))
    assert [h.core.active_version for h in hosts] == [newest] * len(hosts)
    net.run(net.now + 2 * o.core.cfg.heartbeat_s)
    lo = newest - keep + 1
    full = [v for v, is_full in published.items() if is_full]
    if full:
        lo = min(lo, max(full))
    assert held(o) == [v for v in sorted(published) if v >= lo]


@settings(max_examples=30, deadline=None)
@given(gaps=st.lists(st.sampled_from([0.0, 0.05, 0.3, 2.0]), min_size=2, max_size=6),
       anchors=st.sets(st.integers(3, 7), min_size=1), keep=st.integers(1, 3),
       join_after=st.integers(0, 5), seed=st.integers(0, 3))
def test_a_late_joiner_reaches_the_newest_version(gaps, anchors, keep, join_after, seed):
    """A fresh node that starts after ``join_after`` publishes, with at least one anchor
    published: whatever the origin and the nodes forgot meanwhile, it reaches the newest
    version with the others."""
    s, net, o, hosts = fleet(2, 2, keep_versions=keep, seed=seed)
    joiner = None
    for k, gap in enumerate(gaps):
        if k == min(join_after, len(gaps) - 1):
            joiner = net.add("joiner", "reg1", bootstrap=(o.addr, hosts[2].addr),
                             active_version=None, keep_versions=keep)
            net.start(joiner)
        v = k + 2
        net.deliver(o, ev.Publish(net.now, anchor(s, v) if v in anchors else s.manifest(v, PATCH)))
        net.run(net.now + gap)
    newest = len(gaps) + 1
    everyone = [*hosts, joiner]
    if not any(v <= newest for v in anchors):
        return  # no anchor published: a fresh node has no way in (by design)
    net.run(net.now + 90.0, stop=lambda: all(h.core.active_version == newest for h in everyone))
    assert [h.core.active_version for h in everyone] == [newest] * len(everyone)


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.sampled_from([0.0, 0.05, 0.3, 2.0]), min_size=2, max_size=6),
       anchors=st.sets(st.integers(3, 7)), keep=st.integers(1, 3),
       kill_at=st.integers(0, 5), victim=st.integers(0, 5), seed=st.integers(0, 3))
def test_a_node_that_dies_mid_schedule_strands_nobody(gaps, anchors, keep, kill_at, victim, seed):
    """A node (a border or not) dies between two publishes: every live node still reaches
    the newest version, and the origin does not keep versions for the dead one."""
    s, net, o, hosts = fleet(2, 3, keep_versions=keep, seed=seed)
    dead = None
    for k, gap in enumerate(gaps):
        if k == min(kill_at, len(gaps) - 1):
            dead = hosts[victim]
            net.kill(dead)
        v = k + 2
        net.deliver(o, ev.Publish(net.now, anchor(s, v) if v in anchors else s.manifest(v, PATCH)))
        net.run(net.now + gap)
    newest = len(gaps) + 1
    live = [h for h in hosts if h is not dead]
    net.run(net.now + 120.0, stop=lambda: all(h.core.active_version == newest for h in live))
    assert [h.core.active_version for h in live] == [newest] * len(live)
    net.run(net.now + 2 * o.core.cfg.heartbeat_s)
    assert min(held(o)) >= o.core.versions.retained_from(newest, keep)
