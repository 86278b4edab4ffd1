"""A small aiohttp server that keeps SGLang's weight-update HTTP contract.

Used by the tests of ``node.engines.sglang`` (and runnable beside a node with
no GPU): it implements the endpoints and bodies written down in
docs/engines.md ("SGLang's HTTP contract") — field names, status codes, error
bodies, the pause modes and the model-update lock — and it really loads what
it is sent: ``/update_weights_from_disk`` reads every ``*.safetensors`` in
``model_path`` and copies each tensor into its state dict (same name and shape,
cast to the parameter's dtype, like a model's ``load_weights``), one tensor
after another, so a failure half-way leaves a mix, as a real engine would.

``/generate`` is deterministic and computed from the weights: every output
token is taken from a BLAKE3 hash of the state digest of the weights loaded at
that step, the prompt and the position, and each token takes
``--token-delay-s``; in-flight requests therefore see pauses and updates.

``/get_weights_by_name`` returns the first ``truncate_size`` rows of a tensor
as float32 lists (SGLang's shape; checkpoint names only, no fused-shard mapping).

What is not SGLang (test-only, under ``/contract/``):

- ``GET /contract/state``: ``{"state_digest", "weight_version", "paused",
  "pause_mode", "in_flight", "loads", "loading", "calls"}``;
- ``POST /contract/faults``: ``{"slow_load_s": s, "fail_load": "message",
  "status_500": true, "wrong_version": "7", "pause_ignores_mode": true}``
  (any subset; ``{}`` clears them);
- ``POST /contract/reset``: back to the base weights and the first version.

``/update_weights_from_tensor`` answers 400 ``success: false``: its
``serialized_named_tensors`` are SGLang's ``MultiprocessingSerializer`` pickles
(CUDA IPC handles), which only SGLang itself can open.

Run: ``python -m node.engines.testing.sglang_contract --model-path base.safetensors
--port 30000 [--weight-version default] [--api-key KEY] [--sglang-version 0.5.6]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import torch
from aiohttp import web
from safetensors import safe_open
from safetensors.torch import load_file

from swarm.codec import state_digest

VOCAB = 32000
PAUSE_MODES = ("abort", "retract", "in_place")


def expected_tokens(digest: bytes, prompt: str | list[int], n: int, start: int = 0) -> list[int]:
    """The tokens ``/generate`` yields for ``prompt`` at positions ``start..start+n-1``
    while the state digest is ``digest``."""
    key = json.dumps(prompt, separators=(",", ":")).encode()
    out = []
    for i in range(start, start + n):
        h = blake3.blake3(digest + struct.pack("<I", i) + key).digest()
        out.append(int.from_bytes(h[:4], "little") % VOCAB)
    return out


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


class RWLock:
    """SGLang's model-update lock: generate requests read, a weight update writes."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            self._writer = True  # new readers wait from now on
            await self._cond.wait_for(lambda: self._readers == 0)

    async def release_write(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()

    @property
    def locked(self) -> bool:
        return self._readers > 0 or self._writer


def error_response(status: int, message: str) -> web.Response:
    """SGLang's (OpenAI-style) error body, as its exception handlers write it."""
    phrase = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
              500: "Internal Server Error"}.get(status, str(status))
    return web.json_response({"object": "error", "message": message, "type": phrase,
                              "param": None, "code": status}, status=status)


