"""The version-pinned request gateway (node.gateway), on real aiohttp servers on loopback.

Each test runs a real ``Driver`` (its apply and engine-sync paths, no core: the
rig feeds it versions as ``ApplyVersion`` would) with a ``Gateway`` in front of
its engine: the in-process engine over a tiny random Llama (answers computed
by ``node.engines.tiny_lm``), or the SGLang contract server run on loopback,
whose weight updates go through the real SGLang adapter and whose requests the
gateway forwards. Pins that cannot be served get 409 with Retry-After, bad
fields 400, every answer is stamped, and exact pins in flight hold a commit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from lab.fleet import LoopbackFleet, free_port
from node.driver import Driver
from node.engines import tiny_lm
from node.engines.config import EngineConfig
from node.engines.inprocess import InProcessEngine, InProcessWeights
from node.engines.sglang import SGLangEngine
from node.engines.testing.sglang_contract import ContractServer
from node.gateway import END_HEADER, START_HEADER, Gateway, Pin, PinError, parse_pin
from node.gateway_config import GatewayConfig
from swarm.codec import encode_patch
from tests.driver_fakes import FakeManifest, FakeStore
from trainer.served import served_view

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vllm_support import llama_masters, rl_step, write_model

SMALL = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
PROMPT = [1, 17, 230, 45, 99, 3]


def _run(fn: Any) -> Any:
    """Run an async test on a fresh event loop."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


# ------------------------------------------------------------------ the version-field parser


@given(st.integers(0, 2 ** 63 - 1), st.sampled_from(["min_version", "exact_version"]),
       st.booleans())
def test_pin_parser_accepts_non_negative_ints(v: int, name: str, as_header: bool) -> None:
    header = {"min_version": "X-Patchswarm-Min-Version",
              "exact_version": "X-Patchswarm-Exact-Version"}[name]
    pin = parse_pin({}, {header: str(v)}) if as_header else parse_pin({name: v}, {})
    assert pin == Pin(name.removesuffix("_version"), v)


_bad_body = st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=8),
                      st.integers(max_value=-1), st.integers(min_value=2 ** 63),
                      st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                           st.integers(), max_size=1))


@given(_bad_body, st.sampled_from(["min_version", "exact_version"]))
def test_pin_parser_refuses_every_bad_body_value(value: Any, name: str) -> None:
    with pytest.raises(PinError) as e:
        parse_pin({name: value}, {})
    assert e.value.field == name and str(e.value).startswith(f"{name}: ")


@given(st.text(max_size=24).filter(lambda t: not (t.strip().isascii() and t.strip().isdigit()
                                                   and len(t.strip()) <= 19)))
def test_pin_parser_refuses_bad_headers(text: str) -> None:
    try:
        pin = parse_pin({}, {"X-Patchswarm-Exact-Version": text})
    except PinError as exc:
        assert exc.field == "exact_version" and "X-Patchswarm-Exact-Version" in str(exc)
    else:
        raise AssertionError(f"accepted {text!r} as {pin}")


def test_pin_parser_refuses_both_fields_and_twice_given() -> None:
    with pytest.raises(PinError, match="not both"):
        parse_pin({"min_version": 1, "exact_version": 2}, {})
    with pytest.raises(PinError, match="not both"):
        parse_pin({"min_version": 1}, {"X-Patchswarm-Exact-Version": "2"})
    with pytest.raises(PinError, match="give it once"):
        parse_pin({"min_version": 1}, {"X-Patchswarm-Min-Version": "1"})
    assert parse_pin({"min_version": None}, {}) is None


# ------------------------------------------------------------------ rigs


