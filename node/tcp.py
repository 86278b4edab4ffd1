"""TCP options of peer sockets: unsent-byte limit, congestion control, BBR restarts.

What a node asks of the kernel for every peer link (``[network]`` in the node's
TOML, docs/operations.md), and ``CongestionRestart``: when a link starts or keeps
on sending a chunk, put BBR back into its start-up where its bandwidth estimate
has gone stale (docs/benchmarks.md, "round 22").
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from typing import Any

# Unsent bytes the kernel may hold per peer socket by default (``[network]
# unsent_limit_kib``; TCP_NOTSENT_LOWAT, Linux and macOS): the rest waits in our own send
# queue, where a control frame (RELAY order, HAVE, heartbeat) overtakes chunk blocks.
# Without it the kernel queues as much as its autotuned send buffer allows, up to ~1 s of
# a shared 100 Mbit uplink, and on the emulated WAN a RELAY order reached its border
# 0.25-1 s late, queued behind the origin's push to that border (docs/benchmarks.md).
UNSENT_LIMIT = 128 * 1024


def limit_unsent(sock: Any, limit: int) -> bool:
    """Bound the unsent bytes the kernel holds for a peer socket to ``limit`` (0: leave
    the kernel's default); False where the platform has no ``TCP_NOTSENT_LOWAT``."""
    opt = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or opt is None or limit <= 0:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, limit)
    except OSError:
        return False
    return True


# TCP congestion control asked for on every peer socket (``[network] congestion_control``).
# A loss-based algorithm (CUBIC, Reno: most distributions' default) caps one flow near
# MSS / RTT x 1.22 / sqrt(loss), 3-6 Mbit/s at 150 ms and 0.1 % loss, however fat the path;
# BBR paces at the measured bottleneck rate and does not back off on random loss
# (docs/benchmarks.md, "Long lossy links").
CONGESTION_CONTROL = "bbr"


def set_congestion(sock: Any, name: str) -> str | None:
    """Use TCP congestion control ``name`` on a peer socket (Linux ``TCP_CONGESTION``;
    ``""`` leaves the system's). Returns why the kernel refused it (the socket then keeps
    the system's algorithm), else None."""
    if not name or sock is None:
        return None
    opt = getattr(socket, "TCP_CONGESTION", None)
    if opt is None:
        return "this platform has no TCP_CONGESTION"
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, name.encode())
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


SLOW_START_AFTER_IDLE = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"


