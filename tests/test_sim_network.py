"""The flow model against cases with exact answers (within 1%).

The topology comes from a real scenario, so the latencies and link resources
under test are the ones the simulator uses.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.engine import Engine
from simulations.network import TOLERANCE, FlowNet, Resource, mathis_cap, mbps
from simulations.scenario import parse_scenario
from simulations.topology import Endpoint, Topology

MiB = 2**20


def scenario(up=1000.0, down=1000.0, link=float("inf"), lat_ms=40.0, intra_ms=0.5, loss=0.0,
             congestion="bbr"):
    doc = {
        "payload": {"patch": "64 MiB", "chunk": "4 MiB"},
        "defaults": {"uplink_mbps": up, "downlink_mbps": down, "latency_ms": intra_ms},
        "regions": [{"name": "a", "nodes": 4}, {"name": "b", "nodes": 4}],
        "links": {"mbps": link if link != float("inf") else "inf", "latency_ms": lat_ms},
        "network": {"loss": loss, "congestion": congestion, "lanes": 1},  # one flow's physics
    }
    return parse_scenario(doc)


def endpoint(site: str, up: float, down: float, name: str) -> Endpoint:
    return Endpoint(site, Resource(f"up[{name}]", up), Resource(f"down[{name}]", down))


def close(a: float, b: float, rel: float = 0.01) -> bool:
    return math.isclose(a, b, rel_tol=rel)


SHARING = ("maxmin", "bottleneck")


@pytest.mark.parametrize("sharing", SHARING)
def test_one_transfer_is_size_over_rate_plus_latency(sharing):
    sc = scenario(up=800.0, down=1000.0, lat_ms=40.0)
    topo = Topology.build(sc)
    eng = Engine()
    net = FlowNet(eng, sharing)
    a = endpoint("a", mbps(800), mbps(1000), "a0")
    b = endpoint("b", mbps(1000), mbps(1000), "b0")
    arrived = []
    size = 64 * MiB
    lat = topo.latency[("a", "b")]
    net.start(size, topo.flow_resources(a, b), lambda _: eng.after(lat, arrived.append, eng.now + lat))
    eng.run()
    expected = size / mbps(800) + 0.040
    assert close(arrived[0], expected)
    assert close(eng.now, expected)


@pytest.mark.parametrize("sharing", SHARING)
def test_client_server_is_n_f_over_u(sharing):
    eng = Engine()
    net = FlowNet(eng, sharing)
    u = mbps(1000)
    server = endpoint("a", u, math.inf, "s")
    done = []
    n, size = 16, 8 * MiB
    for i in range(n):
        c = endpoint("a", u, u, f"c{i}")
        net.start(size, (server.up, c.down), lambda _: done.append(eng.now))
    eng.run()
    assert len(done) == n
    assert close(max(done), n * size / u)
    assert close(min(done), n * size / u)  # processor sharing: all finish together


@pytest.mark.parametrize("sharing", SHARING)
def test_client_server_staggered_joins_conserve_work(sharing):
    """Flows joining later re-rate the earlier ones; the server's busy time is N F / u."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    u = mbps(100)
    up = Resource("up", u)
    done = []
    size = 1 * MiB
    for i in range(5):
        eng.schedule(i * 0.01, lambda _i: net.start(size, (up,), lambda _: done.append(eng.now)), i)
    eng.run()
    assert close(max(done), 5 * size / u)


