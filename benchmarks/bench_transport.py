"""Transport CPU per GB over loopback: what the node's link layer costs, by layer.

One process holds both ends of one connection and sends ``--blocks`` blocks of
256 KiB (the driver's block size) one way; the table gives process CPU seconds
per GB moved (both ends together) and the rate, for:

- ``tcp``: plain TCP, asyncio streams out, a buffered protocol in (the floor);
- ``tls``: the same inside TLS 1.3 (asyncio's memory-BIO TLS, as the node uses);
- ``ws-client-sends`` / ``ws-server-sends``: aiohttp websockets over TLS, the node's
  links before round 12 (a client masks every frame it sends, RFC 6455);
- ``link`` / ``link-placed``: ``node.link`` over TLS, the node's links since round 12;
  each block ends in a 4 MiB chunk buffer, as in the driver: copied there from the
  message (``link``) or decrypted straight into it (``link-placed``, ``place_with``).

Usage: ``python benchmarks/bench_transport.py [--blocks 2048] [--runs 2] [--out F.json]``.
Run it on an idle machine: CPU-s/GB is steadier than the rate, but both move with load.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import resource
import ssl
import struct
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 256 * 1024


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _contexts(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .sign(key, hashes.SHA256()))
    (tmp / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                  serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp / "c.pem", tmp / "k.pem")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(tmp / "c.pem")
    return server, client


async def _stream(n: int, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None) -> tuple[float, float]:
    done = asyncio.Event()

    class Sink(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.buf = memoryview(bytearray(BLOCK + 4))
            self.pos = 0
            self.blocks = 0

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.buf[self.pos:]

        def buffer_updated(self, nbytes: int) -> None:
            self.pos += nbytes
            if self.pos == len(self.buf):
                self.pos = 0
                self.blocks += 1
                if self.blocks == n:
                    done.set()

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Sink, "127.0.0.1", 0, ssl=tls[0] if tls else None)
    port = server.sockets[0].getsockname()[1]
    if tls:
        _r, w = await asyncio.open_connection("127.0.0.1", port, ssl=tls[1],
                                              server_hostname="localhost")
    else:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
    head, payload = struct.pack(">I", BLOCK), os.urandom(BLOCK)
    c0, t0 = _cpu(), time.perf_counter()
    for _ in range(n):
        w.write(head)
        w.write(payload)
        await w.drain()
    await done.wait()
    c1, t1 = _cpu(), time.perf_counter()
    w.close()
    server.close()
    return c1 - c0, t1 - t0


async def _websocket(n: int, tls: tuple[ssl.SSLContext, ssl.SSLContext],
                     client_sends: bool) -> tuple[float, float]:
    import aiohttp
    from aiohttp import web

    done = asyncio.Event()
    payload = os.urandom(BLOCK)

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 24, compress=False)
        await ws.prepare(request)
        if client_sends:
            for _ in range(n):
                await ws.receive()
        else:
            for _ in range(n):
                await ws.send_bytes(payload)
            await ws.receive()
        done.set()
        return ws

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls[0])
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(f"https://localhost:{port}/", ssl=tls[1],
                                      max_msg_size=1 << 24, compress=0)
        c0, t0 = _cpu(), time.perf_counter()
        if client_sends:
            for _ in range(n):
                await ws.send_bytes(payload)
        else:
            for _ in range(n):
                await ws.receive()
            await ws.send_bytes(b"x")
        await done.wait()
        c1, t1 = _cpu(), time.perf_counter()
        await ws.close()
    await runner.cleanup()
    return c1 - c0, t1 - t0


async def _link(n: int, tls: tuple[ssl.SSLContext, ssl.SSLContext],
                placed: bool) -> tuple[float, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from node.guard import ConnectionGuard
    from node.link import Link, LinkServer, dial

    head = 24  # the driver's block header (swarm.protocol.wire.BLOCK_HEADER_LEN)
    chunk = memoryview(bytearray(4 * 1024 * 1024))
    done = asyncio.Event()

    async def take(link: Link) -> None:
        if placed:
            link.place_with(lambda h, k: chunk[:k], head)
        for _ in range(n):
            m = await link.recv()
            if not placed:
                chunk[:len(m) - head] = memoryview(m)[head:]  # type: ignore[arg-type]
        done.set()

    server = LinkServer(take, ssl_context=tls[0], max_message=1 << 23,
                        guard=ConnectionGuard(max_total=4, max_per_ip=4, upgrade_timeout_s=10),
                        read_coalesce_s=0.0)
    await server.start("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tls[1].check_hostname = False  # the node's contexts check identities, not names
    try:
        link = await dial("127.0.0.1", port, ssl_context=tls[1], max_message=1 << 23, timeout=10)
    finally:
        tls[1].check_hostname = True
    header, payload = os.urandom(head), os.urandom(BLOCK)
    c0, t0 = _cpu(), time.perf_counter()
    for _ in range(n):
        await link.send(header, payload)
    await done.wait()
    c1, t1 = _cpu(), time.perf_counter()
    await link.close()
    await server.close()
    return c1 - c0, t1 - t0


def write_results(path: Path | None, doc: dict) -> None:
    """The results as JSON at ``path`` (none: nothing), with the Python version."""
    if path is not None:
        path.write_text(json.dumps({**doc, "python": sys.version.split()[0]}, indent=1) + "\n")
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2048, help="256 KiB blocks per arm (2048: 0.5 GiB)")
    ap.add_argument("--runs", type=int, default=2, help="runs per arm (the table shows each)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    with tempfile.TemporaryDirectory() as tmp:
        tls = _contexts(Path(tmp))
        arms = {
            "tcp": lambda: _stream(args.blocks, None),
            "tls": lambda: _stream(args.blocks, tls),
            "ws-client-sends": lambda: _websocket(args.blocks, tls, True),
            "ws-server-sends": lambda: _websocket(args.blocks, tls, False),
            "link": lambda: _link(args.blocks, tls, False),
            "link-placed": lambda: _link(args.blocks, tls, True),
        }
        gb = args.blocks * BLOCK / 1e9
        rows = []
        for run in range(args.runs):
            for name, make in arms.items():
                cpu, wall = asyncio.run(make())
                rows.append({"arm": name, "run": run + 1, "cpu_s_per_gb": round(cpu / gb, 3),
                             "gb_per_s": round(gb / wall, 3)})
    print(f"{'arm':18} {'run':>3} {'CPU-s/GB (both ends)':>21} {'GB/s':>6}")
    for r in rows:
        print(f"{r['arm']:18} {r['run']:>3} {r['cpu_s_per_gb']:>21.2f} {r['gb_per_s']:>6.2f}")
    write_results(args.out, {"bench": "transport", "block_bytes": BLOCK, "blocks": args.blocks,
                             "loop": loop_name, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
