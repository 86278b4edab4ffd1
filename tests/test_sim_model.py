"""What made the emulated network slower than the first simulator (issue #11), modelled:
head-of-line blocking of control frames behind chunk data on one connection, the
per-flow TCP ceiling under loss (Mathis) with a slow-start ramp, per-node CPU.

Each is checked through the real driver (``Simulation``) on a hand-made connection
between two nodes, so the numbers are the ones a run uses; the protocol core is not
involved (its nodes are never booted).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.bounds import cold_chunk_s, flow_cap, lower_bound
from simulations.cpu import Cores, run_job
from simulations.driver import Half, Simulation
from simulations.network import mathis_cap, mbps
from simulations.scenario import parse_scenario
from swarm.errors import ConfigError
from swarm.protocol import events as ev
from swarm.protocol.stripes import AUTO_LANES, lanes_for_loss

MiB = 2**20


def two_site(replace: tuple[str, ...] = (), **over):
    """Regions a and b (4 nodes each); knobs through keyword overrides of the TOML doc
    (tables are merged into the defaults, except those named in ``replace``)."""
    doc = {
        "payload": {"patch": "8 MiB", "chunk": "4 MiB"},
        "defaults": {"uplink_mbps": 100, "downlink_mbps": 100, "latency_ms": 0.5},
        "regions": [{"name": "a", "nodes": 4}, {"name": "b", "nodes": 4}],
        "links": {"latency_ms": 40},
    }
    for k, v in over.items():
        doc[k] = {**doc.get(k, {}), **v} if isinstance(v, dict) and k not in replace else v
    return parse_scenario(doc)


class Wire:
    """A Simulation whose nodes are never booted: connections made by hand, arrivals recorded."""

    def __init__(self, sc) -> None:
        self.sim = sim = Simulation(sc, "patchswarm")
        self.frames: list[tuple[float, bytes]] = []
        self.chunks: list[tuple[float, int]] = []
        self.verified: list[tuple[float, int]] = []
        sim._frame_arrives = lambda item: self.frames.append((sim.engine.now, item[1]))
        sim._deliver = lambda *a: None  # no cores: ChunkSent, ChunkReceived go nowhere
        real_arrives = sim._chunk_arrives

        def chunk_arrives(item):
            self.chunks.append((sim.engine.now, item[2]))
            real_arrives(item)

        sim._chunk_arrives = chunk_arrives
        real_verified = sim._chunk_verified

        def verified(item):
            self.verified.append((sim.engine.now, item[2]))
            real_verified(item)

        sim._chunk_verified = verified

    def connect(self, src, dst, cid: int = 1) -> Half:
        """An open connection src -> dst (as ``_accept`` builds it), returns src's end."""
        lat = self.sim._lat(src, dst)
        mine, theirs = Half(src, cid, lat), Half(dst, cid, lat)
        mine.peer, theirs.peer = theirs, mine
        src.conns[cid], dst.conns[cid] = mine, theirs
        src.alive = dst.alive = True
        if self.sim.sc.slow_start:
            mine.cwnd = theirs.cwnd = self.sim._initial_window(src, dst)
        return mine

    def node(self, region: str, i: int):
        return self.sim.region_nodes[region][i]

    def chunk(self, src, size: int, index: int = 0, cid: int = 1) -> None:
        self.sim._send_chunk(src, ev.SendChunk(cid, 2, index, size))

    def frame(self, src, data: bytes = b"\x90", cid: int = 1) -> None:
        self.sim._send_frame(src, ev.SendFrame(cid, data))

    def at(self, t: float, fn, *args) -> None:
        self.sim.engine.schedule(t, lambda _: fn(*args))

    def run(self) -> None:
        self.sim.engine.run()


# ------------------------------------------------------------------ head-of-line


@pytest.mark.parametrize(("block", "expected"), [
    (0, 4 * MiB / mbps(100)),  # the whole 4 MiB message first: 0.336 s
    (256 * 1024, 256 * 1024 / mbps(100)),  # one 256 KiB block: 21 ms
])
def test_control_frame_behind_a_4_mib_chunk_on_100_mbit(block, expected):
    w = Wire(two_site(network={"interleave_block_bytes": block}))
    a0, a1 = w.node("a", 0), w.node("a", 1)
    w.connect(a0, a1)
    w.chunk(a0, 4 * MiB)
    w.frame(a0)  # sent right after the chunk was queued
    w.run()
    lat = 0.0005
    assert w.frames[0][0] == pytest.approx(expected + lat, rel=1e-3)
    assert w.chunks[0][0] == pytest.approx(4 * MiB / mbps(100) + lat, rel=1e-3)
    if block:
        assert w.frames[0][0] < w.chunks[0][0]  # the frame overtook the rest of the chunk