@pytest.mark.parametrize("sharing", SHARING)
def test_chain_store_and_forward(sharing):
    """k chunks along n hops: (k + n - 1) c/u + n L."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    u = mbps(1000)
    hops, k, c, lat = 5, 12, 4 * MiB, 0.002
    nodes = [endpoint("a", u, u, f"n{i}") for i in range(hops + 1)]
    queue: list[list[int]] = [[] for _ in nodes]
    busy = [False] * len(nodes)
    got = [0] * len(nodes)
    finish = [0.0]

    def pump(i: int) -> None:
        if busy[i] or not queue[i] or i == hops:
            return
        busy[i] = True
        chunk = queue[i].pop(0)
        net.start(c, (nodes[i].up, nodes[i + 1].down), sent, (i, chunk))

    def sent(arg) -> None:
        i, chunk = arg
        busy[i] = False
        eng.after(lat, arrive, (i + 1, chunk))
        pump(i)

    def arrive(arg) -> None:
        j, chunk = arg
        got[j] += 1
        finish[0] = eng.now
        queue[j].append(chunk)
        pump(j)

    queue[0] = list(range(k))
    pump(0)
    eng.run()
    assert got[hops] == k
    assert close(finish[0], (k + hops - 1) * c / u + hops * lat)


@pytest.mark.parametrize("sharing", SHARING)
def test_inter_region_link_is_shared_by_its_flows(sharing):
    sc = scenario(up=10_000.0, down=10_000.0, link=1000.0)
    topo = Topology.build(sc)
    eng = Engine()
    net = FlowNet(eng, sharing)
    done = []
    m, size = 8, 16 * MiB
    for i in range(m):
        a = endpoint("a", mbps(10_000), mbps(10_000), f"a{i}")
        b = endpoint("b", mbps(10_000), mbps(10_000), f"b{i}")
        res = topo.flow_resources(a, b)
        assert topo.links[("a", "b")] in res
        net.start(size, res, lambda _: done.append(eng.now))
    eng.run()
    assert close(max(done), m * size / mbps(1000))
    assert topo.links[("a", "b")].bytes == m * size


@pytest.mark.parametrize("sharing", SHARING)
def test_bottleneck_share_takes_the_smallest_share(sharing):
    """Two senders into one downlink: each gets half the downlink, not its own uplink."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    d = Resource("down", mbps(100))
    done = []
    for i in range(2):
        net.start(1 * MiB, (Resource(f"up{i}", mbps(1000)), d), lambda _: done.append(eng.now))
    eng.run()
    assert close(max(done), 2 * MiB / mbps(100))


@pytest.mark.parametrize("sharing", SHARING)
def test_cancel_frees_capacity(sharing):
    eng = Engine()
    net = FlowNet(eng, sharing)
    up = Resource("up", 100.0)
    done = []
    f1 = net.start(100.0, (up,), lambda _: done.append(("f1", eng.now)))
    net.start(100.0, (up,), lambda _: done.append(("f2", eng.now)))
    eng.schedule(1.0, lambda _: net.cancel(f1))
    eng.run()
    # f2 ran at 50 B/s for 1 s, then alone at 100 B/s for the remaining 50 B
    assert done == [("f2", pytest.approx(1.5))]
    assert net.active == 0


@pytest.mark.parametrize("sharing", SHARING)
def test_capacity_change_rerates(sharing):
    eng = Engine()
    net = FlowNet(eng, sharing)
    up = Resource("up", 100.0)
    done = []
    net.start(100.0, (up,), lambda _: done.append(eng.now))
    eng.schedule(0.5, lambda _: net.set_capacity(up, 25.0))
    eng.run()
    assert done == [pytest.approx(0.5 + 50.0 / 25.0)]


# ---- following: a chunk sent on while it arrives runs no faster than it comes in


@pytest.mark.parametrize("sharing", SHARING)
def test_a_follower_runs_at_its_leaders_rate_and_follows_it(sharing):
    """A leader on a 100 B/s link, a follower on a 1000 B/s one: the follower runs at
    100; a second flow on the leader's link halves both; once the follower is let go
    it takes its own link's rate."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    slow, fast = Resource("slow", 100.0), Resource("fast", 1000.0)
    leader = net.start(1000.0, (slow,), lambda _: None)
    follower = net.start(10_000.0, (fast,), lambda _: None)
    net.follow(follower, leader)
    assert follower.rate == pytest.approx(100.0)
    other = net.start(1000.0, (slow,), lambda _: None)
    assert leader.rate == pytest.approx(50.0) and follower.rate == pytest.approx(50.0)
    net.cancel(other)
    assert follower.rate == pytest.approx(100.0)
    net.unfollow(follower)
    assert follower.rate == pytest.approx(1000.0)


@pytest.mark.parametrize("sharing", SHARING)
def test_a_follower_is_let_go_when_its_leader_is_done(sharing):
    """The leader's last byte left at 1 s (100 B at 100 B/s): the follower, 100 B in at
    that rate, sends its other 900 B at its own 1000 B/s and is done at 1.9 s."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    slow, fast = Resource("slow", 100.0), Resource("fast", 1000.0)
    done = []
    leader = net.start(100.0, (slow,), lambda _: done.append(("leader", eng.now)))
    follower = net.start(1000.0, (fast,), lambda _: done.append(("follower", eng.now)))
    net.follow(follower, leader)
    eng.run()
    assert done == [("leader", pytest.approx(1.0)), ("follower", pytest.approx(1.9))]


