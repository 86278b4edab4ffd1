"""The swarm CA and mutual TLS: real handshakes on loopback, identities from certificates."""

from __future__ import annotations

import asyncio
import ssl
import stat

import pytest

from patchswarm.cli import main
from swarm.errors import ConfigError
from swarm.trust import ca


@pytest.fixture
def pki(tmp_path):
    ca.init_ca(tmp_path / "ca")
    ca.issue(tmp_path / "ca", "node-a", region="eu", out_dir=tmp_path / "certs")
    ca.issue(tmp_path / "ca", "trainer", region="hq", role="origin", out_dir=tmp_path / "certs")
    ca.init_ca(tmp_path / "rogue")
    ca.issue(tmp_path / "rogue", "trainer", region="hq", role="origin", out_dir=tmp_path / "evil")
    return tmp_path


def ctx(pki, side, who, ca_dir="ca", certs="certs"):
    make = ca.server_context if side == "server" else ca.client_context
    return make(pki / ca_dir / "ca.crt", pki / certs / f"{who}.crt", pki / certs / f"{who}.key")


async def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext):
    """One real TLS connection on 127.0.0.1; returns (server saw, client saw) identities."""
    seen: dict[str, object] = {}
    done = asyncio.Event()

    async def on_conn(reader, writer):
        try:
            seen["server"] = ca.peer_identity(writer.get_extra_info("ssl_object"))
            writer.write(b"ok")
            await writer.drain()
        except Exception as exc:  # recorded for the assertion
            seen["server"] = exc
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=client_ctx), 5)
            seen["client"] = ca.peer_identity(writer.get_extra_info("ssl_object"))
            # TLS 1.3: a client learns that the server refused its certificate on first read.
            seen["data"] = await asyncio.wait_for(reader.read(2), 5)
            writer.close()
            await asyncio.wait_for(done.wait(), 2)
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            seen["error"] = exc
    finally:
        server.close()
        await server.wait_closed()
    return seen


def refused(seen) -> bool:
    """The server never accepted the connection and the client got no byte from it."""
    return "server" not in seen and seen.get("data", b"") == b"" and (
        "error" in seen or seen.get("data") == b"")


def test_mutual_tls_binds_identities(pki):
    seen = asyncio.run(handshake(ctx(pki, "server", "trainer"), ctx(pki, "client", "node-a")))
    assert seen["server"] == ca.Identity("node-a", "eu", "node")
    assert seen["client"] == ca.Identity("trainer", "hq", "origin")
    assert seen["data"] == b"ok"


def test_a_certificate_from_another_ca_cannot_claim_the_trainer(pki):
    """The attack of issue #10: claiming node id "trainer" needs the CA's signature."""
    seen = asyncio.run(handshake(ctx(pki, "server", "node-a"),
                                 ctx(pki, "client", "trainer", certs="evil")))
    assert refused(seen)


def test_a_client_without_a_certificate_is_refused(pki):
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.load_verify_locations(cafile=str(pki / "ca" / "ca.crt"))

    async def go():
        return await handshake(ctx(pki, "server", "node-a"), bare)

    assert refused(asyncio.run(go()))


def test_keys_are_private_and_never_overwritten(pki):
    assert stat.S_IMODE((pki / "ca" / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((pki / "certs" / "node-a.key").stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="already exists"):
        ca.init_ca(pki / "ca")
    with pytest.raises(ConfigError, match="already exists"):
        ca.issue(pki / "ca", "node-a", region="eu", out_dir=pki / "certs")


@pytest.mark.parametrize("bad", ["", "a b", "x:y", "../etc", "é", "a" * 129])
def test_bad_names_refused(pki, bad):
    with pytest.raises(ConfigError, match="node id"):
        ca.issue(pki / "ca", bad, region="eu", out_dir=pki / "out")


def test_identity_of_a_certificate_without_ours(pki):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    cert = x509.load_pem_x509_certificate((pki / "ca" / "ca.crt").read_bytes())
    with pytest.raises(ConfigError, match="no patchswarm identity"):
        ca.identity_of(cert.public_bytes(Encoding.DER))


def test_cli(tmp_path, capsys):
    assert main(["ca", "init", str(tmp_path / "ca")]) == 0
    assert main(["ca", "issue", "n1", "--region", "us", "--ca", str(tmp_path / "ca"),
                 "-o", str(tmp_path / "c")]) == 0
    assert "issued node n1 (region us)" in capsys.readouterr().out
    assert main(["ca", "issue", "n2", "--region", "us", "--ca", str(tmp_path / "nope"),
                 "-o", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("patchswarm ca: error:") and "\n" not in err


def test_a_node_refuses_to_dial_an_impostor(pki):
    seen = asyncio.run(handshake(ctx(pki, "server", "trainer", ca_dir="rogue", certs="evil"),
                                 ctx(pki, "client", "node-a")))
    assert isinstance(seen.get("error"), ssl.SSLError) and "client" not in seen
