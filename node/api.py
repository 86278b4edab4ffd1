"""The node's HTTP API, served on the same port as the peer protocol.

- ``GET /healthz``: 200 ``ok`` while the node runs and its engine serves the
  node's verified version; 503 with the reason on one line while draining, or
  while the engine is unhealthy, behind or not yet synced (``engine: ...``).
- ``GET /status``: JSON — node id, region, model, role, active and staged
  versions, the active state digest, peers, and chunk bytes sent/received
  split into same-region, cross-region and from-trainer, plus per region pair;
  ``engine``: kind, state, reason, served version, the last commit (path,
  bytes, pause and commit seconds).
  ``?wait_active=N[&timeout_s=S]`` blocks until the node serves version N or later (at
  most S seconds, default 30, up to 300), then answers the same document with ``wait``:
  the version, whether it was reached, the seconds waited (``node.active_wait``); 400
  naming the parameter for a bad one, 503 while 256 requests wait already.
  With a request gateway (``node.gateway``), ``/metrics`` also has its
  ``patchswarm_gateway_*`` families.
- ``GET /metrics``: Prometheus text format (``prometheus_client``), computed
  from the same state at scrape time, so the two never disagree.
- ``GET /fleet`` (origin only; 404 elsewhere): JSON — every node's last version
  report (node id, region, active and engine-served version, seconds since the
  report, linked or not), the latest version, and per recent version the seconds
  from its publish to half of the fleet (p50) and to all of it (p100) serving it.
  On the origin ``/metrics`` adds the fleet: nodes serving each version per region,
  a histogram of the nodes' lag behind the latest version, and those seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)

from node import buffers, link
from node.active_wait import TooManyWaiters, parse_wait

if TYPE_CHECKING:
    from node.driver import Driver

log = logging.getLogger("patchswarm.api")

KIND_NAMES = {"same_region": "same_region", "cross_region": "cross_region",
              "from_origin": "from_trainer"}


def status_dict(driver: Driver, model: str) -> dict[str, Any]:
    """The ``/status`` document (call on the loop thread)."""
    core = driver.core
    st = core.status()
    counters = st["counters"]
    weights = driver.weights
    digest = weights.digest.hex() if weights is not None else None
    if weights is None:
        rec = _active_record(driver)
        digest = rec.digest.hex() if rec is not None else None

    def split(d: dict[str, int]) -> dict[str, int]:
        return {KIND_NAMES[k]: v for k, v in d.items()}

    return {
        "node_id": st["node_id"],
        "region": st["region"],
        "model": model,
        "role": st["role"],
        # the protocol versions this release speaks, oldest and newest (each peer in
        # ``peers`` shows the one its link speaks: ``proto``)
        "protocol": st["protocol"],
        "active_version": st["active_version"],
        "active_digest": digest,
        "staged_versions": st["staged_versions"],
        "applying": st["applying"],
        "border": st["border"],
        "peers": st["peers"],
        "bytes": {"sent": split(counters["sent_bytes"]), "received": split(counters["recv_bytes"])},
        "chunks": {"sent": split(counters["sent_chunks"]),
                   "received": split(counters["recv_chunks"])},
        "region_bytes": {"sent": counters["region_sent"], "received": counters["region_recv"]},
        "bad_chunks": counters["bad_chunks"],
        # whole chunks received that were held already (a twin not stopped in time)
        "dup_chunks": counters["dup_chunks"],
        # twin requests asked in a version's endgame ([swarm] endgame_twin_after_s)
        "endgame_twins": counters.get("endgame_twins", 0),
        # chunks peers withdrew while sending them to us (they did not arrive whole there)
        "withdrawn_chunks": counters.get("withdrawn", 0),
        # answers this node started while the chunk still arrived here (serve_arriving)
        "served_arriving": counters.get("served_arriving", 0),
        # chunks offered to region peers (COMING) at a version's end only (a small region)
        "endgame_coming": counters.get("endgame_coming", 0),
        "wire_bytes": dict(driver.wire_bytes),
        "apply_seconds": {str(k): round(v, 6) for k, v in driver.apply_seconds.items()},
        # where each apply's time went (wait, read, stage, commit, engine; cpu_s: the
        # applying thread's CPU), the last 16 versions
        "apply_split": {str(k): v for k, v in getattr(driver, "apply_splits", {}).items()},
        # applies that raised the decode-ahead thread's priority while they waited for it
        "prestage_boosts": getattr(driver, "prestage_boosts", 0),
        # confidential versions this node relays but cannot open (no key for them)
        "no_key_versions": {str(k): v for k, v in getattr(driver, "no_key_versions", {}).items()},
        "activated_at": {str(k): v for k, v in driver.activated_at.items()},
        "store_bytes": driver.store.used_bytes,
        # the pool of large aligned buffers (node.buffers: an apply's payload, larger than
        # any chunk): taken, reused or newly allocated (fresh pages), bytes out and free
        "buffers": buffers.POOL.stats(),
        "uptime_s": round(time.time() - driver.started_at, 3),
        "draining": driver.draining,
        "engine": engine_dict(driver),
        "transport": {
            "tls": driver.tls is not None,
            # TCP congestion control of the peer sockets ([network] congestion_control)
            "congestion_control": driver.congestion_in_use,
            "congestion_refused": driver.congestion_refused,
            # loss-based algorithm only: Linux restarts an idle link's window (None: n/a)
            "slow_start_after_idle": driver.slow_start_after_idle,
            # BBR started over on a link ([network] congestion_restart_s, node.tcp)
            "congestion_restarts": driver.congestion_restarts,
            # long links' windows opened before the first version ([network] warm_up_kib,
            # node.warm_up): links warmed, under way, why they ended, padding each way
            "warm_up": driver.warm_status(),
            # striped links ([network] lanes): extra connections opened or accepted, and
            # lanes refused (either side)
            "lanes_opened": driver.lanes_opened,
            "lanes_refused": driver.lanes_refused,
            # [network] lanes = "auto": links whose sender found them capped by random loss
            "loss_capped_links": driver.loss_capped,
            # ... and links to a region one of those went to, given as many lanes with
            # their first chunk (no probe of their own)
            "lanes_learned": driver.lanes_learned,
            # striped chunks stuck on a lane: asked for again (receiver), blocks sent
            # again (sender)
            "stripe_wants": driver.stripe_wants,
            "blocks_resent": driver.blocks_resent,
            # receive low-water marks set inside chunk blocks, and marks not reached in
            # time and dropped ([network] read_lowat_kib, node.link._gather)
            "read_marks": link.MARKS["set"],
            "read_marks_expired": link.MARKS["expired"],
            # chunks this node restarted over lanes that came up while they went on
            # the link alone
            "chunks_restriped": driver.chunks_restriped,
            # answers stopped before their last block (the requester cancelled them:
            # it got the chunk from another peer first), of those it cancelled
            "uploads_stopped": driver.uploads_stopped,
            "uploads_cancelled": counters.get("uploads_cancelled", 0),
            # chunk blocks decrypted straight into their chunk's buffer, and those that
            # came through a buffer of their own first (a copy more)
            "blocks_placed": driver.blocks_placed,
            "blocks_copied": driver.blocks_copied,
            "connections": driver.guard.stats.open,
            "refused": driver.guard.stats.refused,
            "timed_out": driver.guard.stats.timed_out,
            "local_faults": counters.get("local_faults", 0),
            # links closed at the HELLO: the peer runs a release with no protocol
            # version in common (docs/operations.md, upgrades)
            "version_refused": counters.get("version_refused", 0),
            "store_fault": driver.store_fault,
        },
        # a border's RELAY orders: carried out at once, on the chunk's arrival, failed
        "relays": dict(counters.get("relays", {})),
        # RELAY_ALIVE: a border, relays it reported on their way (acknowledged); the
        # origin, relay deadlines those reports moved
        "relay_alive": counters.get("relay_alive", 0),
    }


def engine_dict(driver: Driver) -> dict[str, Any] | None:
    """The ``engine`` block of ``/status`` (None on a node without weights, e.g. the origin)."""
    if driver.engine is None:
        return None
    st = driver.engine_state
    cfg = driver.engine_cfg
    last = st.last_commit
    retry = None
    if st.next_retry_at is not None:
        retry = round(max(0.0, st.next_retry_at - time.monotonic()), 3)
    return {
        "kind": st.kind,
        "url": getattr(cfg, "url", None),
        "pause_mode": getattr(cfg, "pause_mode", None),
        "state": st.state,
        "healthy": st.healthy,
        "reason": st.reason or None,
        "served_version": st.served_version,
        "verified_version": driver.weights.version if driver.weights is not None else None,
        "recorded_version": getattr(_active_record(driver), "version", None),
        "uncertain": st.uncertain,
        "last_commit": None if last is None else {
            "version": last.version, "path": last.path, "bytes": last.bytes,
            "paused_s": round(last.paused_s, 6), "commit_s": round(last.commit_s, 6),
            "at": st.last_commit_at,
        },
        "commits": st.commits,
        "failures": st.failures,
        "consecutive_failures": st.consecutive_failures,
        "retry_in_s": retry,
        "state_for_s": round(time.monotonic() - st.since, 3),
    }


def health(driver: Driver) -> str | None:
    """Why the node is not healthy (one line), or None when it is."""
    if driver.draining:
        return "draining"
    if driver.store_fault is not None:  # local: disk full, quota, fd limit
        return f"store: {driver.store_fault}"
    if driver.engine is None:
        return None
    st = driver.engine_state
    if st.state == "ok":
        return None
    if st.state == "starting":
        return (f"engine: {st.kind} engine not yet synced to version "
                f"{driver.weights.version if driver.weights is not None else '?'}")
    return f"engine: {st.state}: {st.reason}"


def _active_record(driver: Driver) -> Any:
    try:
        return driver.store.active()
    except Exception:
        return None


# ------------------------------------------------------------------ fleet (origin)

FLEET_OBSERVE_S = 0.5  # how often the origin samples the fleet for publish-to-active times
FLEET_VERSIONS_KEPT = 64  # versions whose publish-to-active times are kept
LAG_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50)


def _serving(e: Any) -> int | None:
    return e.served if e.served is not None else e.active


class FleetTimes:
    """Origin: seconds from each version's publish until half (p50) and all (p100) of
    the reporting nodes serve it or newer.

    Sampled every ``FLEET_OBSERVE_S`` from the core's fleet view: a node counts for
    version v from the core time of its first report serving v or newer, so the
    times include the nodes' report delay (``status_delay_s``). The publish time is
    the manifest's ``created_at`` (the trainer signs it as it hands the version over).
    """

    def __init__(self, since: float = 0.0) -> None:
        self.published: dict[int, float] = {}  # version -> wall clock of its publish
        self.first: dict[int, dict[str, float]] = {}  # version -> node -> wall clock
        self.done: dict[int, dict[str, float]] = {}  # version -> {"p50": s, "p100": s}
        self.since = since  # versions published before this (wall clock) are not timed

    def observe(self, manifests: dict[int, Any], entries: list[Any], wall_offset: float) -> None:
        for v, m in manifests.items():
            if (v not in self.published and v not in self.done
                    and float(m.created_at) >= self.since):
                self.published[v] = float(m.created_at)
                self.first[v] = {}
        nodes = len(entries)
        for v in list(self.published):
            first = self.first[v]
            for e in entries:
                s = _serving(e)
                if s is not None and s >= v and e.node_id not in first:
                    first[e.node_id] = e.reported_at + wall_offset
            if nodes and len(first) >= nodes:
                times = sorted(first.values())
                t0 = self.published[v]
                self.done[v] = {"p50": max(0.0, times[math.ceil(0.5 * len(times)) - 1] - t0),
                                "p100": max(0.0, times[-1] - t0)}
                del self.published[v], self.first[v]
        for table in (self.done, self.published, self.first):
            while len(table) > FLEET_VERSIONS_KEPT:
                del table[min(table)]

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {str(v): {k: round(x, 4) for k, x in d.items()} for v, d in sorted(self.done.items())}


def fleet_dict(driver: Driver, times: FleetTimes | None = None) -> dict[str, Any]:
    """The ``/fleet`` document (call on the loop thread; origin only)."""
    core = driver.core
    now = driver.now()
    entries = core.fleet()
    return {
        "origin": core.cfg.node_id,
        "latest": core.active_version,
        "nodes": len(entries),
        "entries": [{"node_id": e.node_id, "region": e.region, "active": e.active,
                     "served": e.served, "connected": e.connected,
                     "age_s": round(max(0.0, now - e.reported_at), 3)} for e in entries],
        "publish_to_active_s": times.as_dict() if times is not None else {},
    }


def _fleet_metrics(driver: Driver, times: FleetTimes):  # type: ignore[no-untyped-def]
    core = driver.core
    entries = core.fleet()
    latest = core.active_version
    g = GaugeMetricFamily("patchswarm_fleet_nodes_serving",
                          "Nodes serving each version, per region (version -1: none reported)",
                          labels=["region", "version"])
    counts: dict[tuple[str, int], int] = {}
    for e in entries:
        s = _serving(e)
        key = (e.region, -1 if s is None else s)
        counts[key] = counts.get(key, 0) + 1
    for (region, v), n in sorted(counts.items()):
        g.add_metric([region, str(v)], float(n))
    yield g
    lags = [latest - s for s in map(_serving, entries) if s is not None and latest is not None]
    buckets = [(str(b), float(sum(1 for x in lags if x <= b))) for b in LAG_BUCKETS]
    buckets.append(("+Inf", float(len(lags))))
    h = HistogramMetricFamily("patchswarm_fleet_lag_versions",
                              "Versions each reporting node is behind the latest published")
    h.add_metric([], buckets, sum_value=float(sum(lags)))
    yield h
    g = GaugeMetricFamily("patchswarm_fleet_publish_to_active_seconds",
                          "Seconds from a version's publish until p50 / p100 of the fleet "
                          "served it", labels=["version", "quantile"])
    for v, d in sorted(times.done.items()):
        g.add_metric([str(v), "0.5"], d["p50"])
        g.add_metric([str(v), "1"], d["p100"])
    yield g


class _Collector:
    """Prometheus collector reading the driver's state at scrape time."""

    def __init__(self, driver: Driver, model: str, gateway: Any = None,
                 times: FleetTimes | None = None) -> None:
        self.driver = driver
        self.model = model
        self.gateway = gateway  # node.gateway.Gateway or None
        self.times = times

    def collect(self):  # type: ignore[no-untyped-def]
        if self.times is not None:
            yield from _fleet_metrics(self.driver, self.times)
        st = status_dict(self.driver, self.model)
        labels = ["node", "region"]
        who = [st["node_id"], st["region"]]
        g = GaugeMetricFamily("patchswarm_active_version", "Version being served", labels=labels)
        g.add_metric(who, float(st["active_version"] or 0))
        yield g
        g = GaugeMetricFamily("patchswarm_staged_versions", "Newer versions known", labels=labels)
        g.add_metric(who, float(len(st["staged_versions"])))
        yield g
        g = GaugeMetricFamily("patchswarm_peers", "Connected, authenticated peers", labels=labels)
        g.add_metric(who, float(len(st["peers"])))
        yield g
        for direction in ("sent", "received"):
            c = CounterMetricFamily(f"patchswarm_chunk_bytes_{direction}",
                                    f"Chunk payload bytes {direction}", labels=[*labels, "kind"])
            for kind, n in st["bytes"][direction].items():
                c.add_metric([*who, kind], float(n))
            yield c
        for name, key, help_text in (
                ("patchswarm_bad_chunks", "bad_chunks", "Chunks that failed verification"),
                ("patchswarm_duplicate_chunks", "dup_chunks",
                 "Whole chunks received that were held here already (an endgame twin not "
                 "stopped in time)"),
                ("patchswarm_endgame_twins", "endgame_twins",
                 "Twin requests asked in a version's endgame: a second holder asked for a "
                 "chunk whose first request was overdue"),
                ("patchswarm_withdrawn_chunks", "withdrawn_chunks",
                 "Chunks a peer withdrew while sending them (they did not arrive whole there; "
                 "nobody blamed)"),
                ("patchswarm_chunks_served_arriving", "served_arriving",
                 "Chunks this node began sending to a region peer while they still arrived "
                 "here"),
                ("patchswarm_chunks_offered_endgame", "endgame_coming",
                 "Chunks this node offered its region's peers while they arrived, at a "
                 "version's end only (serve_arriving_endgame)")):
            c = CounterMetricFamily(name, help_text, labels=labels)
            c.add_metric(who, float(st.get(key, 0)))
            yield c
        g = GaugeMetricFamily("patchswarm_store_bytes", "Bytes held in the chunk store",
                              labels=labels)
        g.add_metric(who, float(st["store_bytes"]))
        yield g
        applies = st.get("apply_seconds") or {}
        if applies:
            last = max(applies, key=int)
            g = GaugeMetricFamily("patchswarm_apply_last_seconds", "The last version's apply, "
                                  "from its last chunk until it was served", labels=labels)
            g.add_metric(who, float(applies[last]))
            yield g
            g = GaugeMetricFamily("patchswarm_apply_last_ahead_bytes", "Patch bytes of the "
                                  "last version decoded while it downloaded", labels=labels)
            g.add_metric(who, float((st["apply_split"].get(last) or {}).get("ahead_bytes", 0)))
            yield g
        pool = st.get("buffers") or {}
        g = GaugeMetricFamily("patchswarm_buffer_pool_bytes", "Pooled aligned buffers (an apply's "
                              "payload): in use (out), or free and kept for reuse (free)",
                              labels=[*labels, "state"])
        for state in ("out", "free"):
            g.add_metric([*who, state], float(pool.get(f"{state}_bytes", 0)))
        yield g
        c = CounterMetricFamily("patchswarm_buffers_taken", "Pooled aligned buffers taken: "
                                "reused, or newly allocated (fresh pages)",
                                labels=[*labels, "source"])
        for source in ("reused", "allocated"):
            c.add_metric([*who, source], float(pool.get(source, 0)))
        yield c
        tr = st["transport"]
        g = GaugeMetricFamily("patchswarm_connections", "Open connections on the swarm port",
                              labels=labels)
        g.add_metric(who, float(tr["connections"]))
        yield g
        for name, key, help_text in (
                ("patchswarm_connections_refused", "refused", "Connections refused by the caps"),
                ("patchswarm_connections_timed_out", "timed_out",
                 "Connections cut off before their link preface"),
                ("patchswarm_local_store_faults", "local_faults",
                 "Chunks not kept for a local reason (disk full, ...)"),
                ("patchswarm_congestion_restarts", "congestion_restarts",
                 "Times BBR was started over on a peer link whose chunk started after idle, "
                 "ran long or left bytes unacknowledged ([network] congestion_restart_s)"),
                ("patchswarm_lanes_opened", "lanes_opened",
                 "Extra connections of striped peer links opened or accepted ([network] lanes)"),
                ("patchswarm_read_marks", "read_marks",
                 "Receive low-water marks set inside chunk blocks ([network] read_lowat_kib)"),
                ("patchswarm_read_marks_expired", "read_marks_expired",
                 "Receive low-water marks not reached in time and dropped to one byte"),
                ("patchswarm_lanes_refused", "lanes_refused",
                 "Extra connections of striped peer links refused, by either side"),
                ("patchswarm_loss_capped_links", "loss_capped_links",
                 "Peer links whose sender found them capped by random loss and asked for "
                 "lanes ([network] lanes = \"auto\")"),
                ("patchswarm_lanes_learned", "lanes_learned",
                 "Peer links given lanes with their first chunk: a link to their region was "
                 "found capped by random loss before ([network] lanes = \"auto\")"),
                ("patchswarm_stripe_wants", "stripe_wants",
                 "Striped chunks stuck on a lane that this node asked for again"),
                ("patchswarm_blocks_resent", "blocks_resent",
                 "Striped blocks this node sent again, asked by a peer whose copy was stuck"),
                ("patchswarm_chunks_restriped", "chunks_restriped",
                 "Chunks this node restarted striped: lanes came up while they went on the "
                 "link alone"),
                ("patchswarm_uploads_cancelled", "uploads_cancelled",
                 "Answers under way that their requester cancelled (it got the chunk from "
                 "another peer first)"),
                ("patchswarm_uploads_stopped", "uploads_stopped",
                 "Answers this node stopped before their last block because the requester "
                 "cancelled them"),
                ("patchswarm_blocks_placed", "blocks_placed",
                 "Chunk blocks received straight into their chunk's buffer"),
                ("patchswarm_blocks_copied", "blocks_copied",
                 "Chunk blocks received through a buffer of their own first (one copy "
                 "more than a placed block)")):
            c = CounterMetricFamily(name, help_text, labels=labels)
            c.add_metric(who, float(tr[key]))
            yield c
        wu = tr.get("warm_up") or {}
        c = CounterMetricFamily("patchswarm_warm_up_links", "Links between regions warmed with "
                                "padding before their first chunk ([network] warm_up_kib), by "
                                "why the warm-up ended", labels=[*labels, "ended"])
        for why, n in sorted((wu.get("ended") or {}).items()):
            c.add_metric([*who, why], float(n))
        yield c
        c = CounterMetricFamily("patchswarm_warm_up_pad_bytes", "Warm-up padding bytes, by "
                                "direction", labels=[*labels, "direction"])
        for direction in ("sent", "received"):
            c.add_metric([*who, direction], float(wu.get(f"pad_{direction}", 0)))
        yield c
        if tr.get("congestion_control"):
            g = GaugeMetricFamily("patchswarm_peer_congestion_control",
                                  "TCP congestion control of the peer sockets (1 for the one in "
                                  "use); refused: 1 when the kernel refused "
                                  "[network] congestion_control", labels=[*labels, "algorithm",
                                                                           "refused"])
            g.add_metric([*who, tr["congestion_control"],
                          "1" if tr.get("congestion_refused") else "0"], 1.0)
            yield g
        c = CounterMetricFamily("patchswarm_relays", "RELAY orders of the origin, by outcome "
                                "(at_once, on_arrival: when the chunk was stored, cut_through: "
                                "while it arrived, failed)",
                                labels=[*labels, "outcome"])
        for outcome, n in sorted(st.get("relays", {}).items()):
            c.add_metric([*who, outcome], float(n))
        yield c
        c = CounterMetricFamily("patchswarm_relay_alive",
                                "RELAY_ALIVE: relays a border reported on their way while "
                                "acknowledged; on the origin, relay deadlines they moved",
                                labels=labels)
        c.add_metric(who, float(st.get("relay_alive", 0)))
        yield c
        c = CounterMetricFamily("patchswarm_version_refused",
                                "Links closed at the handshake: the peer's release speaks no "
                                "protocol version in common with ours", labels=labels)
        c.add_metric(who, float(st["transport"].get("version_refused", 0)))
        yield c
        yield from self._engine_metrics(labels, who)
        if self.gateway is not None:
            yield from self.gateway.metric_families(labels, who)

    def _engine_metrics(self, labels: list[str], who: list[str]):  # type: ignore[no-untyped-def]
        d = self.driver
        if d.engine is None:
            return
        es = d.engine_state
        lab = [*labels, "engine"]
        w = [*who, es.kind]
        g = GaugeMetricFamily("patchswarm_engine_version",
                              "Version the engine confirmed it serves (-1: none)", labels=lab)
        g.add_metric(w, float(es.served_version if es.served_version is not None else -1))
        yield g
        g = GaugeMetricFamily("patchswarm_engine_healthy",
                              "1 while the engine serves the node's verified version", labels=lab)
        g.add_metric(w, 1.0 if es.healthy else 0.0)
        yield g
        s = SummaryMetricFamily("patchswarm_engine_commit_seconds",
                                "Engine commits: seconds per commit call", labels=lab)
        s.add_metric(w, count_value=float(es.commits), sum_value=es.commit_seconds)
        yield s
        s = SummaryMetricFamily("patchswarm_engine_paused_seconds",
                                "Engine commits: seconds generation was held", labels=lab)
        s.add_metric(w, count_value=float(es.commits), sum_value=es.paused_seconds)
        yield s
        last = es.last_commit
        g = GaugeMetricFamily("patchswarm_engine_last_paused_seconds",
                              "Generation pause of the last engine commit", labels=lab)
        g.add_metric(w, last.paused_s if last is not None else 0.0)
        yield g
        c = CounterMetricFamily("patchswarm_engine_failures",
                                "Engine commits or probes that failed", labels=lab)
        c.add_metric(w, float(es.failures))
        yield c