def test_whole_chunk_messages_queue_frames_behind_every_chunk_ahead():
    """Knob 0: a frame waits for all chunks queued before it, not for those queued after."""
    w = Wire(two_site(network={"interleave_block_bytes": 0}))
    a0, a1 = w.node("a", 0), w.node("a", 1)
    w.connect(a0, a1)
    w.chunk(a0, 1 * MiB, 0)
    w.chunk(a0, 1 * MiB, 1)
    w.frame(a0, b"\x91")
    w.chunk(a0, 1 * MiB, 2)
    w.run()
    t = MiB / mbps(100)
    assert [i for _, i in w.chunks] == [0, 1, 2]  # one stream: chunks leave in order
    assert [c for c, _ in w.chunks] == pytest.approx([t + 5e-4, 2 * t + 5e-4, 3 * t + 5e-4], rel=1e-3)
    assert w.frames[0][0] == pytest.approx(2 * t + 5e-4, rel=1e-3)
    hol = w.sim.hol_max
    assert hol == pytest.approx(2 * t, rel=1e-3)


@settings(max_examples=40, deadline=None)
@given(
    block_kib=st.sampled_from([0, 16, 64, 256, 1024]),
    sizes=st.lists(st.integers(1, 4 * MiB), min_size=1, max_size=4),
    sends=st.lists(st.floats(0.0, 1.5), min_size=1, max_size=6),
)
def test_frames_stay_in_order_and_wait_at_most_one_block(block_kib, sizes, sends):
    block = block_kib * 1024
    w = Wire(two_site(network={"interleave_block_bytes": block}))
    a0, a1 = w.node("a", 0), w.node("a", 1)
    w.connect(a0, a1)
    for i, size in enumerate(sizes):
        w.chunk(a0, size, i)
    sent = sorted(sends)
    for k, t in enumerate(sent):
        w.at(t, w.frame, a0, bytes([k]))
    w.run()
    lat, rate = 0.0005, mbps(100)
    assert [f for _, f in w.frames] == [bytes([k]) for k in range(len(sent))]  # FIFO
    assert [t for t, _ in w.frames] == sorted(t for t, _ in w.frames)
    ends, t = [], 0.0
    for size in sizes:
        t += size / rate
        ends.append(t)  # when each chunk's last byte left
    prev = 0.0
    for (arrived, _), t_sent in zip(w.frames, sent, strict=True):
        busy = any(e > t_sent for e in ends)
        if not busy:  # an idle connection: one latency, FIFO behind earlier frames
            assert arrived == pytest.approx(max(t_sent + lat, prev), abs=1e-9)
        elif block:  # at most one block of the chunk on the wire ahead of it
            assert arrived <= max(t_sent + block / rate + lat, prev) + 1e-9
            assert arrived >= t_sent + lat - 1e-9
        else:  # whole-chunk messages: behind every chunk byte queued before it
            assert arrived == pytest.approx(max(ends[-1] + lat, prev), abs=1e-9)
        prev = arrived


def test_a_closed_connection_drops_what_was_queued():
    w = Wire(two_site(network={"interleave_block_bytes": 0}))
    a0, a1 = w.node("a", 0), w.node("a", 1)
    half = w.connect(a0, a1)
    w.chunk(a0, 4 * MiB, 0)
    w.chunk(a0, 4 * MiB, 1)
    w.frame(a0)
    w.at(0.1, w.sim._teardown, half, "test", False)
    w.run()
    assert w.chunks == [] and w.frames == []
    assert w.sim.net.active == 0


# ---------------------------------------------------------------- TCP per flow


