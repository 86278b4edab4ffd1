"""A simulated fanout's timeline: chunk transfers, the origin's decisions, applies.

The same rows ``benchmarks/wan_timeline.py`` reads from an emulated run's logs
(``kind`` "sent" for a chunk on the wire, "push" / "relay_ordered" /
"region_delivered" for the origin's decisions, with their fields), plus
"applied" (a node serves the version), so a simulated and an emulated run of one
scenario can be laid side by side. ``downlink_use`` turns the transfers into
what a region's downlinks carried per time bin, as a share of their capacity:
where a fanout leaves capacity unused (a slow ramp, relays that lag their
pushes, a tail after the last byte crossed) shows there first. ``ramp`` sums it
up: how long the region took to reach half and 90 % use, the downlink time lost
before and after, and how fast its early transfers ran.

``patchswarm sim SCENARIO --out DIR --timeline K`` writes
``DIR/timeline.json`` and ``DIR/timeline.png`` (``plot_use``) and prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DECISIONS = ("push", "relay_ordered", "region_delivered")


@dataclass
class Timeline:
    """Collects one version's rows while a ``Simulation`` runs (``Simulation.timeline``)."""

    version: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[int, dict[str, Any]] = field(default_factory=dict)

    def started(self, key: int, now: float, src: tuple[str, str], dst: tuple[str, str],
                version: int, index: int, size: int, cut_through: bool) -> None:
        """A chunk went on the wire (``src``/``dst``: node id, region)."""
        if version == self.version:
            self._open[key] = {"kind": "sent", "from": src[0], "to": dst[0],
                               "from_region": src[1], "to_region": dst[1], "index": index,
                               "bytes": size, "start": now, "end": None,
                               "cut_through": cut_through}

    def left(self, key: int, now: float) -> None:
        """Its last byte left (an unfinished transfer, cut by a fault, is dropped)."""
        row = self._open.pop(key, None)
        if row is not None:
            row["end"] = now
            self.rows.append(row)

    def decision(self, now: float, event: str, fields: dict[str, Any]) -> None:
        """One of the origin's log lines (``DECISIONS``) about this version."""
        if event in DECISIONS and fields.get("version") == self.version:
            self.rows.append({"kind": event, "start": now, **fields})

    def mark(self, now: float, kind: str, version: int) -> None:
        """``version``'s publish call ("published") or its hand-off to the origin's core
        ("handed_off")."""
        if version == self.version:
            self.rows.append({"kind": kind, "start": now})

    def applied(self, now: float, node: str, region: str) -> None:
        self.rows.append({"kind": "applied", "node": node, "region": region, "start": now})

    def result(self) -> list[dict[str, Any]]:
        """The rows in time order, times in seconds from the version's first row."""
        rows = sorted(self.rows, key=lambda r: (r["start"], r["kind"]))
        if not rows:
            return []
        base = rows[0]["start"]
        out = []
        for r in rows:
            r = dict(r)
            r["start"] = round(r["start"] - base, 4)
            if r.get("end") is not None:
                r["end"] = round(r["end"] - base, 4)
            out.append(r)
        return out


