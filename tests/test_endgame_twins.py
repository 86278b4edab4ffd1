"""Endgame twins held back until the first request is overdue (``[swarm]
endgame_twin_after_s``, round 60).

In the endgame a node asks a second holder for a chunk already in flight (a twin). Asked
at once, on the emulated WAN's 1 Gbit/s LAN the twin shared the requester's link with
the copy it doubled: both came whole, each at half speed, 7-9 whole duplicate chunks a
version over 11 nodes. Now a twin goes once the first request is
``endgame_twin_after_s`` old and older than the chunk time expected of its peer, or
sooner to a peer expected to deliver first. Scripted single cores check when a twin goes
and that the core wakes for it; in-memory fleets (Hypothesis, in
tests/test_cancel_uploads.py) that every version still arrives.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ConfigError
from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.config import CoreConfig
from swarm.protocol.core import NodeCore
from swarm.protocol.testing import MODEL, SECRET, Script, Signer
from tests.test_cancel_uploads import _run_fleet

V = 2


def _wanting(b_ewma: float | None = None, c_ewma: float | None = None,
             **knobs) -> tuple[NodeCore, Script, Script]:
    """Node ``a`` wanting version 2 (one chunk), in the endgame from the start: region
    peer ``b`` shows the chunk first and is asked for it; ``c`` shows it next. A peer's
    ``*_ewma`` is the chunk time it has shown (None: no answers timed yet)."""
    s = Signer()
    cfg = CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1",
                     swarm_secret=SECRET, active_version=1, pipeline=1, endgame_chunks=8,
                     **knobs)
    n = NodeCore(cfg, verify_manifest=s.verify, rng=random.Random(0))
    n.raise_internal_errors = True
    n.handle(ev.LocalChunks(0.0, s.manifest(V, 1), ()))
    peers = []
    for conn, (name, ewma) in enumerate((("b", b_ewma), ("c", c_ewma)), start=1):
        p = Script(n, conn, node_id=name, region="r")
        p.handshake()
        if ewma is not None:
            n.peers[conn].ewma, n.peers[conn].samples = ewma, 5
        peers.append(p)
    b, c = peers
    b.send(wire.Bitfield(V, wire.bits_to_bytes(0b1, 1)))
    c.send(wire.Bitfield(V, wire.bits_to_bytes(0b1, 1)))
    return n, b, c


def _asked(n: NodeCore) -> list[int]:
    return sorted(n.requests.asked.get((V, 0), []))


def _tick(n: NodeCore, at: float) -> list[ev.Action]:
    return n.handle(ev.Tick(at))


def _requests(p: Script, actions: list[ev.Action]) -> list[wire.Frame]:
    """The REQUESTs among ``actions`` to ``p`` (a heartbeat's PING is not one)."""
    return [f for f in p.frames(actions) if isinstance(f, wire.Request)]


def test_a_twin_waits_for_the_first_request_to_be_overdue() -> None:
    n, _b, c = _wanting()
    t0 = n.now
    assert _asked(n) == [1]  # b only: no twin yet
    due = n.requests.twin_due
    assert due == pytest.approx(t0 + 0.1)
    assert n.next_wakeup() <= due  # the core wakes for it
    assert _requests(c, _tick(n, t0 + 0.05)) == [] and _asked(n) == [1]
    assert n.counters.endgame_twins == 0
    got = _tick(n, t0 + 0.1)
    assert _requests(c, got) == [wire.Request(V, (0,))] and _asked(n) == [1, 2]
    assert n.counters.endgame_twins == 1 and n.status()["counters"]["endgame_twins"] == 1
    assert n.requests.twin_due is None  # nothing else held back


def test_a_chunk_that_arrives_in_time_gets_no_twin() -> None:
    n, _b, c = _wanting()
    t0 = n.now
    n.handle(ev.ChunkReceived(t0 + 0.04, 1, V, 0, True))
    assert 0 in n.have(V)
    got = _tick(n, t0 + 0.1)  # the wake-up it had asked for finds nothing to do
    assert _requests(c, got) == [] and n.counters.dup_chunks == 0 and n.requests.n == 0
    assert n.requests.first == {} and n.requests.asked == {}


def test_a_twin_waits_for_the_peer_asked_first_to_be_late() -> None:
    """``b`` takes 0.5 s a chunk, ``c`` has shown no faster: the twin waits until ``b``'s
    answer is later than its usual, not just the 0.1 s floor."""
    n, _b, c = _wanting(b_ewma=0.5, c_ewma=0.6)
    t0 = n.now
    assert n.requests.twin_due == pytest.approx(t0 + 0.1)
    assert _requests(c, _tick(n, t0 + 0.1)) == []
    assert n.requests.twin_due == pytest.approx(t0 + 0.5)
    assert _requests(c, _tick(n, t0 + 0.3)) == []
    assert _requests(c, _tick(n, t0 + 0.5)) == [wire.Request(V, (0,))]


def test_a_faster_peer_gets_the_twin_at_the_floor() -> None:
    """``b`` takes 2 s a chunk, ``c`` 0.05 s: ``c`` would deliver first, so its twin goes
    at the floor, not after ``b``'s 2 s."""
    n, _b, c = _wanting(b_ewma=2.0, c_ewma=0.05)
    t0 = n.now
    assert _requests(c, _tick(n, t0 + 0.1)) == [wire.Request(V, (0,))]


def test_zero_asks_the_twin_at_once() -> None:
    n, _b, _c = _wanting(endgame_twin_after_s=0.0)
    assert _asked(n) == [1, 2] and n.requests.twin_due is None


def test_a_twin_for_a_chunk_whose_first_request_was_dropped_goes_at_once() -> None:
    """``b`` refuses (REJECT): nothing is in flight, so asking ``c`` is no twin."""
    n, b, c = _wanting()
    b.send(wire.Reject(V, (0,)))
    assert c.frames(b.actions) == [wire.Request(V, (0,))] and _asked(n) == [2]


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), 3601.0])
def test_the_knob_is_validated(value: float) -> None:
    with pytest.raises(ConfigError, match="endgame_twin_after_s"):
        CoreConfig(node_id="a", region="r", model=MODEL, listen_addr="a:1",
                   swarm_secret=SECRET, endgame_twin_after_s=value)


