"""Warm-up of long links: TCP's congestion window opened before the first version.

A link that carries chunks between regions crosses a long round trip. Until a chunk has
gone over it, its sender's window is TCP's initial one (10 segments): on the emulated
WAN (81 ms) the first version's pushes needed ~6 round trips to fill their share of a
100 Mbit/s uplink, which carried 2, 16 and 86 Mbit/s in its first three quarter-seconds,
and a first version took ~0.5 s longer than a later one, whose links kept the window the
last version left (docs/benchmarks.md, rounds 34 and 42).

A window, once open, stays open: Linux skips its restart after idle for an algorithm with
its own ``cong_control`` (BBR, ``node.tcp.keeps_window_across_idle``), and the driver's
start-over of BBR on a chunk after idle (``node.tcp.CongestionRestart``) starts from the
window the link has. So once a link is up and its handshake done, the side that uploads
on it (the origin to the borders it feeds, a border to a border of another region) writes
padding (``wire.PAD_MAGIC``, dropped unread by the peer) while the node moves no chunk:
up to ``[network] warm_up_kib`` bytes, and no longer than BBR's start-up lasts (it ends
once the path is full) or ``WARM_UP_MAX_S``. A node warms one link at a time: in BBR's
start-up the window grows by what is acknowledged, up to ~2.9x the rate measured times
the round trip, so a link warmed alone on a path ends with a window of its path, and one
of 30 warmed at once on a shared uplink with a thirtieth of it. 512 KiB opens a window of
~0.5 MB, enough that the start-over of BBR on the first chunk (from that window, at 2.9x
it per round trip) paces a 100 Mbit/s path at 81 ms full from its first round trip.

It ships on for the origin only (``node.config.DEFAULT_ORIGIN_WARM_UP_KIB``): the origin's
links to the borders it pushes to, at most ``border_nodes`` per remote region, once each.
On the emulated WAN its first pushes then fill the trainer's uplink from their start, as a
later version's do (docs/benchmarks.md round 53). A node's links ship cold
(``WARM_UP_KIB``): warm relays between borders burst into inlets the origin's pushes had
filled, collapsed into loss recovery, and a first version took as long as a cold one
(round 42). Links whose round trip is under
``warm_up_min_rtt_ms`` are left alone (their start-up costs milliseconds), and so is a link
that has carried a chunk (its window is the chunk's). The first chunk the node sends or
receives ends every warm-up at once: a version's bytes come first.

``WarmUp`` is one link's warm-up, by bytes and time (both come in as arguments);
``WarmUps`` is the part of ``node.driver.Driver`` that starts, feeds and ends them (a
mixin: it uses the driver's loop, core and connections).
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from typing import Any

from node.config import DEFAULT_WARM_UP_KIB
from node.conn import Conn
from node.tcp import TAIL_MIN_BYTES, _tcp_info, bbr_info, unacked_bytes
from swarm.protocol import wire

log = logging.getLogger("patchswarm.node")

WARM_UP_KIB = DEFAULT_WARM_UP_KIB  # a node's shipped [network] warm_up_kib (0: never)
WARM_UP_MIN_RTT_MS = 20.0  # shipped [network] warm_up_min_rtt_ms
WARM_UP_MAX_S = 5.0  # a warm-up ends this long after it began, whatever it sent
WARM_UP_DELAY_S = 0.25  # after a link comes up, its first look (the handshake is under way)
WARM_UP_LOOKS = 6  # looks at a link before giving up on it, each twice as late
# the writer hands padding over only while the link's own buffer is empty (the kernel then
# holds at most [network] unsent_limit_kib of it unsent): a chunk that comes meanwhile
# waits behind that and what is in flight, not behind the rest of the budget; it looks
# again this often
WARM_UP_POLL_S = 0.005
DRAIN_LOOK_S = 0.02  # how often a link whose padding is all handed over is looked at
QUIET_S = 1.0  # a warm-up begins only this long after the node last moved a chunk
# BBR's pacing gain (x256) during its start-up is 2.885 (739); after it, at most 1.25
BBR_STARTUP_GAIN = 2 * 256


class WarmUp:
    """One link's warm-up: how much padding to write next, and when it is over."""

    __slots__ = ("budget", "ended_at", "sent", "started", "why")

    def __init__(self, budget: int, now: float) -> None:
        self.budget = budget
        self.started = now
        self.sent = 0
        self.why: str | None = None  # why it ended (None: under way)
        self.ended_at: float | None = None

    def next_pad(self, now: float, startup: bool | None) -> int:
        """Bytes of the next padding message, counted as sent; 0 once the warm-up is over
        (``why`` says why). ``startup``: whether BBR is still in its start-up (None: not
        BBR, or unknown), looked at before this message."""
        if self.why is not None:
            return 0
        if self.sent >= self.budget:
            self.end(now, "budget")
        elif now - self.started >= WARM_UP_MAX_S:
            self.end(now, "time")
        elif startup is False and self.sent > 0:
            self.end(now, "path_full")
        if self.why is not None:
            return 0
        n = min(wire.PAD_MESSAGE_BYTES, self.budget - self.sent)
        self.sent += n
        return n

    def end(self, now: float, why: str) -> None:
        if self.why is None:
            self.why, self.ended_at = why, now


