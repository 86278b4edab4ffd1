"""A patch's short last chunk goes first: at the origin (pushes, relays) and in a node's
requests (``picker.first_pick``, ``VersionState.short``).

A patch one header past whole chunks ends in a chunk of a few bytes. Picked lowest
first it was the last chunk pushed: it queued behind the version's last full chunks on
the same connections and then crossed every hop after them, and on the emulated WAN some
node of a version waited up to 0.1 s for it after its last full chunk
(docs/benchmarks.md, round 41).
"""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.picker import first_pick, lowest
from swarm.protocol.testing import MODEL, SECRET, Script, Signer
from swarm.protocol.versions import VersionState
from tests.test_protocol_core import fleet


@given(st.integers(min_value=1, max_value=(1 << 40) - 1), st.integers(min_value=0, max_value=40))
def test_first_pick_is_a_candidate_the_short_one_if_it_is_one(cand: int, last: int) -> None:
    short = 1 << last
    i = first_pick(cand, short)
    assert (cand >> i) & 1
    assert i == (last if cand & short else lowest(cand))
    assert first_pick(cand, 0) == lowest(cand)


def test_only_a_last_chunk_under_half_a_full_one_is_short() -> None:
    s = Signer()
    for chunks, last, short in [(4, 10, 1 << 3), (4, 499, 1 << 3), (4, 500, 0), (4, None, 0),
                                (1, 10, 0), (2, 1, 1 << 1)]:
        raw = s.manifest(2, chunks, last_chunk=last)
        assert VersionState(s.verify(raw), raw).short == short, (chunks, last)


def _node(s: Signer, **knobs) -> NodeCore:
    cfg = CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1",
                     swarm_secret=SECRET, active_version=1, **knobs)
    core = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    core.raise_internal_errors = True
    return core


def _requests(acts: list[ev.Action]) -> list[wire.Request]:
    frames = [wire.decode(a.frame) for a in acts if isinstance(a, ev.SendFrame)]
    return [f for f in frames if isinstance(f, wire.Request)]


def _bitfield(n: NodeCore, conn: int, bits: int) -> list[wire.Request]:
    return _requests(n.handle(ev.FrameReceived(n.now, conn, wire.Bitfield(
        2, wire.bits_to_bytes(bits, 8)).encode())))


def test_a_node_asks_for_the_short_chunk_first_even_where_it_is_not_the_rarest() -> None:
    s = Signer()
    for pipeline in (1, 4):
        n = _node(s, pipeline=pipeline, max_requests=8)
        n.handle(ev.LocalChunks(0.0, s.manifest(2, 8, last_chunk=10), ()))
        q, p = Script(n, 2, node_id="q", region="r"), Script(n, 3, node_id="p", region="r")
        q.handshake()
        p.handshake()
        # q holds only the short chunk: asked for it at once
        assert [tuple(r.indices) for r in _bitfield(n, 2, 0x80)] == [(7,)]
        # p holds everything: chunk 7 is now the most common, and in flight: the rest go
        # rarest first (all alike here)
        (req,) = _bitfield(n, 3, 0xFF)
        assert 7 not in req.indices and len(set(req.indices)) == pipeline
        # the same with the short chunk not yet asked for: asked first, from p
        m = _node(s, pipeline=pipeline, max_requests=8)
        m.handle(ev.LocalChunks(0.0, s.manifest(2, 8, last_chunk=10), ()))
        q, p = Script(m, 2, node_id="q", region="r"), Script(m, 3, node_id="p", region="r")
        q.handshake()
        p.handshake()
        assert len(_bitfield(m, 2, 0x01)) == 1  # q: chunk 0 (its only one)
        (req,) = _bitfield(m, 3, 0xFF)
        assert req.indices[0] == 7 and len(set(req.indices)) == pipeline


def test_the_origin_sends_the_short_chunk_first_and_every_region_gets_it_early() -> None:
    """Three regions of six: the origin's first push of the version is its short chunk,
    and in every region it is among the first half of the chunks to come in from outside
    (by the origin's push or a relay). Picked lowest first, two of the three regions took
    it in last."""
    s, net, o, hosts = fleet(3, 6, push_slots=2)
    net.sent_chunks.clear()
    net.deliver(o, ev.Publish(net.now, s.manifest(2, 12, last_chunk=10)))
    net.run(net.now + 60, stop=lambda: all(2 in h.applied for h in hosts))
    assert all(h.core.active_version == 2 for h in hosts)
    pushed = [i for a, _b, v, i in net.sent_chunks if a == "origin" and v == 2]
    assert pushed[0] == 11 and sorted(set(pushed)) == list(range(12))
    for r in ("reg0", "reg1", "reg2"):
        into = [i for a, b, v, i in net.sent_chunks
                if v == 2 and net.host(b).region == r and net.host(a).region != r]
        assert 11 in into[:6], (r, into)
