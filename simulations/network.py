"""The modelled network: flow-level bandwidth sharing plus per-message latency.

Bandwidth
---------
Every capacity in the network is a :class:`Resource`: a node's uplink, a
node's downlink, a region's aggregate egress/ingress, a (src, dst) link
between two sites. A chunk transfer is a :class:`Flow` through the resources
on its path (sender uplink, [sender-region egress, pair link, receiver-region
ingress,] receiver downlink).

Sharing is processor sharing per resource: a resource of capacity ``C`` with
``n`` active flows offers each ``C/n``, and a flow runs at the minimum share
over its resources (and its own cap, e.g. the TCP loss ceiling). This is the
"bottleneck share" relaxation of max-min fairness: identical to max-min when
flows that share a resource have the same bottleneck (every exact validation
case, and homogeneous fleets), slightly pessimistic otherwise, because the
capacity a flow leaves unused on a non-bottleneck resource is not handed to
the others.

Why not global max-min: recomputing it on every flow start/finish touches
every flow (1.2M transfers x thousands of active flows at 10k nodes). Here a
change on a flow only changes the share of *its* resources, so only flows on
those resources are re-rated: O(flows per resource), i.e. a node's few upload
slots and pipelined downloads. Between changes every rate is constant, so each
flow's finish time is exact (fluid model: ``remaining / rate``) and scheduled
on the engine heap; a re-rate bumps the flow's token, leaving the old heap
entry stale.

Latency
-------
Control frames and connection set-up take the one-way latency of their path
(intra-region latency, or the pair latency between sites), FIFO per direction.
With ``loss > 0`` a frame is delayed by one retransmission timeout with that
probability, and a flow is capped at the Mathis et al. TCP ceiling
``MSS / (RTT * sqrt(2p/3))``. A chunk's last byte reaches the receiver one
latency after it left the sender.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from simulations.engine import Engine

INF = float("inf")
EXACT_FLOWS = 64  # more flows than this: a "crowded" resource, shared as cap/n
TOLERANCE = 0.01  # level/share moves smaller than this do not propagate further
MAX_EVALS = 64  # resource evaluations per flow change (max-min mode)


class Resource:
    """A capacity (bytes/s) shared equally by the flows crossing it."""

    __slots__ = ("bytes", "cap", "flows", "level", "name", "queued", "rated")

    def __init__(self, name: str, cap: float) -> None:
        self.name = name
        self.cap = cap
        self.flows: dict[Flow, None] = {}  # insertion-ordered set: deterministic iteration
        self.bytes = 0.0  # bytes carried by completed flows
        self.rated = cap  # bottleneck mode: the share its flows were last rated at
        self.level = INF  # max-min mode: water-filling level (INF: limits no flow)
        self.queued = False

    def share(self) -> float:
        n = len(self.flows)
        return self.cap / n if n else self.cap


class Flow:
    """One transfer of ``size`` bytes through ``resources``."""

    __slots__ = (
        "alive",
        "arg",
        "base",
        "cap",
        "done",
        "followers",
        "leader",
        "rate",
        "remaining",
        "resources",
        "size",
        "t",
        "token",
    )

    def __init__(
        self,
        size: float,
        resources: tuple[Resource, ...],
        cap: float,
        done: Callable[[Any], None],
        arg: Any,
        now: float,
    ) -> None:
        self.size = size
        self.remaining = float(size)
        self.resources = resources
        self.cap = cap
        self.done = done
        self.arg = arg
        self.rate = 0.0
        self.t = now
        self.token = 0
        self.alive = True
        self.leader: Flow | None = None  # this flow cannot run faster than its leader
        self.base = cap  # its own ceiling while it follows
        self.followers: list[Flow] | None = None


class FlowNet:
    """Incremental processor-sharing flow model driven by an :class:`Engine`."""

    def __init__(self, engine: Engine, sharing: str = "maxmin") -> None:
        if sharing not in ("maxmin", "bottleneck"):
            raise ValueError(f"sharing must be 'maxmin' or 'bottleneck', not {sharing!r}")
        self.engine = engine
        self.maxmin = sharing == "maxmin"
        self.active = 0
        self.completed = 0
        self._moved: dict[Flow, None] = {}  # leaders whose rate changed: followers to re-cap
        self._depth = 0

    # ------------------------------------------------------------------ flows
    def start(
        self,
        size: float,
        resources: tuple[Resource, ...],
        done: Callable[[Any], None],
        arg: Any = None,
        cap: float = INF,
    ) -> Flow:
        """Begin a transfer; ``done(arg)`` runs when its last byte has left."""
        now = self.engine.now
        flow = Flow(size, resources, cap, done, arg, now)
        for r in resources:
            r.flows[flow] = None
        self.active += 1
        self._reshare(resources, now, flow)
        return flow

    def cancel(self, flow: Flow) -> None:
        """Abort a transfer (peer gone, connection closed); ``done`` never runs."""
        if not flow.alive:
            return
        self._remove(flow)

    def set_cap(self, flow: Flow, cap: float) -> None:
        """Change one flow's own ceiling (a TCP window opening) and re-rate around it."""
        if flow.leader is not None:
            flow.base = cap
            cap = self._led(flow)
        self._set_cap(flow, cap)

    def _set_cap(self, flow: Flow, cap: float) -> None:
        if not flow.alive or cap == flow.cap:
            return
        flow.cap = cap
        self._reshare(flow.resources, self.engine.now, flow)

    def follow(self, flow: Flow, leader: Flow) -> None:
        """``flow`` forwards what ``leader`` brings in (a chunk sent on while it arrives):
        it runs no faster than ``leader`` does now, whatever its own share, until
        ``unfollow``. Its own ceiling (``set_cap``) still applies beneath."""
        if not flow.alive or not leader.alive or flow.leader is not None:
            return
        flow.leader, flow.base = leader, flow.cap
        if leader.followers is None:
            leader.followers = []
        leader.followers.append(flow)
        self._set_cap(flow, self._led(flow))

    def unfollow(self, flow: Flow) -> None:
        """``flow`` may run at its own ceiling again (what it forwards is all there)."""
        leader = flow.leader
        if leader is None:
            return
        flow.leader = None
        if leader.followers is not None and flow in leader.followers:
            leader.followers.remove(flow)
        self._set_cap(flow, flow.base)

    @staticmethod
    def _led(flow: Flow) -> float:
        leader = flow.leader
        if leader is None or not leader.alive:
            return flow.base
        return min(flow.base, max(leader.rate, 1.0))

    def set_capacity(self, resource: Resource, cap: float) -> None:
        """Change a capacity mid-run (slow-node faults) and re-rate its flows."""
        resource.cap = cap
        resource.rated = -1.0  # force an exact re-rate of every flow on it
        resource.level = -1.0
        self._reshare((resource,), self.engine.now)

    def progress(self, flow: Flow) -> float:
        """Bytes of ``flow`` delivered so far."""
        sent = flow.size - flow.remaining + flow.rate * (self.engine.now - flow.t)
        return min(max(sent, 0.0), flow.size)

    # -------------------------------------------------------------- internals
    def _remove(self, flow: Flow) -> None:
        if flow.followers:  # all it brings in is in: its followers may run at their own pace
            self._moved[flow] = None
        if flow.leader is not None:  # a follower that ends or is cancelled
            lf = flow.leader.followers
            if lf is not None and flow in lf:
                lf.remove(flow)
            flow.leader = None
        flow.alive = False
        flow.token += 1
        for r in flow.resources:
            del r.flows[flow]
        self.active -= 1
        self._reshare(flow.resources, self.engine.now)

    def _reshare(self, resources: tuple[Resource, ...], now: float, new: Flow | None = None) -> None:
        self._depth += 1
        try:
            if self.maxmin:
                self._reshare_maxmin(resources, now, new)
            else:
                self._reshare_bottleneck(resources, now, new)
        finally:
            self._depth -= 1
        if self._depth == 0 and self._moved:
            self._recap_followers()

    def _recap_followers(self) -> None:
        """Leaders changed rate: their followers' ceilings follow (bounded passes)."""
        for _ in range(64):
            moved, self._moved = self._moved, {}
            for leader in moved:
                for g in list(leader.followers or ()):
                    self._set_cap(g, self._led(g))
            if not self._moved:
                return
        self._moved = {}

    # ---- bottleneck-share mode: each resource offers cap/n to each of its flows
    def _reshare_bottleneck(self, resources: tuple[Resource, ...], now: float, new: Flow | None) -> None:
        """Re-rate the flows on the changed resources (crowded ones: past TOLERANCE only)."""
        touched: dict[Flow, None] = {}
        for r in resources:
            n = len(r.flows)
            share = r.cap / n if n else r.cap
            if n <= EXACT_FLOWS or abs(share - r.rated) > TOLERANCE * r.rated:
                r.rated = share
                touched.update(r.flows)
        if new is not None:
            touched[new] = None
        for f in touched:
            rate = f.cap
            for r in f.resources:
                n = len(r.flows)
                sh = r.cap / n if n else r.cap
                if sh < rate:
                    rate = sh
            self._set_rate(f, rate, now)

    # ---- max-min mode: water-filling levels, propagated locally
    def _level(self, r: Resource) -> float:
        """Water-filling level of ``r`` given what its flows can get elsewhere.

        A flow's demand at ``r`` is the smallest level of its *other* resources
        (and its own cap). If the demands fit in ``r.cap``, ``r`` limits no one:
        ``INF``. Otherwise the level ``L`` solves ``sum(min(d, L)) = cap``.
        Crowded resources use ``cap/n`` (they are everyone's bottleneck).
        """
        flows = r.flows
        n = len(flows)
        if n == 0:
            return INF
        cap = r.cap
        if n > EXACT_FLOWS:
            return cap / n
        if n == 1:  # the common case on a node's link: saturated only if the flow can go faster
            for f in flows:
                d = f.cap
                for q in f.resources:
                    if q is not r and q.level < d:
                        d = q.level
                return INF if d <= cap else cap
        demands = []
        total = 0.0
        for f in flows:
            d = f.cap
            for q in f.resources:
                if q is not r and q.level < d:
                    d = q.level
            demands.append(d)
            total += d
        if total <= cap:
            return INF
        demands.sort()
        rem = cap
        for i, d in enumerate(demands):
            share = rem / (n - i)
            if d >= share:
                return share
            rem -= d
        return INF  # unreachable: total > cap

    def _reshare_maxmin(self, resources: tuple[Resource, ...], now: float, new: Flow | None) -> None:
        """Recompute levels from the changed resources outwards, then re-rate.

        A resource whose level moved re-rates its flows; if it moved by more
        than ``TOLERANCE`` the resources of those flows are re-evaluated too
        (they may now give or take the difference), up to ``MAX_EVALS``
        evaluations per change. Smaller ripples are dropped: rates stay within
        about ``TOLERANCE`` of the max-min allocation, at O(neighbourhood) cost.
        """
        queue = list(resources)
        for r in queue:
            r.queued = True
        changed: dict[Resource, None] = {}
        i = 0
        while i < len(queue):
            r = queue[i]
            i += 1
            r.queued = False
            old = r.level
            lvl = self._level(r)
            if lvl == old:
                continue
            r.level = lvl
            changed[r] = None
            if i >= MAX_EVALS or (old != INF and lvl != INF and abs(lvl - old) <= TOLERANCE * old):
                continue
            for f in r.flows:
                for q in f.resources:
                    if q is not r and not q.queued:
                        q.queued = True
                        queue.append(q)
        for r in queue[i:]:
            r.queued = False
        touched: dict[Flow, None] = {}
        for r in changed:
            touched.update(r.flows)
        if new is not None:
            touched[new] = None
        for f in touched:
            rate = f.cap
            for q in f.resources:
                if q.level < rate:
                    rate = q.level
            if rate == INF:
                # no resource is saturated: the flow runs at its tightest capacity
                rate = min((q.cap for q in f.resources), default=INF)
                rate = min(rate, f.cap)
            self._set_rate(f, rate, now)

    def _set_rate(self, f: Flow, rate: float, now: float) -> None:
        if rate == f.rate and f.token:
            return
        if f.rate == INF:
            f.remaining = 0.0
        elif f.rate:
            f.remaining -= f.rate * (now - f.t)
            if f.remaining < 0.0:
                f.remaining = 0.0
        f.t = now
        f.rate = rate
        f.token += 1
        if f.followers:
            self._moved[f] = None
        if f.remaining <= 0.0 or rate == INF:
            self.engine.schedule(now, self._finish, (f, f.token))
        elif rate > 0.0:
            self.engine.schedule(now + f.remaining / rate, self._finish, (f, f.token))
        # rate == 0: stalled until some share changes

    def _finish(self, item: tuple[Flow, int]) -> None:
        f, token = item
        if token != f.token or not f.alive:
            return  # stale: the flow was re-rated or cancelled since
        f.remaining = 0.0
        for r in f.resources:
            r.bytes += f.size
        self.completed += 1
        self._remove(f)
        f.done(f.arg)


