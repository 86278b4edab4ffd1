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
EXACT_FLOWS = 64  # resources with at most this many flows are re-rated exactly on every change
TOLERANCE = 0.005  # crowded resources: re-rate their flows when the share moved by more


class Resource:
    """A capacity (bytes/s) shared equally by the flows crossing it."""

    __slots__ = ("bytes", "cap", "flows", "name", "rated")

    def __init__(self, name: str, cap: float) -> None:
        self.name = name
        self.cap = cap
        self.flows: dict[Flow, None] = {}  # insertion-ordered set: deterministic iteration
        self.bytes = 0.0  # bytes carried by completed flows
        self.rated = cap  # the share its flows were last rated at

    def share(self) -> float:
        n = len(self.flows)
        return self.cap / n if n else self.cap


class Flow:
    """One transfer of ``size`` bytes through ``resources``."""

    __slots__ = (
        "alive",
        "arg",
        "cap",
        "done",
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


class FlowNet:
    """Incremental processor-sharing flow model driven by an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active = 0
        self.completed = 0

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

    def set_capacity(self, resource: Resource, cap: float) -> None:
        """Change a capacity mid-run (slow-node faults) and re-rate its flows."""
        resource.cap = cap
        resource.rated = -1.0  # force an exact re-rate of every flow on it
        self._reshare((resource,), self.engine.now)

    def progress(self, flow: Flow) -> float:
        """Bytes of ``flow`` delivered so far."""
        sent = flow.size - flow.remaining + flow.rate * (self.engine.now - flow.t)
        return min(max(sent, 0.0), flow.size)

    # -------------------------------------------------------------- internals
    def _remove(self, flow: Flow) -> None:
        flow.alive = False
        flow.token += 1
        for r in flow.resources:
            del r.flows[flow]
        self.active -= 1
        self._reshare(flow.resources, self.engine.now)

    def _reshare(self, resources: tuple[Resource, ...], now: float, new: Flow | None = None) -> None:
        """Re-rate the flows whose share may have changed.

        A resource with few flows re-rates all of them (exact). A crowded one
        (more than ``EXACT_FLOWS``) re-rates them only once its share has moved
        more than ``TOLERANCE`` since it last did; in between, its flows keep
        their rate (error < TOLERANCE) and only a newly started flow is rated.
        This bounds the cost of a change on, say, an inter-region link carrying
        thousands of flows to O(1/TOLERANCE) amortised instead of O(flows).
        """
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
            self._rerate(f, now)

    def _rerate(self, f: Flow, now: float) -> None:
        rate = f.cap
        for r in f.resources:
            n = len(r.flows)
            s = r.cap / n if n else r.cap
            if s < rate:
                rate = s
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
    """TCP throughput ceiling under random loss ``p`` (Mathis et al. 1997), bytes/s."""
    if loss <= 0.0 or rtt <= 0.0:
        return INF
    return mss / (rtt * math.sqrt(2.0 * loss / 3.0))


def mbps(x: float) -> float:
    """Megabits per second -> bytes per second (``inf`` stays ``inf``)."""
    return x * 1e6 / 8.0