def slow_start_after_idle(path: str = SLOW_START_AFTER_IDLE) -> bool | None:
    """Whether Linux restarts an idle connection's congestion window (this network
    namespace's ``net.ipv4.tcp_slow_start_after_idle``); None where it cannot be read.
    It applies to loss-based algorithms only: Linux skips it for one with its own
    ``cong_control`` (BBR), see ``keeps_window_across_idle``."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(16).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return {"0": False, "1": True}.get(text)


def keeps_window_across_idle(algorithm: str) -> bool:
    """BBR (and its successors) has its own ``cong_control``: Linux neither restarts its
    window after idle nor decays a window left unused (``tcp_slow_start_after_idle_check``,
    ``tcp_cwnd_validate``); it paces the first flight after idle at its estimate."""
    return algorithm.startswith("bbr")


def congestion_of(sock: Any) -> str | None:
    """The congestion control a TCP socket uses, or None where it cannot be read."""
    opt = getattr(socket, "TCP_CONGESTION", None)
    if sock is None or opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, 16)
    except OSError:
        return None
    return raw.split(b"\0", 1)[0].decode("ascii", "replace") or None




# ----------------------------------------------------------------- BBR restarts

# BBR keeps one bottleneck-rate estimate per connection and, once out of its start-up,
# raises it by at most a quarter per probe cycle (8 round trips). A connection that
# began a chunk while its path was full (its start-up ended at a small share), or one
# that had carried only control frames, keeps a low estimate after the competition is
# gone: on the emulated WAN such relays crawled at 5-25 Mbit/s for 2-5 s through an
# otherwise idle 100 Mbit/s inlet (TCP_INFO samples, docs/benchmarks.md round 22).
# Linux re-initialises a socket's congestion control when it is changed (asking for
# the one in use changes nothing), so switching to Reno (always allowed) and back
# starts BBR over: start-up, doubling per round trip from the connection's current
# window, the round-trip floor it measured kept.
CONGESTION_RESTART_S = 1.0  # shipped [network] congestion_restart_s (0: never)
RESTART_IDLE_S = 0.2  # a chunk after this long without one on the link starts afresh
# A relay forwarded as its chunk arrives is paced by its source until the chunk is all
# here; a link then this far behind it, whose BBR estimate is under the source's arrival
# rate / STALE_FACTOR although it has had STALE_SETTLE_RTTS round trips since BBR last
# started over (its start-up from the initial window gains x16 in four; a chunk after
# idle starts it over), holds a stale estimate (cut-through relays crawled at 1.5-5
# Mbit/s for 1.8-2.8 s after their source had finished at ~23 Mbit/s, through an inlet
# 80-90 % idle: docs/benchmarks.md round 38) and starts over at once. Judged while the
# chunk still arrived, relays that began behind it fired within 10 ms of a restart (round
# 38). Round 40: a version's last relay 3.4 MB behind its source at 32.7 Mbit/s against
# the source's 77 (0.87 s to drain through an idle inlet) was left alone, under half but
# not a quarter, and judged 0.305 s after it began on a busy link (the settle then ran
# from the chunk's start, not BBR's); a factor of 1.25 fired 13 times in 16 versions for
# nothing in time, 2 fires on relays at under half their source's rate (2 in ~100).
RELAY_LAG_BYTES = 512 << 10
STALE_FACTOR = 2.0
STALE_SETTLE_RTTS = 4
TCP_CC_INFO = 26  # linux/tcp.h; struct tcp_bbr_info for BBR
BBR_INFO = struct.Struct("=IIIII")  # bw_lo, bw_hi (bytes/s), min_rtt (us), pacing, cwnd gain


def restart_congestion(sock: Any, name: str) -> bool:
    """Start congestion control ``name`` over on ``sock`` (Reno, then ``name``): False
    where the platform or the kernel refuses (the socket keeps what it had)."""
    opt = getattr(socket, "TCP_CONGESTION", None)
    if sock is None or opt is None or not name or name == "reno":
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, b"reno")
    except OSError:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, name.encode())
    except OSError:
        return False  # left on Reno; set_congestion's own refusal would have said so
    return True


def bbr_bandwidth(sock: Any) -> float | None:
    """BBR's bottleneck-rate estimate of ``sock`` in bytes/s (``TCP_CC_INFO``), or None
    where the socket does not run BBR or the platform cannot say."""
    model = bbr_model(sock)
    return None if model is None else model[0]


def bbr_info(sock: Any) -> tuple[int, ...] | None:
    """``struct tcp_bbr_info`` of ``sock`` (``TCP_CC_INFO``): bandwidth low and high words
    (bytes/s), round-trip floor (us), pacing and window gains (x256); None where the socket
    does not run BBR or the platform cannot say."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_CC_INFO, BBR_INFO.size)
    except (OSError, AttributeError):
        return None
    if len(raw) < BBR_INFO.size:
        return None
    return BBR_INFO.unpack(raw[:BBR_INFO.size])


def bbr_model(sock: Any) -> tuple[float, float] | None:
    """BBR's model of ``sock``: (bottleneck-rate estimate in bytes/s, round-trip floor in
    seconds), from ``TCP_CC_INFO``; None where the socket does not run BBR or the
    platform cannot say."""
    info = bbr_info(sock)
    if info is None:
        return None
    lo, hi, rtt_us, _pg, _cg = info
    return float((hi << 32) | lo), rtt_us / 1e6