class Rig:
    """A driver with a tiny Llama truth, an engine and a gateway in front of it."""

    def __init__(self, tmp: Path, *, engine: str = "inprocess", pause_mode: str = "wait",
                 hold_max_s: float = 5.0, weights: dict[str, torch.Tensor] | None = None,
                 token_delay_s: float = 0.02, retry_after_s: float = 3.0,
                 upstream_timeout_s: float = 30.0, api_key: str | None = None) -> None:
        self.tmp = tmp
        self.masters = llama_masters(0, SMALL)
        self.served = {1: weights if weights is not None else served_view(self.masters, "bf16")}
        write_model(tmp / "model", self.served[1], SMALL)
        self.kind, self.pause_mode, self.hold_max_s = engine, pause_mode, hold_max_s
        self.token_delay_s = token_delay_s
        self.retry_after_s, self.upstream_timeout_s = retry_after_s, upstream_timeout_s
        self.api_key = api_key
        self.store = FakeStore()
        self.applied: list[tuple[int, bool]] = []
        self.contract: ContractServer | None = None
        self.runners: list[web.AppRunner] = []

    async def __aenter__(self) -> Rig:
        base = self.tmp / "model" / "model.safetensors"
        self.truth = InProcessWeights.load(base, 1, "cpu")
        if self.kind == "inprocess":
            engine: Any = InProcessEngine(self.truth)
            ecfg = EngineConfig(pause_mode=self.pause_mode)
        else:
            self.contract = ContractServer(base, weight_version="1", api_key=self.api_key,
                                           token_delay_s=self.token_delay_s)
            app = self.contract.app()
            app.router.add_post("/v1/completions", self._slow_stream)
            port = await self._serve(app)
            self.engine_url = f"http://127.0.0.1:{port}"
            ecfg = EngineConfig(kind="sglang", url=self.engine_url, pause_mode=self.pause_mode,
                                timeout_s=5.0, commit_timeout_s=30.0, api_key=self.api_key,
                                exchange_dir=self.tmp / "exchange")
            engine = SGLangEngine(ecfg)
        self.driver = Driver(None, self.store, None, weights=self.truth, engine=engine,  # type: ignore[arg-type]
                             engine_cfg=ecfg, host="127.0.0.1", port=0)
        self.driver.feed = lambda e: self.applied.append((e.version, e.ok))  # type: ignore[method-assign]
        self.driver.loop = asyncio.get_running_loop()
        if self.kind != "inprocess":
            async with self.driver._engine_lock:
                assert await self.driver._sync_engine()
        self.port = free_port(["127.0.0.1"])
        cfg = GatewayConfig("127.0.0.1", self.port, hold_max_s=self.hold_max_s,
                            retry_after_s=self.retry_after_s,
                            upstream_timeout_s=self.upstream_timeout_s)
        self.gw = Gateway(cfg, self.driver, model="tiny-llama",
                          model_config=self.tmp / "model" / "config.json")
        self.driver.commit_gate = self.gw.commit_hold
        await self.gw.start()
        self.http = aiohttp.ClientSession()
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()
        await self.gw.stop()
        for r in self.runners:
            await r.cleanup()

    async def _serve(self, app: web.Application) -> int:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port(["127.0.0.1"])
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        return port

    async def _slow_stream(self, request: web.Request) -> web.StreamResponse:
        """An OpenAI-style SSE stream from the contract engine: one event per token, each
        naming the weight version that produced it; generation pauses while it is paused."""
        cs = self.contract
        assert cs is not None
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await cs.lock.acquire_read()
        try:
            for i in range(int(body.get("max_tokens", 8))):
                await cs._resume.wait()
                event = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}],
                         "weight_version": cs.weight_version}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await asyncio.sleep(self.token_delay_s)
        finally:
            await cs.lock.release_read()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def publish(self) -> int:
        """The next trainer step's served view, as a patch the driver can apply."""
        v = max(self.served) + 1
        self.masters = rl_step(self.masters, v)
        self.served[v] = served_view(self.masters, "bf16")
        enc = encode_patch(self.served[v - 1], self.served[v])
        self.store.m[v] = (FakeManifest("patch", enc.base_digest, enc.target_digest), enc.patch)
        return v

    def apply(self, v: int) -> asyncio.Task:
        return asyncio.ensure_future(self.driver._apply(v))

    async def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
                   ) -> tuple[int, dict[str, str], Any]:
        async with self.http.post(self.url + path, json=body, headers=headers or {}) as r:
            text = await r.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = text
            return r.status, dict(r.headers), data

    def greedy(self, v: int, n: int, prompt: list[int] = PROMPT) -> list[int]:
        shape = tiny_lm.shape_of(self.served[v], tiny_lm.read_config(
            self.tmp / "model" / "config.json"))
        return tiny_lm.greedy(shape, self.served[v], prompt, n)


async def _until(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _gen(n: int = 6, **pin: int) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n}, **pin}


# ------------------------------------------------------------------ in-process engine


