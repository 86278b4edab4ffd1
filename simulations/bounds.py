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

from simulations.network import flow_ceiling, mbps
from simulations.scenario import TRAINER_SITE, Cpu, Scenario
from swarm.protocol.config import CoreConfig


@dataclass
class Bound:
    """The bound and each cut it is the maximum of (seconds), for the report.

    ``info`` holds figures that explain a gap but are not part of the bound
    (e.g. a region's inflow if it used only the protocol's few flows).
    """

    seconds: float
    terms: dict[str, float] = field(default_factory=dict)
    binding: str = ""
    info: dict[str, float] = field(default_factory=dict)


def flow_cap(sc: Scenario, a: str, b: str) -> float:
    """Per-flow TCP ceiling between sites ``a`` and ``b``, bytes/s: Mathis for loss-based
    congestion control (``inf``: no loss, or BBR; ``network.flow_ceiling``)."""
    if a == b:
        if a == TRAINER_SITE:
            return math.inf
        r = sc.region(a)
        return flow_ceiling(sc.congestion, sc.mss, 2 * r.latency_ms / 1000.0, r.loss)
    link = sc.link(a, b)
    return flow_ceiling(sc.congestion, sc.mss, 2 * link.latency_ms / 1000.0, link.loss)


def _hosts(sc: Scenario, site: str) -> int:
    """Hosts at ``site`` that can send: its nodes, plus the trainer if it sits there."""
    n = 0 if site == TRAINER_SITE else sc.region(site).nodes
    return n + (1 if site == sc.trainer_site() else 0)