def lossy(n: int = 8, **net):
    """Two sites 150 ms apart with 1 % loss; loss-based congestion control unless ``net``
    says otherwise (the Mathis ceiling applies to CUBIC and Reno, not BBR)."""
    net = {"congestion": "cubic", "lanes": 1, **net}
    return two_site(
        defaults={"uplink_mbps": 10_000, "downlink_mbps": 10_000, "latency_ms": 0.5},
        regions=[{"name": "a", "nodes": n}, {"name": "b", "nodes": n}],
        links={"rtt_ms": 150, "loss": 0.01},
        network=net,
        replace=("links",),
    )


def test_one_flow_on_a_long_lossy_link_is_capped_at_the_mathis_rate():
    sc = lossy()
    cap = mathis_cap(1460, 0.150, 0.01)
    assert cap == pytest.approx(1460 / 0.150 * 1.2247 / math.sqrt(0.01), rel=1e-3)  # ~0.95 Mbit/s
    assert flow_cap(sc, "a", "b") == pytest.approx(cap)
    w = Wire(sc)
    a0, b0 = w.node("a", 0), w.node("b", 0)
    w.connect(a0, b0)
    w.chunk(a0, MiB)
    w.run()
    assert w.chunks[0][0] == pytest.approx(MiB / cap + 0.075, rel=1e-3)


def test_bbr_is_not_capped_by_random_loss():
    """The nodes ask for BBR (``[network] congestion``, shipped "bbr"): a flow on the same
    lossy link goes at the link's rate, and the bound has no per-flow ceiling either."""
    sc = lossy(congestion="bbr")
    assert flow_cap(sc, "a", "b") == math.inf
    w = Wire(sc)
    a0, b0 = w.node("a", 0), w.node("b", 0)
    w.connect(a0, b0)
    w.chunk(a0, MiB)
    w.run()
    assert w.chunks[0][0] == pytest.approx(MiB / (10_000e6 / 8) + 0.075, rel=1e-2)
    assert w.chunks[0][0] < MiB / mathis_cap(1460, 0.150, 0.01) / 50


def test_eight_parallel_flows_get_eight_times_one():
    sc = lossy()
    cap = mathis_cap(1460, 0.150, 0.01)
    w = Wire(sc)
    for i in range(8):
        w.connect(w.node("a", i), w.node("b", i), cid=1)
        w.chunk(w.node("a", i), MiB)
    w.run()
    assert len(w.chunks) == 8
    elapsed = max(t for t, _ in w.chunks) - 0.075
    assert 8 * MiB / elapsed == pytest.approx(8 * cap, rel=1e-3)


def test_chunks_on_one_connection_share_its_one_flow():
    """Two chunks on one connection: one TCP stream, one Mathis ceiling (not two)."""
    cap = mathis_cap(1460, 0.150, 0.01)
    w = Wire(lossy())
    a0, b0 = w.node("a", 0), w.node("b", 0)
    w.connect(a0, b0)
    w.chunk(a0, MiB, 0)
    w.chunk(a0, MiB, 1)
    w.run()
    assert w.chunks[-1][0] == pytest.approx(2 * MiB / cap + 0.075, rel=1e-3)


@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_a_striped_link_has_a_loss_ceiling_per_lane(lanes):
    """``network.lanes`` (what-if): a cross-region link striped over k connections takes
    a chunk at k Mathis ceilings; a link inside a region stays one connection."""
    sc = lossy(lanes=lanes)
    cap = mathis_cap(1460, 0.150, 0.01)
    assert sc.lanes == lanes
    w = Wire(sc)
    a0, b0, a1 = w.node("a", 0), w.node("b", 0), w.node("a", 1)
    w.connect(a0, b0)
    w.chunk(a0, MiB)
    w.run()
    assert w.chunks[0][0] == pytest.approx(MiB / (lanes * cap) + 0.075, rel=1e-3)
    assert w.sim.topo.flow_cap[("a", "a")] == math.inf  # 1 ms inside, no loss
    assert w.sim._initial_window(a0, a1) == 10 * 1460


