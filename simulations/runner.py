"""Run one scenario under one or several strategies and compute their figures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from simulations.bounds import lower_bound
from simulations.driver import RunResult, Simulation
from simulations.scenario import Scenario
from simulations.timeline import Timeline


def run_strategy(
    sc: Scenario,
    strategy: str,
    seed: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    timeline: Timeline | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Simulate ``strategy`` on ``sc``; return the raw tallies and the report figures.
    ``timeline``: filled with its version's transfers and decisions as the run goes."""
    from simulations.report import figures

    sim = Simulation(sc, strategy, seed=seed, progress=progress)
    sim.timeline = timeline
    result = sim.run()
    ups = {r: [u for u, _ in caps] for r, caps in sim.capacities.items()}
    downs = {r: [d for _, d in caps] for r, caps in sim.capacities.items()}
    bound = lower_bound(sc, sim.payload, ups, downs)
    return result, figures(sc, result, bound)