def mathis_cap(mss: float, rtt: float, loss: float) -> float:
    """TCP throughput ceiling under random loss ``p`` (Mathis et al. 1997), bytes/s.

    ``MSS / (RTT sqrt(2p/3))`` = ``MSS/RTT x C/sqrt(p)`` with ``C = sqrt(3/2) ~ 1.22``.
    """
    if loss <= 0.0 or rtt <= 0.0:
        return INF
    return mss / (rtt * math.sqrt(2.0 * loss / 3.0))


LOSS_BASED = ("cubic", "reno")
CONGESTION = (*LOSS_BASED, "bbr")


def flow_ceiling(congestion: str, mss: float, rtt: float, loss: float) -> float:
    """One TCP flow's ceiling from random loss, bytes/s, by congestion control.

    A loss-based algorithm (``cubic``, ``reno``) takes each loss for congestion: the Mathis
    ceiling (``mathis_cap``). ``bbr`` paces at the bottleneck rate it measures and does not
    back off on random loss: no ceiling here. Measured on an emulated 100 Mbit/s path with
    150 ms RTT and 0.1 % loss (``benchmarks/bench_lossy_path.py``): Reno 3.7 Mbit/s in
    steady state (Mathis: 3.0), CUBIC 6.2, BBR ~0.75 of the lossless rate, so the model is
    optimistic for BBR on lossy links by up to that factor.
    """
    if congestion == "bbr":
        return INF
    return mathis_cap(mss, rtt, loss)


def mbps(x: float) -> float:
    """Megabits per second -> bytes per second (``inf`` stays ``inf``)."""
    return x * 1e6 / 8.0