@settings(max_examples=20, deadline=None)
@given(b_ewma=st.one_of(st.none(), st.floats(0.001, 5.0)),
       c_ewma=st.one_of(st.none(), st.floats(0.001, 5.0)),
       after=st.floats(0.001, 2.0), step=st.floats(0.001, 0.5))
def test_a_twin_goes_exactly_when_the_rule_says(b_ewma: float | None, c_ewma: float | None,
                                                after: float, step: float) -> None:
    """Ticks at any spacing: the twin is asked at the first tick at or after the rule's
    time, never before; and the core always has a wake-up no later than that time."""
    n, _b, c = _wanting(b_ewma, c_ewma, endgame_twin_after_s=after)
    t0 = n.now
    exp_b = b_ewma or 0.0
    mine = c_ewma or 0.0

    def ready(t: float) -> bool:
        return t >= t0 + after and (t >= t0 + exp_b or t + mine < t0 + exp_b)

    t = t0
    for _ in range(int(12 / step) + 2):
        wake = n.next_wakeup()
        assert wake is not None and wake > t  # never a wake-up at or before now
        t = min(t + step, wake)
        got = _tick(n, t)
        if _requests(c, got):
            assert ready(t) and _asked(n) == [1, 2]
            return
        assert _asked(n) == [1]
        assert not ready(t) or n.requests.twin_due is not None
    raise AssertionError("no twin was asked within 12 s")


def test_holding_twins_back_takes_in_fewer_duplicates() -> None:
    """The same in-memory fleets (every chunk in endgame, slow LAN links) with twins asked
    at once and held back 0.1 s: held back, the nodes take in fewer whole duplicate
    chunks and ask fewer twins."""
    def dups(after: float) -> tuple[int, int]:
        hosts = _run_fleet(seed=3, per=5, twins=12, rate=2e4, twin_after=after)
        return (sum(h.core.counters.dup_chunks for h in hosts),
                sum(h.core.counters.uploads_cancelled for h in hosts))

    at_once, held = dups(0.0), dups(0.1)
    assert held[0] < at_once[0] and held[1] < at_once[1], (at_once, held)
