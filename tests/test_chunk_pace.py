"""A chunk's own pace (``ChunkPace``): the driver's one report per arriving chunk, and
the simulator's, which the core projects a cut-through relay's start from
(docs/benchmarks.md round 59)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.conn import Arrival, Conn
from simulations.driver import Simulation
from simulations.scenario import load_scenario
from swarm.protocol import events as ev
from swarm.protocol import wire
from tests.test_cut_through import N, _driver, _link

LENGTH = 4 << 20


@given(st.lists(st.tuples(st.floats(0.0, 0.02), st.integers(1, 1 << 20)), min_size=1,
                max_size=60))
def test_an_arrival_reports_its_pace_once_after_the_look_while_it_still_arrives(
        steps: list[tuple[float, int]]) -> None:
    """Blocks come at any times and sizes (the first at t0): a pace is due at most once,
    at the first block ``PACE_LOOK_S`` or more after the first one that leaves the chunk
    unfinished, and it counts the bytes after the first block and those left."""
    a = Arrival(conn=1, buf=memoryview(bytearray(0)), length=LENGTH, t0=10.0)
    t, got, reports = 10.0, 0, []
    first: int | None = None
    for k, (dt, n) in enumerate(steps):
        t = t + dt if k else 10.0
        got = min(LENGTH, got + n)
        a.got = got
        first = got if first is None else first
        due = a.pace_due(t)
        if due is not None:
            reports.append((t, got, due))
    assert len(reports) <= 1
    if reports:
        t_at, got_at, (after, left) = reports[0]
        assert t_at - 10.0 >= ev.PACE_LOOK_S
        assert after == got_at - first > 0 and left == LENGTH - got_at > 0
    else:
        # no report: the look never came while the chunk still arrived with bytes after
        # its first block
        tt, g = 10.0, 0
        for k, (dt, n) in enumerate(steps):
            tt = tt + dt if k else 10.0
            g = min(LENGTH, g + n)
            assert k == 0 or not (tt - 10.0 >= ev.PACE_LOOK_S and first < g < LENGTH)


def test_the_simulator_tells_a_border_the_pace_of_a_slow_push() -> None:
    """The simulator's driver sends ``ChunkPace`` as the node driver does: once per chunk
    arriving from another region, ``PACE_LOOK_S`` after its first block, with the bytes
    of the flow since then and those left, while it still arrives."""
    sc = load_scenario("configs/sim/wan-3x4.toml")
    sim = Simulation(sc, "patchswarm", seed=1)
    paces: list[tuple[str, float, ev.ChunkPace]] = []
    arriving: dict[tuple[str, int, int, int], float] = {}
    deliver = sim._deliver

    def spy(node, inc, e):  # type: ignore[no-untyped-def]
        if isinstance(e, ev.ChunkArriving):
            arriving[(node.node_id, e.conn, e.version, e.index)] = e.now
        if isinstance(e, ev.ChunkPace):
            paces.append((node.node_id, arriving[(node.node_id, e.conn, e.version, e.index)],
                          e))
        return deliver(node, inc, e)

    sim._deliver = spy  # type: ignore[method-assign]
    sim.run()
    assert paces, "no chunk came slowly enough over the scenario's 100 Mbit/s uplinks"
    seen = set()
    for node_id, t_first, e in paces:
        assert e.now - t_first == pytest.approx(ev.PACE_LOOK_S)
        assert e.got > 0 and e.left > 0
        key = (node_id, e.conn, e.version, e.index, t_first)
        assert key not in seen  # once per arriving chunk
        seen.add(key)


def test_the_node_driver_reports_a_slow_chunks_pace_once() -> None:
    """The node driver, as blocks of a chunk are taken on a link: ``ChunkArriving`` at the
    first, one ``ChunkPace`` at the first block ``PACE_LOOK_S`` or more after it (bytes
    after the first block, bytes left), none after it nor for a chunk that came fast."""
    asyncio.run(_driver_paces())


async def _driver_paces() -> None:
    messages: asyncio.Queue = asyncio.Queue()
    server, link = await _link(messages)
    events: list[ev.Event] = []
    drv = _driver([])
    feed = drv.feed

    def spy(e: ev.Event) -> None:
        if isinstance(e, (ev.ChunkArriving, ev.ChunkPace)):
            events.append(e)
        feed(e)

    drv.feed = spy  # type: ignore[method-assign]
    c = Conn(id=7, link=link, outbound=False, addr="peer")
    try:
        slow, fast = memoryview(bytearray(N)), memoryview(bytearray(N))
        block = wire.BLOCK_BYTES
        at = []
        for k in range(1, 4):  # chunk 0 of version 2: a block every 0.6 x the look
            at.append(drv.now())
            await drv._block_done(c, None, ((2, 0), slow, N, k * block))
            await asyncio.sleep(0.6 * ev.PACE_LOOK_S)
        await drv._block_done(c, None, ((2, 1), fast, N, block))  # chunk 1: all at once
        await drv._block_done(c, None, ((2, 1), fast, N, 3 * block))
        assert [type(e) for e in events] == [ev.ChunkArriving, ev.ChunkPace, ev.ChunkArriving]
        pace = events[1]
        assert isinstance(pace, ev.ChunkPace)
        assert (pace.conn, pace.version, pace.index) == (7, 2, 0)
        # the first block the look had passed at (the third, or the second on a slow box)
        k = next(k for k in (2, 3) if at[k - 1] - at[0] >= ev.PACE_LOOK_S)
        assert (pace.got, pace.left) == ((k - 1) * block, N - k * block)
    finally:
        await link.close()
        await server.close()