def test_auto_lanes_stripe_only_lossy_links_and_open_no_windows_early():
    """``network.lanes = "auto"`` (the node's): a lossy cross-region link gets as many
    ceilings as its loss calls for (``lanes_for_loss``: 13 at 1 %), a clean one stays
    one connection, and no connection opens extra initial windows (the node opens lanes
    only after looking at a sending socket)."""
    sc = lossy(lanes="auto")
    cap = mathis_cap(1460, 0.150, 0.01)
    assert (sc.lanes, sc.lanes_auto) == (AUTO_LANES, True)
    k = lanes_for_loss(0.01)
    assert k == 13
    w = Wire(sc)
    a0, b0 = w.node("a", 0), w.node("b", 0)
    w.connect(a0, b0)
    w.chunk(a0, MiB)
    w.run()
    assert w.chunks[0][0] == pytest.approx(MiB / (k * cap) + 0.075, rel=1e-3)
    assert w.sim._initial_window(a0, b0) == 10 * 1460
    clean = two_site(network={"congestion": "cubic", "lanes": "auto"})
    assert Wire(clean).sim.topo.flow_cap[("a", "b")] == math.inf
    with pytest.raises(ConfigError, match=r"network\.lanes"):
        two_site(network={"lanes": "all"})


def test_a_striped_link_starts_with_a_window_per_lane():
    """k fresh connections open k initial windows at once: 1 MiB over 80 ms RTT on 4 lanes
    needs the rounds one lane needs for 256 KiB (IW10 x 4, doubling per RTT)."""
    def first_chunk(lanes: int) -> float:
        sc = two_site(defaults={"uplink_mbps": 1000, "downlink_mbps": 1000, "latency_ms": 0.5},
                      network={"slow_start": True, "lanes": lanes})
        w = Wire(sc)
        w.connect(w.node("a", 0), w.node("b", 0))
        w.chunk(w.node("a", 0), MiB)
        w.run()
        return w.chunks[0][0]

    one, four = first_chunk(1), first_chunk(4)
    assert four < one - 0.15  # two round trips of 80 ms fewer
    iw, rtt = 4 * 10 * 1460, 0.080
    rounds = next(r for r in range(1, 20) if iw * (2**r - 1) >= MiB)
    sent = iw * (2 ** (rounds - 1) - 1)
    assert four == pytest.approx((rounds - 1) * rtt + (MiB - sent) / (iw * 2 ** (rounds - 1) / rtt)
                                 + 0.040, rel=1e-3)
    with pytest.raises(ConfigError, match=r"network\.lanes"):
        two_site(network={"lanes": 0})


def test_slow_start_ramps_a_new_connection():
    """IW10 doubling per 80 ms RTT: 1 MiB needs 6 full RTTs and a bit of the 7th."""
    sc = two_site(defaults={"uplink_mbps": 1000, "downlink_mbps": 1000, "latency_ms": 0.5},
                  network={"slow_start": True})
    w = Wire(sc)
    a0, b0 = w.node("a", 0), w.node("b", 0)
    half = w.connect(a0, b0)
    w.chunk(a0, MiB, 0)
    # the window stays open: the next chunk on the same connection goes at the ramped rate
    w.at(0.6, w.chunk, a0, MiB, 1)
    w.run()
    iw, rtt = 10 * 1460, 0.080
    sent6 = iw * (2**6 - 1)
    expected = 6 * rtt + (MiB - sent6) / (iw * 2**6 / rtt)
    assert w.chunks[0][0] == pytest.approx(expected + 0.040, rel=1e-3)
    assert w.chunks[1][0] - 0.6 < 0.5 * expected
    assert half.cwnd == math.inf or half.cwnd > iw * 2**6


def _two_chunks(second_at: float, idle_restart: bool,
                congestion: str = "cubic") -> tuple[float, float, int]:
    """1 MiB on a fresh 80 ms-RTT connection, another at ``second_at`` on the same one:
    (first's arrival, second's time from ``second_at``, chunks started on a decayed window)."""
    sc = two_site(defaults={"uplink_mbps": 1000, "downlink_mbps": 1000, "latency_ms": 0.5},
                  network={"slow_start": True, "idle_restart": idle_restart,
                           "congestion": congestion})
    w = Wire(sc)
    a0, b0 = w.node("a", 0), w.node("b", 0)
    w.connect(a0, b0)
    w.chunk(a0, MiB, 0)
    w.at(second_at, w.chunk, a0, MiB, 1)
    w.run()
    return w.chunks[0][0], w.chunks[1][0] - second_at, w.sim.idle_restarts


