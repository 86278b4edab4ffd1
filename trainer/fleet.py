"""The trainer's fleet view: which version every rollout node serves, and who lags.

Built from the origin core's version reports (``NodeCore.fleet()``, a list of
``swarm.protocol.fleet.FleetEntry``: node id, region, active and engine-served
version, when it last reported, whether it is linked now). A node *serves* the
version its engine confirmed, else (no engine report) the version active on its
truth. ``FleetView`` is a snapshot; ``Publisher.fleet()`` makes one, the origin's
``/fleet`` endpoint serves ``FleetView.to_json()`` and ``patchswarm fleet`` prints
``FleetView.table()`` (``patchswarm/cli_fleet.py``). Pure data: no sockets, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.errors import PatchswarmError


class EntryLike(Protocol):
    """The fields of ``swarm.protocol.fleet.FleetEntry`` this module reads."""

    node_id: str
    region: str
    active: int | None
    served: int | None
    reported_at: float
    connected: bool


def serving(e: EntryLike) -> int | None:
    """The version ``e`` answers requests with: its engine's, else its active one."""
    return e.served if e.served is not None else e.active


@dataclass(frozen=True)
class Laggard:
    """A node serving less than the version asked about."""

    node_id: str
    region: str
    serving: int | None  # None: it never reported a version
    lag: int | None  # versions behind the one asked about (None: unknown)
    connected: bool
    age_s: float  # seconds since its last report

    def describe(self) -> str:
        v = "nothing" if self.serving is None else f"v{self.serving}"
        link = "" if self.connected else ", not linked"
        return f"{self.node_id} ({self.region}) serves {v}{link}, reported {self.age_s:.0f} s ago"


class StalenessTimeout(PatchswarmError):
    """Too few nodes serve a version in time; ``laggards`` names the nodes behind it."""

    def __init__(self, version: int, fraction: float, timeout: float, view: FleetView) -> None:
        self.version = version
        self.fraction = fraction
        self.view = view
        self.laggards = view.laggards(version)
        got = view.served_fraction(version)
        shown = ", ".join(lg.describe() for lg in self.laggards[:10])
        more = f" and {len(self.laggards) - 10} more" if len(self.laggards) > 10 else ""
        super().__init__(
            f"version {version}: {got:.0%} of {len(view)} node(s) serve it or newer after "
            f"{timeout:.0f} s, {fraction:.0%} needed; behind: {shown or 'none'}{more}")


