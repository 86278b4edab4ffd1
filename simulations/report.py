"""Figures, ``report.json`` and PNG plots from finished runs.

Definitions (also in ``docs/simulation.md``):

- ``t_pXX_s``: seconds from a version's publication until XX% of the nodes
  alive at the end of the run hold every verified chunk of it (the instant
  their core asks to apply it). Nearest-rank percentile; ``null`` when fewer
  than that share finished. With several versions the top-level figures are
  the worst version's.
- ``t_applied_pXX_s``: the same until the node's ``Applied`` (its CPU applied the
  version). Times start at the publish call, so they include ``encode_s``.
- ``lower_bound_s``: :func:`simulations.bounds.lower_bound` for the shipped
  payload; ``t_p100_over_bound`` = ``t_p100_s / lower_bound_s``.
- ``cross_region_bytes``: chunk bytes whose sender and receiver sit in
  different sites (the trainer's own site counts as one); control frames are
  reported apart (``control_bytes``, ``cross_region_control_bytes``).
- ``cross_region_ratio``: ``cross_region_bytes / (remote regions x payload x
  versions)``; remote regions are all regions, or all but the trainer's when
  it sits inside one. 1.0 means one copy into each region.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from simulations.bounds import Bound
from simulations.driver import RunResult
from simulations.scenario import Scenario

PERCENTILES = (50, 90, 99, 100)


def percentile(sorted_times: list[float], total: int, p: float) -> float | None:
    """Nearest rank over ``total`` nodes; unfinished nodes count as never."""
    if total == 0:
        return None
    k = max(1, math.ceil(p / 100.0 * total))
    if k > len(sorted_times):
        return None
    return sorted_times[k - 1]


def _times(
    run: RunResult, version: int, nodes: dict[str, str], region: str | None
) -> tuple[list[float], int]:
    t0 = run.publish_at[version - 1] if version - 1 < len(run.publish_at) else math.inf
    done = run.done.get(version, {})
    ids = [n for n, r in nodes.items() if region is None or r == region]
    times = sorted(done[n] - t0 for n in ids if n in done)
    return times, len(ids)


def _pcts(times: list[float], total: int) -> dict[str, float | None]:
    return {f"t_p{p}_s": _r(percentile(times, total, p)) for p in PERCENTILES}


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None or math.isinf(x) else round(x, nd)


def _worst(vals: list[float | None]) -> float | None:
    return None if any(v is None for v in vals) else max(v for v in vals if v is not None)


def figures(sc: Scenario, run: RunResult, bound: Bound) -> dict[str, Any]:
    """The report for one strategy's run (the issue's field list, plus details)."""
    versions = sc.versions
    F = run.payload_bytes
    live = run.live_nodes
    tsite = sc.trainer_site()
    remote = [r.name for r in sc.regions if r.name != tsite]
    cross = sum(b for (a, d), b in run.pair_bytes.items() if a != d)
    denom = max(1, len(remote)) * F * versions

    per_version = []
    for v in range(1, versions + 1):
        times, total = _times(run, v, live, None)
        per_version.append(
            {"version": v, "completed": len(times), "of": total, **_pcts(times, total)}
        )
    top = {k: _worst([pv[k] for pv in per_version]) for k in (f"t_p{p}_s" for p in PERCENTILES)}

    per_region: dict[str, Any] = {}
    for r in sc.regions:
        rv = []
        for v in range(1, versions + 1):
            times, total = _times(run, v, live, r.name)
            rv.append(_pcts(times, total))
        inflow = sum(b for (a, d), b in run.pair_bytes.items() if d == r.name and a != d)
        outflow = sum(b for (a, d), b in run.pair_bytes.items() if a == r.name and a != d)
        from_trainer = run.pair_bytes.get((tsite, r.name), 0) if tsite != r.name else 0
        same = run.pair_bytes.get((r.name, r.name), 0)
        pr = {k: _worst([x[k] for x in rv]) for k in rv[0]}
        per_region[r.name] = {
            "nodes": sum(1 for reg in live.values() if reg == r.name),
            **pr,
            "inflow_bytes": inflow,
            "inflow_copies": round(inflow / (F * versions), 4),
            "outflow_bytes": outflow,
            "from_trainer_bytes": from_trainer,
            # the loopback demo's per-region shape: bytes its nodes received, by sender kind
            "received": {"from_trainer": from_trainer, "cross_region": inflow - from_trainer,
                         "same_region": same},
            "upload_bytes": sum(
                run.upload_bytes.get(n, 0) for n, reg in run.node_region.items() if reg == r.name
            ),
        }
    applied = []
    for v in range(1, versions + 1):
        t0 = run.publish_at[v - 1] if v - 1 < len(run.publish_at) else math.inf
        done = run.applied.get(v, {})
        times = sorted(done[n] - t0 for n in live if n in done)
        applied.append({k.replace("t_p", "t_applied_p"): x for k, x in _pcts(times, len(live)).items()})
    top_applied = {k: _worst([a[k] for a in applied]) for k in applied[0]} if applied else {}
    incomplete = sum(pv["of"] - pv["completed"] for pv in per_version)
    t100 = top["t_p100_s"]
    return {
        "scenario": sc.name,
        "strategy": run.strategy,
        "nodes": sc.nodes,
        "live_nodes": len(live),
        "regions": len(sc.regions),
        "versions": versions,
        "patch_bytes": sc.patch_bytes,
        "payload_bytes": F,
        "chunk_bytes": run.chunk_bytes,
        **top,
        **top_applied,
        "encode_s": _r(run.encode_s),
        "lower_bound_s": _r(bound.seconds),
        "bound_binding": bound.binding,
        "bound_terms": {k: _r(v) for k, v in bound.terms.items()},
        "bound_info": {k: _r(v) for k, v in bound.info.items()},
        "t_p100_over_bound": _r(t100 / bound.seconds, 4) if t100 is not None else None,
        "cross_region_bytes": cross,
        "cross_region_ratio": round(cross / denom, 4),
        "trainer_egress_bytes": run.trainer_egress_bytes,
        "trainer_egress_copies": round(run.trainer_egress_bytes / (F * versions), 4),
        "incomplete_nodes": incomplete,
        "per_region": per_region,
        "per_version": per_version,
        "pair_bytes": {f"{a}->{d}": b for (a, d), b in sorted(run.pair_bytes.items())},
        "control_bytes": run.control_bytes,
        "control_frames": run.control_frames,
        "cross_region_control_bytes": run.cross_region_control_bytes,
        "chunks_sent": run.chunks_sent,
        "chunks_stopped": run.chunks_stopped,
        "control_hol": {k: _r(v) for k, v in run.hol.items()},
        "cpu_busy_s": _r(run.cpu_busy_s),
        "idle_restarts": run.idle_restarts,
        "churn": run.churn,
        "logs": dict(sorted(run.logs.items())),
        "virtual_end_s": _r(run.end_time),
        "wall_s": round(run.wall_s, 3),
        "cpu_s": round(run.cpu_s, 3),
        "events": run.events,
    }


def deterministic_view(report: dict[str, Any]) -> dict[str, Any]:
    """The report without wall-clock fields (what must match across same-seed runs)."""

    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in ("wall_s", "cpu_s", "bench_wall_s")}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d

    return strip(report)


def write_report(out: Path, sc: Scenario, seed: int, results: list[dict[str, Any]]) -> Path:
    """``report.json``: the first strategy's figures at top level, all under ``strategies``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        **results[0],
        "seed": seed,
        "strategies": {r["strategy"]: r for r in results},
        "table": table_rows(results),
    }
    path = out / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