class CongestionRestart:
    """When one link's sender considers starting BBR over (``restart_congestion``), by
    time alone.

    A chunk that starts after ``idle_s`` without one on the link (a link that carried only
    control frames, or whose last chunk shared a full path, holds an estimate that says
    nothing of now), a chunk still sending ``every_s`` after its start or the last restart,
    and a chunk whose bytes are still unacknowledged in the kernel ``every_s`` after the
    writer handed over its last block (a tail loss: after the retransmission timeout BBR
    v1 may pace at its long-term "policer" estimate, a fraction of a Mbit/s, for 48 round
    trips; docs/benchmarks.md round 22). A chunk that flows at its path's rate ends first
    (4 MiB: 0.34 s at 100 Mbit/s), so on a link that keeps up nothing restarts mid-chunk.
    ``every_s`` = 0 turns it off. Time comes in as arguments; the driver looks at
    ``next_check``, on a timer of its own: a writer can wait on a squeezed socket for
    long, and after its last block it has nothing more to send.

    A chunk forwarded as it arrives (``paced``) goes at its source's pace, which says
    nothing of the link: the long-chunk rule runs for it only from when all its bytes are
    here (``own_pace``), as if it started then."""

    __slots__ = ("every_s", "free_from", "idle_s", "last_end", "last_restart", "restarts",
                 "started", "tails")

    def __init__(self, every_s: float = CONGESTION_RESTART_S,
                 idle_s: float = RESTART_IDLE_S) -> None:
        self.every_s, self.idle_s = every_s, idle_s
        self.last_end: float | None = None  # when the link's last chunk was all sent
        self.last_restart = float("-inf")
        self.started: float | None = None  # the chunk being sent: when it began
        # from when the chunk being sent goes at the link's own pace (None: a chunk
        # forwarded as it arrives, whose source is still sending it)
        self.free_from: float | None = None
        self.restarts = 0
        self.tails = 0  # tail checks left for the last chunk sent

    def chunk_started(self, now: float, paced: bool = False) -> bool:
        """A chunk begins on the link (``paced``: forwarded as it arrives): True if BBR is
        to start over now."""
        self.started, self.tails = now, 0
        self.free_from = None if paced else now
        if self.every_s <= 0:
            return False
        if self.idle_s > 0 and (self.last_end is None or now - self.last_end >= self.idle_s):
            return self._restart(now)
        return False

    def own_pace(self, now: float) -> None:
        """The paced chunk being sent is all here: from now on its pace is the link's."""
        if self.started is not None and self.free_from is None:
            self.free_from = now

    def block(self, now: float) -> bool:
        """A chunk is sending: True if BBR is to start over now."""
        if self.every_s <= 0 or self.started is None or self.free_from is None:
            return False
        if now - max(self.free_from, self.last_restart) >= self.every_s:
            return self._restart(now)
        return False

    def stale(self, now: float, lag: int, link_bps: float | None, source_bps: float,
              settle_s: float = 0.0) -> bool:
        """The paced chunk being sent is all here (``own_pace``); ``lag`` bytes of it are
        not yet handed to the socket, whose BBR estimate is ``link_bps`` (None: unknown)
        against the ``source_bps`` it arrived at: True if BBR is to start over now (a link
        that fell behind its source at a fraction of its rate: a stale estimate, not a
        share of a full path), unless BBR last started over less than ``settle_s`` ago
        (its start-up is still ramping). A chunk that began on a busy link did not start
        BBR over: its estimate is the link's, however recently the chunk began."""
        if (self.every_s <= 0 or self.started is None or lag < RELAY_LAG_BYTES
                or link_bps is None or link_bps * STALE_FACTOR >= source_bps
                or now - self.last_restart < settle_s):
            return False
        return self._restart(now)

    def chunk_ended(self, now: float) -> None:
        self.started, self.free_from, self.last_end = None, None, now
        self.tails = TAIL_CHECKS if self.every_s > 0 else 0

    def tail(self, now: float, unacked: int | None) -> bool:
        """No chunk sending, ``unacked`` bytes of the link not yet acknowledged: True if
        BBR is to start over now (at least ``TAIL_MIN_BYTES`` of them stuck ``every_s``
        after the last chunk was handed over, or after the last restart; at most
        ``TAIL_CHECKS`` looks a chunk)."""
        if self.started is not None or self.last_end is None or self.tails <= 0:
            return False
        if now - max(self.last_end, self.last_restart) < self.every_s:
            return False
        self.tails -= 1
        if not unacked or unacked < TAIL_MIN_BYTES:
            # all acknowledged but a control frame just written (a heartbeat, a HAVE):
            # nothing to look at until the next chunk
            self.tails = 0
            return False
        return self._restart(now)

    def next_check(self) -> float | None:
        """When the driver should look at the link next (``block`` or ``tail``), or None."""
        if self.every_s <= 0:
            return None
        if self.started is not None:
            if self.free_from is None:
                return None  # at its source's pace: ``own_pace`` says when to look
            return max(self.free_from, self.last_restart) + self.every_s
        if self.tails > 0 and self.last_end is not None:
            return max(self.last_end, self.last_restart) + self.every_s
        return None

    def _restart(self, now: float) -> bool:
        self.last_restart = now
        self.restarts += 1
        return True