class FleetView:
    """A snapshot of the fleet: per region {version: nodes}, laggards, served fractions."""

    def __init__(self, entries: Iterable[EntryLike], *, latest: int | None = None,
                 now: float | None = None) -> None:
        self.entries: list[EntryLike] = sorted(entries, key=lambda e: (e.region, e.node_id))
        served = [v for v in map(serving, self.entries) if v is not None]
        self.latest = latest if latest is not None else (max(served) if served else None)
        self.now = now if now is not None else max(
            (e.reported_at for e in self.entries), default=0.0)

    def __len__(self) -> int:
        return len(self.entries)

    def regions(self) -> dict[str, dict[int | None, int]]:
        """Per region, how many nodes serve each version (None: not reported yet)."""
        out: dict[str, dict[int | None, int]] = {}
        for e in self.entries:
            counts = out.setdefault(e.region, {})
            v = serving(e)
            counts[v] = counts.get(v, 0) + 1
        return out

    def nodes(self, region: str | None = None) -> list[EntryLike]:
        return [e for e in self.entries if region is None or e.region == region]

    def served_fraction(self, version: int, region: str | None = None) -> float:
        """Share of the (region's) reporting nodes serving ``version`` or newer; 1.0 for
        no node at all (nobody is behind)."""
        nodes = self.nodes(region)
        if not nodes:
            return 1.0
        ok = sum(1 for e in nodes if (serving(e) or -1) >= version)
        return ok / len(nodes)

    def laggards(self, version: int | None = None) -> list[Laggard]:
        """Nodes serving less than ``version`` (default: the latest), most behind first."""
        want = self.latest if version is None else version
        if want is None:
            return []
        out = []
        for e in self.entries:
            v = serving(e)
            if v is None or v < want:
                out.append(Laggard(e.node_id, e.region, v, None if v is None else want - v,
                                   e.connected, max(0.0, self.now - e.reported_at)))
        out.sort(key=lambda lg: (-(lg.lag if lg.lag is not None else 1 << 62), lg.region,
                                 lg.node_id))
        return out

    def lags(self) -> list[int]:
        """Each reporting node's lag behind the latest version (for a histogram)."""
        if self.latest is None:
            return []
        return [self.latest - v for v in map(serving, self.entries) if v is not None]

    def versions(self) -> list[int | None]:
        vs = {serving(e) for e in self.entries}
        return sorted(vs, key=lambda v: -1 if v is None else v)

    def to_json(self) -> dict[str, Any]:
        return {
            "latest": self.latest,
            "nodes": len(self.entries),
            "regions": {r: {("none" if v is None else str(v)): n for v, n in c.items()}
                        for r, c in self.regions().items()},
            "served_fraction_latest": (None if self.latest is None
                                       else round(self.served_fraction(self.latest), 6)),
            "laggards": [{"node_id": lg.node_id, "region": lg.region, "serving": lg.serving,
                          "lag": lg.lag, "connected": lg.connected, "age_s": round(lg.age_s, 3)}
                         for lg in self.laggards()],
            "entries": [{"node_id": e.node_id, "region": e.region, "active": e.active,
                         "served": e.served, "connected": e.connected,
                         "age_s": round(max(0.0, self.now - e.reported_at), 3)}
                        for e in self.entries],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FleetView:
        """Rebuild a view from ``to_json()`` (what ``patchswarm fleet --api`` reads)."""
        try:
            entries = [_Entry(str(e["node_id"]), str(e["region"]), _opt_int(e["active"]),
                              _opt_int(e["served"]), -float(e["age_s"]), bool(e["connected"]))
                       for e in doc["entries"]]
            latest = _opt_int(doc.get("latest"))
        except (KeyError, TypeError, ValueError) as exc:
            raise PatchswarmError(f"not a fleet document: {exc!r}") from None
        return cls(entries, latest=latest, now=0.0)

    def table(self, max_stragglers: int = 10) -> str:
        """Regions x versions, with each region's lag and its stragglers by node id."""
        return format_table(self, max_stragglers)


@dataclass(frozen=True)
class _Entry:
    node_id: str
    region: str
    active: int | None
    served: int | None
    reported_at: float
    connected: bool


def _opt_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected a version, got {v!r}")
    return v


def format_table(view: FleetView, max_stragglers: int = 10) -> str:
    """The text table of ``patchswarm fleet``."""
    versions = view.versions()
    if not view.entries:
        return "no node has reported its version to the origin yet"
    heads = ["region", "nodes", *("-" if v is None else f"v{v}" for v in versions),
             "max lag", "stragglers"]
    rows: list[Sequence[str]] = []
    for region, counts in view.regions().items():
        nodes = view.nodes(region)
        behind = [lg for lg in view.laggards() if lg.region == region]
        lags = [lg.lag for lg in behind if lg.lag is not None]
        lag = "?" if any(lg.lag is None for lg in behind) else str(max(lags, default=0))
        names = ", ".join(lg.node_id for lg in behind[:max_stragglers])
        if len(behind) > max_stragglers:
            names += f" +{len(behind) - max_stragglers}"
        rows.append([region, str(len(nodes)), *(str(counts.get(v, "")) for v in versions),
                     lag, names])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    frac = "" if view.latest is None else (
        f"; {view.served_fraction(view.latest):.0%} serve the latest (v{view.latest})")
    lines.append(f"{len(view)} node(s){frac}")
    return "\n".join(lines)
