"""Turn a :class:`Scenario` into concrete capacities and latencies for one run.

Per-node bandwidths are drawn here, once, from a seeded RNG (stragglers
included), so the flow bound and the simulated network see the same numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from simulations.network import INF, Resource, flow_ceiling, mbps
from simulations.scenario import TRAINER_SITE, Scenario
from swarm.protocol.stripes import lanes_for_loss


@dataclass
class Endpoint:
    """Where a node sits and the two capacities it owns."""

    site: str
    up: Resource
    down: Resource


@dataclass
class Topology:
    scenario: Scenario
    # (src site, dst site) -> resources a cross-site flow crosses between the two nodes
    paths: dict[tuple[str, str], tuple[Resource, ...]] = field(default_factory=dict)
    # (src site, dst site) -> one-way latency, seconds (same site: intra-region latency)
    latency: dict[tuple[str, str], float] = field(default_factory=dict)
    # (src site, dst site) -> per-flow TCP loss ceiling, bytes/s
    flow_cap: dict[tuple[str, str], float] = field(default_factory=dict)
    # (src site, dst site) -> random packet loss on that path
    loss: dict[tuple[str, str], float] = field(default_factory=dict)
    links: dict[tuple[str, str], Resource] = field(default_factory=dict)
    egress: dict[str, Resource] = field(default_factory=dict)
    ingress: dict[str, Resource] = field(default_factory=dict)
    # (src site, dst site) -> (resource, seconds): queues a message waits in while busy
    queues: dict[tuple[str, str], tuple[tuple[Resource, float], ...]] = field(default_factory=dict)

    @classmethod
    def build(cls, sc: Scenario) -> Topology:
        topo = cls(sc)
        sites = sc.sites
        for r in sc.regions:
            if r.egress_mbps != INF:
                topo.egress[r.name] = Resource(f"egress[{r.name}]", mbps(r.egress_mbps))
            if r.ingress_mbps != INF:
                topo.ingress[r.name] = Resource(f"ingress[{r.name}]", mbps(r.ingress_mbps))
        intra = {r.name: r.latency_ms / 1000.0 for r in sc.regions}
        intra.setdefault(TRAINER_SITE, 0.0)
        intra_loss = {r.name: r.loss for r in sc.regions}
        intra_loss.setdefault(TRAINER_SITE, 0.0)
        for a in sites:
            for b in sites:
                if a == b:
                    topo.latency[(a, b)] = intra[a]
                    topo.loss[(a, b)] = intra_loss[a]
                    topo.flow_cap[(a, b)] = flow_ceiling(sc.congestion, sc.mss, 2 * intra[a],
                                                         intra_loss[a])
                    continue
                link = sc.link(a, b)
                res: list[Resource] = []
                if a in topo.egress:
                    res.append(topo.egress[a])
                if link.mbps != INF:
                    lr = Resource(f"link[{a}->{b}]", mbps(link.mbps))
                    topo.links[(a, b)] = lr
                    res.append(lr)
                if b in topo.ingress:
                    res.append(topo.ingress[b])
                topo.paths[(a, b)] = tuple(res)
                q = []
                if a in topo.egress and sc.region(a).queue_ms:
                    q.append((topo.egress[a], sc.region(a).queue_ms / 1000.0))
                if b in topo.ingress and sc.region(b).queue_ms:
                    q.append((topo.ingress[b], sc.region(b).queue_ms / 1000.0))
                if q:
                    topo.queues[(a, b)] = tuple(q)
                lat = link.latency_ms / 1000.0
                topo.latency[(a, b)] = lat
                topo.loss[(a, b)] = link.loss
                # a flow's RTT: this link's one-way latency there and back; a link striped
                # over ``lanes`` connections has as many ceilings (Scenario.lanes; "auto":
                # only a link that loses segments at random, as many as its loss calls
                # for, as a node's probe finds: stripes.lanes_for_loss)
                if not sc.lanes_auto:
                    lanes = sc.lanes
                else:
                    lanes = lanes_for_loss(link.loss) if link.loss > 0 else 1
                topo.flow_cap[(a, b)] = lanes * flow_ceiling(sc.congestion, sc.mss, 2 * lat,
                                                             link.loss)
        return topo

    def queue_delay(self, src: str, dst: str) -> float:
        """Queueing delay now between two sites: the busy shaped uplinks on the way."""
        q = self.queues.get((src, dst))
        if not q:
            return 0.0
        return sum(d for r, d in q if r.flows)

    def flow_resources(self, src: Endpoint, dst: Endpoint) -> tuple[Resource, ...]:
        if src.site == dst.site:
            return (src.up, dst.down)
        return (src.up, *self.paths[(src.site, dst.site)], dst.down)


def draw_capacities(sc: Scenario, rng: random.Random) -> dict[str, list[tuple[float, float]]]:
    """Region -> list of (uplink, downlink) bytes/s per node, stragglers applied."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in sc.regions:
        caps = []
        for _ in range(r.nodes):
            up = mbps(r.uplink.draw(rng))
            down = mbps(r.downlink.draw(rng))
            if r.straggler_fraction and rng.random() < r.straggler_fraction:
                up *= r.straggler_factor
                down *= r.straggler_factor
            caps.append((up, down))
        out[r.name] = caps
    return out