# ------------------------------------------------------------ unacknowledged bytes

TAIL_CHECKS = 3  # looks at a sent chunk's unacknowledged bytes, every_s apart
# fewer unacknowledged bytes than this are a control frame in flight, not a stuck tail
# (on the emulated WAN, spurious tail restarts were 28-59 bytes: a heartbeat, a HAVE)
TAIL_MIN_BYTES = 4096
SIOCOUTQ = getattr(termios, "TIOCOUTQ", 0x5411)  # Linux: a TCP socket's unacked + unsent


def unacked_bytes(sock: Any) -> int | None:
    """Bytes written to ``sock`` and not yet acknowledged by the peer (Linux ``SIOCOUTQ``:
    unsent and in flight), or None where it cannot be read."""
    try:
        raw = fcntl.ioctl(sock.fileno(), SIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return None
    return struct.unpack("i", raw)[0]


# ------------------------------------------------------------- random loss, for lanes

TCP_INFO_LEN = 152  # struct tcp_info up to tcpi_min_rtt (Linux 4.10+)
LOSS_PROBE_S = 0.25  # a sending link's socket is looked at this often
QUEUE_FACTOR = 1.25  # a smoothed round trip above this x the link's floor: a queue is full
LOSS_SAMPLES = 1  # looks with new retransmissions and no queue before lanes open


def _tcp_info(sock: Any) -> bytes | None:
    """A TCP socket's ``struct tcp_info`` (Linux, up to ``tcpi_min_rtt``), or None."""
    opt = getattr(socket, "TCP_INFO", None)
    if sock is None or opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, TCP_INFO_LEN)
    except OSError:
        return None
    return raw if len(raw) >= TCP_INFO_LEN else None


TCP_INFO_RATE_LEN = 168  # ... up to tcpi_delivery_rate (Linux 4.9+)


def link_rate(sock: Any) -> float | None:
    """The rate ``sock`` delivers at, in bytes/s: BBR's bottleneck estimate
    (``TCP_CC_INFO``), else the kernel's latest delivery-rate sample
    (``tcpi_delivery_rate``); None where the platform cannot say or nothing was measured
    yet."""
    bw = bbr_bandwidth(sock)
    if bw:
        return bw
    opt = getattr(socket, "TCP_INFO", None)
    if sock is None or opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, TCP_INFO_RATE_LEN)
    except (OSError, AttributeError):
        return None
    if len(raw) < TCP_INFO_RATE_LEN:
        return None
    (rate,) = struct.unpack_from("=Q", raw, 160)
    return float(rate) or None


def acked_bytes(sock: Any) -> int | None:
    """Bytes of ``sock`` the peer has acknowledged (``tcpi_bytes_acked``), or None where
    it cannot be read."""
    raw = _tcp_info(sock)
    return None if raw is None else struct.unpack_from("=Q", raw, 120)[0]


def loss_share(sock: Any, queued: int = 0) -> float | None:
    """Retransmitted segments per segment sent on ``sock`` since it opened
    (``tcpi_total_retrans / tcpi_segs_out``), less ``queued`` retransmissions known to be
    a full queue's (``RandomLoss.queued``), or None where it cannot be read."""
    raw = _tcp_info(sock)
    if raw is None:
        return None
    (retrans,) = struct.unpack_from("=I", raw, 100)
    (segs_out,) = struct.unpack_from("=I", raw, 136)
    return max(0, retrans - queued) / segs_out if segs_out else None


