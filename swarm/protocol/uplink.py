"""How many chunks the origin keeps in flight through its site uplink, by measurement.

Pushes into remote regions (and relays by the origin's own region's borders) leave
through the origin's site uplink. A push holds its place in the window until its
last byte has left the origin (a relay until its HAVE): waiting for the HAVE, a
round trip after the last byte, would leave the uplink idle between chunks. Too
few at once and a per-flow TCP ceiling (long lossy links) caps the uplink; too
many and they share it, all arrive late and together, and the regions that would
relay them on idle meanwhile. The origin does not know the right number.

``UplinkWindow`` finds it the way BBR's start-up does, at chunk granularity: a
*round* is ``w`` deliveries while the window is full; its delivery rate is bytes
delivered over the round's duration. While a round's rate beats the best by
``startup_gain`` the window doubles; start-up ends after ``full_rounds`` (2) rounds in a
row that do not (BBR waits for three: the origin's pushes into a region stay on its warm
connection, so one doubling may stack pushes on a border's downlink and pay nothing, and
the next spread them over more borders and pay). Then it settles at the window of the
best rate (a larger window of a round that did not pay takes over only by
``probe_gain``, so a thin uplink keeps few in flight) and every ``hold`` rounds probes
one more, kept only if the rate grows by
``probe_gain``, or (every other probe) one less, kept if the rate stays within
``1 / probe_gain`` (fewer in flight, each chunk sooner). Deliveries while the window is not full (nothing more to send)
say nothing about the uplink and restart the round.

After the window changes, the next round is timed from the first delivery of a
transfer sent mostly under it (as BBR counts a round from the first packet sent after
a change): a HAVE comes a round trip after its chunk left, so right after the window
doubles the next deliveries are still those of the smaller window. Timed from them, a
doubling that did pay (a fleet whose pushes are capped by each border's downlink, not
by the uplink) looked like none, and start-up stopped at its first step. "Mostly", not
"started after": where one chunk takes many seconds to send (a long lossy link) the
pushes under way at the change are the new window's.

Start-up doubles only a window the origin has transfers to fill (``backlog``), as BBR
does not grow on rounds the application limits; the doubling after a round that did not
pay (a probe) only where the version has the transfers to time a round at twice the
window (more than ``2 w`` left), since ``restart`` takes back a probe never timed (the
emulated WAN, round 40: 8 in flight for a second version's last 7-8 pushes). Near a
version's end a round may close with two chunks left to cross; doubled there, the window
became a probe never carried, and as the window is kept across versions the next version
started with it: on a thin uplink, eight pushes at once that all arrived late (the
simulator's `wan-3x4`: a second version took 8.07 s, the first 7.58). Between versions
the uplink is idle: ``restart`` times the next round from the new version's transfers,
not across the gap, and ends a start-up that has seen a round not pay at the best window
measured.

Where the site uplink is fat, a round timed by HAVEs is slow to come: on ``fleet-10k``
(60 ms between sites) the first HAVE is back ~0.15 s after the first push, and the window
went 5 → 10 → 20 at 0.19 and 0.40 s while the 10 Gbit/s uplink ran half empty and the
regions' downlinks waited for chunks to spread. So start-up also runs on *departures*
(``left``): while every push leaves the origin within ``fast_startup_s`` (0.2 s: 4 MiB at
over 168 Mbit/s, each push capped by its border's downlink, not by the uplink), each
departure of a push while the window was full opens the window by ``departure_step``
(``fast_startup_step``, 2): the window triples once per push time, as the pushes leave
(round 43 opened it by one, as each ACK does TCP's window in slow start, so it doubled:
5 → 10 → 20 at 0.04 and 0.10 s on fleet-1k; until round 42 it doubled only once a round of
``w`` departures had been timed: 5 → 10 → 20 → 40 at 0.07, 0.18 and 0.29 s;
docs/simulation.md rounds 43 and 49). Rounds are still timed, as many departures in a row as the
window held when the round began, to end it: a round whose departure rate does not beat
the best by ``startup_gain`` counts as flat (more pushes may stack on busy borders before
the next spread them); two flat rounds in a row end it, as does a push that takes
``fast_startup_s`` to leave or is still leaving after as long (a thin uplink, a slow direct
path: `wan-3x4`, `slow-direct`, where it never grows or stops at the first slow push). The
HAVE rounds go on beside it, and end the start-up as before. Where the origin's own uplink
is a saturated queue the rounds stop paying while the window still grows, so there the
start-up runs until a push has waited ``fast_startup_s``: at most that much of the uplink's
pushes queued (docs/simulation.md round 43 has a model of it).
"""

