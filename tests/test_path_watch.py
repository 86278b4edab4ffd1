"""The origin's look at a leaving push's path (``node.tcp_watch.TcpWatch._path_watch``):
once a round trip while a chunk leaves on a link, whether the socket's smoothed round
trip runs above its floor (``ev.PathSample``), read from a real socket's ``TCP_INFO``."""

from __future__ import annotations

import asyncio
import socket

import pytest

import node.tcp_watch as tcp_watch
from node.conn import Conn
from node.tcp import QUEUE_FACTOR, path_sample, ramping
from node.tcp_watch import PATH_WATCH_MIN_S, TcpWatch
from swarm.protocol import events as ev
from tests.tcp_pairs import allowed_congestion, tcp_pair

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="no TCP_INFO here")


class _Watch(TcpWatch):
    """The driver's parts ``TcpWatch`` uses: its loop, connections, clock and core feed."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.conns: dict[int, Conn] = {}
        self.fed: list[ev.Event] = []

    def feed(self, e: ev.Event) -> None:
        self.fed.append(e)

    def now(self) -> float:
        return self.loop.time()


def _leaving(w: _Watch, sock: socket.socket) -> Conn:
    c = Conn(7, None, True, "peer:1")  # type: ignore[arg-type]  # the link is not used
    c.sock, c.in_chunk = sock, True
    w.conns[c.id] = c
    return c


def test_a_leaving_push_is_sampled_once_a_round_trip_until_its_chunk_is_handed_over() -> None:
    srv, cli, acc = tcp_pair()

    async def main() -> tuple[list[ev.Event], int]:
        w = _Watch()
        c = _leaving(w, cli)
        w._watch_path(c)
        w._watch_path(c)  # already watched: one timer
        await asyncio.sleep(0.12)
        c.in_chunk = False  # the chunk is all handed over: the next look is the last
        await asyncio.sleep(2 * PATH_WATCH_MIN_S)
        n = len(w.fed)
        await asyncio.sleep(3 * PATH_WATCH_MIN_S)
        assert c.path_timer is None
        return w.fed, n

    try:
        floor = path_sample(cli)
        assert floor is not None and floor[2] > 0  # loopback: tens of microseconds
        fed, n = asyncio.run(main())
    finally:
        for s in (srv, cli, acc):
            s.close()
    # a loopback round trip is far under the 20 ms floor of the period: ~6 looks in 0.12 s
    assert 3 <= n <= 8 and len(fed) == n, fed
    # an idle connection's smoothed round trip is its handshake's: no queue; the floor
    # comes in seconds
    assert all(isinstance(e, ev.PathSample) and e.conn == 7 and not e.queued
               and 0 < e.rtt < 0.02 for e in fed)


class _Sock:
    """A socket whose ``TCP_INFO`` and ``TCP_CC_INFO`` (None: not BBR) are given."""

    def __init__(self, ssthresh: int, cwnd: int, bbr_gains: tuple[int, int] | None) -> None:
        import struct

        self.info = bytearray(152)
        struct.pack_into("=II", self.info, 76, ssthresh, cwnd)
        self.cc = None if bbr_gains is None else struct.pack("=IIIII", 0, 0, 80_000, *bbr_gains)

    def getsockopt(self, level: int, opt: int, n: int) -> bytes:
        if opt == socket.TCP_INFO:
            return bytes(self.info)
        if self.cc is None:
            raise OSError("no TCP_CC_INFO")
        return self.cc


def test_a_window_under_its_slow_start_threshold_or_bbr_in_start_up_is_ramping() -> None:
    inf = 0x7FFFFFFF
    assert ramping(_Sock(inf, 10, None))  # slow start: under an unset (infinite) threshold
    assert not ramping(_Sock(20, 40, None))  # congestion avoidance
    assert ramping(_Sock(inf, 10, (739, 739)))  # BBR's start-up: pacing gain 2.89 (x256)
    assert not ramping(_Sock(inf, 10, (320, 512)))  # BBR probing bandwidth: 1.25
    srv, cli, acc = tcp_pair()
    try:
        if "cubic" in allowed_congestion():
            cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
            assert ramping(cli)  # a real fresh connection: IW10, no threshold yet
    finally:
        for s in (srv, cli, acc):
            s.close()


def test_a_round_trip_over_its_floor_by_the_queue_factor_is_a_queue(monkeypatch) -> None:
    srv, cli, acc = tcp_pair()
    monkeypatch.setattr(tcp_watch, "ramping", lambda _s: False)
    samples = iter([(0, 1000, 1000), (0, int(QUEUE_FACTOR * 1000) + 1, 1000),
                    (0, int(QUEUE_FACTOR * 1000), 1000)])
    monkeypatch.setattr(tcp_watch, "path_sample", lambda _s: next(samples, None))

    async def main() -> list[ev.Event]:
        w = _Watch()
        c = _leaving(w, cli)
        w._watch_path(c)  # (its period comes from the first sample)
        await asyncio.sleep(6 * PATH_WATCH_MIN_S)
        return w.fed

    try:
        fed = asyncio.run(main())
    finally:
        for s in (srv, cli, acc):
            s.close()
    # the last sample is None (no TCP_INFO): the looks stop
    assert [e.queued for e in fed] == [True, False]  # type: ignore[attr-defined]
