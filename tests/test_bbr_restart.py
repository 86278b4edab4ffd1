"""BBR started over on a peer link (``node.tcp``): the kernel really resets the estimate
when the algorithm is switched away and back, and ``CongestionRestart`` decides when, as a
plain model of its rule says, over any sequence of chunk starts, blocks and ends."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.tcp import (
    RELAY_LAG_BYTES,
    STALE_FACTOR,
    TAIL_CHECKS,
    TAIL_MIN_BYTES,
    CongestionRestart,
    bbr_bandwidth,
    congestion_of,
    restart_congestion,
    set_congestion,
    unacked_bytes,
)
from tests.tcp_pairs import allowed_congestion, tcp_pair
from tests.waiting import eventually

needs_bbr = pytest.mark.skipif(
    not hasattr(socket, "TCP_CONGESTION") or "bbr" not in allowed_congestion(),
    reason="BBR is not allowed on this host (net.ipv4.tcp_allowed_congestion_control)")


@needs_bbr
def test_a_restart_resets_bbrs_estimate_on_a_live_connection() -> None:
    srv, cli, acc = tcp_pair()
    done = threading.Event()

    def drain() -> None:
        while acc.recv(1 << 20):
            pass
        done.set()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        assert set_congestion(cli, "bbr") is None
        block = b"\0" * (1 << 20)
        for _ in range(64):  # 64 MiB: BBR measures loopback's rate
            cli.sendall(block)
        before = bbr_bandwidth(cli)
        assert before is not None and before > 1e6, before
        assert restart_congestion(cli, "bbr")
        assert congestion_of(cli) == "bbr"
        assert bbr_bandwidth(cli) == 0.0  # start-up: nothing measured yet
        for _ in range(16):  # and the connection carries on
            cli.sendall(block)
        assert (bbr_bandwidth(cli) or 0.0) > 0.0
    finally:
        cli.close()
        done.wait(5)
        for s in (acc, srv):
            s.close()


def test_no_restart_without_a_socket_an_algorithm_or_with_reno() -> None:
    srv, cli, acc = tcp_pair()
    try:
        assert restart_congestion(None, "bbr") is False
        assert restart_congestion(cli, "") is False
        assert restart_congestion(cli, "reno") is False
        cli.sendall(b"ok")
        assert acc.recv(2) == b"ok"
        assert bbr_bandwidth(None) is None
    finally:
        for s in (cli, acc, srv):
            s.close()


# ---- when: CongestionRestart against a plain model of its rule

EVERY, IDLE = 1.0, 0.2
steps = st.lists(st.tuples(st.sampled_from(["start", "block", "end"]),
                           st.floats(min_value=0.0, max_value=0.7)), max_size=60)
tail_steps = st.lists(st.tuples(st.sampled_from(["start", "paced", "done", "block", "end",
                                                 "tail"]),
                                st.floats(min_value=0.0, max_value=0.7),
                                st.sampled_from([0, 28, TAIL_MIN_BYTES - 1, TAIL_MIN_BYTES,
                                                 1 << 20])), max_size=60)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_restart_decisions_match_the_rule(seq: list[tuple[str, float]]) -> None:
    r = CongestionRestart(EVERY, IDLE)
    now, started, last_end, last_restart, restarts = 0.0, None, None, None, 0
    for kind, dt in seq:
        now += dt
        if kind == "start":
            want = last_end is None or now - last_end >= IDLE
            started = now
            assert r.chunk_started(now) is want
        elif kind == "block":
            ref = started if last_restart is None else max(started or 0.0, last_restart)
            want = started is not None and now - ref >= EVERY
            assert r.block(now) is want
        else:
            r.chunk_ended(now)
            started, last_end, want = None, now, False
        if want:
            last_restart = now
            restarts += 1
    assert r.restarts == restarts


@settings(max_examples=200, deadline=None)
@given(steps)
def test_within_a_chunk_restarts_are_at_least_the_period_apart(seq) -> None:
    r = CongestionRestart(EVERY, IDLE)
    now, last = 0.0, None
    for kind, dt in seq:
        now += dt
        if kind == "start":
            r.chunk_started(now)
            last = None  # a new chunk may start with one
        elif kind == "block":
            if r.block(now):
                assert last is None or now - last >= EVERY - 1e-9
                last = now
        else:
            r.chunk_ended(now)


def test_off_means_never() -> None:
    r = CongestionRestart(0.0)
    for t in range(100):
        assert not r.chunk_started(t * 10.0)
        assert not r.block(t * 10.0 + 5)
        r.chunk_ended(t * 10.0 + 6)
    assert r.restarts == 0


def test_a_link_that_keeps_up_restarts_only_after_idle() -> None:
    """Back-to-back chunks of 0.34 s each (4 MiB at 100 Mbit/s): one restart, at the first."""
    r = CongestionRestart()
    t, n = 0.0, 0
    for _ in range(20):
        n += r.chunk_started(t)
        for k in range(16):
            n += r.block(t + k * 0.34 / 16)
        t += 0.34
        r.chunk_ended(t)
    assert n == 1
    # a chunk 0.5 s after the last: restarts; a crawling one restarts every second
    assert r.chunk_started(t + 0.5)
    assert [r.block(t + 0.5 + x) for x in (0.5, 1.25, 1.5, 2.0, 2.3, 3.5)] == [
        False, True, False, False, True, True]


@settings(max_examples=300, deadline=None)
@given(tail_steps)
def test_tail_and_next_check_decisions_match_the_rule(seq) -> None:
    """A sent chunk's bytes still unacknowledged ``EVERY`` after it was handed over (or
    after the last restart) restart BBR, at most ``TAIL_CHECKS`` looks a chunk, none once
    all is acknowledged but a control frame's worth; ``next_check`` says when the next
    look is due. A chunk forwarded as it arrives (``paced``) is not looked at until all of
    it is here (``own_pace``), and then as if it started at that moment."""
    r = CongestionRestart(EVERY, IDLE)
    now, started, last_end, last_restart, tails = 0.0, None, None, float("-inf"), 0
    free = None  # from when the chunk being sent goes at the link's pace
    for kind, dt, unacked in seq:
        now += dt
        if kind in ("start", "paced"):
            want = last_end is None or now - last_end >= IDLE
            started, tails = now, 0
            free = now if kind == "start" else None
            assert r.chunk_started(now, paced=kind == "paced") is want
        elif kind == "done":
            r.own_pace(now)
            if started is not None and free is None:
                free = now
            want = False
        elif kind == "block":
            want = free is not None and now - max(free, last_restart) >= EVERY
            assert r.block(now) is want
        elif kind == "end":
            r.chunk_ended(now)
            started, free, last_end, tails, want = None, None, now, TAIL_CHECKS, False
        else:
            looks = (started is None and last_end is not None and tails > 0
                     and now - max(last_end, last_restart) >= EVERY)
            want = looks and unacked >= TAIL_MIN_BYTES
            if looks:
                tails = tails - 1 if want else 0
            assert r.tail(now, unacked) is want
        if want:
            last_restart = now
        if started is not None:
            assert r.next_check() == (None if free is None else max(free, last_restart) + EVERY)
        elif tails > 0:
            assert r.next_check() == max(last_end, last_restart) + EVERY
        else:
            assert r.next_check() is None


def test_a_relay_that_fell_behind_its_source_at_a_fraction_of_its_rate_is_stale() -> None:
    """All of a forwarded chunk is here: a link far behind it whose BBR estimate is under
    the source's rate / STALE_FACTOR starts over at once; one that kept up, one with a
    fair share of a full path, one whose estimate is unknown, or a link with restarts off
    does not, and nothing restarts before ``own_pace`` either way."""
    src = 23e6 / 8  # bytes/s: the source's arrival (4 MiB in 1.45 s)
    slow = src / STALE_FACTOR * 0.9
    for lag, link, want in ((RELAY_LAG_BYTES, slow, True), (4 << 20, 0.0, True),
                            (RELAY_LAG_BYTES - 1, slow, False),  # kept up
                            (4 << 20, src / STALE_FACTOR, False),  # a share of a full path
                            (4 << 20, None, False)):  # not BBR: no estimate
        r = CongestionRestart(EVERY, IDLE)
        r.chunk_started(0.0, paced=True)
        assert r.next_check() is None and not r.block(5.0)
        r.own_pace(5.0)
        assert r.stale(5.0, lag, link, src) is want
        assert r.restarts == 1 + want  # the first: the chunk after idle
        assert r.next_check() == 6.0
    settling = CongestionRestart(EVERY, IDLE)  # BBR started over 0.2 s ago: still ramping
    settling.chunk_started(0.0, paced=True)
    settling.own_pace(0.2)
    assert not settling.stale(0.2, 4 << 20, 0.0, src, settle_s=0.32)
    assert settling.stale(0.4, 4 << 20, 0.0, src, settle_s=0.32)
    # a relay that began on a busy link, right after the one before it (no restart at
    # its start): BBR's estimate is the link's, judged at once (round 40: 3.4 MB behind
    # at 33 Mbit/s against a 77 Mbit/s source, 0.305 s into the chunk, was left alone)
    busy = CongestionRestart(EVERY, IDLE)
    busy.chunk_started(0.0, paced=True)  # after idle: BBR starts over at 0.0
    busy.own_pace(0.9)
    busy.chunk_ended(0.9)
    assert not busy.chunk_started(0.95, paced=True)  # back to back: no restart
    busy.own_pace(1.255)
    assert busy.stale(1.255, 3400 << 10, 32.7e6 / 8, 77.1e6 / 8, settle_s=0.32)
    assert busy.restarts == 2
    # ... and one under the source's rate but not under half of it is a share: left alone
    fair = CongestionRestart(EVERY, IDLE)
    fair.chunk_started(0.0, paced=True)
    fair.own_pace(1.0)
    assert not fair.stale(1.0, 4 << 20, 44e6 / 8, 60e6 / 8, settle_s=0.32)
    off = CongestionRestart(0.0, IDLE)
    off.chunk_started(0.0, paced=True)
    off.own_pace(1.0)
    assert not off.stale(1.0, 4 << 20, 0.0, src) and off.restarts == 0
    idle = CongestionRestart(EVERY, IDLE)  # between chunks: nothing to judge
    assert not idle.stale(1.0, 4 << 20, 0.0, src)


def test_off_means_no_checks_at_all() -> None:
    r = CongestionRestart(0.0, IDLE)
    assert not r.chunk_started(0.0) and r.next_check() is None
    r.chunk_ended(0.5)
    assert r.next_check() is None and not r.tail(5.0, 1000) and r.restarts == 0


def test_unacked_bytes_on_a_live_connection() -> None:
    """Bytes the peer has not acknowledged: what a socket's writer left in the kernel
    (``SIOCOUTQ``), here a send buffer the reader does not drain; zero once it has."""
    srv, cli, acc = tcp_pair()
    try:
        assert unacked_bytes(cli) == 0
        cli.setblocking(False)
        sent = 0
        with pytest.raises(BlockingIOError):  # both buffers fill: bounded by them
            for _ in range(4096):
                sent += cli.send(b"\0" * 65536)
        held = unacked_bytes(cli)
        assert held is not None and 0 < held <= sent
        got = 0
        while got < sent:
            got += len(acc.recv(1 << 20))
        for _ in range(200):  # the acknowledgements are the peer kernel's, at once
            if unacked_bytes(cli) == 0:
                break
            threading.Event().wait(0.01)
        assert unacked_bytes(cli) == 0
        assert unacked_bytes(None) is None
    finally:
        for s in (cli, acc, srv):
            s.close()


def _driver_with(sock: socket.socket, every_s: float):
    """A driver holding one link (``Conn``) over ``sock``, as ``_register`` would."""
    from node.driver import Conn, Driver
    from swarm.protocol.config import CoreConfig
    from swarm.protocol.core import NodeCore

    core = NodeCore(CoreConfig(node_id="a", region="r", model="m", listen_addr="127.0.0.1:1"),
                    verify_manifest=lambda raw: None, rng=random.Random(0))
    drv = Driver(core, None, None, host="127.0.0.1", port=0,  # type: ignore[arg-type]
                 congestion_restart_s=every_s)
    drv.loop = asyncio.get_running_loop()
    drv._congestion(sock)
    c = Conn(id=1, link=None, outbound=True, addr="peer", sock=sock,  # type: ignore[arg-type]
             restart=CongestionRestart(every_s, IDLE))
    drv.conns[c.id] = c
    return drv, c


@needs_bbr
def test_the_driver_restarts_a_link_whose_last_chunk_stays_unacknowledged() -> None:
    """After a chunk's last block the writer has nothing left to send, so its own timer
    looks at the socket: bytes still unacknowledged ``every_s`` later start BBR over
    (a tail loss); a link whose bytes were all acknowledged is left alone."""
    asyncio.run(_tail_restart())


async def _tail_restart() -> None:
    srv, cli, acc = tcp_pair()
    try:
        drv, c = _driver_with(cli, 0.05)
        assert drv.congestion_in_use == "bbr"
        cli.sendall(b"x" * 1000)  # a short chunk the peer acknowledges at once
        acc.recv(1000)
        c.restart.chunk_started(drv.now())
        drv._chunk_ended(c)
        await asyncio.sleep(0.3)
        assert drv.congestion_restarts == 0 and c.restart_timer is None  # nothing to look at
        cli.setblocking(False)
        with pytest.raises(BlockingIOError):  # the peer reads nothing: bytes stay in flight
            for _ in range(4096):
                cli.send(b"\0" * 65536)
        c.restart.chunk_started(drv.now())  # (a chunk after idle: its own restart)
        before = drv.congestion_restarts
        drv._chunk_ended(c)
        await eventually(lambda: c.restart_timer is None
                         and drv.congestion_restarts - before >= TAIL_CHECKS, "every look")
        await asyncio.sleep(0.1)
        assert drv.congestion_restarts - before == TAIL_CHECKS  # every look, then no more
        assert c.restart_timer is None and congestion_of(cli) == "bbr"
    finally:
        for s in (cli, acc, srv):
            s.close()


@needs_bbr
def test_the_driver_judges_a_cut_through_relay_once_its_source_is_done(
        caplog: pytest.LogCaptureFixture) -> None:
    """A relay forwarded as its chunk arrives: no timer while the source sends (the timer
    used to re-arm every millisecond once the chunk ran past ``every_s``); when the chunk
    is all here, a link far behind it at a fraction of its rate starts BBR over at once
    (``stale_relay``) unless BBR has just started over there, and one that kept up is
    looked at ``every_s`` later. At debug level each judgement is logged
    (``relay_source_done``) with what the rule saw."""
    caplog.set_level(logging.DEBUG, logger="patchswarm.node")
    asyncio.run(_relay_restart())
    seen = [r.fields for r in caplog.records if r.getMessage() == "relay_source_done"]
    assert [f["lag"] for f in seen] == [3 << 20, 4 << 20, 64 << 10]  # the three relays
    assert all(f["source_mbit"] > 0 and f["bbr_mbit"] >= 0 and f["min_rtt_ms"] >= 0 for f in seen)
    assert seen[0]["since_restart_s"] is not None and seen[0]["chunk_s"] >= 0.29


async def _relay_restart() -> None:
    from node.conn import Arrival

    srv, cli, acc = tcp_pair()
    try:
        drv, c = _driver_with(cli, 0.2)
        n = 4 << 20
        a = Arrival(conn=7, buf=memoryview(bytearray(n)), length=n, got=1 << 20,
                    t0=drv.now() - 0.01)  # arriving at 3 Gbit/s: far above a fresh link
        a.watchers.append(c)
        assert c.restart.chunk_started(drv.now(), paced=True)  # after idle: one restart
        drv._arm_restart_check(c)
        assert c.restart_timer is None  # nothing to look at while the source sends
        await asyncio.sleep(0.3)  # the chunk's time so far (``chunk_s`` in the log)
        assert c.restart.restarts == 1
        c.handed = 1 << 20  # 3 MiB behind it when it is all here
        a.got = n
        drv._source_done(a)
        assert c.restart.restarts == 2 and drv.congestion_restarts == 1
        assert congestion_of(cli) == "bbr" and c.restart_timer is not None
        drv._chunk_ended(c)

        # a path whose round-trip floor is 0.5 s: 0.3 s after the chunk began, its
        # start-up is still ramping (the kernel's model, as TCP_CC_INFO would give it)
        import node.tcp_watch as tw

        real = tw.bbr_model
        tw.bbr_model = lambda sock: (0.0, 0.5)  # type: ignore[assignment]
        try:
            c.restart = CongestionRestart(0.2, IDLE)
            c.restart.chunk_started(drv.now(), paced=True)
            c.handed = 0
            await asyncio.sleep(0.3)
            drv._source_done(a)
            assert c.restart.restarts == 1 and drv.congestion_restarts == 1
            assert c.restart.free_from is not None and c.restart_timer is not None
        finally:
            tw.bbr_model = real
        drv._chunk_ended(c)

        c.restart = CongestionRestart(0.2, IDLE)
        c.restart.chunk_started(drv.now(), paced=True)
        c.handed = n - (64 << 10)  # kept up with it
        drv._source_done(a)
        assert c.restart.restarts == 1 and drv.congestion_restarts == 1
        assert c.restart_timer is not None and c.restart.next_check() is not None
        drv._source_done(a)  # told twice: nothing more
        assert c.restart.restarts == 1
    finally:
        if c.restart_timer is not None:
            c.restart_timer.cancel()
        for s in (cli, acc, srv):
            s.close()


@settings(max_examples=200, deadline=None)
@given(steps)
def test_no_restart_after_idle_keeps_the_other_rules(seq) -> None:
    """``[network] congestion_restart_idle_s = 0``: no chunk starts BBR over for having
    started after idle; the long-chunk rule goes on as with it."""
    r, ref = CongestionRestart(EVERY, 0.0), CongestionRestart(EVERY, IDLE)
    now = 0.0
    for kind, dt in seq:
        now += dt
        if kind == "start":
            assert r.chunk_started(now) is False
            if ref.chunk_started(now):
                ref.last_restart = float("-inf")  # compare the long-chunk rule alone
        elif kind == "block":
            assert r.block(now) is ref.block(now)
        else:
            r.chunk_ended(now)
            ref.chunk_ended(now)
