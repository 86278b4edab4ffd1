"""The node's HTTP API, served on the same port as the peer protocol.

- ``GET /healthz``: 200 ``ok`` while the node runs (503 while draining), for
  container health checks and load balancers.
- ``GET /status``: JSON — node id, region, model, role, active and staged
  versions, the active state digest, peers, and chunk bytes sent/received
  split into same-region, cross-region and from-trainer, plus per region pair.
- ``GET /metrics``: Prometheus text format (``prometheus_client``), computed
  from the same state at scrape time, so the two never disagree.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from node.driver import Driver

KIND_NAMES = {"same_region": "same_region", "cross_region": "cross_region",
              "from_origin": "from_trainer"}


def status_dict(driver: Driver, model: str) -> dict[str, Any]:
    """The ``/status`` document (call on the loop thread)."""
    core = driver.core
    st = core.status()
    counters = st["counters"]
    engine = driver.engine
    digest = engine.digest.hex() if engine is not None else None
    if engine is None:
        rec = _active_record(driver)
        digest = rec.digest.hex() if rec is not None else None

    def split(d: dict[str, int]) -> dict[str, int]:
        return {KIND_NAMES[k]: v for k, v in d.items()}

    return {
        "node_id": st["node_id"],
        "region": st["region"],
        "model": model,
        "role": st["role"],
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
        "dup_chunks": counters["dup_chunks"],
        "wire_bytes": dict(driver.wire_bytes),
        "apply_seconds": {str(k): round(v, 6) for k, v in driver.apply_seconds.items()},
        "activated_at": {str(k): v for k, v in driver.activated_at.items()},
        "store_bytes": driver.store.used_bytes,
        "uptime_s": round(time.time() - driver.started_at, 3),
        "draining": driver.draining,
    }


def _active_record(driver: Driver) -> Any:
    try:
        return driver.store.active()
    except Exception:
        return None


class _Collector:
    """Prometheus collector reading the driver's state at scrape time."""

    def __init__(self, driver: Driver, model: str) -> None:
        self.driver = driver
        self.model = model

    def collect(self):  # type: ignore[no-untyped-def]
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
        c = CounterMetricFamily("patchswarm_bad_chunks", "Chunks that failed verification",
                                labels=labels)
        c.add_metric(who, float(st["bad_chunks"]))
        yield c
        g = GaugeMetricFamily("patchswarm_store_bytes", "Bytes held in the chunk store",
                              labels=labels)
        g.add_metric(who, float(st["store_bytes"]))
        yield g


def add_routes(app: web.Application, driver: Driver, model: str) -> None:
    """Mount /healthz, /status and /metrics on the driver's application."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(driver, model))

    async def healthz(_: web.Request) -> web.Response:
        if driver.draining:
            return web.Response(status=503, text="draining\n")
        return web.Response(text="ok\n")

    async def status(_: web.Request) -> web.Response:
        return web.json_response(status_dict(driver, model))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
