"""The fleet view: STATUS frames from nodes to the origin (swarm/protocol/fleet.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.errors import ProtocolError
from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.protocol.testing import Script
from tests.test_protocol_core import fleet, publish

versions = st.none() | st.integers(0, wire.MAX_VERSION)


def served_by(o) -> dict[str, tuple[str, int | None, int | None]]:
    return {e.node_id: (e.region, e.active, e.served) for e in o.core.fleet()}


def test_every_node_reports_its_versions_tracker_only_nodes_included() -> None:
    s, net, o, hosts = fleet(3, 4, peer_boot=False, border_nodes=1)
    assert {n: a for n, (_r, a, _s) in served_by(o).items()} == {h.core.cfg.node_id: 1 for h in hosts}
    publish(s, net, o, 2, 6)
    net.run(net.now + 20.0, stop=lambda: all(h.core.active_version == 2 for h in hosts))
    net.run(net.now + 2.0)  # reports are spread over status_delay_s
    view = served_by(o)
    assert view == {h.core.cfg.node_id: (h.region, 2, None) for h in hosts}
    # most nodes are not linked to the origin (tracker only): they dialled it to report
    linked = sum(e.connected for e in o.core.fleet())
    assert linked == 3, linked  # one border per region


def test_engine_served_version_is_reported_and_nodes_re_report_periodically() -> None:
    _s, net, o, hosts = fleet(2, 2, status_interval_s=5.0)
    h = hosts[0]
    net.deliver(h, ev.EngineServed(net.now, 1))
    net.run(net.now + 3.0)
    assert served_by(o)[h.core.cfg.node_id] == (h.region, 1, 1)
    first = {e.node_id: e.reported_at for e in o.core.fleet()}
    net.run(net.now + 12.0)
    again = {e.node_id: e.reported_at for e in o.core.fleet()}
    assert all(again[n] > first[n] + 4.0 for n in first)


def test_a_node_does_not_busy_loop_when_the_origin_is_gone() -> None:
    _s, net, o, hosts = fleet(1, 2)
    net.kill(o)
    h = hosts[0]
    net.deliver(h, ev.EngineServed(net.now, 1))
    ticks = 0
    orig = h.core.handle

    def count(e):
        nonlocal ticks
        ticks += isinstance(e, ev.Tick)
        return orig(e)

    h.core.handle = count  # type: ignore[method-assign]
    net.run(net.now + 60.0)
    assert ticks < 200  # a heartbeat a second plus redials, not a wake-up per event


def origin_core():
    _s, _net, o, _hosts = fleet(1, 1)
    return o.core


def test_status_before_the_handshake_is_refused() -> None:
    core = origin_core()
    sc = Script(core, 900, node_id="intruder", region="reg0")
    core.handle(ev.PeerConnected(core.now, 900, False, "intruder:1"))
    sc.send(wire.Status(1, 1, 1))
    assert sc.closed()
    assert "intruder" not in {e.node_id for e in core.fleet()}


def test_status_naming_an_unpublished_version_is_refused_and_logged() -> None:
    core = origin_core()
    sc = Script(core, 901, node_id="liar", region="reg0")
    sc.handshake()
    sc.send(wire.Status(1, 99, None))
    assert "liar" not in {e.node_id for e in core.fleet()}
    assert any(isinstance(a, ev.Log) and a.event == "status_refused" for a in sc.actions)
    sc.send(wire.Status(1, 1, None))
    assert {e.node_id: e.active for e in core.fleet()}["liar"] == 1


def test_fleet_table_is_bounded() -> None:
    _s, _net, o, _hosts = fleet(1, 5, fleet_max=3)
    assert len(o.core.fleet()) == 3


@given(active=versions, served=versions)
def test_status_frame_round_trips(active, served) -> None:
    f = wire.Status(wire.STATUS_FORMAT, active, served)
    assert wire.decode(f.encode()) == f


def test_a_later_status_format_is_read_for_the_fields_we_know() -> None:
    raw = wire.encode(wire.STATUS, 2, 5, 4, "a field of format 2", 7)
    assert wire.decode(raw) == wire.Status(2, 5, 4)


@pytest.mark.parametrize("fields", [
    (0, 1, 1), (1, 1), (1, 1, 1, 1), (1, -1, 1), (1, True, 1), (1, 1, "2"), (1, 1.5, None),
    (1, 2**63, None), (1, None, b"x"), (2**17, 1, 1), tuple(range(1, 20)),
])
def test_malformed_status_frames_are_refused(fields) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(wire.encode(wire.STATUS, *fields))
