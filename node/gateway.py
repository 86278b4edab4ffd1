"""The version-pinned request gateway in front of a node's engine (docs/gateway.md).

One small aiohttp application on its own address (``[gateway] listen``):
``POST /v1/completions``, ``/v1/chat/completions`` and ``/generate`` go to the
engine — forwarded to the vLLM/SGLang server at ``[engine] url``, or answered
by ``node.engines.tiny_lm`` over the node's in-process truth — and
``GET /gateway/version`` says what is served.

- **Pins.** A request may carry ``min_version`` or ``exact_version`` (in the
  JSON body or as ``X-Patchswarm-Min-Version`` / ``X-Patchswarm-Exact-Version``);
  they are stripped before forwarding. A malformed pin is a 400 naming the
  field. A pin the node cannot satisfy now is a 409 with ``target_version``,
  ``served_version``, ``reason`` (``behind``: the node has not reached it yet;
  ``ahead``: the node has passed an exact pin, waiting here never helps;
  ``commit_pending``: an exact pin on the version a pending commit replaces)
  and ``Retry-After``.
- **Served version** is the version the engine confirmed (the driver's
  ``EngineState``); the in-process engine's truth is its own confirmation.
- **Stamps.** Every response carries ``X-Patchswarm-Version-Start`` (served
  when admitted) and, unless streamed, ``X-Patchswarm-Version-End`` (served when
  it completed); a JSON object body gets ``"patchswarm": {"version_start",
  "version_end"}``; a stream gets the same member as one last SSE event before
  ``data: [DONE]``. Every token of the response came from a version in
  ``[version_start, version_end]``: a response that completes while a commit
  runs (``keep`` mode, or admitted during the commit) waits for that commit to
  settle before it is stamped.
- **Hold.** The driver enters ``commit_hold(next)`` right before the engine
  commits (``Driver.commit_gate``): the commit waits while exact-pinned requests
  are in flight, at most ``hold_max_s``; meanwhile new exact pins on the old
  version get 409 ``commit_pending``, so the hold cannot be starved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from node.engines.http import error_text
from node.gateway_config import GatewayConfig

if TYPE_CHECKING:
    from node.driver import Driver
    from node.engines.inprocess import InProcessWeights

log = logging.getLogger("patchswarm.gateway")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
PIN_HEADERS = {"min_version": "X-Patchswarm-Min-Version",
               "exact_version": "X-Patchswarm-Exact-Version"}
START_HEADER = "X-Patchswarm-Version-Start"
END_HEADER = "X-Patchswarm-Version-End"
MAX_VERSION = 2 ** 63 - 1
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # a non-streamed engine answer larger than this is a 502
MAX_NEW_TOKENS = 4096
MAX_PROMPT_TOKENS = 32768
CADENCE_COMMITS = 8  # recent commits the Retry-After estimate looks at
SHUTDOWN_S = 5.0


# ------------------------------------------------------------------ pins


class PinError(ValueError):
    """A malformed version field (HTTP 400); ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Pin:
    kind: str  # "min" | "exact"
    version: int

    @property
    def field(self) -> str:
        return f"{self.kind}_version"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number with a fraction", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _body_version(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PinError(name, f"expected a non-negative integer, got {_kind(value)} "
                             f"({json.dumps(value)[:40]})")
    if not 0 <= value <= MAX_VERSION:
        raise PinError(name, f"expected a non-negative integer below 2**63, got {value}")
    return value


def _header_version(name: str, header: str, text: str) -> int:
    t = text.strip()
    if not t or len(t) > 19 or not t.isascii() or not t.isdigit():
        raise PinError(name, f"header {header}: expected a non-negative integer, "
                             f"got {text[:40]!r}")
    value = int(t)
    if value > MAX_VERSION:
        raise PinError(name, f"header {header}: expected a non-negative integer below 2**63")
    return value