class ContractServer:
    def __init__(self, model_path: Path, *, weight_version: str = "default",
                 api_key: str | None = None, sglang_version: str = "0.5.6",
                 token_delay_s: float = 0.01) -> None:
        self.model_path = str(model_path)
        self.base_path = model_path
        self.initial_version = weight_version
        self.weights = load_weights(model_path)
        self.digest = state_digest(self.weights)
        self.weight_version = weight_version
        self.api_key = api_key
        self.sglang_version = sglang_version
        self.token_delay_s = token_delay_s
        self.lock = RWLock()
        self.paused = False
        self.pause_mode: str | None = None
        self._resume = asyncio.Event()
        self._resume.set()
        self.in_flight: dict[str, dict[str, Any]] = {}
        self.loads = 0
        self.loading = False
        self.faults: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []
        self._rid = 0
        self.radix_cache: dict[str, int] = {}

    # --------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_route("GET", "/get_weights_by_name", self.get_weights_by_name)
        r.add_route("POST", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/contract/state", self.contract_state)
        r.add_post("/contract/faults", self.contract_faults)
        r.add_post("/contract/reset", self.contract_reset)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        # SGLang's api-key middleware: every route but the health checks needs the key
        open_path = request.path in ("/health", "/health_generate") \
            or request.path.startswith("/contract/")
        if self.api_key and not open_path \
                and request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        self.calls.append({"method": request.method, "path": request.path, "at": time.time()})
        return await handler(request)

    async def _json(self, request: web.Request, *, required: tuple[str, ...] = (),
                    optional: bool = False) -> dict[str, Any] | web.Response:
        raw = await request.read()
        if not raw:
            if optional:
                return {}
            return error_response(400, "1 validation error: body: Field required")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return error_response(400, f"JSON decode error: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "body: Input should be a valid dictionary")
        for key in required:
            if key not in body:
                return error_response(400, f"1 validation error: body.{key}: Field required")
        self.calls[-1]["body"] = body
        return body

    # ---------------------------------------------------------- endpoints

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def get_model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        })

    async def get_weight_version(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def get_server_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "weight_version": self.weight_version,
            "load_format": "auto", "version": self.sglang_version, "internal_states": [{}],
        })

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request, required=("new_version",))
        if isinstance(body, web.Response):
            return body
        if body.get("abort_all_requests", False):
            self._abort_all()
        self.weight_version = str(body["new_version"])
        return web.json_response({"success": True,
                                  "message": f"Weight version updated to {self.weight_version}",
                                  "new_version": self.weight_version})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request, optional=True)
        if isinstance(body, web.Response):
            return body
        mode = body.get("mode", "abort")  # SGLang's default
        if self.faults.get("pause_ignores_mode"):
            mode = "abort"  # what SGLang <= 0.5.5 does whatever the body says
        if mode not in PAUSE_MODES:
            return error_response(400, f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        self.paused = True
        self.pause_mode = mode
        self._resume.clear()
        if mode == "abort":
            self._abort_all()
            while self.lock.locked:  # like SGLang: wait until no request holds the lock
                await asyncio.sleep(0.01)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request, optional=True)
        if isinstance(body, web.Response):
            return body
        self.paused = False
        self.pause_mode = None
        self._resume.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request, required=("model_path",))
        if isinstance(body, web.Response):
            return body
        if self.faults.get("status_500"):
            return web.Response(status=500, text="Internal Server Error")
        if body.get("abort_all_requests", False):
            self._abort_all()
        locked = not self.paused  # SGLang: the writer lock unless generation is paused
        if locked:
            await self.lock.acquire_write()
        try:
            success, message = await self._load(Path(str(body["model_path"])))
        finally:
            if locked:
                await self.lock.release_write()
        if success:
            if body.get("flush_cache", True):
                self.radix_cache.clear()
            version = body.get("weight_version")
            if version is not None:
                self.weight_version = str(self.faults.get("wrong_version", version))
                message += f" Weight version updated to {version}."
            self.model_path = str(body["model_path"])
        content = {"success": success, "message": message, "num_paused_requests": 0}
        return web.json_response(content, status=200 if success else 400)

    async def _load(self, path: Path) -> tuple[bool, str]:
        self.loading = True
        try:
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
            if not files:
                return False, f"Failed to get weights iterator: Cannot find any model weights with `{path}`."
            names: list[tuple[Path, str]] = []
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    names.extend((f, k) for k in h.keys())  # noqa: SIM118 (safe_open API)
            slow = float(self.faults.get("slow_load_s", 0.0))
            fail = self.faults.get("fail_load")
            for i, (f, name) in enumerate(names):
                if slow:
                    await asyncio.sleep(slow / max(1, len(names)))
                if fail and i == len(names) // 2:
                    raise ValueError(str(fail))
                with safe_open(str(f), framework="pt") as h:
                    t = h.get_tensor(name)
                param = self.weights.get(name)
                if param is None:
                    raise KeyError(f"{name} is not a parameter of this model")
                if tuple(param.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} does not match the "
                                     f"parameter's {tuple(param.shape)}")
                param.copy_(t)  # cast to the parameter's dtype, like a weight_loader
            self.loads += 1
            return True, "Succeeded to update model weights."
        except Exception as exc:  # an engine reports any load failure
            return False, f"Failed to update weights: {exc}.\nRolling back to original weights."
        finally:
            self.digest = state_digest(self.weights)
            self.loading = False

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._json(request, required=("serialized_named_tensors",))
        if isinstance(body, web.Response):
            return body
        return web.json_response(
            {"success": False, "message": "the contract server cannot open SGLang's "
             "MultiprocessingSerializer payloads; use /update_weights_from_disk"}, status=400)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        # SGLang: the parameter as float32 lists, the first ``truncate_size`` rows
        body = await self._json(request, required=("name",))
        if isinstance(body, web.Response):
            return body
        t = self.weights.get(str(body["name"]))
        if t is None:
            return error_response(400, "Get parameter by name failed")
        return web.json_response(t.to(torch.float32).tolist()[: int(body.get("truncate_size", 100))])

    async def flush_cache(self, _: web.Request) -> web.Response:
        busy = bool(self.in_flight) and self.pause_mode != "retract"
        if not busy:
            self.radix_cache.clear()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
                 "(When there are running or waiting requests, the operation will not be performed.)\n",
            status=400 if busy else 200)

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("text", body.get("input_ids"))
        if prompt is None:
            return error_response(400, "Either text or input_ids should be provided.")
        params = body.get("sampling_params") or {}
        n = int(params.get("max_new_tokens", 16))
        self._rid += 1
        rid = str(body.get("rid") or f"req-{self._rid}")
        state: dict[str, Any] = {"aborted": False, "versions": []}
        t0 = time.perf_counter()
        await self._resume.wait()
        await self.lock.acquire_read()
        self.in_flight[rid] = state
        out: list[int] = []
        try:
            for i in range(n):
                if not self._resume.is_set():
                    await self._resume.wait()
                if state["aborted"]:
                    break
                out.extend(expected_tokens(self.digest, prompt, 1, i))
                if self.weight_version not in state["versions"]:
                    state["versions"].append(self.weight_version)
                await asyncio.sleep(self.token_delay_s)
        finally:
            self.in_flight.pop(rid, None)
            await self.lock.release_read()
        key = json.dumps(prompt)
        self.radix_cache[key] = self.radix_cache.get(key, 0) + 1
        finish = ({"type": "abort", "message": "Abort all requests."} if state["aborted"]
                  else {"type": "length", "length": n})
        extra: dict[str, Any] = {}
        if body.get("return_logprob"):
            extra["output_token_logprobs"] = [
                [-(tok % 1000) / 997.0, tok, None] for tok in out]
        return web.json_response({
            "text": " ".join(map(str, out)), "output_ids": out,
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": len(key),
                          "completion_tokens": len(out), "cached_tokens": 0,
                          "weight_version": self.weight_version,
                          "e2e_latency": time.perf_counter() - t0, **extra},
        })

    def _abort_all(self) -> None:
        for st in self.in_flight.values():
            st["aborted"] = True

    # ---------------------------------------------------------- test-only

    async def contract_state(self, _: web.Request) -> web.Response:
        return web.json_response({
            "state_digest": self.digest.hex(), "weight_version": self.weight_version,
            "paused": self.paused, "pause_mode": self.pause_mode,
            "in_flight": len(self.in_flight), "loads": self.loads, "loading": self.loading,
            "model_path": self.model_path, "calls": self.calls[-200:],
        })

    async def contract_faults(self, request: web.Request) -> web.Response:
        body = await self._json(request, optional=True)
        if isinstance(body, web.Response):
            return body
        self.faults = dict(body)
        return web.json_response({"faults": self.faults})

    async def contract_reset(self, _: web.Request) -> web.Response:
        """Back to the state at start (base weights, first version), no faults, as if restarted."""
        self.weights = load_weights(self.base_path)
        self.digest = state_digest(self.weights)
        self.model_path = str(self.base_path)
        self.weight_version = self.initial_version
        self.faults, self.calls, self.loads = {}, [], 0
        self.paused, self.pause_mode = False, None
        self._resume.set()
        self.radix_cache.clear()
        return web.json_response({"state_digest": self.digest.hex()})


def spawn(model_path: Path, port: int, *, host: str = "127.0.0.1", log: Path | None = None,
          extra: list[str] | None = None, timeout: float = 60.0) -> subprocess.Popen:
    """Start the contract server as its own process and wait until ``/health`` answers."""
    import urllib.request

    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.engines.testing.sglang_contract", "--model-path",
         str(model_path), "--host", host, "--port", str(port), *(extra or [])],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if log is not None:
        out.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang contract server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1.0):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"sglang contract server not answering on {host}:{port} after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--sglang-version", default="0.5.6")
    ap.add_argument("--token-delay-s", type=float, default=0.01)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    srv = ContractServer(a.model_path, weight_version=a.weight_version, api_key=a.api_key,
                         sglang_version=a.sglang_version, token_delay_s=a.token_delay_s)
    print(json.dumps({"event": "ready", "port": a.port, "state_digest": srv.digest.hex()}), flush=True)
    web.run_app(srv.app(), host=a.host, port=a.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