@_run
async def test_inprocess_answers_are_stamped_and_computed_from_the_served_version(
        tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        status, headers, out = await rig.post("/generate", _gen(6))
        assert status == 200, out
        assert out["output_ids"] == rig.greedy(1, 6)
        assert out["patchswarm"] == {"version_start": 1, "version_end": 1}
        assert headers[START_HEADER] == "1" and headers[END_HEADER] == "1"
        assert out["meta_info"]["weight_version"] == "1"

        v = rig.publish()
        await rig.apply(v)
        assert rig.applied == [(2, True)] and rig.driver.engine_state.served_version == 2
        status, headers, out = await rig.post("/v1/completions",
                                              {"prompt": PROMPT, "max_tokens": 5, "min_version": 2})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == rig.greedy(2, 5)
        assert out["patchswarm"] == {"version_start": 2, "version_end": 2}
        assert out["object"] == "text_completion" and out["model"] == "tiny-llama"
        # a text prompt is its UTF-8 bytes as token ids
        status, _, out = await rig.post("/generate", {"text": "hi!", "sampling_params": {
            "max_new_tokens": 3}, "exact_version": 2})
        assert status == 200 and out["output_ids"] == rig.greedy(2, 3, list(b"hi!"))


@_run
async def test_unsatisfiable_pins_get_409_with_retry_after(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        await rig.apply(rig.publish())  # serves 2
        cases = [({"min_version": 3}, "behind", 3),            # min ahead of the node
                 ({"exact_version": 4}, "behind", 4),          # exact ahead of the node
                 ({"exact_version": 1}, "ahead", 1)]           # exact behind: passed for good
        for pin, reason, target in cases:
            status, headers, out = await rig.post("/generate", _gen(2, **pin))
            assert status == 409, out
            assert out["target_version"] == target and out["served_version"] == 2
            assert out["reason"] == reason and out["error"]
            assert out["satisfiable_here"] is (reason != "ahead")
            assert int(headers["Retry-After"]) >= 1
        # the same through headers
        status, headers, out = await rig.post("/v1/completions", {"prompt": PROMPT},
                                              {"X-Patchswarm-Min-Version": "5"})
        assert status == 409 and out["reason"] == "behind" and out["target_version"] == 5
        # without commit history Retry-After is the configured default
        assert headers["Retry-After"] == "3"
        assert (await rig.post("/generate", _gen(2, min_version=2)))[0] == 200
        assert (await rig.post("/generate", _gen(2, exact_version=2)))[0] == 200


@pytest.mark.parametrize(("body", "headers", "field"), [
    ({"min_version": True}, {}, "min_version"),
    ({"exact_version": False}, {}, "exact_version"),
    ({"min_version": 2.0}, {}, "min_version"),
    ({"exact_version": 1.5}, {}, "exact_version"),
    ({"min_version": "2"}, {}, "min_version"),
    ({"exact_version": -1}, {}, "exact_version"),
    ({"exact_version": [1]}, {}, "exact_version"),
    ({"min_version": {"v": 1}}, {}, "min_version"),
    ({"min_version": 2 ** 64}, {}, "min_version"),
    ({"min_version": 1, "exact_version": 1}, {}, "exact_version"),
    ({}, {"X-Patchswarm-Exact-Version": "two"}, "exact_version"),
    ({}, {"X-Patchswarm-Min-Version": "-3"}, "min_version"),
    ({}, {"X-Patchswarm-Min-Version": "1.0"}, "min_version"),
    ({"min_version": 1}, {"X-Patchswarm-Exact-Version": "1"}, "exact_version"),
])
@_run
async def test_malformed_version_fields_are_refused_with_400(
        tmp_path: Path, body: dict, headers: dict, field: str) -> None:
    async with Rig(tmp_path) as rig:
        status, _, out = await rig.post("/generate", {**_gen(2), **body}, headers)
        assert status == 400, out
        assert out["field"] == field and out["error"].startswith(field)
        assert rig.gw.stats.requests[("/generate", "400")] == 1


@_run
async def test_bad_bodies_and_unsupported_models(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        async with rig.http.post(rig.url + "/generate", data=b"{not json") as r:
            assert r.status == 400 and "not JSON" in (await r.json())["error"]
        async with rig.http.post(rig.url + "/generate", data=b"x" * (2 * 1024 * 1024)) as r:
            assert r.status == 413 and "max_body_bytes" in (await r.json())["error"]
        status, _, out = await rig.post("/generate", {"input_ids": [5000]})
        assert status == 400 and "outside the vocabulary" in out["error"]
        status, _, out = await rig.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
        assert status == 400 and "max_tokens" in out["error"]
        status, _, out = await rig.post("/v1/chat/completions", {"messages": []})
        assert status == 501 and "chat" in out["error"]
    # weights that are not a causal LM (an encoder): 501, but pins are still checked
    g = torch.Generator().manual_seed(1)
    enc = {"enc.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16)}
    sub = tmp_path / "enc"
    sub.mkdir()
    async with Rig(sub, weights=enc) as rig:
        status, _, out = await rig.post("/generate", _gen(2))
        assert status == 501 and "not a causal LM" in out["error"], out
        status, headers, out = await rig.post("/generate", _gen(2, exact_version=7))
        assert status == 409 and out["reason"] == "behind" and "Retry-After" in headers


@_run
async def test_inprocess_stream_ends_with_the_stamp_event(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        async with rig.http.post(rig.url + "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4, "stream": True, "exact_version": 1}) as r:
            assert r.status == 200 and r.headers[START_HEADER] == "1"
            events = [e for e in (await r.text()).split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: ")) == {
            "patchswarm": {"version_start": 1, "version_end": 1}}
        toks = [json.loads(e.removeprefix("data: "))["choices"][0]["token_ids"][0]
                for e in events[:-2]]
        assert toks == rig.greedy(1, 4)


# ------------------------------------------------------------------ external engine (SGLang)


@_run
async def test_sglang_passthrough_is_stamped(tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang") as rig:
        status, headers, out = await rig.post("/generate", _gen(3, exact_version=1))
        assert status == 200, out
        assert out["meta_info"]["weight_version"] == "1" and len(out["output_ids"]) == 3
        assert out["patchswarm"] == {"version_start": 1, "version_end": 1}
        assert headers[START_HEADER] == headers[END_HEADER] == "1"
        # the pin fields never reach the engine
        assert "exact_version" not in json.dumps(rig.contract.calls)
        # the engine's own 4xx passes through, stamped; the client's fault, not the engine's
        status, headers, out = await rig.post("/generate", {"sampling_params": {}})
        assert status == 400 and headers[START_HEADER] == "1"


@_run
async def test_request_spanning_a_commit_in_keep_mode_has_start_before_end(
        tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang", pause_mode="keep", token_delay_s=0.05) as rig:
        v = rig.publish()

        async def stream() -> tuple[aiohttp.ClientResponse, list[str]]:
            async with rig.http.post(rig.url + "/v1/completions", json={
                    "prompt": "x", "max_tokens": 60, "stream": True, "min_version": 1}) as r:
                return r, [e for e in (await r.text()).split("\n\n") if e]

        async def plain() -> tuple[int, dict[str, str], Any]:
            return await rig.post("/generate", _gen(60, min_version=1))

        s_task, p_task = asyncio.ensure_future(stream()), asyncio.ensure_future(plain())
        await asyncio.sleep(0.4)
        await rig.apply(v)
        assert rig.driver.engine_state.served_version == 2
        r, events = await s_task
        assert r.status == 200 and r.headers[START_HEADER] == "1"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: ")) == {
            "patchswarm": {"version_start": 1, "version_end": 2}}
        produced = [json.loads(e.removeprefix("data: "))["weight_version"] for e in events[:-2]]
        assert produced[0] == "1" and produced[-1] == "2"  # really spanned the commit
        status, headers, out = await p_task
        assert status == 200, out
        assert out["patchswarm"] == {"version_start": 1, "version_end": 2}
        assert headers[START_HEADER] == "1" and headers[END_HEADER] == "2"


@_run
async def test_exact_pin_in_flight_holds_the_commit(tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang", pause_mode="keep", hold_max_s=10,
                   token_delay_s=0.05) as rig:
        v = rig.publish()
        pinned = asyncio.ensure_future(rig.post("/generate", _gen(40, exact_version=1)))
        await _until(lambda: rig.gw.exact_inflight == 1)
        t0 = time.monotonic()
        applying = rig.apply(v)
        await _until(lambda: rig.gw.pending == 2)  # the commit reached the gate and waits
        assert not applying.done() and not pinned.done()
        # while the commit waits, new exact pins on version 1 are turned away ...
        status, headers, out = await rig.post("/generate", _gen(2, exact_version=1))
        assert status == 409 and out["reason"] == "commit_pending", out
        assert out["served_version"] == 1 and int(headers["Retry-After"]) >= 1
        # ... min pins and unpinned requests still run
        assert (await rig.post("/generate", _gen(1, min_version=1)))[0] == 200
        status, headers, out = await pinned
        assert status == 200 and out["patchswarm"] == {"version_start": 1, "version_end": 1}
        assert out["meta_info"]["weight_version"] == "1"
        await applying
        assert rig.driver.engine_state.served_version == 2
        assert rig.gw.stats.holds == 1 and rig.gw.stats.hold_timeouts == 0
        assert 0.2 < rig.gw.stats.hold_seconds < 10
        assert time.monotonic() - t0 >= rig.gw.stats.hold_seconds
        # the commit cadence now drives Retry-After; an exact pin on 2 runs again
        assert (await rig.post("/generate", _gen(1, exact_version=2)))[0] == 200


@_run
async def test_hold_is_released_after_hold_max_s(tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang", pause_mode="keep", hold_max_s=0.3,
                   token_delay_s=0.05) as rig:
        v = rig.publish()
        pinned = asyncio.ensure_future(rig.post("/generate", _gen(100, exact_version=1)))
        await _until(lambda: rig.gw.exact_inflight == 1)
        t0 = time.monotonic()
        await rig.apply(v)
        took = time.monotonic() - t0
        assert rig.driver.engine_state.served_version == 2
        assert not pinned.done() and 0.3 <= took < 4.5
        assert rig.gw.stats.hold_timeouts == 1
        status, _, out = await pinned
        # it ran on past the commit (keep mode): the stamps say so
        assert status == 200 and out["patchswarm"] == {"version_start": 1, "version_end": 2}


@_run
async def test_engine_down_is_a_502_not_the_clients_fault(tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang") as rig:
        for r in rig.runners:
            await r.cleanup()
        rig.runners.clear()
        status, _, out = await rig.post("/generate", _gen(2))
        assert status == 502 and "unreachable" in out["error"] and out["upstream"]
        assert rig.gw.stats.requests[("/generate", "502")] == 1
        text = "\n".join(map(str, rig.gw.metric_families(["node"], ["n"])))
        assert "patchswarm_gateway_requests" in text


# ------------------------------------------------------------------ a real node process


def _post_sync(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.mark.timeout(300)
def test_node_process_serves_a_tiny_llama_through_the_gateway(tmp_path: Path) -> None:
    masters = llama_masters(0, SMALL)
    write_model(tmp_path / "m", served_view(masters, "bf16"), SMALL)
    cfg = tiny_lm.read_config(tmp_path / "m" / "config.json")

    def expect(m: dict[str, torch.Tensor], n: int) -> list[int]:
        w = served_view(m, "bf16")
        return tiny_lm.greedy(tiny_lm.shape_of(w, cfg), w, PROMPT, n)

    fleet = LoopbackFleet(1, 1, chunk_size=16 * 1024, swarm={"redial_s": 1.0})
    node = fleet.nodes[0]
    gport = free_port([node.host])
    section = f'\n[gateway]\nlisten = "{node.host}:{gport}"\nretry_after_s = 2\n'
    orig = fleet._write_configs

    def write_configs() -> None:
        orig()
        node.config.write_text(node.config.read_text() + section)
        (fleet.workdir / "config.json").write_text((tmp_path / "m" / "config.json").read_text())

    fleet._write_configs = write_configs  # type: ignore[method-assign]
    url = f"http://{node.host}:{gport}"
    with fleet:
        fleet.start_nodes_only(served_view(masters, "bf16"))
        # version 2 is not there yet: 409 with the served version and Retry-After
        status, headers, out = _post_sync(url + "/generate", _gen(8, exact_version=2))
        assert status == 409 and out["reason"] == "behind", out
        assert out["served_version"] == 1 and headers["Retry-After"] == "2"
        status, headers, out = _post_sync(url + "/generate", _gen(8))
        assert status == 200 and out["output_ids"] == expect(masters, 8), out
        assert out["patchswarm"] == {"version_start": 1, "version_end": 1}

        masters = rl_step(masters, 1)
        ckpt = tmp_path / "step1.safetensors"
        save_file(masters, str(ckpt))
        r = fleet.publish_cli(ckpt, "--wait-peers", "30", "--linger", "2", "--timeout", "120",
                              "--regions", "1")
        assert r.returncode == 0, fleet.trainer_log.read_text()[-2000:]
        fleet.wait_version(2, timeout=90)
        status, headers, out = _post_sync(url + "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 8, "exact_version": 2})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == expect(masters, 8)
        assert out["patchswarm"] == {"version_start": 2, "version_end": 2}
        assert headers[START_HEADER] == headers[END_HEADER] == "2"
        metrics = urllib.request.urlopen(f"http://{node.api_addr}/metrics", timeout=5).read()
        text = metrics.decode()
        assert 'route="/generate"' in text and 'outcome="409"' in text
        assert "patchswarm_gateway_served_version" in text


# ------------------------------------------------------------------ config, auth, keep in-process


def _node_doc(**gateway: Any) -> dict[str, Any]:
    return {"node": {"id": "n1", "region": "r1", "model": "m"},
            "network": {"listen": "127.0.0.1:7400", "swarm_secret": "ab" * 32},
            "trust": {"trainer_keys": ["trainer.pub"]}, "store": {"dir": "store"},
            "weights": {"base": "base.safetensors"}, "api": {"listen": "127.0.0.1:7401"},
            "gateway": gateway}


@pytest.mark.parametrize(("gateway", "key"), [
    ({}, "gateway.listen"),
    ({"listen": "nowhere"}, "gateway.listen"),
    ({"listen": "127.0.0.1:7401"}, "gateway.listen"),  # the API's address
    ({"listen": "127.0.0.1:7402", "hold_max_s": -1}, "gateway.hold_max_s"),
    ({"listen": "127.0.0.1:7402", "hold_max_s": True}, "gateway.hold_max_s"),
    ({"listen": "127.0.0.1:7402", "retry_after_s": 0}, "gateway.retry_after_s"),
    ({"listen": "127.0.0.1:7402", "max_body_bytes": 10}, "gateway.max_body_bytes"),
    ({"listen": "127.0.0.1:7402", "upstream_timeout_s": "5"}, "gateway.upstream_timeout_s"),
    ({"listen": "127.0.0.1:7402", "token_file": "missing.token"}, "gateway.token_file"),
    ({"listen": "127.0.0.1:7402", "model_config": 3}, "gateway.model_config"),
    ({"listen": "127.0.0.1:7402", "hold": 3}, "gateway.hold"),
])
def test_gateway_config_errors_name_the_key(tmp_path: Path, gateway: dict, key: str) -> None:
    from node.config import parse_config
    from swarm.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{key}: "):
        parse_config(_node_doc(**gateway), tmp_path)


def test_gateway_config_defaults_and_absent(tmp_path: Path) -> None:
    from node.config import parse_config

    (tmp_path / "gw.token").write_text("t" * 32 + "\n")
    cfg = parse_config(_node_doc(listen="127.0.0.1:7402", token_file="gw.token",
                                 hold_max_s=2.5), tmp_path).gateway
    assert cfg is not None and (cfg.host, cfg.port) == ("127.0.0.1", 7402)
    assert cfg.hold_max_s == 2.5 and cfg.retry_after_s == 2.0 and cfg.token == "t" * 32
    doc = _node_doc()
    del doc["gateway"]
    assert parse_config(doc, tmp_path).gateway is None


@_run
async def test_gateway_token(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        rig.gw.cfg = dataclasses.replace(rig.gw.cfg, token="s" * 20)
        status, headers, out = await rig.post("/generate", _gen(2))
        assert status == 401 and "gateway.token_file" in out["error"]
        assert headers["WWW-Authenticate"] == "Bearer"
        status, _, out = await rig.post("/generate", _gen(2),
                                        {"Authorization": "Bearer " + "s" * 20})
        assert status == 200, out


@_run
async def test_inprocess_keep_mode_commits_between_tokens(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is ~40x faster on a busy machine
    try:
        await _keep_mode_span(tmp_path)
    finally:
        torch.set_num_threads(threads)


async def _keep_mode_span(tmp_path: Path) -> None:
    async with Rig(tmp_path, pause_mode="keep") as rig:
        v = rig.publish()
        async with rig.http.post(rig.url + "/generate", json={
                **_gen(600), "stream": True, "min_version": 1}) as r:
            assert r.status == 200 and r.headers[START_HEADER] == "1"
            first = await r.content.readuntil(b"\n\n")  # the first token is out: now commit
            await rig.apply(v)
            rest = await r.content.read()
            events = [e for e in (first + rest).decode().split("\n\n") if e]
        assert rig.driver.engine_state.served_version == 2
        stamp = json.loads(events[-2].removeprefix("data: "))
        assert stamp == {"patchswarm": {"version_start": 1, "version_end": 2}}
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        toks = [c["output_ids"][0] for c in chunks]
        versions = [c["meta_info"]["weight_version"] for c in chunks]
        k = versions.index("2")
        assert 0 < k < len(toks) == 600 and set(versions[k:]) == {"2"}
        # before the commit: version 1's greedy tokens; after it: version 2's continuation
        assert toks[:k] == rig.greedy(1, k)
        assert toks[k:k + 20] == rig.greedy(2, 20, PROMPT + toks[:k])


@_run
async def test_engine_in_an_unknown_state_is_503_not_a_wrong_stamp(tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang") as rig:
        rig.contract.faults = {"fail_load": "out of memory"}
        await rig.apply(rig.publish())
        st = rig.driver.engine_state
        assert st.state == "unhealthy" and st.uncertain  # a failed load may leave a mix
        status, headers, out = await rig.post("/generate", _gen(2))
        assert status == 503 and "uncertain" in out["error"] and out["served_version"] is None
        assert headers["Retry-After"] == "3"
        rig.contract.faults = {}
        async with rig.driver._engine_lock:
            assert await rig.driver._sync_engine()  # what the watch task does on its next probe
        status, _, out = await rig.post("/generate", _gen(2, exact_version=2))
        assert status == 200 and out["patchswarm"] == {"version_start": 2, "version_end": 2}


@_run
async def test_retry_after_follows_the_commit_cadence(tmp_path: Path) -> None:
    async with Rig(tmp_path, retry_after_s=7) as rig:
        status, headers, _ = await rig.post("/generate", _gen(1, min_version=2))
        assert status == 409 and headers["Retry-After"] == "7"  # no cadence known yet
        await rig.apply(rig.publish())
        await asyncio.sleep(0.6)
        await rig.apply(rig.publish())  # serves 3; a commit every ~0.6-0.9 s
        status, headers, out = await rig.post("/generate", _gen(1, min_version=6))
        assert status == 409 and out["served_version"] == 3
        assert 1 <= int(headers["Retry-After"]) <= 3  # three commits away
        status, headers, out = await rig.post("/generate", _gen(1, exact_version=2))
        assert out["reason"] == "ahead" and headers["Retry-After"] == "7"


@_run
async def test_engine_too_slow_is_a_504(tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang", token_delay_s=0.05, upstream_timeout_s=0.3) as rig:
        status, _, out = await rig.post("/generate", _gen(40))
        assert status == 504 and "upstream_timeout_s" in out["error"], out
        assert rig.gw.stats.requests[("/generate", "504")] == 1


@_run
async def test_the_engine_key_goes_to_the_engine_the_clients_header_does_not(
        tmp_path: Path) -> None:
    async with Rig(tmp_path, engine="sglang", api_key="engine-key-0123456789") as rig:
        status, _, out = await rig.post("/generate", _gen(2),
                                        {"Authorization": "Bearer someone-elses"})
        assert status == 200 and out["patchswarm"]["version_end"] == 1, out
        async with rig.http.post(rig.engine_url + "/generate", json=_gen(2)) as r:
            assert r.status == 401  # the engine does want its key


@_run
async def test_inprocess_wait_mode_commit_waits_for_the_generation(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with Rig(tmp_path, pause_mode="wait") as rig:
            v = rig.publish()
            long = asyncio.ensure_future(rig.post("/generate", _gen(400)))
            await _until(lambda: rig.gw.inflight == 1)
            await asyncio.sleep(0.1)
            applying = rig.apply(v)
            await _until(lambda: rig.gw.committing)  # the commit waits for the weights' lock
            assert not long.done()
            # the event loop stays free while the generation holds the weights
            t0 = time.monotonic()
            async with rig.http.get(rig.url + "/gateway/version") as r:
                info = await r.json()
            assert time.monotonic() - t0 < 1.0 and info["in_flight"] == 1
            assert info["committing"] and info["served_version"] == 1
            status, _, out = await long
            assert status == 200 and out["patchswarm"] == {"version_start": 1, "version_end": 1}
            assert out["output_ids"][:50] == rig.greedy(1, 50)
            await applying
            assert rig.truth.version == 2
    finally:
        torch.set_num_threads(threads)
