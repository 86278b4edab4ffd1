"""``VllmEngine`` against a stand-in of vLLM's dev-mode HTTP API (fast; no vLLM needed).

The stand-in answers the endpoints the adapter uses (``/pause``, ``/resume``,
``/collective_rpc``, ``/update_weight_version``, ``/weight_info``,
``/reset_prefix_cache``) and plays the worker extension's ``patchswarm_layout``
and ``patchswarm_apply`` from the update file, so the tests check the plan the
adapter writes (sparse / dense / reload with the whole module group), the call
order, and the failure semantics of the port. The real engine is in
``test_engine_vllm_e2e.py`` (slow).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from safetensors import safe_open

from node.engines.base import EngineError, TensorUpdate, WeightUpdate
from node.engines.vllm import VllmEngine

PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _layout(names: list[str]) -> dict:
    out = {}
    for n in names:
        mod, _, _param = n.rpartition(".")
        head, _, leaf = mod.rpartition(".")
        if leaf in PACKED:
            mod = f"{head}.{PACKED[leaf]}"
        parts = [k for k, v in PACKED.items() if v == PACKED.get(leaf)] or [leaf]
        out[n] = {"module": mod, "inplace": "norm" in n,  # like the CPU backend: linears repacked
                  "group": [f"{head}.{p}.weight" for p in parts]}
    return {"layout": out, "device": "cpu", "dtype": "torch.float32"}


class FakeVllm:
    """Records calls; ``fail`` names an endpoint or rpc method to fail."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.version = "default"
        self.paused = False
        self.fail: str | None = None
        self.refuse = False
        self.applied: list[dict] = []
        self.bad_version = False
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                fake.calls.append("GET " + self.path)
                if self.path == "/weight_info":
                    self._send(200, {"weight_version": fake.version})
                else:
                    self._send(404, {"error": "no"})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null")
                path = urlsplit(self.path).path
                what = path if path != "/collective_rpc" else body["method"]
                fake.calls.append(f"POST {self.path}" + (f" {what}" if what != path else ""))
                if fake.fail == what:
                    self._send(500, {"error": f"{what} failed"})
                    return
                if path == "/pause":
                    fake.paused = True
                    self._send(200, {"status": "paused"})
                elif path == "/resume":
                    fake.paused = False
                    self._send(200, {"status": "resumed"})
                elif path == "/update_weight_version":
                    fake.version = "999" if fake.bad_version else body["new_version"]
                    self._send(200, {"success": True})
                elif path == "/reset_prefix_cache":
                    self._send(200, {"success": True})
                elif what == "patchswarm_layout":
                    self._send(200, {"results": [_layout(json.loads(body["args"][0]))]})
                elif what == "patchswarm_apply":
                    with safe_open(body["args"][0], framework="pt") as f:
                        meta = f.metadata()
                        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                    entries = json.loads(meta["entries"])
                    fake.applied.append({"meta": meta, "entries": entries, "tensors": tensors})
                    if fake.refuse:
                        self._send(200, {"results": [{"ok": False, "wrote": False, "error": "no"}]})
                    else:
                        self._send(200, {"results": [{"ok": True, "wrote": True,
                                                      "counts": {}, "bytes": {}}]})
                else:
                    self._send(404, {"error": "unknown"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def fake() -> Any:
    f = FakeVllm()
    yield f
    f.close()


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    names = ["model.norm.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    return {n: torch.randn(64 if "norm" in n else (16, 64), generator=g).to(torch.bfloat16)
            for n in names}


def _changed(truth: dict, name: str, idx: list[int], value: float = 0.5) -> TensorUpdate:
    t = truth[name]
    t.view(-1)[torch.tensor(idx)] = value
    return TensorUpdate(name, t, torch.tensor(idx, dtype=torch.int64))


def test_plan_sparse_dense_reload_with_siblings(fake: FakeVllm, tmp_path: Path) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path, truth=truth)
    assert eng.served_version() is None
    ups = (_changed(truth, "model.norm.weight", [1, 5]),                       # in place, sparse
           _changed(truth, "model.layers.0.input_layernorm.weight", list(range(40))),  # > 25%: dense
           _changed(truth, "model.layers.0.self_attn.k_proj.weight", [3]))      # repacked: reload
    u = WeightUpdate(7, 6, b"\1" * 32, ups)
    eng.stage(u)
    assert not fake.paused and "patchswarm_apply" not in " ".join(fake.calls)
    stats = eng.commit(u)
    assert eng.served_version() == 7 and not fake.paused
    (applied,) = fake.applied
    plan = {e["name"]: e["path"] for e in applied["entries"]}
    assert plan == {"model.norm.weight": "sparse",
                    "model.layers.0.input_layernorm.weight": "dense",
                    # the whole fused group travels, unchanged siblings included
                    "model.layers.0.self_attn.q_proj.weight": "reload",
                    "model.layers.0.self_attn.k_proj.weight": "reload",
                    "model.layers.0.self_attn.v_proj.weight": "reload"}
    tens = applied["tensors"]
    assert tens["i/model.norm.weight"].tolist() == [1, 5]
    assert torch.equal(tens["v/model.norm.weight"], truth["model.norm.weight"][[1, 5]])
    for n in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{n}.weight"
        assert torch.equal(tens[f"w/{name}"], truth[name])  # exact bits
    assert applied["meta"]["version"] == "7"
    assert stats.path == "sparse+dense+reload" and stats.bytes > 0
    ops = [c for c in fake.calls if c.startswith("POST")]
    assert ops[-5:] == ["POST /pause?mode=wait", "POST /collective_rpc patchswarm_apply",
                        "POST /update_weight_version", "POST /reset_prefix_cache", "POST /resume"]
    assert not list(tmp_path.glob("update-v*"))  # the exchange file is gone after the commit


def test_change_to_nan_goes_dense(fake: FakeVllm, tmp_path: Path) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path, truth=truth)
    u = WeightUpdate(1, 0, b"\1" * 32, (_changed(truth, "model.norm.weight", [2], float("nan")),))
    eng.stage(u)
    eng.commit(u)
    (applied,) = fake.applied
    assert applied["entries"][0]["path"] == "dense"
    assert torch.isnan(applied["tensors"]["w/model.norm.weight"][2])


