"""A real vLLM engine takes patchswarm updates and serves exactly the new checkpoint.

Slow: it builds the engine venv (``scripts/engine_venv.py``) on first use and
starts real ``vllm serve`` processes (CPU backend, float32, a tiny random Llama
written here, prompts as token ids). Versions are real patches
(``swarm.codec.encode_patch`` of the trainer's served BF16 view), verified and
committed on the node's checkpoint-coordinate truth (``InProcessWeights``),
and handed to the engine as the ``WeightUpdate`` the node builds from it.

After every commit the engine's greedy tokens *and* logprobs for fixed prompts
equal, bit for bit, those of a vLLM cold-started on the trainer's checkpoint of
that version; a request in flight during a commit completes; a full rebuild
brings an engine started on another version to the active one.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from node.engines.base import EngineError, TensorUpdate, WeightUpdate
from node.engines.inprocess import InProcessWeights
from node.engines.vllm import VllmEngine, VllmProcess
from swarm.codec import encode_patch
from tests.engine_vllm_support import (
    ENGINE_ARGS,
    engine_env,
    engine_python,
    free_port,
    generate,
    llama_masters,
    probe,
    rl_step,
    write_model,
)
from trainer.served import served_view

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    try:
        return engine_python()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot build the vLLM engine venv here: {exc}")


def _versions() -> list[dict[str, torch.Tensor]]:
    """Served views v0..v4: three RL-sized steps (a few % of values change), one dense."""
    m = llama_masters(0)
    views = [served_view(m, "bf16")]
    for k, lr in enumerate((2e-4, 3e-4, 2e-4, 0.2), start=1):
        m = rl_step(m, k, lr=lr)
        views.append(served_view(m, "bf16"))
    return views


class Node:
    """What a node does per version: verify and commit the patch on its truth, then build
    the engine's ``WeightUpdate`` from it (``InProcessWeights.weight_update``)."""

    def __init__(self, base: dict[str, torch.Tensor]) -> None:
        self.truth = InProcessWeights({k: v.clone() for k, v in base.items()}, 0, "cpu")

    def apply(self, old: dict, new: dict, version: int) -> WeightUpdate:
        enc = encode_patch(old, new)
        self.truth.stage(version, "patch", enc.patch, enc.base_digest)
        self.truth.commit(version, enc.target_digest)
        return self.truth.weight_update(version, version - 1, self.truth.last_changes,
                                        sparse_max_fraction=0.25)

    def full(self) -> WeightUpdate:
        return self.truth.weight_update(self.truth.version, None, None)


def _start(py: Path, model: Path, tmp: Path, name: str) -> VllmProcess:
    return VllmProcess(py, model, free_port(), log_path=tmp / f"{name}.log", env=engine_env(),
                       extra_args=ENGINE_ARGS).start()


def _generate_into(out: dict, url: str) -> None:
    out.update(generate(url, [3, 4, 5, 6], max_tokens=48))


def _ready(*procs: VllmProcess) -> None:
    for p in procs:
        p.wait_ready(900)


def test_vllm_engine_serves_each_version_exactly(vllm_python: Path, tmp_path: Path) -> None:
    views = _versions()
    dirs = [write_model(tmp_path / f"model-v{v}", view) for v, view in enumerate(views)]
    node = Node(views[0])
    engine = _start(vllm_python, dirs[0], tmp_path, "engine")
    refs = {1: _start(vllm_python, dirs[1], tmp_path, "cold-v1"),
            2: _start(vllm_python, dirs[2], tmp_path, "cold-v2")}
    procs = [engine, *refs.values()]
    try:
        _ready(engine, *refs.values())
        port = VllmEngine(engine.url, tmp_path / "exchange", truth=node.truth, pause_mode="wait")
        assert port.served_version() is None
        before = probe(engine.url)
        paths = {}
        for v in (1, 2, 3, 4):
            if v == 3:  # the first pair of cold starts is done with: two more
                for r in refs.values():
                    r.stop()
                refs = {3: _start(vllm_python, dirs[3], tmp_path, "cold-v3"),
                        4: _start(vllm_python, dirs[4], tmp_path, "cold-v4")}
                procs += list(refs.values())
                _ready(*refs.values())
            update = node.apply(views[v - 1], views[v], v)
            port.pause_mode = "keep" if v == 2 else "wait"
            port.stage(update)
            # a long request in flight while the engine commits must complete
            inflight: dict = {}
            t = threading.Thread(target=_generate_into, args=(inflight, engine.url))
            t.start()
            stats = port.commit(update)
            t.join(300)
            assert len(inflight.get("tokens") or []) == 48, f"v{v}: in-flight request lost"
            assert port.served_version() == v
            paths[v] = (stats.path, port.last_apply["counts"])
            got, want = probe(engine.url), probe(refs[v].url)
            assert got == want, f"v{v}: engine differs from a cold start on v{v} ({stats})"
            assert got != before
            before = got
        assert "sparse" in paths[1][0] and "reload" in paths[1][0], paths
        assert paths[4][1]["sparse"] == 0, paths  # the dense version ships whole tensors

        # a refusal before any write is certain: generation resumes on the old weights.
        # (A stale layout claims a repacked linear takes in-place writes; the worker refuses.)
        name = "model.layers.0.self_attn.o_proj.weight"
        port._layout[name]["inplace"] = True
        t = node.truth.weights[name]
        bad = WeightUpdate(5, 4, b"\0" * 32, (TensorUpdate(name, t, torch.tensor([0, 7])),))
        port.stage(bad)
        with pytest.raises(EngineError) as ei:
            port.commit(bad)
        assert not ei.value.uncertain and "in-place" in str(ei.value)
        assert port.served_version() == 4 and probe(engine.url) == before
        assert not port._layout  # asked afresh next time

        # a restarted engine (here: one cold-started on v3) is rebuilt to the active version
        rebuilt = VllmEngine(refs[3].url, tmp_path / "exchange-rebuild", truth=node.truth)
        full = node.full()
        assert full.full and full.version == 4
        rebuilt.stage(full)
        stats = rebuilt.commit(full)
        assert stats.path == "subset-reload" and rebuilt.served_version() == 4
        assert probe(refs[3].url) == probe(refs[4].url)
    finally:
        for p in procs:
            p.stop()