TABLE_COLS = (
    "strategy",
    "t_p50_s",
    "t_p90_s",
    "t_p99_s",
    "t_p100_s",
    "lower_bound_s",
    "t_p100_over_bound",
    "cross_region_ratio",
    "trainer_egress_copies",
    "incomplete_nodes",
)


def table_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {c: r.get(c) for c in (*TABLE_COLS, "cross_region_bytes", "trainer_egress_bytes")}
        for r in results
    ]


def format_table(results: list[dict[str, Any]]) -> str:
    heads = (
        "strategy",
        "p50 s",
        "p90 s",
        "p99 s",
        "p100 s",
        "bound s",
        "p100/bound",
        "xregion",
        "trainer copies",
        "incomplete",
    )
    rows = []
    for r in results:
        rows.append(
            [
                str(r.get(c)) if not isinstance(r.get(c), float) else f"{r[c]:.3f}"
                for c in TABLE_COLS
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    line = "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([line, *body])


def plot(out: Path, sc: Scenario, runs: list[RunResult]) -> list[Path]:
    """Completion CDFs (overall and per region) and upload per node, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        times, total = _times(run, sc.versions, run.live_nodes, None)
        if times:
            ax.step(
                times,
                [(i + 1) / total for i in range(len(times))],
                where="post",
                label=run.strategy,
            )
    lo = min((t for r in runs for t in _times(r, sc.versions, r.live_nodes, None)[0][:1]), default=0.0)
    hi = max((t for r in runs for t in _times(r, sc.versions, r.live_nodes, None)[0][-1:]), default=0.0)
    if lo > 0 and hi / lo > 30:
        ax.set_xscale("log")  # strategies orders of magnitude apart (direct vs patchswarm)
    ax.set_xlabel("seconds since publication (last version)")
    ax.set_ylabel("share of nodes holding the verified payload")
    ax.set_title(f"{sc.name}: completion CDF, {sc.nodes} nodes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for run in runs:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in sc.regions:
            times, total = _times(run, sc.versions, run.live_nodes, r.name)
            if times:
                ax1.step(
                    times, [(i + 1) / total for i in range(len(times))], where="post", label=r.name
                )
        ax1.set_xlabel("seconds since publication")
        ax1.set_ylabel("share of the region's nodes")
        ax1.set_title(f"{run.strategy}: completion CDF per region")
        ax1.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        F = run.payload_bytes * sc.versions
        for r in sc.regions:
            ups = sorted(
                (
                    run.upload_bytes.get(n, 0) / F
                    for n, reg in run.node_region.items()
                    if reg == r.name
                ),
                reverse=True,
            )
            ax2.plot(range(len(ups)), ups, label=r.name)
        ax2.axhline(
            run.upload_bytes.get("trainer", 0) / F, color="k", ls="--", lw=1, label="trainer"
        )
        ax2.set_xlabel("nodes, sorted by upload")
        ax2.set_ylabel("uploaded / payload (copies)")
        ax2.set_title(f"{run.strategy}: upload per node")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"{run.strategy}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def compare_with_demo(fig: dict[str, Any], demo: dict[str, Any]) -> dict[str, Any]:
    """Who sent what to whom, simulated vs the loopback fleet (``patchswarm demo --json``).

    Both sides are normalised to copies of the payload (bytes / total payload
    bytes over all versions), per region and sender kind, so the comparison
    holds even though the demo's real patches vary in size per version. The
    demo names regions by index; they are matched in order.
    """
    F_sim = fig["payload_bytes"] * fig["versions"]
    demo_patch = demo.get("patch_bytes") or []
    F_demo = sum(demo_patch) if isinstance(demo_patch, list) else int(demo_patch)
    if F_demo <= 0:
        raise ValueError("demo JSON has no patch_bytes")
    sim_regions = list(fig["per_region"])
    demo_regions = sorted(demo.get("per_region", {}))
    rows = []
    for sname, dname in zip(sim_regions, demo_regions, strict=False):
        s = fig["per_region"][sname]["received"]
        d = demo["per_region"][dname]
        for kind in ("from_trainer", "cross_region", "same_region"):
            rows.append({
                "region": sname, "demo_region": dname, "kind": kind,
                "sim_copies": round(s[kind] / F_sim, 3),
                "demo_copies": round(d.get(kind, 0) / F_demo, 3),
            })
    return {
        "rows": rows,
        "cross_region_ratio": {"sim": fig["cross_region_ratio"], "demo": demo.get("cross_region_ratio")},
        "fanout_s": {"sim_p100": fig["t_p100_s"], "demo": demo.get("fanout_s")},
    }
