"""Slowloris and connection floods against a real node (issue #10, attack 3): caps per
address and in total, a deadline for the link preface, and the node keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from node.config import parse_config
from node.daemon import build_node, serve
from patchswarm.cli import main as cli
from tests.peer_client import connect


def _config(tmp: Path, port: int, api_port: int) -> dict:
    assert cli(["keygen", str(tmp / "t.key")]) == 0
    save_file({"w": torch.zeros(8)}, str(tmp / "base.safetensors"))
    return {
        "node": {"id": "n1", "region": "r1", "model": "m"},
        "network": {"listen": f"127.0.0.1:{port}", "swarm_secret": "ab" * 32,
                    "max_connections": 40, "max_connections_per_ip": 8,
                    "upgrade_timeout_s": 1.0},
        "api": {"listen": f"127.0.0.1:{api_port}"},
        "trust": {"trainer_keys": ["t.key.pub"]},
        "store": {"dir": "store", "fsync": False},
        "weights": {"base": "base.safetensors", "device": "cpu"},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def _running(cfg):
    """A real node (driver, guard, API) on this event loop, drained on exit."""
    node = build_node(cfg)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(node, stop, ready))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield node
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _status(api: str) -> dict:
    with urllib.request.urlopen(f"http://{api}/status", timeout=5) as r:
        return json.loads(r.read())


def test_slowloris_and_per_ip_flood_are_cut_off(tmp_path: Path) -> None:
    port, api_port = _free_port(), _free_port()
    cfg = parse_config(_config(tmp_path, port, api_port), tmp_path)

    async def scenario() -> dict:
        async with _running(cfg):
            loop = asyncio.get_running_loop()
            socks = []
            for _ in range(20):  # 20 slowloris sockets from one address: 8 admitted
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"GET /swarm HTTP/1.1\r\nHost: x\r\n")  # and never the rest
                s.setblocking(False)
                socks.append(s)
            await asyncio.sleep(0.3)
            st = await loop.run_in_executor(None, _status, f"127.0.0.1:{api_port}")
            assert st["transport"]["connections"] == 8
            assert st["transport"]["refused"] == 12
            t0 = time.monotonic()
            await asyncio.sleep(1.6)  # past the upgrade deadline: all cut off
            closed = 0
            for s in socks:
                try:
                    closed += s.recv(1) == b""
                except (ConnectionResetError, BlockingIOError) as exc:
                    closed += isinstance(exc, ConnectionResetError)
                s.close()
            assert closed == 20, closed
            st = await loop.run_in_executor(None, _status, f"127.0.0.1:{api_port}")
            assert st["transport"]["timed_out"] == 8 and st["transport"]["connections"] == 0
            assert time.monotonic() - t0 < 5
            # the node still takes an honest link afterwards
            link = await connect(f"127.0.0.1:{port}")
            assert await asyncio.wait_for(link.recv(), 5) is not None  # the node's HELLO
            await link.close()
            return st

    asyncio.run(scenario())


@pytest.mark.parametrize(("key", "value"), [("max_connections", 0),
                                            ("max_connections_per_ip", -1),
                                            ("upgrade_timeout_s", float("inf"))])
def test_caps_are_range_checked(tmp_path: Path, key: str, value: float) -> None:
    from swarm.errors import ConfigError

    doc = _config(tmp_path, 7400, 7401)
    doc["network"][key] = value
    with pytest.raises(ConfigError, match=f"network.{key}"):
        parse_config(doc, tmp_path)


def test_api_token_guards_everything_but_healthz(tmp_path: Path) -> None:
    """Attack 5: /status listed every peer, region and version to anyone."""
    port, api_port = _free_port(), _free_port()
    doc = _config(tmp_path, port, api_port)
    (tmp_path / "api.token").write_text("s3cret-token-0123456789\n")
    doc["api"]["token_file"] = "api.token"
    cfg = parse_config(doc, tmp_path)

    def get(path: str, token: str | None = None) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{api_port}{path}")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    async def scenario() -> None:
        async with _running(cfg):
            loop = asyncio.get_running_loop()
            codes = await loop.run_in_executor(None, lambda: (
                get("/healthz"), get("/status"), get("/metrics"), get("/status", "wrong"),
                get("/status", "s3cret-token-0123456789"),
                get("/metrics", "s3cret-token-0123456789")))
            assert codes == (200, 401, 401, 401, 200, 200), codes
            # and the swarm port serves no API at all
            def swarm_status() -> int:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
                        return r.status
                except urllib.error.HTTPError as exc:
                    return exc.code
            assert await loop.run_in_executor(None, swarm_status) == 404

    asyncio.run(scenario())


def test_fd_exhaustion_is_survived(tmp_path: Path) -> None:
    """A real node process under ``prlimit --nofile=96`` and a flood of 300 sockets from
    many loopback addresses (the per-address cap alone would not save it): it refuses
    what it cannot hold, stays up, and serves honest peers once the flood is gone."""
    import shutil
    import subprocess
    import sys

    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux)")
    port, api_port = _free_port(), _free_port()
    doc = _config(tmp_path, port, api_port)
    doc["network"]["max_connections_per_ip"] = 4
    doc["network"]["max_connections"] = 1024  # above the fd limit on purpose
    doc["network"]["upgrade_timeout_s"] = 60.0  # let the flood hold its sockets
    lines = []
    for section, values in doc.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    (tmp_path / "node.toml").write_text("\n".join(lines) + "\n")
    log = (tmp_path / "node.log").open("wb")
    proc = subprocess.Popen(["prlimit", "--nofile=96:96", sys.executable, "-m", "patchswarm",
                             "node", "--config", str(tmp_path / "node.toml")],
                            stdout=log, stderr=subprocess.STDOUT)
    socks: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                _status(f"127.0.0.1:{api_port}")
                break
            except OSError:
                time.sleep(0.3)
        for i in range(300):  # 75 addresses x 4 = 300 > 96 fds
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2,
                                             source_address=(f"127.0.10.{1 + i // 4}", 0))
                s.sendall(b"GET /swarm HTTP/1.1\r\n")
                socks.append(s)
            except OSError:
                pass
        time.sleep(1.0)
        assert proc.poll() is None, "the node died under fd exhaustion"
        pid = proc.pid
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pid = int(kids[0]) if kids else pid  # prlimit execs the node (no child) or forks
        held = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        assert len(socks) >= 200 and held >= 90, (
            f"the flood did not reach the fd limit ({len(socks)} sockets, {held} fds open)")
        for s in socks:
            s.close()
        socks.clear()
        time.sleep(2.0)  # asyncio resumes accepting after an EMFILE pause

        async def honest() -> bool:
            link = await connect(f"127.0.0.1:{port}", timeout=10)
            msg = await asyncio.wait_for(link.recv(), 10)
            await link.close()
            return msg is not None

        assert asyncio.run(honest())
        assert _status(f"127.0.0.1:{api_port}")["transport"]["connections"] <= 1
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