def test_refusal_before_any_write_is_certain_and_resumes(fake: FakeVllm, tmp_path: Path) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path, truth=truth)
    fake.refuse = True
    u = WeightUpdate(1, 0, b"\1" * 32, (_changed(truth, "model.norm.weight", [2]),))
    eng.stage(u)
    with pytest.raises(EngineError) as ei:
        eng.commit(u)
    assert not ei.value.uncertain and not fake.paused and fake.version == "default"


@pytest.mark.parametrize("fail", ["patchswarm_apply", "/update_weight_version", "/resume"])
def test_failures_after_the_apply_began_are_uncertain(fake: FakeVllm, tmp_path: Path,
                                                      fail: str) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path, truth=truth)
    fake.fail = fail
    u = WeightUpdate(1, 0, b"\1" * 32, (_changed(truth, "model.norm.weight", [2]),))
    eng.stage(u)
    with pytest.raises(EngineError) as ei:
        eng.commit(u)
    assert ei.value.uncertain
    if fail != "/resume":
        assert fake.paused  # nothing is served from weights that may be a mix
    # the node rebuilds it: a full update resumes it at a known version
    fake.fail = None
    full = WeightUpdate(1, None, b"\1" * 32,
                        tuple(TensorUpdate(n, t) for n, t in truth.items()), full=True)
    eng.stage(full)
    stats = eng.commit(full)
    assert stats.path == "subset-reload" and not fake.paused and eng.served_version() == 1
    assert {e["path"] for e in fake.applied[-1]["entries"]} == {"reload"}


def test_pause_failure_is_certain(fake: FakeVllm, tmp_path: Path) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path, truth=truth)
    fake.fail = "/pause"
    u = WeightUpdate(1, 0, b"\1" * 32, (_changed(truth, "model.norm.weight", [2]),))
    eng.stage(u)
    with pytest.raises(EngineError) as ei:
        eng.commit(u)
    assert not ei.value.uncertain and not fake.applied


def test_wrong_version_after_commit_is_uncertain(fake: FakeVllm, tmp_path: Path) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path, truth=truth)
    fake.bad_version = True
    u = WeightUpdate(3, 2, b"\1" * 32, (_changed(truth, "model.norm.weight", [2]),))
    eng.stage(u)
    with pytest.raises(EngineError) as ei:
        eng.commit(u)
    assert ei.value.uncertain and "999" in str(ei.value)


