"""A real ``patchswarm node`` process feeding the SGLang contract server.

One node, one engine, versions published by the real ``patchswarm publish``:
the node brings an engine that is down at start up to date once it answers,
ships each verified patch to it, and when the engine refuses a version, dies
mid-commit or restarts, the node keeps its store and its verified version,
``/healthz`` says what is wrong (503), and the engine is rebuilt once it is back.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lab.fleet import FleetError, LoopbackFleet, free_port
from lab.fleet import until as _until
from node.engines.testing.sglang_contract import spawn
from swarm.codec import state_digest
from trainer.served import served_view


def _masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"enc.weight": torch.randn(256, 256, generator=g),
            "enc.bias": torch.randn(256, generator=g),
            "emb.weight": torch.randn(500, 64, generator=g)}


def _step(masters: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 2e-3 * torch.randn(v.shape, generator=g) for k, v in masters.items()}


class EngineFleet(LoopbackFleet):
    """A loopback fleet whose nodes get an ``[engine]`` section."""

    def __init__(self, engine_section: str, **kw: Any) -> None:
        super().__init__(1, 1, chunk_size=8 * 1024, swarm={"redial_s": 1.0}, **kw)
        self.engine_section = engine_section

    def _write_configs(self) -> None:
        super()._write_configs()
        for n in self.nodes:
            n.config.write_text(n.config.read_text() + "\n" + self.engine_section)


_healthz = LoopbackFleet.healthz


def _unhealthy(addr: str) -> str:
    """Wait for /healthz to answer 503; its one-line reason."""
    return _until("healthz 503", lambda: (lambda c: c[1] if c[0] == 503 else None)(_healthz(addr)))


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())




@pytest.mark.timeout(600)
def test_node_feeds_sglang_and_survives_engine_faults(tmp_path: Path) -> None:
    masters = _masters(0)
    base = served_view(masters, "bf16")
    engine_base = tmp_path / "engine-base.safetensors"
    save_file(base, str(engine_base))
    port = free_port(["127.0.0.1"])
    url = f"http://127.0.0.1:{port}"
    section = (f'[engine]\nkind = "sglang"\nurl = "{url}"\ntimeout_s = 2\ncommit_timeout_s = 30\n'
               f'probe_s = 0.5\nretry_max_s = 2\n')
    server = None

    def start_server() -> None:
        nonlocal server
        server = spawn(engine_base, port, log=tmp_path / "engine.log")

    def kill_server() -> None:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGKILL)
            server.wait(10)

    with EngineFleet(section) as fleet:
        node = fleet.nodes[0]
        try:
            # 1. the engine is down when the node starts: 503 naming it, then synced once it is up
            with pytest.raises(FleetError, match="not healthy"):
                fleet.start_nodes_only(base, timeout=6)
            text = _unhealthy(node.addr)
            assert "unreachable" in text and url in text, text
            start_server()
            fleet.wait_healthy(60)
            st = fleet.status(node)["engine"]
            assert st["kind"] == "sglang" and st["served_version"] == 1 and st["state"] == "ok"
            assert st["last_commit"]["path"] == "disk-full"
            assert _get(url + "/contract/state")["state_digest"] == state_digest(base).hex()

            def publish(k: int, version: int) -> str:
                nonlocal masters
                masters = _step(masters, k)
                path = tmp_path / f"step{k}.safetensors"
                save_file(masters, str(path))
                r = fleet.publish_cli(path, "--wait-peers", "30", "--linger", "2", "--timeout", "120",
                                      "--regions", "1")
                assert r.returncode == 0, fleet.trainer_log.read_text()[-2000:]
                fleet.wait_version(version, timeout=90)  # verified by the node
                return state_digest(served_view(masters, "bf16")).hex()

            def engine_serves(version: int, digest: str) -> None:
                _until(f"engine serves {version}", lambda: (fleet.status(node) or {}).get(
                    "engine", {}).get("served_version") == version and _healthz(node.addr)[0] == 200)
                assert _get(url + "/contract/state")["state_digest"] == digest

            # 2. a patch lands in the engine, bitwise
            want2 = publish(1, 2)
            engine_serves(2, want2)
            st = fleet.status(node)
            assert st["engine"]["last_commit"]["path"] == "disk-subset"
            assert st["engine"]["recorded_version"] == 2 and st["active_digest"] == want2
            metrics = urllib.request.urlopen(f"http://{node.addr}/metrics", timeout=5).read().decode()
            assert 'patchswarm_engine_version{engine="sglang"' in metrics.replace(
                'node="n0-0",region="region-0",', "")
            assert "patchswarm_engine_commit_seconds_count" in metrics
            assert "patchswarm_engine_paused_seconds_sum" in metrics

            # 3. the engine refuses version 3: verified but not served; 503; rebuilt once it works
            _post(url + "/contract/faults", {"fail_load": "out of memory"})
            want3 = publish(2, 3)
            text = _unhealthy(node.addr)
            assert "failed to take version 3" in text and "out of memory" in text, text
            st = fleet.status(node)
            assert st["active_version"] == 3 and st["active_digest"] == want3  # kept, verified
            assert st["engine"]["served_version"] == 2 and st["engine"]["recorded_version"] == 2
            assert st["engine"]["state"] == "unhealthy" and st["engine"]["uncertain"]
            assert (fleet.workdir / "n0-0-store").exists()
            _post(url + "/contract/faults", {})
            engine_serves(3, want3)
            assert fleet.status(node)["engine"]["last_commit"]["path"] == "disk-full"

            # 4. the engine dies mid-commit of version 4, comes back with its base: rebuilt
            _post(url + "/contract/faults", {"slow_load_s": 8})
            masters_before = masters
            want4 = None

            def publish4() -> None:
                nonlocal want4
                want4 = publish(3, 4)

            import threading

            t = threading.Thread(target=publish4)
            t.start()
            _until("engine loading", lambda: _get(url + "/contract/state")["loading"], 90)
            kill_server()
            t.join(120)
            assert want4 is not None and masters is not masters_before
            text = _unhealthy(node.addr)
            assert "version 4" in text, text
            assert "sglang engine failed to take version 4" in node.log.read_text()
            start_server()
            engine_serves(4, want4)

            # 5. the engine restarts while idle: the node notices and brings it back to 4
            kill_server()
            start_server()
            _until("noticed the restart", lambda: _get(url + "/contract/state")["loads"] >= 1, 30)
            engine_serves(4, want4)
            assert "restarted?" in node.log.read_text() or "serves no version" in node.log.read_text()

            # 6. the node itself dies while its engine lags (verified 5, recorded 4): on restart
            #    it rebuilds its truth to the recorded version, re-applies 5 from its store
            _post(url + "/contract/faults", {"fail_load": "busy"})
            want5 = publish(4, 5)
            _unhealthy(node.addr)
            assert fleet.status(node)["engine"]["recorded_version"] == 4
            fleet.kill(node)
            _post(url + "/contract/faults", {})
            fleet.start_node(node)
            fleet.wait_healthy(90)
            engine_serves(5, want5)
            st = fleet.status(node)
            assert st["active_version"] == 5 and st["engine"]["recorded_version"] == 5
        finally:
            kill_server()