def downlink_use(rows: list[dict[str, Any]], region: str, capacity_bps: float,
                 bin_s: float = 0.1) -> list[dict[str, float]]:
    """Per ``bin_s`` from the region's first inbound byte (``t``, seconds on the rows'
    clock): what its nodes took in, each transfer spread evenly over its duration, as a
    share of ``capacity_bps`` (the sum of their downlinks, bits/s; ``use``), in Mbit/s
    (``mbps``) and the part of it from outside the region (``outside_mbps``; against a
    region ingress such as a shaped uplink)."""
    xs = [r for r in rows if r["kind"] == "sent" and r["to_region"] == region]
    if not xs or capacity_bps <= 0 or bin_s <= 0:
        return []
    t0 = min(r["start"] for r in xs)
    total: dict[int, float] = {}
    outside: dict[int, float] = {}
    for r in xs:
        a, b = r["start"], r["end"]
        rate = r["bytes"] / max(b - a, 1e-9)
        k = int((a - t0) // bin_s)
        while t0 + k * bin_s < b:
            lo, hi = max(a, t0 + k * bin_s), min(b, t0 + (k + 1) * bin_s)
            total[k] = total.get(k, 0.0) + rate * (hi - lo)
            if r["from_region"] != region:
                outside[k] = outside.get(k, 0.0) + rate * (hi - lo)
            k += 1
    cap = capacity_bps / 8 * bin_s
    mbit = 8 / 1e6 / bin_s
    return [{"t": round(t0 + k * bin_s, 3), "use": round(total[k] / cap, 3),
             "mbps": round(total[k] * mbit, 1),
             "outside_mbps": round(outside.get(k, 0.0) * mbit, 1)} for k in sorted(total)]


def ramp(rows: list[dict[str, Any]], region: str, table: list[dict[str, float]],
         bin_s: float, busy: float = 0.9) -> dict[str, Any]:
    """A region's start-up and tail from its ``downlink_use`` table (same rows, same
    ``bin_s``; a bin missing from the table carried nothing).

    ``to_half_s`` / ``to_busy_s``: from its first inbound byte to the start of the first
    bin at half / ``busy`` use (None if never). ``ramp_lost_s``: the downlink time left
    unused before that bin, ``sum((1 - use) * bin)``, in seconds of the whole region's
    downlinks (what the ramp costs the version, at most). ``tail_s`` / ``tail_lost_s``:
    the same after the last bin at ``busy`` use. ``early_mbps``: the median rate of
    transfers into the region that started before it was busy, ``early_cut_through``
    the share of them sent while their chunk still arrived at the sender, and
    ``early_cut_through_mbps`` their median rate (a chunk forwarded as it arrives comes no
    faster than it arrives, and a sender forwarding it to two peers halves that)."""
    if not table or bin_s <= 0:
        return {}
    t0 = table[0]["t"]
    uses = [0.0] * (round((table[-1]["t"] - t0) / bin_s) + 1)
    for row in table:
        uses[round((row["t"] - t0) / bin_s)] = min(1.0, row["use"])
    out: dict[str, Any] = {"busy": busy, "first_byte_s": t0, "to_half_s": None,
                           "to_busy_s": None}
    first_busy = last_busy = None
    for k, use in enumerate(uses):
        if out["to_half_s"] is None and use >= 0.5:
            out["to_half_s"] = round(k * bin_s, 4)
        if use >= busy:
            last_busy = k
            if first_busy is None:
                first_busy = k
                out["to_busy_s"] = round(k * bin_s, 4)
    head = uses if first_busy is None else uses[:first_busy]
    out["ramp_lost_s"] = round(sum(1 - u for u in head) * bin_s, 4)
    tail = [] if last_busy is None else uses[last_busy + 1:]
    out["tail_s"] = round(len(tail) * bin_s, 4)
    out["tail_lost_s"] = round(sum(1 - u for u in tail) * bin_s, 4)
    end = t0 + (first_busy if first_busy is not None else len(uses)) * bin_s - 1e-9
    early = sorted((r for r in rows if r["kind"] == "sent" and r["to_region"] == region
                    and r["start"] < end), key=lambda r: r["bytes"] / max(r["end"] - r["start"], 1e-9))
    if early:
        out["early_mbps"] = _median_mbps(early)
        ct = [r for r in early if r["cut_through"]]
        out["early_cut_through"] = round(len(ct) / len(early), 3)
        if ct:
            out["early_cut_through_mbps"] = _median_mbps(ct)
    return out


def _median_mbps(rows: list[dict[str, Any]]) -> float:
    """The median transfer rate of ``rows`` (sorted by rate), Mbit/s."""
    mid = rows[len(rows) // 2]
    return round(8e-6 * mid["bytes"] / max(mid["end"] - mid["start"], 1e-9), 1)


def format_ramp(region: str, summary: dict[str, Any]) -> str:
    """``ramp`` as one line."""
    if not summary:
        return f"region {region}: no transfer in"

    def s(key: str) -> str:
        v = summary.get(key)
        return "never" if v is None else f"{v:.2f} s"

    line = (f"region {region} ramp: half use after {s('to_half_s')}, "
            f"{100 * summary['busy']:.0f} % after "
            f"{s('to_busy_s')}, {summary['ramp_lost_s']:.2f} s of its downlinks lost before; "
            f"tail {summary['tail_s']:.2f} s ({summary['tail_lost_s']:.2f} s lost)")
    if "early_mbps" in summary:
        line += (f"; early transfers {summary['early_mbps']:.0f} Mbit/s (median), "
                 f"{100 * summary['early_cut_through']:.0f} % cut-through")
        if "early_cut_through_mbps" in summary:
            line += f" at {summary['early_cut_through_mbps']:.0f} Mbit/s"
    return line


def format_use(region: str, table: list[dict[str, float]]) -> str:
    """``downlink_use`` as text: one line per bin, with a bar."""
    lines = [f"region {region}: s | share of its downlinks in use | Mbit/s in | "
             "of which from outside the region"]
    for row in table:
        bar = "#" * round(20 * min(1.0, row["use"]))
        lines.append(f"  {row['t']:7.2f}  {row['use']:5.2f}  {row['mbps']:8.1f}  "
                     f"{row['outside_mbps']:8.1f}  {bar}")
    return "\n".join(lines)


def plot_use(path: Path, title: str, use: dict[str, list[dict[str, float]]]) -> Path:
    """Each region's ``downlink_use`` over time (Mbit/s in, and from outside) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for region, table in use.items():
        if not table:
            continue
        ts = [row["t"] for row in table]
        line = ax.step(ts, [row["mbps"] for row in table], where="post", label=f"{region}: in")
        ax.step(ts, [row["outside_mbps"] for row in table], where="post", linestyle="--",
                color=line[0].get_color(), alpha=0.7, label=f"{region}: from outside")
    ax.set_xlabel("seconds since the publish call")
    ax.set_ylabel("Mbit/s into the region's nodes")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