def parse_pin(body: Mapping[str, Any] | None, headers: Mapping[str, str]) -> Pin | None:
    """The request's pin, from its JSON body or headers; ``PinError`` when malformed.

    A body field that is ``null`` counts as absent. Giving both fields, or one
    field both in the body and as a header, is an error."""
    found: dict[str, int] = {}
    for name, header in PIN_HEADERS.items():
        in_body = body is not None and name in body and body[name] is not None
        in_header = header in headers
        if in_body and in_header:
            raise PinError(name, f"given both in the body and as header {header}; give it once")
        if in_body:
            found[name] = _body_version(name, body[name])  # type: ignore[index]
        elif in_header:
            found[name] = _header_version(name, header, headers[header])
    if len(found) == 2:
        raise PinError("exact_version", "give min_version or exact_version, not both")
    if not found:
        return None
    name, v = next(iter(found.items()))
    return Pin(name.removesuffix("_version"), v)


# ------------------------------------------------------------------ the gateway


class Refused(Exception):
    """Answer the request with ``status`` and a JSON ``body`` (and ``headers``)."""

    def __init__(self, status: int, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body.get("error"))
        self.status = status
        self.body = body
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


@dataclass
class Admitted:
    """One admitted request: its pin and the served version when it was admitted."""

    route: str
    pin: Pin | None
    start: int
    during_commit: bool  # admitted while an engine commit was running
    end: int | None = None


@dataclass
class GatewayStats:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (route, outcome) -> n
    holds: int = 0
    hold_seconds: float = 0.0
    hold_timeouts: int = 0