@pytest.mark.parametrize("sharing", SHARING)
def test_a_followers_own_ceiling_still_holds_beneath(sharing):
    """A TCP window (``set_cap``) below the leader's rate binds; raised above, the
    leader's rate binds again."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    leader = net.start(1e6, (Resource("slow", 100.0),), lambda _: None)
    follower = net.start(1e6, (Resource("fast", 1000.0),), lambda _: None)
    net.follow(follower, leader)
    net.set_cap(follower, 40.0)
    assert follower.rate == pytest.approx(40.0)
    net.set_cap(follower, 500.0)
    assert follower.rate == pytest.approx(100.0)


def test_loss_caps_a_flow_at_the_mathis_ceiling():
    """With loss-based congestion control (CUBIC, Reno); BBR has no such ceiling."""
    sc = scenario(up=10_000.0, down=10_000.0, lat_ms=50.0, loss=0.01, congestion="cubic")
    assert Topology.build(scenario(lat_ms=50.0, loss=0.01)).flow_cap[("a", "b")] == math.inf
    topo = Topology.build(sc)
    cap = topo.flow_cap[("a", "b")]
    assert close(cap, mathis_cap(1460, 0.1, 0.01))
    eng = Engine()
    net = FlowNet(eng)
    a = endpoint("a", mbps(10_000), mbps(10_000), "a")
    b = endpoint("b", mbps(10_000), mbps(10_000), "b")
    done = []
    net.start(MiB, topo.flow_resources(a, b), lambda _: done.append(eng.now), cap=cap)
    eng.run()
    assert close(done[0], MiB / cap)


def test_maxmin_hands_unused_capacity_to_the_other_flows():
    """Sender (100) -> 4 receivers, one behind a 10-unit downlink: the others get 30 each.

    Bottleneck shares would give 25/25/25/10 and leave 15 idle; max-min gives 30/30/30/10.
    """
    for sharing, fast in (("maxmin", 30.0), ("bottleneck", 25.0)):
        eng = Engine()
        net = FlowNet(eng, sharing)
        up = Resource("up", 100.0)
        flows = [net.start(1e6, (up, Resource(f"d{i}", 10.0 if i == 0 else 1000.0)), lambda _: None)
                 for i in range(4)]
        assert flows[0].rate == pytest.approx(10.0)
        assert [f.rate for f in flows[1:]] == [pytest.approx(fast)] * 3


def test_maxmin_two_level_chain_of_bottlenecks():
    """Flows A (up1, d) and B (up2, d), C (up2, e): d=60 shared, up2=50 shared by B and C.

    Max-min: B and C get 25 (up2 saturated), A gets 60-25 = 35 at d.
    """
    eng = Engine()
    net = FlowNet(eng, "maxmin")
    up1, up2 = Resource("up1", 1000.0), Resource("up2", 50.0)
    d, e = Resource("d", 60.0), Resource("e", 1000.0)
    a = net.start(1e6, (up1, d), lambda _: None)
    b = net.start(1e6, (up2, d), lambda _: None)
    c = net.start(1e6, (up2, e), lambda _: None)
    assert b.rate == pytest.approx(25.0)
    assert c.rate == pytest.approx(25.0)
    assert a.rate == pytest.approx(35.0)


@pytest.mark.parametrize("sharing", SHARING)
@settings(max_examples=40, deadline=None)
@given(
    caps=st.lists(st.floats(1.0, 1000.0), min_size=1, max_size=4),
    flows=st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(1.0, 500.0), st.lists(st.integers(0, 3), min_size=1, max_size=3)),
        min_size=1, max_size=12,
    ),
)
def test_every_flow_finishes_and_work_is_conserved(sharing, caps, flows):
    """Random flows over random resources: all finish, no resource exceeds its capacity."""
    eng = Engine()
    net = FlowNet(eng, sharing)
    res = [Resource(f"r{i}", c) for i, c in enumerate(caps)]
    done = []
    for start, size, which in flows:
        path = tuple(dict.fromkeys(res[i % len(res)] for i in which))
        eng.schedule(start, lambda arg: net.start(arg[0], arg[1], lambda _: done.append(eng.now)), (size, path))
    eng.run(max_events=100_000)
    assert len(done) == len(flows)
    assert net.active == 0
    for r in res:
        # a resource cannot have carried more than cap x (elapsed time); max-min
        # ripples smaller than TOLERANCE are not propagated, hence the slack
        assert r.bytes <= r.cap * eng.now * (1 + TOLERANCE) + 1e-6
