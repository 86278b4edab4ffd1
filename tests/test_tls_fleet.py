"""Mutual TLS on a real fleet (issue #10): nodes and trainer with certificates from
the fleet's swarm CA, the HTTP API on its own port. Outsiders without a CA
certificate get no link; an insider cannot claim another identity."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import pytest

from lab.fleet import MODEL, LoopbackFleet
from node.driver import set_congestion
from swarm.protocol import handshake as hs
from swarm.trust import ca
from tests.peer_client import connect, ending


async def _try_link(addr: str, ssl_ctx: ssl.SSLContext | None, hello: bytes | None = None) -> str:
    try:
        link = await connect(addr, ssl_ctx)
    except (ssl.SSLError, OSError, TimeoutError) as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    try:
        if hello is not None:
            await link.send(hello)
        got = await asyncio.wait_for(ending(link, 20), 10)
        return "open" if got == "still open" else got
    finally:
        await link.close()


def test_tls_fleet_converges_and_refuses_outsiders(tmp_path) -> None:
    with LoopbackFleet(2, 2, chunk_size=32 * 1024, tls=True) as fleet:
        fleet.start(timeout=120)
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
        # peer sockets use [network] congestion_control (bbr, shipped) where the kernel
        # allows it; where it does not, the node says why
        with socket.socket() as probe:
            refused = set_congestion(probe, "bbr")
        for st in statuses.values():
            tr = st["transport"]
            if refused is None:
                assert tr["congestion_control"] == "bbr" and tr["congestion_refused"] is None, tr
            else:
                assert tr["congestion_refused"], tr
        target = fleet.nodes[0]
        # 1. a plain (no TLS) link to the swarm port: no connection
        got = asyncio.run(_try_link(target.addr, None))
        assert got.startswith("refused"), got
        # 2. TLS with a certificate from another CA claiming to be the trainer
        ca.init_ca(tmp_path / "rogue")
        ca.issue(tmp_path / "rogue", "trainer", region="trainer", role="origin",
                 out_dir=tmp_path / "rogue-certs")
        rogue = ca.client_context(fleet.workdir / "ca" / "ca.crt",
                                  tmp_path / "rogue-certs" / "trainer.crt",
                                  tmp_path / "rogue-certs" / "trainer.key")
        got = asyncio.run(_try_link(target.addr, rogue))
        assert not got.startswith("open"), got
        # 3. an insider (n1-1's real certificate) claiming to be the trainer in its HELLO
        w = fleet.workdir
        insider = ca.client_context(w / "ca" / "ca.crt", w / "certs" / "n1-1.crt",
                                    w / "certs" / "n1-1.key")
        hello = hs.hello_frame(model=MODEL, node_id="trainer", region="trainer",
                               addr="127.0.9.9:1", role="origin", nonce=os.urandom(16))
        got = asyncio.run(_try_link(target.addr, insider, hello))
        assert got.startswith("closed") and "certificate" in got, got
        # the API lives on its own port; the swarm port serves no API
        assert fleet.http(target.api_addr, "/healthz") == b"ok\n"
        # and the fleet still moves the next version
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
        assert all(st["bad_chunks"] == 0 for st in statuses.values())


@pytest.mark.parametrize("bad", ["wrong-node", "missing"])
def test_config_refuses_a_certificate_for_another_node(tmp_path, bad) -> None:
    from node.config import parse_config
    from swarm.errors import ConfigError

    ca.init_ca(tmp_path / "ca")
    ca.issue(tmp_path / "ca", "other", region="r1", out_dir=tmp_path)
    cert = "other.crt" if bad == "wrong-node" else "nope.crt"
    doc = {
        "node": {"id": "n1", "region": "r1", "model": "m"},
        "network": {"listen": "127.0.0.1:7400", "swarm_secret": "ab" * 32},
        "trust": {"trainer_keys": ["t.pub"]},
        "store": {"dir": "s"}, "weights": {"base": "b.safetensors"},
        "tls": {"ca": "ca/ca.crt", "cert": cert, "key": "other.key"},
        "api": {"listen": "127.0.0.1:7401"},
    }
    with pytest.raises(ConfigError, match=r"tls\.cert"):
        parse_config(doc, tmp_path)
    doc["tls"]["cert"] = "other.crt"
    doc["node"]["id"] = "other"
    del doc["api"]
    with pytest.raises(ConfigError, match=r"api\.listen: required with"):
        parse_config(doc, tmp_path)
