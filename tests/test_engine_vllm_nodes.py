"""Two real nodes, each feeding its own real ``vllm serve``, from a real trainer.

Slow (``-m slow``): builds the engine venv on first use (skips with the reason
if it cannot), starts two vLLM CPU engines on a tiny random Llama (float32,
``--skip-tokenizer-init``, prompts as token ids) and a loopback fleet of two
``patchswarm node`` processes with ``[engine] kind = "vllm"``; versions come
from the real ``patchswarm publish`` (a ``Publisher`` per run): three RL-sized
steps of the FP32 masters (a few % of the BF16 served values change) and one
dense step.

Each engine starts on the base checkpoint, reports no version, and is brought
to the node's base version by a full update. After every version each engine's
greedy tokens and logprobs for fixed prompts equal, bit for bit, those of a
third vLLM cold-started on the trainer's served view of that version, and
requests that were in flight while the nodes committed complete. Never more
than three engines at once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from lab.fleet import LoopbackFleet, until
from node.engines.vllm import VllmProcess
from swarm.codec import state_digest
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


def until_slow(what: str, fn: Any, timeout: float) -> Any:
    return until(what, fn, timeout, poll_s=0.5)
BASE_VERSION = 1  # LoopbackFleet's configs start every node at version 1


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    try:
        return engine_python()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot build the vLLM engine venv here: {exc}")


class VllmFleet(LoopbackFleet):
    """One region, two nodes; node i feeds the vLLM engine at ``urls[i]``."""

    def __init__(self, urls: list[str], **kw: Any) -> None:
        super().__init__(1, len(urls), chunk_size=64 * 1024, swarm={"redial_s": 1.0}, **kw)
        self.urls = urls

    def _write_configs(self) -> None:
        super()._write_configs()
        for n, url in zip(self.nodes, self.urls, strict=True):
            n.config.write_text(n.config.read_text() + (
                f'\n[engine]\nkind = "vllm"\nurl = "{url}"\ntimeout_s = 20\n'
                f'commit_timeout_s = 300\npause_mode = "wait"\nprobe_s = 1\nretry_max_s = 5\n'))




class Traffic:
    """Long greedy requests, one after another, against one engine, until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.done.append(len(generate(self.url, [7, 8, 9, 10], max_tokens=32)["tokens"]))
            except Exception as exc:  # recorded and asserted on by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Traffic:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(300)


def test_two_nodes_feed_real_vllm_engines_exactly(vllm_python: Path, tmp_path: Path) -> None:
    # the trainer's FP32 masters and the served views every version will have
    masters = [llama_masters(0)]
    for k, lr in enumerate((2e-4, 3e-4, 2e-4, 0.2), start=1):
        masters.append(rl_step(masters[-1], k, lr=lr))
    views = {BASE_VERSION + k: served_view(m, "bf16") for k, m in enumerate(masters)}
    dirs = {v: write_model(tmp_path / f"model-v{v}", view) for v, view in views.items()}

    def start(v: int, name: str) -> VllmProcess:
        return VllmProcess(vllm_python, dirs[v], free_port(), log_path=tmp_path / f"{name}.log",
                           env=engine_env(), extra_args=ENGINE_ARGS).start()

    engines = [start(BASE_VERSION, "engine-a"), start(BASE_VERSION, "engine-b")]
    ref = start(BASE_VERSION + 1, f"cold-v{BASE_VERSION + 1}")
    try:
        for p in (*engines, ref):
            p.wait_ready(900)
        with VllmFleet([e.url for e in engines]) as fleet:
            fleet.start_nodes_only(views[BASE_VERSION], timeout=300)

            def engine_status(n: Any) -> dict:
                st = fleet.status(n)
                return (st or {}).get("engine") or {}

            def serves(v: int) -> bool:
                return all(engine_status(n).get("served_version") == v for n in fleet.nodes)

            # started on the base checkpoint with no version: rebuilt to the node's version
            until_slow("engines at the base version", lambda: serves(BASE_VERSION), 300)
            for v in range(BASE_VERSION + 1, BASE_VERSION + len(masters)):
                path = tmp_path / f"masters-v{v}.safetensors"
                save_file(masters[v - BASE_VERSION], str(path))
                with Traffic(engines[0].url) as traffic:
                    r = fleet.publish_cli(path, "--wait-peers", "30", "--linger", "2",
                                          "--timeout", "240", "--regions", "1")
                    assert r.returncode == 0, fleet.trainer_log.read_text()[-2000:]
                    statuses = fleet.wait_version(v, timeout=240)
                    assert {s["active_digest"] for s in statuses.values()} == {
                        state_digest(views[v]).hex()}
                    until_slow(f"both engines serve v{v}", lambda v=v: serves(v), 300)
                # every request that was in flight around the commits finished whole
                assert not traffic.errors, traffic.errors[:3]
                assert traffic.done and set(traffic.done) == {32}, traffic.done
                want = probe(ref.url)
                for e in engines:
                    assert probe(e.url) == want, f"v{v}: {e.url} differs from a cold start"
                for n in fleet.nodes:
                    last = engine_status(n).get("last_commit") or {}
                    assert last.get("version") == v, last
                ref.stop()
                if v + 1 in dirs:
                    ref = start(v + 1, f"cold-v{v + 1}")
                    ref.wait_ready(900)
    finally:
        for p in (*engines, ref):
            p.stop()

