"""A flow lower bound on fanout time, after Kumar & Ross (2006), extended to regions.

Setting: one source (the trainer, uplink ``u_s``) holds a file of ``F`` bytes;
``N`` nodes with uplinks ``u_i`` and downlinks ``d_i`` sit in regions; sites
(regions and the trainer's own site) are joined by directed links of capacity
``l(a, b)``; a region may also have an aggregate egress ``e_r`` and ingress
``g_r``. Every node must end up holding all ``F`` bytes. Any schedule,
however clever, obeys these cuts (each is "bytes that must cross / capacity
of the cut"), so the fanout time ``T`` is at least each of them:

1. **Trainer uplink**: ``F / u_s``. Every byte exists first at the trainer;
   each must leave it at least once.
2. **Slowest downlink**: ``F / d_min``. That node must take in ``F``.
3. **Region inflow** (one per region ``r`` without the trainer): every byte must
   enter ``r`` at least once, through the links into ``r``:
   ``F / min(g_r, sum_{a != r} min(l(a, r), e_a, [u_s if a is the trainer's site]))``.
   This also covers *every inter-region link* that is the only way in.
4. **In-region upload capacity** (Kumar-Ross within a region): the ``n_r`` nodes of
   ``r`` must receive ``n_r F`` bytes in total; each byte is uploaded by a node of
   ``r`` or crosses the inflow cut of (3): ``n_r F / (sum_{i in r} u_i + C_in(r))``.
5. **Fleet upload capacity** (Kumar-Ross over the whole fleet):
   ``N F / (u_s + sum_i u_i)``.

Pure flow cuts ignore latency; adding the smallest one-way latency any byte
must travel (the last byte still has to cross one hop after it leaves its
bottleneck) keeps the bound valid, so it is added. The store-and-forward
pipeline term of Mundinger et al., ``(c/u) log2 N``, is *not* included: it is
only optimal-schedule folklore for homogeneous swarms, not a cut.

The bound is a property of the scenario, not of the strategy: it says what any
schedule could do on this network. ``direct`` and ``per-region`` are measured
against the same bound and show how far their restrictions cost.
Capacities used are the per-node values actually drawn for the run
(stragglers included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulations.network import mbps
from simulations.scenario import TRAINER_SITE, Scenario


@dataclass
class Bound:
    """The bound and each cut it is the maximum of (seconds), for the report."""

    seconds: float
    terms: dict[str, float] = field(default_factory=dict)
    binding: str = ""


def lower_bound(
    sc: Scenario,
    payload_bytes: int,
    uplinks: dict[str, list[float]],
    downlinks: dict[str, list[float]],
) -> Bound:
    """Bound for ``payload_bytes`` on ``sc``'s network.

    ``uplinks`` / ``downlinks`` map region name -> the per-node capacities in
    bytes/s drawn for this run.
    """
    F = float(payload_bytes)
    terms: dict[str, float] = {}
    u_s = mbps(sc.trainer_uplink_mbps)
    trainer_site = sc.trainer_site()
    terms["trainer_uplink"] = F / u_s

    d_min = min(min(v) for v in downlinks.values() if v)
    terms["slowest_downlink"] = F / d_min

    total_up = u_s
    for region in sc.regions:
        r = region.name
        up_r = sum(uplinks[r])
        total_up += up_r
        if r == trainer_site:
            c_in = u_s  # the trainer sits inside r: its uplink is the inflow
        else:
            c_in = 0.0
            for a in sc.sites:
                if a == r:
                    continue
                cap = mbps(sc.link(a, r).mbps)
                if a == TRAINER_SITE:
                    cap = min(cap, u_s)
                else:
                    cap = min(cap, mbps(sc.region(a).egress_mbps))
                    if a == trainer_site:
                        cap = min(cap, u_s + sum(uplinks[a]))
                    else:
                        cap = min(cap, sum(uplinks[a]))
                c_in += cap
            c_in = min(c_in, mbps(region.ingress_mbps))
            terms[f"inflow[{r}]"] = F / c_in
        terms[f"region_upload[{r}]"] = region.nodes * F / (up_r + c_in)
    n = sc.nodes
    terms["fleet_upload"] = n * F / total_up

    binding = max(terms, key=lambda k: terms[k])
    latency = min_latency_s(sc)
    return Bound(
        seconds=terms[binding] + latency, terms={**terms, "latency": latency}, binding=binding
    )


def min_latency_s(sc: Scenario) -> float:
    """Smallest one-way latency of any hop a byte can take (intra- or inter-site)."""
    lats = [r.latency_ms for r in sc.regions]
    lats += [link.latency_ms for link in sc.links.values()]
    return min(lats) / 1000.0 if lats else 0.0


def kumar_ross(F: float, u_s: float, uploads: list[float], d_min: float) -> float:
    """The original single-swarm bound ``max(F/u_s, F/d_min, N F / (u_s + sum u_i))``."""
    n = len(uploads)
    return max(F / u_s, F / d_min if d_min > 0 else math.inf, n * F / (u_s + sum(uploads)))
