"""Faults injected into a run: churn, joiners, region cuts, nodes turning slow.

All times and victims are drawn from a seeded RNG of their own, so adding a
fault never shifts the randomness of anything else, and the same seed gives
the same victims.

- **Churn**: ``churn`` x N nodes (never the trainer) leave at uniform times in
  ``churn_window_s``; with ``rejoin`` each comes back ``downtime_s`` later as
  a restarted daemon that resumes from its store (``LocalChunks``).
- **Joiners**: ``joiners`` x N fresh nodes (holding only the base version)
  start at uniform times in the window, in regions drawn by region size.
- **Region cut**: for ``duration_s`` every connection crossing the region's
  border drops and new ones time out; inside the region nothing changes.
- **Slow nodes**: at ``slow_at_s`` a share of nodes drops to ``factor`` times
  its uplink and downlink (a degraded NIC, a noisy neighbour).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.driver import SimNode, Simulation


def schedule_faults(sim: Simulation) -> None:
    sc = sim.sc
    f = sc.faults
    rng = random.Random(f"faults:{sim.seed}")
    eng = sim.engine
    fleet = sim.nodes[1:]
    lo, hi = f.churn_window_s

    if f.churn > 0:
        victims = rng.sample(fleet, round(f.churn * len(fleet)))
        for node in victims:
            t = rng.uniform(lo, hi)
            sim.pending_faults += 1
            eng.schedule(t, _leave, (sim, node, f.rejoin, f.downtime_s))

    if f.joiners > 0:
        names = [r.name for r in sc.regions]
        weights = [r.nodes for r in sc.regions]
        for _ in range(round(f.joiners * len(fleet))):
            region = rng.choices(names, weights)[0]
            ri = names.index(region)
            spec = sc.regions[ri]
            up = spec.uplink.draw(rng) * 1e6 / 8
            down = spec.downlink.draw(rng) * 1e6 / 8
            node = sim.add_node(ri, region, up, down)
            sim.pending_faults += 1
            eng.schedule(rng.uniform(lo, hi), _join, (sim, node))

    for cut in f.cuts:
        sim.pending_faults += 1
        eng.schedule(cut.start_s, _cut, (sim, cut.region))
        eng.schedule(cut.start_s + cut.duration_s, _heal, (sim, cut.region))

    if f.slow_fraction > 0:
        slow = rng.sample(fleet, round(f.slow_fraction * len(fleet)))
        eng.schedule(f.slow_at_s, _slow_down, (sim, slow, f.slow_factor))


def _leave(item: tuple[Any, ...]) -> None:
    sim, node, rejoin, downtime = item
    sim.churn["left"] += 1
    if rejoin:
        sim.kill(node)
        sim.engine.schedule(sim.engine.now + downtime, _rejoin, (sim, node))
    else:
        sim.pending_faults -= 1
        sim.kill(node)


def _rejoin(item: tuple[Any, ...]) -> None:
    sim, node = item
    sim.churn["rejoined"] += 1
    sim.pending_faults -= 1
    sim.revive(node)


def _join(item: tuple[Simulation, SimNode]) -> None:
    sim, node = item
    sim.churn["joined"] += 1
    sim.pending_faults -= 1
    sim.join(node)


def _cut(item: tuple[Simulation, str]) -> None:
    sim, region = item
    sim.sever(region)


def _heal(item: tuple[Simulation, str]) -> None:
    sim, region = item
    sim.pending_faults -= 1
    sim.heal(region)
    sim.check_finished()


def _slow_down(item: tuple[Any, ...]) -> None:
    sim, nodes, factor = item
    for node in nodes:
        sim.net.set_capacity(node.ep.up, node.ep.up.cap * factor)
        sim.net.set_capacity(node.ep.down, node.ep.down.cap * factor)