def test_missing_sibling_without_truth_refuses_the_stage(fake: FakeVllm, tmp_path: Path) -> None:
    truth = _truth()
    eng = VllmEngine(fake.url, tmp_path)  # no truth, no full update committed yet
    u = WeightUpdate(1, 0, b"\1" * 32,
                     (_changed(truth, "model.layers.0.self_attn.k_proj.weight", [3]),))
    with pytest.raises(EngineError) as ei:
        eng.stage(u)
    assert (not ei.value.uncertain and "q_proj" in str(ei.value)) or "v_proj" in str(ei.value)
    # after a full update the adapter holds every tensor and can send the group
    full = WeightUpdate(0, None, b"\1" * 32,
                        tuple(TensorUpdate(n, t) for n, t in truth.items()), full=True)
    eng.stage(full)
    eng.commit(full)
    eng.stage(u)
    eng.commit(u)
    assert eng.served_version() == 1


def test_unreachable_engine_and_unstaged_commit(tmp_path: Path) -> None:
    eng = VllmEngine("http://127.0.0.1:9", tmp_path, timeout_s=1.0)
    with pytest.raises(EngineError) as ei:
        eng.served_version()
    assert not ei.value.uncertain
    with pytest.raises(EngineError):
        eng.commit(WeightUpdate(1, 0, b"\1" * 32, ()))


def test_from_config(tmp_path: Path) -> None:
    from node.engines.config import parse_engine
    from node.engines.vllm import VLLMEngine

    cfg = parse_engine({"kind": "vllm", "url": "http://127.0.0.1:8000", "pause_mode": "keep",
                        "sparse_max_fraction": 0.1}, tmp_path, tmp_path)
    eng = VLLMEngine(cfg, truth=_truth())
    assert eng.pause_mode == "keep" and eng.sparse_max_fraction == 0.1
    assert eng.exchange_dir == tmp_path / "engine-exchange" and eng.kind == "vllm"


def test_rl_steps_change_a_few_percent_of_the_served_view() -> None:
    """Guard for the slow tests: an RL-sized step changes some, not most, BF16 values."""
    from tests.engine_vllm_support import llama_masters, rl_step
    from trainer.served import served_view

    m0 = llama_masters(0)
    a, b = served_view(m0, "bf16"), served_view(rl_step(m0, 1, lr=2e-4), "bf16")
    changed = sum(int((a[k].view(torch.int16) != b[k].view(torch.int16)).sum()) for k in a)
    assert 0.005 < changed / sum(v.numel() for v in a.values()) < 0.2


def test_engine_venv_reuses_a_good_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/engine_venv.py: a venv whose marker records the same recipe and that imports
    vLLM is reused without running pip; a different recipe is rebuilt."""
    from tests.engine_vllm_support import engine_venv

    dest = tmp_path / "venv"
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "python").write_text("")
    monkeypatch.setattr(engine_venv, "probe", lambda d, timeout=300.0: "0.32.0")
    pips: list[tuple] = []
    monkeypatch.setattr(engine_venv, "pip", lambda d, *a, log=None: pips.append(a))
    want = engine_venv.recipe(engine_venv.VLLM_PACKAGE, False)
    (dest / engine_venv.MARKER).write_text(json.dumps(want))
    assert engine_venv.build(dest) == dest / "bin" / "python" and not pips
    # another vLLM package: rebuilt (pip runs), marker rewritten
    monkeypatch.setattr(engine_venv.subprocess, "run",
                        lambda *a, **k: type("R", (), {"returncode": 1, "stdout": ""})())
    engine_venv.build(dest, "vllm==0.32.0")
    assert pips and pips[0][:3] == ("install", "-c", str(dest / "engine-constraints.txt"))
    # the engine venv shares only the torch pin of the lock (vLLM pins its own transformers)
    assert (dest / "engine-constraints.txt").read_text().startswith("torch==")
    assert (dest / "engine-constraints.txt").read_text().count("\n") == 1
    assert "vllm==0.32.0" in pips[0] and "torchcodec==0.14.0" in pips[0]
    assert ("install", "--no-deps", "--no-build-isolation", "-e", str(engine_venv.ROOT)) in pips
    assert json.loads((dest / engine_venv.MARKER).read_text())["vllm"] == "vllm==0.32.0"