@pytest.mark.parametrize("congestion", ["cubic", "reno"])
def test_a_window_left_unused_decays_back_to_slow_start(congestion):
    """Linux halves a loss-based algorithm's window the sender left unused for a
    retransmission timeout (RTT + 200 ms here): 3 s after its last chunk a connection is
    back at IW10 and its next chunk takes as long as a fresh connection's first.
    ``idle_restart = false`` keeps the window open."""
    first, again, restarts = _two_chunks(3.5, True, congestion)
    assert again == pytest.approx(first, rel=1e-3) and restarts == 1
    first, kept_open, restarts = _two_chunks(3.5, False, congestion)
    assert kept_open < 0.5 * first and restarts == 0


def test_bbr_keeps_its_window_across_idle():
    """Linux skips slow start after idle and the RFC 2861 decay for a congestion control
    with its own ``cong_control`` (BBR): with ``idle_restart`` on, a BBR connection's
    second chunk 3 s later goes at the ramped rate, exactly as with it off."""
    first, again, restarts = _two_chunks(3.5, True, "bbr")
    assert restarts == 0 and again < 0.5 * first
    assert again == pytest.approx(_two_chunks(3.5, False, "bbr")[1], rel=1e-9)
    assert again == pytest.approx(_two_chunks(3.5, False, "cubic")[1], rel=1e-9)


def test_a_window_unused_for_less_than_a_timeout_stays_as_it_was():
    # the first chunk left at ~0.49 s: 0.21 s idle at 0.7 s, under the 0.28 s timeout
    _, took, restarts = _two_chunks(0.7, True)
    assert restarts == 0
    assert took == pytest.approx(_two_chunks(0.7, False)[1], rel=1e-9)


def test_headers_take_their_share_of_a_shaped_link():
    """A shaper counts every packet's headers: 4 MiB of chunk over 100 Mbit/s takes
    (mss + header_bytes) / mss of the payload-only time."""
    for header, mss in ((0, 1460), (66, 1448)):
        w = Wire(two_site(network={"header_bytes": header, "mss": mss}))
        a0, b0 = w.node("a", 0), w.node("b", 0)
        w.connect(a0, b0)
        w.chunk(a0, 4 * MiB)
        w.run()
        assert w.chunks[0][0] == pytest.approx(4 * MiB * (mss + header) / mss / mbps(100) + 0.040,
                                               rel=1e-3)
    with pytest.raises(ConfigError, match=r"network\.header_bytes"):
        two_site(network={"header_bytes": -1})


def test_slow_start_off_by_default():
    w = Wire(two_site(defaults={"uplink_mbps": 1000, "downlink_mbps": 1000}))
    a0, b0 = w.node("a", 0), w.node("b", 0)
    w.connect(a0, b0)
    w.chunk(a0, MiB)
    w.run()
    assert w.chunks[0][0] == pytest.approx(MiB / mbps(1000) + 0.040, rel=1e-3)


# ---------------------------------------------------------------------- CPU


def test_hash_rate_delays_chunk_received_by_size_over_rate():
    sc = two_site(cpu={"hash_mb_s": 100, "chunk_overhead_ms": 2})
    w = Wire(sc)
    a0, a1 = w.node("a", 0), w.node("a", 1)
    w.connect(a0, a1)
    w.chunk(a0, 4 * MiB)
    w.run()
    arrived = w.chunks[0][0]
    assert w.verified[0][0] == pytest.approx(arrived + 4 * MiB / 100e6 + 0.002, rel=1e-6)
    assert 0 in a1.have[2]  # the store holds it only once verified


def test_one_core_serialises_chunks_two_cores_overlap():
    for cores, factor in ((1, 2), (2, 1)):
        sc = two_site(cpu={"hash_mb_s": 10, "cores": cores})
        w = Wire(sc)
        a1 = w.node("a", 1)
        for i, src in enumerate((w.node("a", 0), w.node("a", 2))):
            w.connect(src, a1, cid=i + 1)
            w.chunk(src, MiB, i, cid=i + 1)
        w.run()
        arrived = max(t for t, _ in w.chunks)
        assert max(t for t, _ in w.verified) == pytest.approx(arrived + factor * MiB / 10e6, rel=1e-3)


def test_cores_and_a_shared_host():
    own_a, own_b, host = Cores(1), Cores(1), Cores(1)
    # two nodes with a core each, but one machine core between them: the jobs queue
    assert run_job(0.0, 1.0, own_a, host) == 1.0
    assert run_job(0.0, 1.0, own_b, host) == 2.0
    assert run_job(5.0, 0.5, own_a, host) == 5.5
    assert host.busy_s == 2.5 and own_a.busy_s == 1.5
    two = Cores(2)
    assert [run_job(0.0, 1.0, two) for _ in range(3)] == [1.0, 1.0, 2.0]