from __future__ import annotations


class UplinkWindow:
    __slots__ = ("best", "best_w", "dep_best", "dep_flat", "dep_n", "dep_on", "dep_start",
                 "dep_step", "dep_w", "down", "flat", "full_rounds", "hi", "hold", "last_rate", "lo", "n", "nbytes",
                 "probe_gain", "probing", "rounds", "since", "start", "startup", "startup_gain",
                 "w")

    def __init__(self, lo: int, hi: int, *, startup_gain: float = 1.25,
                 probe_gain: float = 1.1, hold: int = 4, full_rounds: int = 2,
                 departure_step: int = 1) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"uplink window bounds {lo}..{hi}")
        if departure_step < 1:
            raise ValueError(f"uplink window departure step {departure_step}")
        self.lo, self.hi = lo, hi
        self.startup_gain, self.probe_gain, self.hold = startup_gain, probe_gain, hold
        self.w = lo
        self.best = 0.0  # bytes/s of the last round at best_w
        self.last_rate = 0.0  # bytes/s (or pushes/s on departures) of the last round timed
        self.best_w = lo
        self.startup = True
        self.full_rounds = full_rounds
        self.flat = 0  # start-up rounds in a row that did not beat the best by startup_gain
        self.probing = False
        self.down = False  # the next probe is one less
        self.rounds = 0  # rounds since the last probe
        self.start: float | None = None
        self.n = 0
        self.nbytes = 0
        self.since = float("-inf")  # when ``w`` last changed (``delivered``)
        # start-up on departures (``left``): on until a push leaves slowly
        self.dep_on = True
        self.dep_start: float | None = None
        self.dep_n = 0
        self.dep_best = 0.0  # pushes/s of the best departure round
        self.dep_flat = 0  # departure rounds in a row that did not beat it
        self.dep_w = lo
        self.dep_step = departure_step  # places opened per departure while the window is full

    def raise_floor(self, n: int) -> None:
        """At least ``n`` in flight from now on (``lo``), the window and its best with it."""
        n = min(n, self.hi)
        if n > self.lo:
            self.lo = n
            self.w = max(self.w, n)
            self.best_w = max(self.best_w, n)

    def restart(self, now: float) -> None:
        """The uplink carried nothing for a while (between versions): the next round is
        timed from the first transfer sent from ``now`` on, not across the gap. A start-up
        that has seen a round not pay ends here, at the best window measured: the window
        it doubled to after that round was not measured whole, and a window larger than
        a version's transfers can keep full is never measured at all (its rounds never
        complete), so it would stay for every version after."""
        self.start, self.n, self.nbytes = None, 0, 0
        self.since = now
        if self.startup and self.flat:
            self.startup = False
            self.w = self.best_w

    @property
    def on_departures(self) -> bool:
        """Whether start-up still grows on departures (``left``)."""
        return self.startup and self.dep_on

    def left(self, now: float, issued: float, fast_s: float, full: bool,
             backlog: int | None = None, oldest: float | None = None) -> None:
        """A push's last byte left the origin; it was issued at ``issued``; ``oldest``:
        when the oldest push still leaving was issued; ``full``: the window was full.
        Start-up on departures (module docstring): each departure while the window was
        full (and ``backlog`` can fill one more) opens it by one, whenever its push was
        issued; as many departures in a row as the window held when the round began make
        a round, and two rounds in a row that do not beat the best departure rate by
        ``startup_gain`` end it. A push that took ``fast_s`` or longer to leave, or one
        still leaving after as long, ends it for good; the HAVE rounds (``delivered``) go
        on as before."""
        if not self.on_departures:
            return
        if now - issued >= fast_s or (oldest is not None and now - oldest >= fast_s):
            self.dep_on = False
            return
        if not full:
            return
        if self.w < self.hi and (backlog is None or backlog >= self.w):
            # more per departure while the window was full (slow start: one)
            self.w = min(self.hi, self.w + self.dep_step)
        if self.dep_start is None:
            # the round is timed from a departure, over as many as the window was then
            self.dep_start, self.dep_n, self.dep_w = now, 0, self.w
            return
        self.dep_n += 1
        if self.dep_n < self.dep_w or now <= self.dep_start:
            return
        rate = self.dep_n / (now - self.dep_start)
        self.last_rate = rate
        self.dep_start, self.dep_n = None, 0
        if rate >= self.dep_best * self.startup_gain:
            self.dep_best, self.dep_flat = rate, 0
        else:
            self.dep_flat += 1  # more in flight may stack on busy borders: one more round
        if self.dep_flat >= self.full_rounds or self.w >= self.hi:
            self.dep_on = False
            return
        # a HAVE round counts transfers sent mostly from now on (``delivered``)
        self.since = now
        self.start = None

    def delivered(self, nbytes: int, now: float, full: bool,
                  started: float | None = None, sent: float | None = None,
                  backlog: int | None = None) -> None:
        """A transfer through the uplink was confirmed (HAVE). ``full``: the window was
        full just before it (the uplink was kept as busy as the window allows).
        ``started`` / ``sent``: when it began and when its last byte left (``now`` if
        unknown). After the window changed, the round is timed from the first transfer
        that spent most of its sending under the new window: one sent mostly before
        measures the old window. ``backlog``: transfers still waiting to cross the uplink
        (None: unknown, as many as the window takes); start-up doubles only a window it
        can fill."""
        if self.start is None and started is not None:
            end = now if sent is None else sent
            if end - self.since < (end - started) / 2:
                return  # sent mostly under the window before
        if not full:
            self.start, self.n, self.nbytes = now, 0, 0
            return
        if self.start is None:
            self.start = now  # the round is timed from a delivery
            return
        self.n += 1
        self.nbytes += nbytes
        if self.n < self.w or now <= self.start:
            return
        rate = self.nbytes / (now - self.start)
        self.last_rate = rate
        self.start, self.n, self.nbytes = now, 0, 0
        w = self.w
        self._round(rate, backlog)
        if self.w != w:
            self.since = now  # the next round starts with a transfer sent mostly from now on
            self.start = None

    def _round(self, rate: float, backlog: int | None = None) -> None:
        if self.startup:
            # twice the window needs ``w`` more transfers than are under way now
            grow = backlog is None or backlog >= self.w
            if rate >= self.best * self.startup_gain and self.w < self.hi:
                self.best, self.best_w = rate, self.w
                self.flat = 0
                if grow:
                    self.w = min(self.hi, self.w * 2)
                return
            # A round that did not pay: a larger window takes over the best only by a
            # clear gain (``probe_gain``), so a thin uplink settles at few in flight.
            self.flat += 1
            if rate >= self.best * self.probe_gain:
                self.best, self.best_w = rate, self.w
            if self.flat < self.full_rounds and self.w < self.hi:
                # The doubling after a round that did not pay is a probe, and ``restart``
                # takes back an untimed probe at the version's end: made with too few
                # transfers left to time a round at twice the window, it only crowds the
                # version's last chunks onto the uplink (the emulated WAN: 8 in flight for
                # a second version's last 7-8 pushes, round 40)
                if grow and (backlog is None or backlog > 2 * self.w):
                    self.w = min(self.hi, self.w * 2)
                return
            self.startup = False
            self.w = self.best_w
            return
        if self.probing:
            self.probing = False
            keep = rate >= self.best * (1 / self.probe_gain if self.w < self.best_w
                                        else self.probe_gain)
            if keep:
                self.best, self.best_w = rate, self.w
            else:
                self.w = self.best_w
            return
        if self.w == self.best_w:
            self.best = rate  # conditions move: compare probes with the latest rate
        self.rounds += 1
        if self.rounds >= self.hold:
            self.rounds = 0
            self.down = not self.down
            step = -1 if self.down else 1
            if self.lo <= self.w + step <= self.hi:
                self.probing = True
                self.w += step
