"""The simulator's prediction for a run of ``benchmarks/bench_wan.py``, calibrated that day.

The emulated WAN runs every host and every delay holder on one small machine, so
how fast that machine is that day (it varies about 2x here) moves the emulated
fanout through CPU: hashing, TLS, the store, the apply. The network does not
move. ``configs/sim/wan-3x4.toml`` models the same network with a CPU per byte
measured once; ``emulated_wan`` re-reads that file and sets what the bench
measured in the same run instead:

- ``apply_mb_s`` from the nodes' own apply CPU after the last chunk (``/status``
  ``apply_split``: the applying thread's CPU; what a node decoded while the patch
  downloaded is in the rest, as the simulator charges no decode ahead);
- ``io_mb_s`` from the nodes' median CPU-seconds per GB received (everything a
  received byte costs besides its hash, the per-chunk overhead and the apply;
  the hash rate and overhead stay as the file has them);
- ``encode_s`` from the median hand-off (publish call to the swarm);
- the payload and chunk size;
- the one-way delay and the random loss between regions (``--delay-ms``, ``--loss``:
  the file's links are the bench's inter-region paths; round 23).

Only the bench's default shape (3 regions x 4 hosts, the uplink of the file) maps
onto the file; another shape returns None.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from simulations.network import CONGESTION
from simulations.runner import run_strategy
from simulations.scenario import Scenario, load_scenario
from swarm.protocol.stripes import AUTO_LANES

SCENARIO = Path(__file__).resolve().parent.parent / "configs" / "sim" / "wan-3x4.toml"


def emulated_wan(*, size_bytes: int, chunk_bytes: int, handoff_s: float,
                 node_cpu_s_per_gb: float, apply_cpu_s_per_gb: float, regions: int = 3, hosts_per_region: int = 4,
                 uplink_mbit: float = 100.0, delay_ms: float = 40.0, loss: float = 0.0,
                 lanes: int | str = 1, congestion: str = "bbr",
                 warm_up_kib: int | None = None,
                 path: Path = SCENARIO) -> Scenario | None:
    """``path``'s scenario with the run's measured CPU, hand-off and payload, and the
    bench's inter-region delay, loss, lanes and congestion control on its links, and its
    ``warm_up_kib`` for the origin and every node where it set one (None: as shipped, the
    origin's on and a node's off); None if the bench's shape is not the file's."""
    sc = load_scenario(path)
    hosts = {r.name: r.nodes for r in sc.regions}
    want = {r.name: hosts_per_region - (r.name == sc.trainer_region) for r in sc.regions}
    if (regions != len(sc.regions) or hosts != want or not 0 <= loss < 0.5 or delay_ms <= 0
            or any(r.egress_mbps != uplink_mbit or r.ingress_mbps != uplink_mbit
                   for r in sc.regions)):
        return None
    links = {k: dataclasses.replace(x, latency_ms=delay_ms, loss=loss)
             for k, x in sc.links.items()}
    cpu = sc.regions[0].cpu
    per_gb = 1e3 / cpu.hash_mb_s + apply_cpu_s_per_gb \
        + cpu.chunk_overhead_ms / 1e3 * (1e9 / chunk_bytes)
    rest = node_cpu_s_per_gb - per_gb
    if rest <= 0 or apply_cpu_s_per_gb <= 0:
        return None  # the measurement is below the file's fixed costs: nothing to fit
    io, apply = 1e3 / rest, 1e3 / apply_cpu_s_per_gb
    regs = tuple(dataclasses.replace(r, cpu=dataclasses.replace(r.cpu, io_mb_s=io,
                                                                apply_mb_s=apply))
                 for r in sc.regions)
    return dataclasses.replace(sc, regions=regs, links=links, patch_bytes=size_bytes,
                               chunk_bytes=chunk_bytes, encode_s=handoff_s,
                               lanes=AUTO_LANES if lanes == "auto" else int(lanes),
                               lanes_auto=lanes == "auto",
                               congestion=congestion if congestion in CONGESTION else "bbr",
                               **({} if warm_up_kib is None else
                                  {"warm_up_kib": warm_up_kib, "origin_warm_up_kib": warm_up_kib}))


def predict(sc: Scenario) -> dict[str, Any]:
    """Run ``sc`` under patchswarm: every node holding the version, and serving it."""
    _, fig = run_strategy(sc, "patchswarm")
    cpu = sc.regions[0].cpu
    return {"held_s": fig["t_p100_s"], "serving_s": fig["t_applied_p100_s"],
            "bound_s": fig["lower_bound_s"], "io_mb_s": round(cpu.io_mb_s, 1),
            "apply_mb_s": round(cpu.apply_mb_s, 1), "encode_s": sc.encode_s}