def test_encode_and_cpu_enter_the_bound():
    sc = two_site(trainer={"encode_s": 2.0}, cpu={"hash_mb_s": 10, "cores": 1})
    ups = {r.name: [mbps(100)] * r.nodes for r in sc.regions}
    b = lower_bound(sc, sc.patch_bytes, ups, ups)
    # each node hashes 8 MiB at 10 MB/s on one core; the last 4 MiB chunk after it arrived
    assert b.terms["node_cpu[a]"] == pytest.approx(8 * MiB / 10e6)
    assert b.terms["last_chunk_cpu"] == pytest.approx(4 * MiB / 10e6)
    assert b.terms["encode"] == 2.0
    assert b.seconds == pytest.approx(2.0 + 8 * MiB / 10e6 + 4 * MiB / 10e6 + 0.0005, rel=1e-6)


# --------------------------------------------------------------------- bounds


def test_bound_counts_per_flow_caps_over_every_pair():
    """2 x 2 nodes behind a 0.95 Mbit/s-per-flow link: inflow <= 2 senders x 2 receivers x cap."""
    sc = lossy(n=2)
    up = {r.name: [mbps(10_000)] * r.nodes for r in sc.regions}
    b = lower_bound(sc, sc.patch_bytes, up, up)
    cap = mathis_cap(1460, 0.150, 0.01)
    # region a takes in from the trainer (2 flows, no loss there: the link default is lossy too)
    # and from b (2 x 2 flows)
    assert b.terms["inflow[a]"] == pytest.approx(8 * MiB / (2 * cap + 4 * cap), rel=1e-6)
    # the protocol's default border count (CoreConfig.border_nodes = 8) names the info; 8
    # border flows are more than the 6 pairs there are, so they cap nothing here
    assert b.info["inflow_8_flows[a]"] == pytest.approx(8 * MiB / (6 * cap), rel=1e-6)
    # a 4 MiB chunk crosses over one flow: no chunk enters sooner than 4 MiB at the cap
    assert b.info["chunk_one_flow[a]"] == pytest.approx(4 * MiB / cap, rel=1e-6)
    assert "cold_chunk[a]" not in b.info  # slow start off


def test_bound_info_follows_the_scenarios_border_count():
    sc = lossy(n=2)
    sc = dataclasses.replace(sc, protocol={**sc.protocol, "border_nodes": 2})
    up = {r.name: [mbps(10_000)] * r.nodes for r in sc.regions}
    b = lower_bound(sc, sc.patch_bytes, up, up)
    cap = mathis_cap(1460, 0.150, 0.01)
    assert b.info["inflow_2_flows[a]"] == pytest.approx(8 * MiB / (2 * cap), rel=1e-6)


@pytest.mark.parametrize("nbytes,iw,rounds", [
    (1, 10, 1), (10 * 1460, 10, 1), (10 * 1460 + 1, 10, 2), (30 * 1460, 10, 2),
    (30 * 1460 + 1, 10, 3), (4 * MiB, 10, 9), (4 * MiB, 1000, 2)])
def test_cold_chunk_counts_slow_start_rounds(nbytes, iw, rounds):
    """IW segments in the first round trip, twice as many in each next: 10, 30, 70, ...
    cumulative; the last round counts only its data's one-way trip."""
    assert cold_chunk_s(nbytes, 1460, iw, 0.1) == pytest.approx((rounds - 1) * 0.1 + 0.05)
    assert cold_chunk_s(0, 1460, iw, 0.1) == 0.0


def test_bound_info_has_the_cold_chunk_with_slow_start():
    sc = lossy(n=2, slow_start=True)
    up = {r.name: [mbps(10_000)] * r.nodes for r in sc.regions}
    b = lower_bound(sc, sc.patch_bytes, up, up)
    # 4 MiB = 2,873 segments of 1,460: 10 + 20 + ... + 2,560 > 2,873 after 9 rounds of 150 ms
    assert b.info["cold_chunk[a]"] == pytest.approx(8 * 0.150 + 0.075)


