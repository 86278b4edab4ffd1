"""The SGLang adapter against the SGLang contract server (a real process, killable).

Each bad input gives one clear ``EngineError``; ``uncertain`` says whether the
engine may hold a mix; the pause modes keep their promises to in-flight requests.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lab.fleet import free_port
from node.engines.base import EngineError
from node.engines.config import EngineConfig
from node.engines.inprocess import InProcessWeights
from node.engines.sglang import SGLangEngine
from node.engines.testing.sglang_contract import expected_tokens, spawn
from swarm.codec import encode_patch, state_digest


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(4)}


def _moved(s: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    out = {n: v.clone() for n, v in s.items()}
    out["layers.1.w"][k, :8] += 1.0
    out["layers.3.w"][k + 1, 3] = 0.25
    return out


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.base = _state(0)
        save_file(self.base, str(tmp / "base.safetensors"))
        self.port = free_port(["127.0.0.1"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.truth = InProcessWeights.load(tmp / "base.safetensors", 1, "cpu")
        self.states = {1: self.base}

    def start(self, *extra: str) -> None:
        self.proc = spawn(self.tmp / "base.safetensors", self.port, log=self.tmp / "server.log",
                          extra=list(extra))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def engine(self, **kw: object) -> SGLangEngine:
        cfg = dict(kind="sglang", url=self.url, timeout_s=2.0, commit_timeout_s=4.0,
                   exchange_dir=self.tmp / "exchange")
        cfg.update(kw)
        return SGLangEngine(EngineConfig(**cfg))  # type: ignore[arg-type]

    def next_update(self, *, full: bool = False):  # type: ignore[no-untyped-def]
        v = self.truth.version
        new = _moved(self.states[v], v)
        enc = encode_patch(self.states[v], new)
        self.truth.stage(v + 1, "patch", enc.patch, enc.base_digest)
        self.truth.commit(v + 1, enc.target_digest)
        self.states[v + 1] = new
        return self.truth.weight_update(v + 1, None if full else v,
                                        None if full else self.truth.last_changes)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def state(self) -> dict:
        return self.get("/contract/state")

    def faults(self, **f: object) -> None:
        self.post("/contract/faults", f)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("sglang"))
    r.start()
    try:
        yield r
    finally:
        r.kill()


@pytest.fixture
def rig(shared_server: Rig, tmp_path: Path) -> Rig:
    """A fresh truth and exchange directory against the shared server, reset to its base."""
    if shared_server.proc is None or shared_server.proc.poll() is not None:
        shared_server.start()
    shared_server.post("/contract/reset", {})
    r = Rig.__new__(Rig)
    r.__dict__.update(shared_server.__dict__)
    r.tmp = tmp_path
    save_file(r.base, str(tmp_path / "base.safetensors"))
    r.truth = InProcessWeights.load(tmp_path / "base.safetensors", 1, "cpu")
    r.states = {1: r.base}
    r.shared = shared_server
    return r


def _generate_in_thread(rig: Rig, n: int, out: list) -> threading.Thread:
    def go() -> None:
        out.append(rig.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": n}}))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while rig.state()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return t


def test_full_then_sparse_updates_land_bitwise(rig: Rig) -> None:
    eng = rig.engine()
    assert eng.served_version() is None  # "default": never set
    full = rig.truth.weight_update(1, None, None)
    stats = eng.commit(full)
    assert stats.path == "disk-full" and eng.served_version() == 1
    u = rig.next_update()
    eng.stage(u)
    staged = list((rig.tmp / "exchange").iterdir())
    assert len(staged) == 1  # written while the engine serves
    stats = eng.commit(u)
    assert stats.version == 2 and stats.path == "disk-subset" and stats.bytes == 2 * 64 * 64 * 2
    st = rig.state()
    assert st["state_digest"] == state_digest(rig.states[2]).hex() and st["weight_version"] == "2"
    assert list((rig.tmp / "exchange").iterdir()) == []  # removed after the commit
    body = next(c["body"] for c in reversed(st["calls"]) if c["path"] == "/update_weights_from_disk")
    assert body["abort_all_requests"] is False and body["weight_version"] == "2"
    assert not any(c["path"] == "/pause_generation" for c in st["calls"])  # wait mode: no pause
    out = rig.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4}})
    assert out["output_ids"] == expected_tokens(state_digest(rig.states[2]), "x", 4)
    assert out["meta_info"]["weight_version"] == "2"


def test_wait_mode_lets_in_flight_requests_finish_on_the_old_version(rig: Rig) -> None:
    eng = rig.engine()
    eng.commit(rig.truth.weight_update(1, None, None))
    out: list = []
    t = _generate_in_thread(rig, 40, out)
    stats = eng.commit(rig.next_update())
    t.join(10)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert out[0]["output_ids"] == expected_tokens(state_digest(rig.states[1]), "hello", 40)
    assert stats.paused_s > 0.1  # the update waited for the request to drain


def test_keep_mode_pauses_with_retract_and_resumes_requests(rig: Rig) -> None:
    eng = rig.engine(pause_mode="keep")
    eng.commit(rig.truth.weight_update(1, None, None))
    out: list = []
    t = _generate_in_thread(rig, 60, out)
    stats = eng.commit(rig.next_update())
    t.join(10)
    assert out and out[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out[0]["output_ids"]) == 60 and out[0]["meta_info"]["weight_version"] == "2"
    calls = [c for c in rig.state()["calls"] if c["path"] in ("/pause_generation", "/continue_generation")]
    assert [c["path"] for c in calls][-2:] == ["/pause_generation", "/continue_generation"]
    assert calls[-2]["body"] == {"mode": "retract"}
    assert 0 < stats.paused_s < stats.commit_s
    assert rig.state()["paused"] is False


def test_keep_mode_refuses_an_sglang_whose_pause_aborts(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.start("--sglang-version", "0.5.5")
    try:
        eng = rig.engine(pause_mode="keep")
        with pytest.raises(EngineError, match=r"needs SGLang >= 0\.5\.6") as e:
            eng.commit(rig.truth.weight_update(1, None, None))
        assert not e.value.uncertain
        assert not any(c["path"] == "/pause_generation" for c in rig.state()["calls"])
    finally:
        rig.kill()


def test_abort_mode_aborts_only_when_configured(rig: Rig) -> None:
    eng = rig.engine(pause_mode="abort")
    eng.commit(rig.truth.weight_update(1, None, None))
    out: list = []
    t = _generate_in_thread(rig, 400, out)
    eng.commit(rig.next_update())
    t.join(10)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"


def test_load_failure_is_uncertain_and_names_the_version(rig: Rig) -> None:
    eng = rig.engine()
    eng.commit(rig.truth.weight_update(1, None, None))
    rig.faults(fail_load="disk on fire")
    with pytest.raises(EngineError, match=r"sglang refused version 2 \(HTTP 400\): "
                                          r"Failed to update weights: disk on fire") as e:
        eng.commit(rig.next_update())
    assert e.value.uncertain  # half of the tensors were loaded: a mix
    assert eng.served_version() == 1
    rig.faults()
    eng.commit(rig.truth.weight_update(2, None, None))  # rebuilt with everything
    assert rig.state()["state_digest"] == state_digest(rig.states[2]).hex()


def test_server_error_500_and_wrong_version(rig: Rig) -> None:
    eng = rig.engine()
    eng.commit(rig.truth.weight_update(1, None, None))
    rig.faults(status_500=True)
    with pytest.raises(EngineError, match=r"HTTP 500: Internal Server Error") as e:
        eng.commit(rig.next_update())
    assert e.value.uncertain
    rig.faults(wrong_version="7")
    with pytest.raises(EngineError, match=r"accepted version 2 but serves version 7") as e:
        eng.commit(rig.truth.weight_update(2, None, None))
    assert e.value.uncertain


def test_slow_engine_times_out(rig: Rig) -> None:
    eng = rig.engine(commit_timeout_s=2.0)
    eng.commit(rig.truth.weight_update(1, None, None))
    rig.faults(slow_load_s=4.0)
    with pytest.raises(EngineError, match=r"update_weights_from_disk: no answer within 2 s") as e:
        eng.commit(rig.next_update())
    assert e.value.uncertain


def test_engine_down_and_killed_mid_commit(rig: Rig) -> None:
    eng = rig.engine()
    eng.commit(rig.truth.weight_update(1, None, None))
    rig.faults(slow_load_s=5.0)
    result: list = []

    def commit() -> None:
        try:
            eng.commit(rig.next_update())
        except EngineError as exc:
            result.append(exc)

    t = threading.Thread(target=commit)
    t.start()
    deadline = time.monotonic() + 5
    while not rig.state()["loading"] and time.monotonic() < deadline:
        time.sleep(0.02)
    rig.kill()
    t.join(10)
    assert result and result[0].uncertain
    assert "unreachable" in str(result[0]) or "no answer" in str(result[0])
    with pytest.raises(EngineError, match=r"engine at http://127\.0\.0\.1:\d+ is unreachable") as e:
        eng.served_version()
    assert not e.value.uncertain
    rig.start()  # restarted: the base again, no version
    rig.shared.proc = rig.proc  # the shared server is this one now (killed at module end)
    assert eng.served_version() is None
    eng.commit(rig.truth.weight_update(2, None, None))
    assert rig.state()["state_digest"] == state_digest(rig.states[2]).hex()


def test_api_key_is_sent(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.start("--api-key", "s3cret")
    try:
        with pytest.raises(EngineError, match=r"HTTP 401: Unauthorized"):
            rig.engine().served_version()
        eng = rig.engine(api_key="s3cret")
        eng.commit(rig.truth.weight_update(1, None, None))
        assert eng.served_version() == 1
    finally:
        rig.kill()