def path_sample(sock: Any) -> tuple[int, int, int] | None:
    """``(total retransmitted segments, smoothed round trip us, round-trip floor us)`` of a
    TCP socket (Linux ``TCP_INFO``), or None where it cannot be read."""
    raw = _tcp_info(sock)
    if raw is None:
        return None
    (srtt,) = struct.unpack_from("=I", raw, 68)
    (retrans,) = struct.unpack_from("=I", raw, 100)
    (floor,) = struct.unpack_from("=I", raw, 148)
    return retrans, srtt, floor


def ramping(sock: Any) -> bool:
    """Whether ``sock``'s window is still opening from its start: BBR in its start-up
    (pacing gain over 2x: 2.89 there, at most 1.25 after), or a loss-based window under
    its slow-start threshold (Linux ``TCP_INFO``). False where it cannot be read."""
    info = bbr_info(sock)
    if info is not None:
        return info[3] > 2 * 256
    raw = _tcp_info(sock)
    if raw is None:
        return False
    ssthresh, cwnd = struct.unpack_from("=II", raw, 76)
    return cwnd < ssthresh


class RandomLoss:
    """Whether one link's sender is capped by random loss on its path, so that more
    connections ("lanes", docs/striped-links.md) would carry more, or by a queue it
    shares, where they would only take from the other flows (``[network] lanes = "auto"``).

    A loss-based sender (CUBIC, Reno) caps itself near MSS / RTT x 1.22 / sqrt(loss) on
    either. What tells them apart is the round trip when segments are lost: a full queue
    drops only once it holds its depth, and the smoothed round trip is then well above
    the link's floor (the emulated WAN: 80 ms floor, 100 ms of tbf queue); a lossy path
    that is not full loses segments at its floor. So the rule counts looks (every
    ``every_s`` while a chunk is sending) that saw new retransmissions with the smoothed
    round trip within ``queue_factor`` of the floor; one that saw them above it resets the
    count (a queue overflows: more flows would hurt), and ``need`` of them decide, once.
    Only losses while a chunk is sending count: a chunk's first look (``fresh``) sets the
    count of retransmissions to compare with. Between chunks a queue that overflowed at
    the end of the last one drains, and the next look would see its losses at the floor
    (the clean emulated WAN did that once before the rule was added). Measured both ways
    in docs/striped-links.md. Time and samples come in as arguments.

    ``queued`` counts the retransmissions of looks that saw a queue: the share of
    segments lost that sizes the lanes (``loss_share``) leaves them out, so a link whose
    first pushes overflowed a shared uplink is not taken for a very lossy path."""

    __slots__ = ("decided", "every_s", "need", "next_at", "queue_factor", "queued", "retrans",
                 "seen")

    def __init__(self, every_s: float = LOSS_PROBE_S, need: int = LOSS_SAMPLES,
                 queue_factor: float = QUEUE_FACTOR) -> None:
        self.every_s, self.need, self.queue_factor = every_s, need, queue_factor
        self.next_at = float("-inf")
        self.retrans: int | None = None  # retransmissions at the last look
        self.seen = 0  # looks with loss and no queue since the last with a queue
        self.queued = 0  # retransmissions seen by looks with a queue
        self.decided = False

    def due(self, now: float) -> bool:
        """Whether to look at the socket now (``sample``)."""
        return not self.decided and now >= self.next_at

    def sample(self, now: float, retrans: int, srtt_us: int, floor_us: int,
               fresh: bool = False) -> bool:
        """One look (``fresh``: the first of a chunk): True (once) when the link is found
        capped by random loss."""
        self.next_at = now + self.every_s
        last, self.retrans = self.retrans, retrans
        if fresh or last is None or retrans <= last or self.decided:
            return False
        if floor_us <= 0 or srtt_us > self.queue_factor * floor_us:
            self.seen = 0
            self.queued += retrans - last
            return False
        self.seen += 1
        if self.seen >= self.need:
            self.decided = True
        return self.decided