def bbr_in_startup(sock: Any) -> bool | None:
    """Whether BBR on ``sock`` is in its start-up (pacing gain above 2), or None where the
    socket does not run BBR or the platform cannot say."""
    info = bbr_info(sock)
    return None if info is None else info[3] >= BBR_STARTUP_GAIN


def window_bytes(sock: Any) -> int | None:
    """``sock``'s congestion window in bytes (``tcpi_snd_cwnd`` x ``tcpi_snd_mss``)."""
    raw = _tcp_info(sock)
    if raw is None:
        return None
    (mss,) = struct.unpack_from("=I", raw, 16)
    (cwnd,) = struct.unpack_from("=I", raw, 80)
    return cwnd * mss


def smoothed_rtt_s(sock: Any) -> float | None:
    raw = _tcp_info(sock)
    return None if raw is None else struct.unpack_from("=I", raw, 68)[0] / 1e6


class WarmUps:
    """The part of ``Driver`` that warms long links (module docstring)."""

    def _warm_setup(self, kib: int, min_rtt_ms: float) -> None:
        self.warm_up_bytes = max(0, kib) * 1024
        self.warm_up_min_rtt_s = min_rtt_ms / 1000
        self.warming: dict[int, Conn] = {}  # conn id -> link being warmed
        # links found to warm while another is: one at a time per node, so that each
        # start-up measures more of its path than a share among all of them
        self.warm_queue: deque[Conn] = deque()
        self.warm_ups = 0  # links warmed (begun)
        self.warm_ended: dict[str, int] = {}  # why warm-ups ended: count
        self.pad_sent = 0
        self.pad_received = 0
        self.chunk_io_at = float("-inf")  # when the node last sent or received a chunk block

    def _warm_schedule(self, c: Conn, look: int = 0) -> None:
        if self.warm_up_bytes <= 0 or self.loop is None or look >= WARM_UP_LOOKS:
            return
        c.warm_timer = self.loop.call_later(WARM_UP_DELAY_S * (1 << look), self._warm_look, c, look)

    def _warm_look(self, c: Conn, look: int) -> None:
        """Whether ``c`` is to be warmed now; looks again later where it cannot tell yet."""
        c.warm_timer = None
        if c.closing or c.id not in self.conns or c.warm is not None or c.carried:
            return
        core = self.core
        if not core.authenticated(c.id):
            self._warm_schedule(c, look + 1)  # its handshake is still under way
            return
        if not core.peer_border(c.id) or core.peer_proto(c.id) < wire.PAD_PROTOCOL:
            return  # not a link between regions, or a peer that does not take padding
        if self.slow_start_after_idle:
            return  # a loss-based window restarts after idle anyway (docs/operations.md)
        if self.now() - self.chunk_io_at < QUIET_S:
            self._warm_schedule(c, look + 1)  # a version is moving: its bytes come first
            return
        rtt = smoothed_rtt_s(c.sock) if c.sock is not None else None
        if rtt is None or rtt < self.warm_up_min_rtt_s:
            return
        if self.warming:
            self.warm_queue.append(c)
            return
        self._warm_begin(c)

    def _warm_begin(self, c: Conn) -> None:
        c.warm = WarmUp(self.warm_up_bytes, self.now())
        self.warming[c.id] = c
        self.warm_ups += 1
        c.wake.set()

    def _warm_next(self) -> None:
        """The node's warm-up ended: the next link queued that still qualifies."""
        while self.warm_queue and not self.warming:
            c = self.warm_queue.popleft()
            if not c.closing and c.id in self.conns and not c.carried and c.warm is None:
                self._warm_begin(c)

    def _warm_pad(self, c: Conn) -> bytes | None:
        """The writer of ``c`` has nothing else to send: the next padding message, or None
        (no warm-up, or it just ended)."""
        w = c.warm
        if w is None or w.why is not None:
            return None
        n = w.next_pad(self.now(), bbr_in_startup(c.sock) if c.sock is not None else None)
        if n == 0:
            # all handed over: the link's turn ends once the peer has acknowledged it
            # (the kernel and the link's buffer hold most of it still)
            self._warm_drained(c)
            return None
        self.pad_sent += n
        return wire.pack_pad(n)

    def _warm_drained(self, c: Conn) -> None:
        """``c``'s padding is all handed over: its warm-up ends once the kernel holds none
        of it unacknowledged (``WARM_UP_MAX_S`` at most); looked at every ``DRAIN_LOOK_S``."""
        c.warm_timer = None
        w = c.warm
        if w is None or c.id not in self.warming or c.closing:
            return
        left = unacked_bytes(c.sock) if c.sock is not None else None
        if (left is None or left < TAIL_MIN_BYTES or self.loop is None
                or self.now() - w.started >= WARM_UP_MAX_S):
            self._warm_end(c)
            return
        c.warm_timer = self.loop.call_later(DRAIN_LOOK_S, self._warm_drained, c)

    def _warm_end(self, c: Conn, why: str | None = None) -> None:
        w = c.warm
        if w is None or c.id not in self.warming:
            return
        if why is not None:
            w.end(self.now(), why)
        del self.warming[c.id]
        if c.warm_timer is not None:
            c.warm_timer.cancel()
            c.warm_timer = None
        reason = w.why or "closed"
        if reason == "chunks":
            self.warm_queue.clear()  # a version moves: its bytes warm what it uses
        else:
            self._warm_next()
        self.warm_ended[reason] = self.warm_ended.get(reason, 0) + 1
        window = window_bytes(c.sock) if c.sock is not None else None
        log.info("link_warmed", extra={"fields": {
            "peer": c.addr, "bytes": w.sent, "why": reason,
            "handed_s": round((w.ended_at or self.now()) - w.started, 3),
            "s": round(self.now() - w.started, 3),
            "window_kib": None if window is None else window >> 10}})

    def _chunk_moved(self, c: Conn) -> None:
        """A chunk block is sent or received on ``c``: every warm-up ends (a version's
        bytes come first), and ``c`` is never warmed."""
        c.carried = True
        self.chunk_io_at = self.now()
        self.warm_queue.clear()
        if self.warming:
            for w in list(self.warming.values()):
                self._warm_end(w, "chunks")

    async def _on_pad(self, c: Conn, data: bytes | bytearray) -> None:
        """Padding from the peer: dropped unread, counted against ``wire.PAD_LIMIT``."""
        if not self.core.authenticated(c.id):
            await self._drop(c, "padding before the handshake")
            return
        c.pad_in += len(data)
        self.pad_received += len(data)
        if c.pad_in > wire.PAD_LIMIT:
            await self._drop(c, f"{c.pad_in} bytes of padding, over the {wire.PAD_LIMIT} "
                                "a link may carry")

    def warm_status(self) -> dict[str, Any]:
        """``/status`` ``transport.warm_up``."""
        return {"links": self.warm_ups, "warming": len(self.warming) + len(self.warm_queue),
                "ended": dict(self.warm_ended),
                "pad_sent": self.pad_sent, "pad_received": self.pad_received}
