"""What the node driver watches on a link's TCP sockets around a chunk: whether the
bytes it handed over are still being acknowledged (``ev.Acked``: the origin's pushes,
a border's relays, which then do not time out), and when to restart the congestion
window (``CongestionRestart``). ``TcpWatch`` is a part of ``node.driver.Driver`` (a
mixin: it uses the driver's loop, core and connections)."""

from __future__ import annotations

import logging
from typing import Any

from node.conn import Arrival, Conn
from node.tcp import (
    QUEUE_FACTOR,
    STALE_SETTLE_RTTS,
    acked_bytes,
    bbr_model,
    keeps_window_across_idle,
    path_sample,
    ramping,
    restart_congestion,
    unacked_bytes,
)
from swarm.protocol import events as ev

log = logging.getLogger("patchswarm.node")

# how often a watched link's acknowledged bytes are looked at (``TcpWatch._ack_watch``)
ACK_WATCH_S = 1.0
# the origin looks at a leaving push's path once a round trip (its floor), at most this often
PATH_WATCH_MIN_S = 0.02


class TcpWatch:
    """The part of ``Driver`` that watches a link's sockets (module docstring)."""

    def _chunk_ended(self, c: Conn) -> None:
        """``c``'s chunk is all handed to the kernel: look at the link's unacknowledged
        bytes later (``CongestionRestart.tail``), and on the origin whether they are
        still being acknowledged (``_ack_watch``)."""
        c.in_chunk = False
        if self.core.cfg.is_origin:
            self._watch_acks(c)
        c.restart.chunk_ended(self.now())
        if self.congestion_restart_s > 0 and c.sock is not None:
            self._arm_restart_check(c)

    @staticmethod
    def _socks(c: Conn) -> list[Any]:
        return [s for s in (c.sock, *(lane.sock for lane in c.lanes)) if s is not None]

    def _acked(self, c: Conn) -> int:
        return sum(acked_bytes(s) or 0 for s in self._socks(c))

    def _watch_acks(self, c: Conn) -> None:
        """Start ``_ack_watch`` on ``c`` unless it runs."""
        if c.ack_timer is None and self.loop is not None:
            c.ack_seen = self._acked(c)
            c.ack_timer = self.loop.call_later(ACK_WATCH_S, self._ack_watch, c)

    def _ack_watch(self, c: Conn) -> None:
        """A timer on ``c`` (the origin: after a chunk was handed over; a border: while
        it relays a chunk to another region): bytes are being acknowledged still, so the
        push or relay is on its way (``ev.Acked``: the core keeps it from timing out).
        Looks again while a chunk is being sent or bytes are unacknowledged."""
        c.ack_timer = None
        if c.closing or self.conns.get(c.id) is not c or self.loop is None:
            return
        seen = self._acked(c)
        if seen > c.ack_seen:
            self.feed(ev.Acked(self.now(), c.id))
        c.ack_seen = seen
        if c.in_chunk or any((unacked_bytes(s) or 0) > 0 for s in self._socks(c)):
            c.ack_timer = self.loop.call_later(ACK_WATCH_S, self._ack_watch, c)

    def _watch_path(self, c: Conn) -> None:
        """Start ``_path_watch`` on ``c`` (the origin, a chunk leaving on it) unless it runs."""
        if c.path_timer is None and self.loop is not None and c.sock is not None:
            c.path_timer = self.loop.call_later(self._path_period(c), self._path_watch, c)

    @staticmethod
    def _path_period(c: Conn) -> float:
        sample = path_sample(c.sock)
        floor = sample[2] / 1e6 if sample is not None else 0.0
        return max(PATH_WATCH_MIN_S, floor)

    def _path_watch(self, c: Conn) -> None:
        """A timer on ``c`` while a chunk leaves on it: whether its smoothed round trip
        runs ``QUEUE_FACTOR`` x above its floor (a queue stands on the path), and whether
        its window is still opening (``node.tcp.ramping``), as ``ev.PathSample``, once a
        round trip. The core reads only those of pushes into
        other regions (``OriginRole.on_path_sample``)."""
        c.path_timer = None
        if c.closing or self.conns.get(c.id) is not c or self.loop is None or not c.in_chunk:
            return
        sample = path_sample(c.sock)
        if sample is None:
            return  # not a TCP socket this platform can look into: no samples
        _retrans, srtt, floor = sample
        if floor > 0:
            self.feed(ev.PathSample(self.now(), c.id, srtt > QUEUE_FACTOR * floor, floor / 1e6,
                                    ramping=ramping(c.sock)))
        c.path_timer = self.loop.call_later(max(PATH_WATCH_MIN_S, floor / 1e6),
                                            self._path_watch, c)

    def _arm_restart_check(self, c: Conn) -> None:
        if c.restart_timer is not None:
            c.restart_timer.cancel()
            c.restart_timer = None
        t = c.restart.next_check()
        if t is None or self.loop is None or c.closing:
            return
        c.restart_timer = self.loop.call_at(max(t, self.now() + 0.001), self._restart_check, c)

    def _restart_check(self, c: Conn) -> None:
        """A timer: a chunk sending long, or a sent one's bytes stuck in the kernel. Runs
        off the writer, which may be waiting for the socket to drain all that time."""
        c.restart_timer = None
        if c.closing or self.conns.get(c.id) is not c:
            return
        now = self.now()
        if c.restart.started is not None:
            # (a chunk forwarded as it arrives is looked at only once it is all here)
            why = "long_chunk" if c.restart.block(now) else None
        else:
            unacked = unacked_bytes(c.sock)
            why = f"tail ({unacked} bytes unacknowledged)" if c.restart.tail(now, unacked) else None
        if why is not None:
            self._restart_congestion(c, why)
        self._arm_restart_check(c)

    def _source_done(self, a: Arrival) -> None:
        """Every byte of chunk ``a`` is here: the links forwarding it as it arrived go at
        their own pace from now (``CongestionRestart.own_pace``), and one that fell far
        behind it at a fraction of its arrival rate starts BBR over at once
        (``CongestionRestart.stale``)."""
        if self.congestion_restart_s <= 0 or not a.watchers:
            return
        now = self.now()
        source_bps = a.length / max(now - a.t0, 1e-3)
        in_use = self.congestion_in_use
        bbr = in_use is not None and keeps_window_across_idle(in_use)
        for c in a.watchers:
            r = c.restart
            if r.started is None or r.free_from is not None or c.closing:
                continue  # not yet started on it, or not forwarded as it arrived
            r.own_pace(now)
            model = bbr_model(c.sock) if bbr and c.sock is not None else None
            lag = a.length - c.handed
            if model is not None and log.isEnabledFor(logging.DEBUG):
                # what the stale rule judges (every relay forwarded as its chunk arrived)
                log.debug("relay_source_done", extra={"fields": {
                    "peer": c.addr, "lag": lag, "source_mbit": round(source_bps * 8e-6, 1),
                    "bbr_mbit": round(model[0] * 8e-6, 1), "min_rtt_ms": round(model[1] * 1e3, 1),
                    "chunk_s": round(now - (r.started or now), 3),
                    "since_restart_s": (round(now - r.last_restart, 3)
                                        if r.last_restart > float("-inf") else None)}})
            if model is not None and r.stale(now, lag, model[0], source_bps,
                                             STALE_SETTLE_RTTS * model[1]):
                self._restart_congestion(c, "stale_relay")
            self._arm_restart_check(c)

    def _restart_congestion(self, c: Conn, why: str) -> None:
        """Start BBR over on ``c``'s socket (``node.tcp.CongestionRestart`` says when);
        nothing where the link does not run BBR."""
        in_use = self.congestion_in_use
        if c.sock is None or in_use is None or not keeps_window_across_idle(in_use):
            return
        if restart_congestion(c.sock, in_use):
            self.congestion_restarts += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("congestion_restart", extra={"fields": {"peer": c.addr, "why": why}})
