"""The engine port's node side: [engine] config, WeightUpdates from the truth, the
in-process engine, the codec's staged-change accessor, and the HTTP client's errors."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from node.config import parse_config
from node.engines import exchange, make_engine
from node.engines.base import Engine, EngineError
from node.engines.config import parse_engine
from node.engines.http import EngineHTTP
from node.engines.inprocess import InProcessEngine, InProcessWeights, merge_changes
from swarm.codec import encode_patch, stage_patch, state_digest
from swarm.errors import ConfigError


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "b": torch.randn(100, generator=g).to(torch.bfloat16),
            "c": torch.randn(50, generator=g).to(torch.bfloat16)}


def _moved(s: dict[str, torch.Tensor], k: int = 0) -> dict[str, torch.Tensor]:
    out = {n: v.clone() for n, v in s.items()}
    out["a"][3 + k, :5] += 1.0
    out["b"][7 + k] = 0.5 + k
    return out


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(("sec", "needle"), [
    ({"kind": "tgi"}, "engine.kind"),
    ({"kind": "sglang"}, "engine.url"),
    ({"kind": "sglang", "url": "ftp://x"}, "engine.url"),
    ({"kind": "sglang", "url": "http://h:99999"}, "engine.url"),
    ({"timeout_s": 0}, "engine.timeout_s"),
    ({"timeout_s": float("nan")}, "engine.timeout_s"),
    ({"timeout_s": True}, "engine.timeout_s"),
    ({"commit_timeout_s": 1, "timeout_s": 5}, "engine.commit_timeout_s"),
    ({"pause_mode": "drain"}, "engine.pause_mode"),
    ({"sparse_max_fraction": 2}, "engine.sparse_max_fraction"),
    ({"api_key": ""}, "engine.api_key"),
    ({"api_key": "a", "api_key_file": "f"}, "engine.api_key"),
    ({"api_key_file": "missing.key"}, "engine.api_key_file"),
    ({"probe_s": -1}, "engine.probe_s"),
    ({"colour": "red"}, "engine.colour"),
])
def test_engine_config_errors_name_the_key(tmp_path: Path, sec: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_engine(sec, tmp_path, tmp_path / "store")
    assert str(err.value).startswith(needle)


def test_engine_config_defaults_and_paths(tmp_path: Path) -> None:
    c = parse_engine(None, tmp_path, tmp_path / "store")
    assert c.kind == "inprocess" and c.pause_mode == "wait" and not c.external
    (tmp_path / "k").write_text("secret\n")
    c = parse_engine({"kind": "sglang", "url": "http://127.0.0.1:30000", "api_key_file": "k",
                      "exchange_dir": "x"}, tmp_path, tmp_path / "store")
    assert c.api_key == "secret" and c.exchange_dir == tmp_path / "x" and c.external
    c = parse_engine({"kind": "vllm", "url": "http://h:1"}, tmp_path, tmp_path / "store")
    assert c.exchange_dir == tmp_path / "store" / "engine-exchange"


def test_node_config_has_an_engine_section(tmp_path: Path) -> None:
    data = {"node": {"id": "n", "region": "r", "model": "m"},
            "network": {"listen": "127.0.0.1:1", "swarm_secret": "00" * 16},
            "trust": {"trainer_keys": ["k.pub"]}, "store": {"dir": "s"},
            "weights": {"base": "b.safetensors"},
            "engine": {"kind": "sglang", "url": "http://127.0.0.1:30000", "pause_mode": "keep"}}
    cfg = parse_config(data, tmp_path)
    assert cfg.engine.kind == "sglang" and cfg.engine.pause_mode == "keep"
    data["engine"] = {"kind": "sglang"}
    with pytest.raises(ConfigError, match=r"^engine\.url"):
        parse_config(data, tmp_path)
    data["engine"] = {"kind": "inprocess"}
    data["node"]["role"] = "origin"
    data["publish"] = {"signing_key": "k"}
    data["engine"] = {"kind": "sglang", "url": "http://h:1"}
    with pytest.raises(ConfigError, match=r"^engine\.kind"):
        parse_config(data, tmp_path)


# ------------------------------------------------------- updates and truth


@pytest.fixture
def truth(tmp_path: Path) -> InProcessWeights:
    save_file(_state(0), str(tmp_path / "base.safetensors"))
    return InProcessWeights.load(tmp_path / "base.safetensors", 1, "cpu")


def test_staged_changes_name_the_changed_positions() -> None:
    base, new = _state(0), _moved(_state(0))
    w = {k: v.clone() for k, v in base.items()}
    enc = encode_patch(base, new)
    applier = stage_patch(w, enc.patch)
    changes = {n: flat for n, _, flat in applier.staged_changes()}
    assert set(changes) == {"a", "b"}
    for n, flat in changes.items():
        diff = (base[n].view(torch.int16) != new[n].view(torch.int16)).flatten().nonzero().flatten()
        assert sorted(flat.tolist()) == diff.tolist()
    applier.finish()
    assert state_digest(w) == state_digest(new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_staged_changes_of_a_dense_record(dtype) -> None:
    """DENSE records are kept as XOR byte planes: changed = any byte of the element."""
    g = torch.Generator().manual_seed(3)
    base = {"d": torch.randn(4096, generator=g).to(dtype)}
    new = {"d": torch.randn(4096, generator=g).to(dtype)}
    new["d"][::7] = base["d"][::7]  # some elements unchanged
    enc = encode_patch(base, new)
    applier = stage_patch({k: v.clone() for k, v in base.items()}, enc.patch)
    [(name, kind, flat)] = applier.staged_changes()
    assert (name, kind) == ("d", "dense")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[base["d"].element_size()]
    diff = (base["d"].view(bits) != new["d"].view(bits)).nonzero().flatten()
    assert flat.tolist() == diff.tolist()


def test_weight_update_after_a_patch_holds_the_changed_tensors(truth: InProcessWeights) -> None:
    base, new = _state(0), _moved(_state(0))
    enc = encode_patch(base, new)
    truth.stage(2, "patch", enc.patch, enc.base_digest)
    truth.commit(2, enc.target_digest)
    u = truth.weight_update(2, 1, truth.last_changes, sparse_max_fraction=0.5)
    assert not u.full and u.base_version == 1 and u.target_digest == state_digest(new)
    assert [t.name for t in u.tensors] == ["a", "b"]
    for t in u.tensors:
        assert torch.equal(t.value.view(torch.int16), new[t.name].view(torch.int16))
        assert t.changed is not None and t.changed.dtype == torch.int64
    assert u.changed_bytes == (64 * 32 + 100) * 2
    # nearly everything changed -> shipped whole
    u = truth.weight_update(2, 1, truth.last_changes, sparse_max_fraction=0.0)
    assert all(t.changed is None for t in u.tensors)
    full = truth.weight_update(2, None, None)
    assert full.full and full.base_version is None and [t.name for t in full.tensors] == ["a", "b", "c"]


def test_changes_owed_accumulate_across_versions() -> None:
    a = {"x": torch.tensor([1, 5]), "y": None}
    b = {"x": torch.tensor([5, 9]), "z": torch.tensor([0])}
    m = merge_changes(a, b, first=False)
    assert m["x"].tolist() == [1, 5, 9] and m["y"] is None and m["z"].tolist() == [0]
    assert merge_changes(a, None, first=False) is None
    assert merge_changes(None, b, first=False) is None
    assert merge_changes({}, b, first=True) == b
    assert merge_changes(a, {"x": False}, first=False)["x"] is False


def test_in_process_engine_follows_the_truth(truth: InProcessWeights) -> None:
    from node.engines.config import EngineConfig

    eng = make_engine(EngineConfig(), truth)
    assert isinstance(eng, InProcessEngine) and isinstance(eng, Engine)
    assert eng.served_version() == 1
    base, new = _state(0), _moved(_state(0))
    enc = encode_patch(base, new)
    truth.stage(2, "patch", enc.patch, enc.base_digest)
    truth.commit(2, enc.target_digest)
    u = truth.weight_update(2, 1, truth.last_changes)
    eng.stage(u)
    assert eng.commit(u).path == "inprocess" and eng.served_version() == 2
    with pytest.raises(EngineError):
        eng.commit(truth.weight_update(2, 1, None).__class__(3, 2, b"", ()))


def test_exchange_files_are_atomic_and_carry_metadata(truth: InProcessWeights, tmp_path: Path) -> None:
    u = truth.weight_update(1, None, None)
    d = exchange.write_update(tmp_path / "x", u, with_changed=False)
    assert d.name.startswith("v1-") and [p.name for p in d.iterdir()] == ["model.safetensors"]
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        meta = f.metadata()
    assert meta["patchswarm.version"] == "1" and meta["patchswarm.full"] == "1"
    assert meta["patchswarm.target_digest"] == truth.digest.hex()
    assert exchange.sweep(tmp_path / "x") == 1 and not d.exists()


# --------------------------------------------------------------- HTTP client


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/slow":
            import time

            time.sleep(1.0)
        codes = {"/ok": 200, "/bad": 400, "/boom": 500, "/slow": 200, "/text": 503}
        code = codes.get(self.path, 404)
        body = (b'{"object": "error", "message": "model_path: Field required", "code": 400}'
                if self.path == "/bad" else b"upstream exploded" if self.path == "/text"
                else b'{"ok": true}')
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_http_client_errors_are_one_clear_line() -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.handle_error = lambda *a: None  # type: ignore[method-assign] (the timed-out client hung up)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        c = EngineHTTP(f"http://127.0.0.1:{srv.server_port}", timeout_s=0.3)
        assert c.get("/ok").body == {"ok": True}
        with pytest.raises(EngineError, match=r"HTTP 400: model_path: Field required"):
            c.get("/bad")
        with pytest.raises(EngineError, match=r"HTTP 503: upstream exploded") as e:
            c.get("/text", uncertain=True)
        assert e.value.uncertain
        with pytest.raises(EngineError, match=r"no answer within 0.3 s"):
            c.get("/slow")
        assert c.get("/bad", ok_statuses=(400,)).status == 400
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(EngineError, match=r"unreachable"):
        EngineHTTP(f"http://127.0.0.1:{srv.server_port}", timeout_s=0.5).get("/ok")


def test_in_process_node_reports_its_engine(tmp_path: Path) -> None:
    from node.api import health, status_dict
    from node.daemon import build_node
    from swarm.trust.keys import generate_keypair

    generate_keypair(tmp_path / "t.key")
    save_file(_state(0), str(tmp_path / "base.safetensors"))
    data = {"node": {"id": "n", "region": "r", "model": "m"},
            "network": {"listen": "127.0.0.1:1", "swarm_secret": "00" * 16},
            "trust": {"trainer_keys": ["t.key.pub"]}, "store": {"dir": "s", "fsync": False},
            "weights": {"base": "base.safetensors", "device": "cpu"}}
    node = build_node(parse_config(data, tmp_path))
    try:
        eng = status_dict(node.driver, "m")["engine"]
        assert eng["kind"] == "inprocess" and eng["served_version"] == 1 and eng["healthy"]
        assert eng["verified_version"] == 1 and health(node.driver) is None
        assert node.weights is not None and node.weights.device == "cpu"
    finally:
        node.store.close()
    data["engine"] = {"kind": "sglang", "url": "http://127.0.0.1:9"}
    data["weights"]["device"] = "auto"
    node = build_node(parse_config(data, tmp_path))
    try:
        assert node.weights is not None and node.weights.device == "cpu"  # the engine owns the GPU
        assert node.engine is not None and node.engine.kind == "sglang"
        assert health(node.driver) == "engine: sglang engine not yet synced to version 1"
        assert status_dict(node.driver, "m")["engine"]["state"] == "starting"
    finally:
        node.store.close()