def test_bound_waits_out_a_cut():
    sc = two_site(
        defaults={"uplink_mbps": 1000, "downlink_mbps": 1000},
        links={"mbps": 100},
        payload={"start_s": 1.0},
        faults={"cuts": [{"region": "b", "start_s": 1.5, "duration_s": 3.0}]},
    )
    up = {r.name: [mbps(1000)] * r.nodes for r in sc.regions}
    b = lower_bound(sc, sc.patch_bytes, up, up)
    # b takes in 200 Mbit/s (trainer + a); 8 MiB needs 0.336 s: 0.5 s before the cut suffice
    assert b.terms["inflow[b]"] == pytest.approx(8 * MiB / mbps(200))
    late = two_site(
        defaults={"uplink_mbps": 1000, "downlink_mbps": 1000},
        links={"mbps": 10},
        payload={"start_s": 1.0},
        faults={"cuts": [{"region": "b", "start_s": 1.5, "duration_s": 3.0}]},
    )
    b = lower_bound(late, late.patch_bytes, up, up)
    # 20 Mbit/s in: 3.36 s of inflow, 0.5 s of it before the cut, the rest after it heals
    assert b.terms["inflow[b]"] == pytest.approx(8 * MiB / mbps(20) + 3.0)
    assert b.binding == "inflow[b]"


# ---------------------------------------------------------------- cut-through relays


def _relay_pair():
    """a0 -> b0 over a 100 Mbit uplink; b0 (1 Gbit uplink) relays the chunk on to a1
    while it arrives (``SendChunk(arriving=True)``)."""
    w = Wire(two_site(defaults={"uplink_mbps": 100, "downlink_mbps": 1000, "latency_ms": 0.5},
                      regions=[{"name": "a", "nodes": 4},
                               {"name": "b", "nodes": 4, "uplink_mbps": 1000}],
                      replace=("regions",)))
    events: list = []
    w.sim._deliver = lambda node, inc, e: events.append((node, e))
    a0, b0, a1 = w.node("a", 0), w.node("b", 0), w.node("a", 1)
    up = w.connect(a0, b0, cid=1)
    w.connect(b0, a1, cid=2)
    w.chunk(a0, 4 * MiB, 0, cid=1)
    w.at(0.05, w.sim._send_chunk, b0, ev.SendChunk(2, 2, 0, 4 * MiB, arriving=True))
    return w, events, up, (a0, b0, a1)


def test_a_cut_through_relay_arrives_once_the_relay_verified_the_chunk_not_a_hop_later():
    w, events, _up, (_a0, b0, a1) = _relay_pair()
    w.run()
    (t_b0, _), = [(t, i) for t, i in w.verified if t < 1.0][:1]
    arrivals = [t for t, _i in w.chunks]
    assert len(arrivals) == 2  # at b0, then at a1
    # the relay's flow ran no faster than the chunk came in; its last block waited for b0's verdict
    assert t_b0 < arrivals[1] < t_b0 + 0.045
    assert arrivals[1] < t_b0 + 4 * MiB / mbps(100)  # store-and-forward would add a hop
    # the receivers heard of the first block one latency after each flow started
    arriving = [(n, e) for n, e in events if isinstance(e, ev.ChunkArriving)]
    assert [n for n, _e in arriving] == [b0, a1]
    sent = [e for n, e in events if isinstance(e, ev.ChunkSent) and n is b0]
    assert sent == [ev.ChunkSent(sent[0].now, 2, 2, 0)]


def test_a_cut_through_relay_is_withdrawn_when_its_chunk_stops_arriving():
    w, events, up, (_a0, b0, _a1) = _relay_pair()
    w.at(0.2, w.sim._teardown, up, "test", False)  # a0 -> b0 closes mid-chunk
    w.run()
    assert w.chunks == []  # nothing arrived, at b0 or at a1
    sent = [e for n, e in events if isinstance(e, ev.ChunkSent) and n is b0]
    assert sent == [ev.ChunkSent(sent[0].now, 2, 2, 0, withdrawn=True)]
    assert not w.sim.parked and not w.sim.incoming and not w.sim.paced
    # the receiver hears of it one latency on: it drops the blocks and asks elsewhere
    gone = [(n, e) for n, e in events if isinstance(e, ev.ChunkWithdrawn)]
    assert [(n, e.conn, e.version, e.index) for n, e in gone] == [(_a1, 2, 2, 0)]
    assert gone[0][1].now > sent[0].now