def add_routes(app: web.Application, driver: Driver, model: str, *,
               token: str | None = None, gateway: Any = None) -> None:
    """Mount /healthz, /status and /metrics. With ``token``, every path but /healthz
    needs ``Authorization: Bearer <token>`` (/status names peers, regions and
    versions: what an attacker would look for first)."""
    origin = driver.core.cfg.role == "origin"
    times = FleetTimes(since=driver.started_at) if origin else None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(driver, model, gateway, times))

    def authorized(request: web.Request) -> None:
        if token is None:
            return
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise web.HTTPUnauthorized(text="a bearer token is required (api.token_file)\n",
                                       headers={"WWW-Authenticate": "Bearer"})

    async def healthz(_: web.Request) -> web.Response:
        why = health(driver)
        if why is not None:
            return web.Response(status=503, text=why.replace("\n", " ") + "\n")
        return web.Response(text="ok\n")

    async def status(request: web.Request) -> web.Response:
        authorized(request)
        try:
            wait = parse_wait(dict(request.query))
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        if wait is None:
            return web.json_response(status_dict(driver, model))
        version, timeout_s = wait
        t0 = time.monotonic()
        try:
            got = await driver.active_waiters.wait(version, timeout_s)
        except TooManyWaiters as exc:
            raise web.HTTPServiceUnavailable(text=f"{exc}; poll /status instead\n",
                                             headers={"Retry-After": "1"}) from None
        doc = status_dict(driver, model)
        doc["wait"] = {"version": version, "reached": got,
                       "waited_s": round(time.monotonic() - t0, 3)}
        return web.json_response(doc)

    async def metrics(request: web.Request) -> web.Response:
        authorized(request)
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    if times is not None:
        async def fleet(request: web.Request) -> web.Response:
            authorized(request)
            return web.json_response(fleet_dict(driver, times))

        async def observe_fleet(_: web.Application) -> AsyncIterator[None]:
            async def loop() -> None:
                while True:
                    await asyncio.sleep(FLEET_OBSERVE_S)
                    core = driver.core
                    try:
                        times.observe(core.manifests, core.fleet(), time.time() - driver.now())
                    except Exception:  # a bug here must not take the API down
                        log.exception("fleet sampling failed; publish-to-active times stop")
                        return

            task = asyncio.ensure_future(loop())
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

        app.router.add_get("/fleet", fleet)
        app.cleanup_ctx.append(observe_fleet)
