"""The driver's engine path with a scripted engine (no processes, no sockets).

What is sent (incremental, full, nothing), what is recorded (the store's
active record only once the engine confirmed), and how failures are reported
and retried: the node's verified version never goes back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from node.api import engine_dict, health
from node.driver import Driver
from node.engines.base import CommitStats, EngineError, WeightUpdate
from node.engines.config import EngineConfig
from node.engines.inprocess import InProcessEngine, InProcessWeights
from swarm.codec import encode_patch, state_digest
from tests.driver_fakes import FakeManifest, FakeStore


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(32, 32, generator=g).to(torch.bfloat16) for n in ("a", "b", "c")}


def _moved(s: dict[str, torch.Tensor], k: int, name: str) -> dict[str, torch.Tensor]:
    out = {n: v.clone() for n, v in s.items()}
    out[name][k, :4] += 1.0
    return out


class ScriptedEngine:
    """An engine whose next answers the test scripts."""

    kind = "sglang"

    def __init__(self) -> None:
        self.version: int | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.updates: list[WeightUpdate] = []
        self.fail_next: EngineError | None = None
        self.down = False

    def served_version(self) -> int | None:
        if self.down:
            raise EngineError("engine at http://x is unreachable")
        return self.version

    def stage(self, update: WeightUpdate) -> None:
        pass

    def commit(self, update: WeightUpdate) -> CommitStats:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            if exc.uncertain:
                self.version = None
            raise exc
        for t in update.tensors:
            self.state[t.name] = t.value.clone()
        self.updates.append(update)
        self.version = update.version
        return CommitStats(update.version, 0.01, 0.02, "disk-full" if update.full else "disk-subset",
                           update.changed_bytes)

    def close(self) -> None:
        pass


class Rig:
    def __init__(self, tmp: Path, engine: Any = None) -> None:
        self.states = {1: _state(0)}
        save_file(self.states[1], str(tmp / "base.safetensors"))
        self.truth = InProcessWeights.load(tmp / "base.safetensors", 1, "cpu")
        self.store = FakeStore()
        self.engine = engine if engine is not None else ScriptedEngine()
        self.driver = Driver(None, self.store, None, weights=self.truth, engine=self.engine,
                             engine_cfg=EngineConfig(kind="sglang", url="http://x", retry_max_s=4),
                             host="127.0.0.1", port=0)
        self.applied: list[tuple[int, bool]] = []
        self.driver.feed = lambda e: self.applied.append((e.version, e.ok))  # type: ignore[method-assign]
        self.driver.loop = asyncio.get_running_loop()

    def publish(self, name: str) -> int:
        v = max(self.states) + 1
        self.states[v] = _moved(self.states[v - 1], v, name)
        enc = encode_patch(self.states[v - 1], self.states[v])
        self.store.m[v] = (FakeManifest("patch", enc.base_digest, enc.target_digest), enc.patch)
        return v

    def engine_digest(self) -> bytes:
        return state_digest(self.engine.state)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_first_sync_is_full_then_only_what_changed(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        assert health(r.driver) == "engine: sglang engine not yet synced to version 1"
        assert await r.driver._sync_engine()
        assert r.engine.updates[-1].full and r.store.recorded == [1]
        v = r.publish("b")
        await r.driver._apply(v)
        u = r.engine.updates[-1]
        assert not u.full and u.base_version == 1 and [t.name for t in u.tensors] == ["b"]
        assert r.applied == [(2, True)] and r.store.recorded == [1, 2]
        assert r.engine_digest() == state_digest(r.states[2]) and health(r.driver) is None
        assert engine_dict(r.driver)["last_commit"]["path"] == "disk-subset"

    run(go())


def test_certain_failure_keeps_the_verified_version_and_sends_the_union_later(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        await r.driver._sync_engine()
        r.engine.fail_next = EngineError("sglang refused version 2 (HTTP 400): bad request")
        await r.driver._apply(r.publish("a"))
        assert r.applied == [(2, True)]  # verified: the swarm moves on
        assert r.truth.version == 2 and r.store.recorded == [1]  # not served: not recorded
        st = engine_dict(r.driver)
        assert st["state"] == "unhealthy" and not st["uncertain"] and st["served_version"] == 1
        assert "failed to take version 2" in health(r.driver) and st["retry_in_s"] is not None
        r.engine.down = True
        await r.driver._apply(r.publish("c"))  # the engine is down: still verified
        assert r.truth.version == 3 and "unreachable" in health(r.driver)
        r.engine.down = False
        assert await r.driver._sync_engine()
        u = r.engine.updates[-1]
        assert not u.full and u.base_version == 1 and [t.name for t in u.tensors] == ["a", "c"]
        assert r.engine_digest() == state_digest(r.states[3]) and r.store.recorded == [1, 3]

    run(go())


def test_uncertain_failure_rebuilds_with_everything(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        await r.driver._sync_engine()
        r.engine.fail_next = EngineError("POST /update_weights_from_disk: no answer", uncertain=True)
        await r.driver._apply(r.publish("a"))
        st = r.driver.engine_state
        assert st.uncertain and st.state == "unhealthy" and st.consecutive_failures == 1
        assert "mid-commit" in st.reason
        delay1 = st.next_retry_at
        r.engine.fail_next = EngineError("still broken", uncertain=True)
        await r.driver._sync_engine()
        assert st.consecutive_failures == 2 and st.next_retry_at > delay1  # backing off
        await r.driver._sync_engine()
        assert r.engine.updates[-1].full and health(r.driver) is None
        assert r.engine_digest() == state_digest(r.states[2])

    run(go())


def test_restarted_engine_is_rebuilt_and_one_in_step_gets_nothing(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        await r.driver._sync_engine()
        await r.driver._apply(r.publish("a"))
        n = len(r.engine.updates)
        assert await r.driver._sync_engine()  # already there: nothing sent
        assert len(r.engine.updates) == n
        r.engine.version, r.engine.state = None, {}  # restarted from its base
        await r.driver._sync_engine()
        assert r.engine.updates[-1].full and r.engine_digest() == state_digest(r.states[2])

    run(go())


def test_in_process_engine_records_its_commit(tmp_path: Path) -> None:
    async def go() -> None:
        save_file(_state(0), str(tmp_path / "base.safetensors"))
        truth = InProcessWeights.load(tmp_path / "base.safetensors", 1, "cpu")
        r = Rig(tmp_path, engine=InProcessEngine(truth))
        r.truth = truth
        r.driver.weights = truth
        r.driver.engine_state.kind = "inprocess"
        await r.driver._apply(r.publish("b"))
        st = engine_dict(r.driver)
        assert st["served_version"] == 2 and st["last_commit"]["path"] == "inprocess"
        assert r.store.recorded == [2] and health(r.driver) is None

    run(go())


@pytest.mark.parametrize("cut", [0.02, 0.5, 0.98])
def test_a_bad_patch_is_an_apply_failure_and_touches_no_engine(tmp_path: Path, cut: float) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        await r.driver._sync_engine()
        v = r.publish("a")
        m, payload = r.store.m[v]
        r.store.m[v] = (m, payload[: int(len(payload) * cut)])
        n = len(r.engine.updates)
        await r.driver._apply(v)
        assert r.applied == [(2, False)] and r.truth.version == 1 and len(r.engine.updates) == n
        assert health(r.driver) is None

    run(go())


def test_engine_ahead_of_a_restarted_node_is_not_taken_back(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        v = r.publish("a")
        r.engine.version = v  # it took version 2 before the node restarted at 1
        r.engine.state = {k: t.clone() for k, t in r.states[v].items()}
        assert not await r.driver._sync_engine()
        assert r.engine.updates == [] and "newer than the node's" in health(r.driver)
        await r.driver._apply(v)  # the node re-applies 2 from its store: nothing to send
        assert r.engine.updates == [] and health(r.driver) is None and r.store.recorded == [2]

    run(go())


def test_engine_ahead_for_good_is_rebuilt(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        r.engine.version = 9
        for _ in range(3):
            assert not await r.driver._sync_engine()
        assert await r.driver._sync_engine()
        assert r.engine.updates[-1].full and r.engine.version == 1

    run(go())


def test_uncertain_commit_is_remembered_across_a_node_restart(tmp_path: Path) -> None:
    async def go() -> None:
        r = Rig(tmp_path)
        r.store.root = tmp_path  # type: ignore[attr-defined]
        r.driver._commit_mark = tmp_path / "engine-commit"
        await r.driver._sync_engine()
        assert not (tmp_path / "engine-commit").exists()
        r.engine.fail_next = EngineError("cut off mid-load", uncertain=True)
        await r.driver._apply(r.publish("a"))
        assert (tmp_path / "engine-commit").read_text() == "2\n"
        r.engine.version = 1  # its label still says 1, its weights may be a mix
        # the node restarts: a new driver over the same store, truth rebuilt to the record (1)
        truth = InProcessWeights.load(tmp_path / "base.safetensors", 1, "cpu")
        d = Driver(None, r.store, None, weights=truth, engine=r.engine,
                   engine_cfg=EngineConfig(kind="sglang", url="http://x"), host="127.0.0.1", port=0)
        d.loop = asyncio.get_running_loop()
        n = len(r.engine.updates)
        assert await d._sync_engine()
        assert len(r.engine.updates) == n + 1 and r.engine.updates[-1].full  # label not trusted
        assert not (tmp_path / "engine-commit").exists()
        assert r.engine_digest() == state_digest(r.states[1])

    run(go())