def test_a_chunk_sent_on_while_it_arrives_runs_no_faster_than_it_comes_in():
    """b0 relays on at 1 Gbit what reaches it at 100 Mbit: the relay's flow follows the
    incoming one's rate, and is let go once the chunk was verified at b0."""
    w, _events, up, (_a0, b0, _a1) = _relay_pair()
    seen = []

    def look(_=None):
        relay = b0.conns[2].cur
        seen.append((relay[4].rate, up.cur[4].rate, relay[4].leader is up.cur[4]))

    w.at(0.2, look)
    w.run()
    (relay_rate, in_rate, following), = seen
    assert following and relay_rate == pytest.approx(in_rate) and in_rate == pytest.approx(mbps(100), rel=0.05)
    assert not w.sim.paced  # let go at the verdict


def test_with_serve_arriving_a_region_takes_chunks_from_peers_they_still_arrive_at():
    """A whole run: region b's nodes ask each other for chunks while they arrive (the
    simulator announces every chunk's first block with the knob on); every node ends
    with the version, and some answers were started while their chunk arrived."""
    from simulations.runner import run_strategy

    sc = two_site(payload={"patch": "64 MiB", "chunk": "4 MiB"},
                  defaults={"uplink_mbps": 1000, "downlink_mbps": 1000, "latency_ms": 0.5},
                  regions=[{"name": "a", "nodes": 6}, {"name": "b", "nodes": 6}],
                  protocol={"serve_arriving": True, "serve_arriving_region": 0},
                  replace=("regions",))
    sims = []
    real_run = Simulation.run

    def run(self):
        sims.append(self)
        return real_run(self)

    Simulation.run = run  # type: ignore[method-assign]
    try:
        res, fig = run_strategy(sc, "patchswarm")
    finally:
        Simulation.run = real_run  # type: ignore[method-assign]
    assert len(res.done[min(res.done)]) == 12
    nodes = [n for n in sims[0].nodes if not n.origin]
    assert sum(n.core.counters.served_arriving for n in nodes) > 0
    assert sum(n.core.counters.bad_chunks for n in nodes) == 0
    assert fig["cross_region_ratio"] <= 1.02


def test_the_origin_warms_its_border_links_and_its_first_version_starts_sooner():
    """node.warm_up as shipped, in the model: the origin pads its links to the borders of
    other regions (``origin_warm_up_kib``, 512), one at a time, and a node's links stay
    cold (``warm_up_kib``, 0); a first version published after the warm-ups takes in its
    first chunks from open windows and ends sooner than with the origin's off."""
    from simulations.runner import run_strategy

    def first_version(origin_kib: int) -> tuple[float, list[tuple[bool, float]]]:
        sc = two_site(payload={"patch": "16 MiB", "chunk": "4 MiB", "start_s": 5.0},
                      trainer={"region": "a", "uplink_mbps": 1000},
                      regions=[{"name": "a", "nodes": 3, "egress_mbps": 100, "ingress_mbps": 100},
                               {"name": "b", "nodes": 4, "egress_mbps": 100, "ingress_mbps": 100}],
                      network={"slow_start": True, "origin_warm_up_kib": origin_kib},
                      replace=("regions",))
        assert (sc.warm_up_kib, sc.origin_warm_up_kib) == (0, origin_kib)
        warmed: list[tuple[bool, float]] = []
        real = Simulation._warm_look

        def look(self, item):
            real(self, item)
            if item[0].warm_at != math.inf:
                warmed.append((item[0].node.origin, item[0].warm_at))

        Simulation._warm_look = look  # type: ignore[method-assign]
        try:
            _, fig = run_strategy(sc, "patchswarm")
        finally:
            Simulation._warm_look = real  # type: ignore[method-assign]
        assert fig["incomplete_nodes"] == 0
        return fig["t_p100_s"], warmed

    warm_s, warmed = first_version(512)
    cold_s, none = first_version(0)
    assert none == []
    # the origin alone, each border of region b once, one after another, before the publish
    assert [origin for origin, _ in warmed] == [True] * 4
    ends = [t for _, t in warmed]
    assert ends == sorted(ends) and len(set(ends)) == 4 and ends[-1] < 5.0
    assert warm_s < cold_s - 0.2  # ~4 of BBR's start-up rounds at 81 ms saved