def _through_cuts(sc: Scenario, region: str, t0: float, need: float) -> float:
    """Seconds from ``t0`` until ``need`` seconds of inflow fit outside ``region``'s cuts."""
    t = t0
    for cut in sorted((c for c in sc.faults.cuts if c.region == region), key=lambda c: c.start_s):
        end = cut.start_s + cut.duration_s
        if end <= t:
            continue
        if cut.start_s > t:
            if need <= cut.start_s - t:
                break
            need -= cut.start_s - t
        t = end
    return t + need - t0


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
    info: dict[str, float] = {}
    u_s = mbps(sc.trainer_uplink_mbps)
    trainer_site = sc.trainer_site()
    # the trainer can keep one TCP flow per peer: with per-flow caps that may be below u_s
    t_flows = sum(r.nodes * flow_cap(sc, trainer_site, r.name) for r in sc.regions)
    terms["trainer_uplink"] = F / min(u_s, t_flows)

    d_min = min(min(v) for v in downlinks.values() if v)
    terms["slowest_downlink"] = F / d_min

    k_flows = int(sc.protocol.get("border_nodes", CoreConfig.border_nodes))
    t0 = sc.start_s + sc.encode_s
    total_up = u_s
    c_ins: dict[str, float] = {}
    for region in sc.regions:
        r = region.name
        # a node uploads inside r over at most n_r - 1 flows, each under the intra-region cap
        intra = flow_cap(sc, r, r) * max(1, region.nodes - 1)
        up_r = sum(min(u, intra) for u in uplinks[r])
        total_up += sum(uplinks[r])
        if r == trainer_site:
            c_in = u_s  # the trainer sits inside r: its uplink is the inflow
            c_ins[r] = c_in
        else:
            c_in = 0.0
            per_flow = 0.0
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
                # at most one flow per (sender, receiver) pair, each under the Mathis cap
                fc = flow_cap(sc, a, r)
                cap = min(cap, _hosts(sc, a) * region.nodes * fc)
                per_flow = max(per_flow, fc)
                c_in += cap
            c_in = min(c_in, mbps(region.ingress_mbps))
            c_ins[r] = c_in
            # not a bound: r fed by the trainer's direct link alone (routing by topology)
            direct = min(mbps(sc.link(trainer_site, r).mbps), u_s, mbps(region.ingress_mbps),
                         region.nodes * flow_cap(sc, trainer_site, r))
            if trainer_site != TRAINER_SITE:
                direct = min(direct, mbps(sc.region(trainer_site).egress_mbps))
            info[f"direct_only[{r}]"] = F / direct
            terms[f"inflow[{r}]"] = _through_cuts(sc, r, t0, F / c_in)
            if per_flow != math.inf:
                # not a bound: the same region fed over only the protocol's border flows
                info[f"inflow_{k_flows}_flows[{r}]"] = F / min(c_in, k_flows * per_flow)
                # not a bound: the protocol moves a chunk over one TCP flow, so no chunk
                # enters r sooner than one chunk at the best per-flow ceiling into it
                info[f"chunk_one_flow[{r}]"] = min(sc.chunk_bytes, F) / per_flow
            if sc.slow_start:
                # not a bound: one chunk over a fresh connection on the shortest path into
                # r, slow start from the initial window (a first version's floor per chunk)
                rtt = 2 * min(sc.link(a, r).latency_ms for a in sc.sites if a != r) / 1000.0
                info[f"cold_chunk[{r}]"] = cold_chunk_s(min(sc.chunk_bytes, F), sc.mss,
                                                        sc.initial_window, rtt)
        terms[f"region_upload[{r}]"] = region.nodes * F / (up_r + c_in)
        if r != trainer_site and region.nodes > 1:
            # not a bound: with one copy let in, the region's own uploads carry (n_r - 1) F
            info[f"region_upload_one_copy[{r}]"] = (region.nodes - 1) * F / up_r
        cpu = region.cpu
        if not cpu.free:
            work = _chunk_work(sc, payload_bytes, cpu)
            terms[f"node_cpu[{r}]"] = work / cpu.cores
    n = sc.nodes
    terms["fleet_upload"] = n * F / total_up
    if sc.host_cores > 0:
        work = sum(r.nodes * _chunk_work(sc, payload_bytes, r.cpu) for r in sc.regions)
        terms["host_cpu"] = work / sc.host_cores

    remote = [r for r in sc.regions if r.name != trainer_site]
    if remote:
        # not a bound: every remote region's copy leaves the trainer's uplink (no relaying)
        t_out = u_s
        if trainer_site != TRAINER_SITE:
            t_out = min(u_s, mbps(sc.region(trainer_site).egress_mbps))
        info["all_direct"] = len(remote) * F / t_out
    binding = max(terms, key=lambda k: terms[k])
    flat = max(v for k, v in terms.items() if not k.startswith("inflow["))
    for cut in sc.faults.cuts:
        # not a bound: the whole transfer again once the cut heals (nothing let in before it)
        key = f"after_heal[{cut.region}]"
        after = cut.start_s + cut.duration_s - t0 + max(flat, F / max(1e-9, c_ins[cut.region]))
        info[key] = max(info.get(key, 0.0), after)
    latency = min_latency_s(sc)
    # the last chunk is hashed and stored after its last byte arrived: no overlap possible
    last = payload_bytes - (max(1, -(-payload_bytes // sc.chunk_bytes)) - 1) * sc.chunk_bytes
    tail = min(r.cpu.chunk_s(min(last, sc.chunk_bytes)) for r in sc.regions)
    extra = {"latency": latency}
    if tail:
        extra["last_chunk_cpu"] = tail
    if sc.encode_s:
        extra["encode"] = sc.encode_s
    return Bound(
        seconds=terms[binding] + sum(extra.values()),
        terms={**terms, **extra},
        binding=binding,
        info=info,
    )


def _chunk_work(sc: Scenario, payload_bytes: int, cpu: Cpu) -> float:
    """CPU seconds one node spends verifying and storing every chunk of the payload."""
    count = max(1, -(-payload_bytes // sc.chunk_bytes))
    last = payload_bytes - (count - 1) * sc.chunk_bytes
    return (count - 1) * cpu.chunk_s(sc.chunk_bytes) + cpu.chunk_s(last)


def cold_chunk_s(nbytes: float, mss: int, iw: int, rtt: float) -> float:
    """Seconds for a fresh TCP connection to deliver ``nbytes`` when its window starts at
    ``iw`` segments and doubles every round trip (slow start, no cap): the rounds needed,
    each one ``rtt``, the last counted as the one-way trip of its data only."""
    segments = math.ceil(nbytes / mss)
    if segments <= 0:
        return 0.0
    rounds = 0
    sent = 0
    while sent < segments:
        sent += iw << rounds
        rounds += 1
    return (rounds - 1) * rtt + rtt / 2


def min_latency_s(sc: Scenario) -> float:
    """Smallest one-way latency of any hop a byte can take (intra- or inter-site)."""
    lats = [r.latency_ms for r in sc.regions]
    lats += [link.latency_ms for link in sc.links.values()]
    return min(lats) / 1000.0 if lats else 0.0


def kumar_ross(F: float, u_s: float, uploads: list[float], d_min: float) -> float:
    """The original single-swarm bound ``max(F/u_s, F/d_min, N F / (u_s + sum u_i))``."""
    n = len(uploads)
    return max(F / u_s, F / d_min if d_min > 0 else math.inf, n * F / (u_s + sum(uploads)))