class Gateway:
    """See the module docstring. ``start``/``stop`` run its server; the driver calls
    ``commit_hold`` (set it as ``Driver.commit_gate``)."""

    def __init__(self, cfg: GatewayConfig, driver: Driver, *, model: str,
                 model_config: Path | None = None) -> None:
        self.cfg = cfg
        self.driver = driver
        self.model = model
        ecfg = driver.engine_cfg
        self.pause_mode = ecfg.pause_mode if ecfg is not None else "wait"
        self.pending: int | None = None  # the version a commit waiting to run will bring
        self.committing = False  # the engine commit itself is running
        self.inflight = 0
        self.exact_inflight = 0
        self.stats = GatewayStats()
        self._commits: deque[float] = deque(maxlen=CADENCE_COMMITS)  # monotonic, successes
        self._last_commit_s = 0.0
        self._exact_idle: asyncio.Event | None = None
        self._settled: asyncio.Event | None = None
        # Set while no commit runs: the in-process runner's threads wait on it before they
        # take the truth's lock, so a commit is not starved by a stream of requests.
        self.open = threading.Event()
        self.open.set()
        self.upstream: HttpUpstream | LocalRunner
        engine = driver.engine
        if engine is not None and engine.kind != "inprocess":
            assert ecfg is not None and ecfg.url is not None
            self.upstream = HttpUpstream(ecfg.url, ecfg.api_key, cfg.upstream_timeout_s)
        else:
            self.upstream = LocalRunner(self, driver.weights, model_config)
        self.runner: web.AppRunner | None = None

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes,
                              middlewares=[self._middleware])
        for route in ROUTES:
            app.router.add_post(route, self._handle)
        app.router.add_get("/gateway/version", self._version)
        return app

    async def start(self) -> None:
        """Listen on ``[gateway] listen``."""
        self._exact_idle = asyncio.Event()
        self._exact_idle.set()
        self._settled = asyncio.Event()
        self._settled.set()
        await self.upstream.start()
        # on stop, requests in flight get a few seconds to finish (like the driver's drain)
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                    shutdown_timeout=SHUTDOWN_S)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.cfg.host, self.cfg.port, reuse_address=True).start()
        log.info("gateway listening on %s:%d (%s upstream)", self.cfg.host, self.cfg.port,
                 self.upstream.name)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        await self.upstream.close()
        self.open.set()

    # ------------------------------------------------------------ versions

    def served(self) -> tuple[int | None, str]:
        """The version the engine confirmed it serves, or (None, why not)."""
        d = self.driver
        if d.engine is None or d.weights is None:
            return None, "this node feeds no engine"
        if d.engine.kind == "inprocess":
            return d.weights.version, ""  # the truth's commit is the engine's
        st = d.engine_state
        if st.served_version is None:
            return None, (f"the {st.kind} engine has not confirmed any version yet"
                          + (f": {st.reason}" if st.reason else ""))
        if st.uncertain:
            return None, f"the {st.kind} engine's weights are uncertain until rebuilt: {st.reason}"
        if st.state == "behind":  # it reported another version than it confirmed (restarted?)
            return None, f"the {st.kind} engine is being brought back: {st.reason}"
        return st.served_version, ""

    def _cadence(self) -> float | None:
        c = self._commits
        if len(c) < 2:
            return None
        return (c[-1] - c[0]) / (len(c) - 1)

    def retry_after(self, reason: str, target: int, served: int) -> int:
        """Seconds a client should wait before asking this node again."""
        est = self.cfg.retry_after_s
        if reason == "commit_pending":
            est = max(self._last_commit_s, 0.5)
        elif reason == "behind":
            cadence = self._cadence()
            if cadence is not None:
                est = self._commits[-1] + cadence * (target - served) - time.monotonic()
        return int(min(3600, max(1, math.ceil(est))))

    def _conflict(self, pin: Pin, served: int, reason: str) -> Refused:
        why = {"behind": f"this node serves version {served}; {pin.field} {pin.version} is "
                         "not here yet",
               "ahead": f"this node has moved past version {pin.version} (serves {served}); "
                        "waiting here will not bring it back",
               "commit_pending": f"version {served} is about to be replaced by {self.pending}; "
                                 "exact pins on it are not admitted while a commit is pending"}
        body = {"error": why[reason], "target_version": pin.version, "served_version": served,
                "reason": reason, "pin": pin.field, "satisfiable_here": reason != "ahead"}
        return Refused(409, body, {"Retry-After": str(self.retry_after(reason, pin.version,
                                                                        served))})

    def admit(self, route: str, pin: Pin | None) -> Admitted:
        """Check the pin against what is served now; ``Refused`` (409/503) if it cannot run."""
        if self.driver.draining:
            raise Refused(503, {"error": "the node is draining", "served_version": None},
                          {"Retry-After": str(math.ceil(self.cfg.retry_after_s))})
        served, why = self.served()
        if served is None:
            raise Refused(503, {"error": why, "served_version": None},
                          {"Retry-After": str(math.ceil(self.cfg.retry_after_s))})
        if pin is not None:
            if pin.version > served:
                raise self._conflict(pin, served, "behind")
            if pin.kind == "exact":
                if pin.version < served:
                    raise self._conflict(pin, served, "ahead")
                if self.pending is not None:
                    raise self._conflict(pin, served, "commit_pending")
        return Admitted(route, pin, served, self.committing)

    @contextlib.contextmanager
    def _in_flight(self, adm: Admitted) -> Iterator[None]:
        exact = adm.pin is not None and adm.pin.kind == "exact"
        self.inflight += 1
        if exact:
            self.exact_inflight += 1
            assert self._exact_idle is not None
            self._exact_idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if exact:
                self.exact_inflight -= 1
                if self.exact_inflight == 0 and self._exact_idle is not None:
                    self._exact_idle.set()

    async def end_version(self, adm: Admitted) -> int:
        """The served version now, once a commit that may have touched the response settled."""
        if self.committing and (self.pause_mode == "keep" or adm.during_commit):
            assert self._settled is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), self.cfg.upstream_timeout_s)
        served, _ = self.served()
        return served if served is not None else adm.start

    @contextlib.asynccontextmanager
    async def commit_hold(self, version: int) -> AsyncIterator[None]:
        """The driver's commit gate: hold while exact pins are in flight (bounded)."""
        self.pending = version
        t0 = time.monotonic()
        if self.exact_inflight and self._exact_idle is not None:
            log.info("commit of version %d waits for %d exact-pinned request(s) (at most %g s)",
                     version, self.exact_inflight, self.cfg.hold_max_s)
            try:
                await asyncio.wait_for(self._exact_idle.wait(), self.cfg.hold_max_s)
            except TimeoutError:
                self.stats.hold_timeouts += 1
                log.warning("commit of version %d: %d exact-pinned request(s) still in flight "
                            "after gateway.hold_max_s = %g s; committing", version,
                            self.exact_inflight, self.cfg.hold_max_s)
            held = time.monotonic() - t0
            self.stats.holds += 1
            self.stats.hold_seconds += held
        self.committing = True
        self.open.clear()
        if self._settled is not None:
            self._settled.clear()
        ok = False
        c0 = time.monotonic()
        try:
            yield
            ok = True
        finally:
            self.pending = None
            self.committing = False
            self.open.set()
            if self._settled is not None:
                self._settled.set()
            if ok:
                self._last_commit_s = time.monotonic() - c0
                self._commits.append(time.monotonic())

    # ------------------------------------------------------------ HTTP

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        route = request.path if request.path in ROUTES else "other"
        try:
            if self.cfg.token is not None:
                got = request.headers.get("Authorization", "")
                if not hmac.compare_digest(got.encode(), f"Bearer {self.cfg.token}".encode()):
                    raise Refused(401, {"error": "a bearer token is required "
                                                 "(gateway.token_file)"},
                                  {"WWW-Authenticate": "Bearer"})
            resp = await handler(request)
        except Refused as r:
            resp = r.response()
        except web.HTTPRequestEntityTooLarge:
            resp = web.json_response({"error": f"request body larger than gateway.max_body_bytes "
                                               f"({self.cfg.max_body_bytes})"}, status=413)
        except web.HTTPException as exc:
            resp = web.json_response({"error": exc.reason}, status=exc.status)
        outcome = "ok" if resp.status < 400 else str(resp.status)
        key = (route, outcome)
        self.stats.requests[key] = self.stats.requests.get(key, 0) + 1
        return resp

    async def _version(self, _: web.Request) -> web.Response:
        served, why = self.served()
        return web.json_response({"served_version": served, "reason": why or None,
                                  "pending_version": self.pending, "committing": self.committing,
                                  "in_flight": self.inflight,
                                  "exact_in_flight": self.exact_inflight})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()  # bounded by client_max_size (413)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Refused(400, {"error": f"the body is not JSON: {exc}"}) from None
        if not isinstance(body, dict):
            raise Refused(400, {"error": "the body must be a JSON object"})
        try:
            pin = parse_pin(body, request.headers)
        except PinError as exc:
            raise Refused(400, {"error": str(exc), "field": exc.field}) from None
        for name in PIN_HEADERS:
            body.pop(name, None)
        adm = self.admit(request.path, pin)
        with self._in_flight(adm):
            return await self.upstream.forward(self, request, body, adm)

    # ------------------------------------------------------------ stamps

    @staticmethod
    def stamp(adm: Admitted) -> dict[str, int | None]:
        return {"version_start": adm.start, "version_end": adm.end}

    def json_answer(self, adm: Admitted, obj: Any, status: int = 200) -> web.Response:
        """A JSON response stamped in its headers and (for an object) its body."""
        if isinstance(obj, dict):
            obj = {**obj, "patchswarm": self.stamp(adm)}
        return web.json_response(obj, status=status, headers=self.stamp_headers(adm))

    @staticmethod
    def stamp_headers(adm: Admitted) -> dict[str, str]:
        h = {START_HEADER: str(adm.start)}
        if adm.end is not None:
            h[END_HEADER] = str(adm.end)
        return h

    def stamp_event(self, adm: Admitted) -> bytes:
        return b"data: " + json.dumps({"patchswarm": self.stamp(adm)}).encode() + b"\n\n"

    # ------------------------------------------------------------ metrics

    def metric_families(self, labels: list[str], who: list[str]) -> Iterator[Any]:
        """Prometheus families for the node's /metrics (``node.api``)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            SummaryMetricFamily,
        )

        c = CounterMetricFamily("patchswarm_gateway_requests", "Gateway requests by route and "
                                "outcome (ok or the HTTP status)",
                                labels=[*labels, "route", "outcome"])
        for (route, outcome), n in sorted(self.stats.requests.items()):
            c.add_metric([*who, route, outcome], float(n))
        yield c
        s = SummaryMetricFamily("patchswarm_gateway_hold_seconds",
                                "Engine commits held for exact-pinned requests in flight",
                                labels=labels)
        s.add_metric(who, count_value=float(self.stats.holds), sum_value=self.stats.hold_seconds)
        yield s
        c = CounterMetricFamily("patchswarm_gateway_hold_timeouts",
                                "Holds that ended at gateway.hold_max_s", labels=labels)
        c.add_metric(who, float(self.stats.hold_timeouts))
        yield c
        served, _ = self.served()
        g = GaugeMetricFamily("patchswarm_gateway_served_version",
                              "Version the gateway admits requests against (-1: none)",
                              labels=labels)
        g.add_metric(who, float(served if served is not None else -1))
        yield g
        g = GaugeMetricFamily("patchswarm_gateway_in_flight", "Gateway requests in flight",
                              labels=labels)
        g.add_metric(who, float(self.inflight))
        yield g


# ------------------------------------------------------------------ upstreams


class HttpUpstream:
    """Forward to the vLLM/SGLang server at ``[engine] url`` (streams passed through)."""

    name = "http"

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=True)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _failed(self, status: int, message: str) -> web.Response:
        return web.json_response({"error": message, "upstream": self.url}, status=status)

    async def forward(self, gw: Gateway, request: web.Request, body: dict[str, Any],
                      adm: Admitted) -> web.StreamResponse:
        assert self.session is not None
        headers = {"Content-Type": "application/json",
                   "Accept": request.headers.get("Accept", "*/*")}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.url + request.path
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        resp: web.StreamResponse | None = None
        try:
            async with self.session.post(url, data=json.dumps(body).encode(), headers=headers,
                                         timeout=timeout) as r:
                if r.status >= 500:
                    text = (await r.content.read(4096)).decode("utf-8", "replace")
                    return self._failed(502, f"the engine answered HTTP {r.status}: "
                                             f"{error_text(text) or r.reason}")
                ctype = r.headers.get("Content-Type", "")
                if ctype.startswith("text/event-stream"):
                    resp = web.StreamResponse(status=r.status, headers={
                        "Content-Type": ctype, "Cache-Control": "no-cache",
                        START_HEADER: str(adm.start)})
                    await resp.prepare(request)
                    await self._relay_sse(gw, r, resp, adm)
                    return resp
                raw = await r.content.read(MAX_RESPONSE_BYTES + 1)
                if len(raw) > MAX_RESPONSE_BYTES:
                    return self._failed(502, f"the engine's answer is larger than "
                                             f"{MAX_RESPONSE_BYTES} bytes")
                adm.end = await gw.end_version(adm)
                if ctype.startswith("application/json"):
                    try:
                        return gw.json_answer(adm, json.loads(raw), r.status)
                    except ValueError:
                        pass
                return web.Response(body=raw, status=r.status, headers={
                    "Content-Type": ctype or "application/octet-stream", **gw.stamp_headers(adm)})
        except TimeoutError:
            msg = f"the engine did not answer within gateway.upstream_timeout_s = {self.timeout_s:g} s"
            if resp is None:
                return self._failed(504, msg)
            await self._stream_error(resp, msg)
            return resp
        except (aiohttp.ClientError, OSError) as exc:
            msg = f"the engine at {self.url} is unreachable or broke off: {type(exc).__name__}: {exc}"
            if resp is None:
                return self._failed(502, msg)
            await self._stream_error(resp, msg)
            return resp

    async def _relay_sse(self, gw: Gateway, r: aiohttp.ClientResponse, resp: web.StreamResponse,
                         adm: Admitted) -> None:
        """Pass events through; put the stamp event before ``data: [DONE]`` (or at the end)."""
        buf = b""
        done = False
        async for chunk in r.content.iter_any():
            buf += chunk
            while True:
                i = buf.find(b"\n\n")
                if i < 0:
                    break
                event, buf = buf[:i + 2], buf[i + 2:]
                if event.strip() == b"data: [DONE]":
                    adm.end = await gw.end_version(adm)
                    await resp.write(gw.stamp_event(adm))
                    done = True
                await resp.write(event)
        if buf:
            await resp.write(buf)
        if not done:
            adm.end = await gw.end_version(adm)
            await resp.write(gw.stamp_event(adm))
        await resp.write_eof()

    @staticmethod
    async def _stream_error(resp: web.StreamResponse, message: str) -> None:
        with contextlib.suppress(Exception):
            await resp.write(b"data: " + json.dumps({"error": {"message": message,
                                                              "type": "upstream_error"}}).encode()
                             + b"\n\n")
            await resp.write_eof()


class Stop(Exception):
    """The request's exact pin no longer holds when its generation starts."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


class LocalRunner:
    """The in-process engine's answers: greedy decoding with ``tiny_lm`` over the truth.

    One request decodes at a time (a thread of its own). The truth's lock is
    held for the whole generation in ``wait`` mode (a commit waits for it; new
    requests wait for the commit), per token in ``keep`` mode (a commit may land
    between two tokens; the tokens after it come from the new version)."""

    name = "in-process"

    def __init__(self, gw: Gateway, truth: InProcessWeights | None,
                 model_config: Path | None) -> None:
        self.gw = gw
        self.truth = truth
        self.model_config = model_config
        self._cfg: dict[str, Any] | None = None
        self._cfg_error: str | None = None
        self.pool: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="patchswarm-gen")

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _shape(self) -> Any:
        from node.engines import tiny_lm

        if self.truth is None:
            raise Refused(501, {"error": "this node holds no weights to generate from"})
        if self._cfg is None and self._cfg_error is None:
            if self.model_config is None or not self.model_config.exists():
                self._cfg_error = ("no model config: the in-process runner needs the model's "
                                   "config.json (beside weights.base, or gateway.model_config)")
            else:
                try:
                    self._cfg = tiny_lm.read_config(self.model_config)
                except tiny_lm.Unsupported as exc:
                    self._cfg_error = str(exc)
        if self._cfg is None:
            raise Refused(501, {"error": f"generation is not available: {self._cfg_error}"})
        try:
            # Names and shapes only, without the truth's lock: a generation may hold it for
            # long, and this runs on the event loop. A commit never changes names or shapes
            # but a full checkpoint may: it is checked again by the forward pass itself.
            return tiny_lm.shape_of(dict(self.truth.weights), self._cfg)
        except tiny_lm.Unsupported as exc:
            raise Refused(501, {"error": f"the served weights are not a causal LM the in-process "
                                         f"runner supports: {exc}"}) from None

    @staticmethod
    def _request(route: str, body: dict[str, Any]) -> tuple[Any, int, bool]:
        """(prompt, max new tokens, stream) from an SGLang or OpenAI completions body."""
        def bad(msg: str) -> Refused:
            return Refused(400, {"error": msg})

        if route == "/v1/chat/completions":
            raise Refused(501, {"error": "the in-process runner has no chat template or "
                                         "tokenizer; use /v1/completions or /generate"})
        if route == "/generate":
            prompt = body.get("input_ids", body.get("text"))
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise bad("sampling_params: expected an object")
            n, n_key = params.get("max_new_tokens", 16), "sampling_params.max_new_tokens"
            temp = params.get("temperature", 0)
        else:
            prompt = body.get("prompt")
            n, n_key = body.get("max_tokens", 16), "max_tokens"
            temp = body.get("temperature", 0)
        if prompt is None:
            raise bad("a prompt is required (input_ids or text for /generate, prompt for "
                      "/v1/completions)")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
            raise bad(f"{n_key}: expected an integer in 1..{MAX_NEW_TOKENS}, got {n!r}")
        if isinstance(temp, bool) or not isinstance(temp, int | float) or temp != 0:
            raise bad(f"temperature: the in-process runner decodes greedily only (0), got {temp!r}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad(f"stream: expected true or false, got {stream!r}")
        return prompt, n, stream

    def _decode(self, dec: Any, n: int, exact: int | None, cancel: threading.Event,
                on_token: Any) -> None:
        """Generation thread: ``n`` greedy tokens, reading the truth under its lock."""
        truth = self.truth
        assert truth is not None

        def one() -> None:
            v = truth.version
            if exact is not None and not dec.versions and v != exact:
                raise Stop(v)
            on_token(dec.step(truth.weights, v), v)

        self.gw.open.wait()
        if self.gw.pause_mode == "keep":
            for _ in range(n):
                if cancel.is_set():
                    return
                self.gw.open.wait()
                with truth.lock:
                    one()
        else:
            with truth.lock:
                for _ in range(n):
                    if cancel.is_set():
                        return
                    one()

    async def forward(self, gw: Gateway, request: web.Request, body: dict[str, Any],
                      adm: Admitted) -> web.StreamResponse:
        from node.engines import tiny_lm

        shape = self._shape()
        prompt, n, stream = self._request(request.path, body)
        try:
            ids = tiny_lm.prompt_ids(prompt, shape.vocab)
        except ValueError as exc:
            raise Refused(400, {"error": f"prompt: {exc}"}) from None
        if len(ids) + n > MAX_PROMPT_TOKENS:
            raise Refused(400, {"error": f"prompt and new tokens exceed {MAX_PROMPT_TOKENS}"})
        dec = tiny_lm.Decoder(shape, ids)
        exact = adm.pin.version if adm.pin is not None and adm.pin.kind == "exact" else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        cancel = threading.Event()

        def on_token(tok: int, v: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (tok, v))

        assert self.pool is not None
        fut = asyncio.wrap_future(self.pool.submit(self._decode, dec, n, exact, cancel, on_token))
        rid = uuid.uuid4().hex[:16]
        resp: web.StreamResponse | None = None
        try:
            if stream:
                # headers only once the first token (or a refusal) is known
                first = await self._next(queue, fut)
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache",
                                                   START_HEADER: str(adm.start)})
                await resp.prepare(request)
                item = first
                while item is not None:
                    await resp.write(b"data: " + json.dumps(
                        self._chunk(request.path, rid, *item)).encode() + b"\n\n")
                    item = await self._next(queue, fut)
                adm.end = dec.versions[-1] if dec.versions else adm.start
                await resp.write(gw.stamp_event(adm) + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            await asyncio.wait_for(asyncio.shield(fut), gw.cfg.upstream_timeout_s)
        except Stop as s:
            raise gw._conflict(adm.pin, s.version, "ahead") from None  # type: ignore[arg-type]
        except TimeoutError:
            raise Refused(504, {"error": f"generation did not finish within "
                                         f"gateway.upstream_timeout_s = "
                                         f"{gw.cfg.upstream_timeout_s:g} s"}) from None
        finally:
            cancel.set()
        out = dec.output
        adm.end = dec.versions[-1] if dec.versions else adm.start
        if request.path == "/generate":
            return gw.json_answer(adm, {
                "text": tiny_lm.ids_text(out), "output_ids": out,
                "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": len(out)},
                              "prompt_tokens": len(ids), "completion_tokens": len(out),
                              "weight_version": str(adm.end)}})
        return gw.json_answer(adm, {
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
            "model": gw.model,
            "choices": [{"index": 0, "text": tiny_lm.ids_text(out), "token_ids": out,
                         "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                      "total_tokens": len(ids) + len(out)}})

    @staticmethod
    async def _next(queue: asyncio.Queue, fut: asyncio.Future) -> tuple[int, int] | None:
        """The next (token, version), or None once the generation thread is done."""
        while True:
            if not queue.empty():
                return queue.get_nowait()
            if fut.done():
                fut.result()  # raises Stop or a bug
                return None if queue.empty() else queue.get_nowait()
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                return getter.result()
            getter.cancel()

    def _chunk(self, route: str, rid: str, tok: int, version: int) -> dict[str, Any]:
        """One streamed token; ``/generate`` names the version that produced it."""
        from node.engines import tiny_lm

        toks = [tok]
        if route == "/generate":
            return {"text": tiny_lm.ids_text(toks), "output_ids": toks,
                    "meta_info": {"id": rid, "weight_version": str(version)}}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
                "model": self.gw.model, "choices": [{"index": 0, "text": tiny_lm.ids_text(toks),
                                                     "token_ids": toks, "logprobs": None,
                                                     "finish_reason": None}]}
