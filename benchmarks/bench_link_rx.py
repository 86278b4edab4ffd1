"""A receiver's CPU per GB on a shaped link: the old websocket transport against
``node.link`` with and without batched reads.

Two network namespaces joined by a veth pair, the sender's side shaped with tbf at
each ``--mbit`` rate (burst 32 KiB, as the WAN lab's uplinks). A receiver process in
one namespace takes ``--mib`` MiB in 256 KiB messages (the driver's block size) from
a sender process in the other, over TLS 1.3, with uvloop, for each arm:

- ``ws``: aiohttp websockets over TLS, the server receiving (the transport before
  round 12);
- ``link``: ``node.link`` with ``read_coalesce_s = 0`` (a read per wake-up);
- ``link-batched``: ``read_coalesce_s = 0.002`` (the hold's 2 ms floor and cap, round
  12's fixed hold), no wake-up mark (``read_lowat = 0``: rounds 12-46);
- ``link-cap16``: ``read_coalesce_s = 0.016``: each hold as long as 192 KiB take at the
  link's measured rate, 2-16 ms (round 21);
- ``link-lowat``: ``node.link`` as shipped (round 47): the 2 ms hold between messages,
  and inside one the socket's ``SO_RCVLOWAT`` (``read_lowat = 256 KiB``).

The table gives the receiver process's CPU seconds per GB (utime + stime,
``getrusage``), its voluntary context switches per message (how often its loop
slept and woke), and the rate. Needs root (namespaces, tc); everything it makes is
removed at the end. Usage: ``python benchmarks/bench_link_rx.py [--mbit 100,1000]
[--mib 12] [--runs 2] [--arms link-batched,link-lowat] [--out F.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import perfstat  # noqa: E402  (benchmarks/perfstat.py: perf record, stop, group)

BLOCK = 256 * 1024
PORT = 9917
# arm: (read_coalesce_s, read_lowat)
ARMS = {"ws": None, "link": (0.0, 0), "link-batched": (0.002, 0), "link-cap16": (0.016, 0),
        "link-lowat": (0.002, 256 * 1024)}


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw


def _make_certificate(tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_transport import _contexts as make

    make(tmp)  # writes c.pem / k.pem


def _contexts(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp / "c.pem", tmp / "k.pem")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE  # a benchmark of bytes, not of trust
    return server, client


async def _receive(arm: str, n: int, tls: ssl.SSLContext) -> dict:
    """Serve one connection, take ``n`` messages; usage from the first to the last."""
    done = asyncio.Event()
    mark: dict = {}

    def first() -> None:
        mark["u0"], mark["t0"] = _usage(), time.perf_counter()

    def last() -> None:
        mark["u1"], mark["t1"] = _usage(), time.perf_counter()
        done.set()

    if arm == "ws":
        from aiohttp import web

        async def handler(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(max_msg_size=1 << 24, compress=False)
            await ws.prepare(request)
            for i in range(n):
                await ws.receive()
                if i == 0:
                    first()
            last()
            return ws

        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", PORT, ssl_context=tls).start()
    else:
        from node.guard import ConnectionGuard
        from node.link import Link, LinkServer

        async def on_link(link: Link) -> None:
            for i in range(n):
                await link.recv()
                if i == 0:
                    first()
            last()

        server = LinkServer(on_link, ssl_context=tls, max_message=1 << 23,
                            guard=ConnectionGuard(max_total=4, max_per_ip=4, upgrade_timeout_s=30),
                            read_coalesce_s=ARMS[arm][0], read_lowat=ARMS[arm][1])
        await server.start("0.0.0.0", PORT)
    print("listening", flush=True)
    await asyncio.wait_for(done.wait(), 600)
    gb = (n - 1) * BLOCK / 1e9
    return {"cpu_s_per_gb": round((mark["u1"][0] - mark["u0"][0]) / gb, 2),
            "wakeups_per_message": round((mark["u1"][1] - mark["u0"][1]) / (n - 1), 1),
            "mb_per_s": round(gb * 1e3 / (mark["t1"] - mark["t0"]), 1)}


async def _send(arm: str, n: int, host: str, tls: ssl.SSLContext) -> None:
    payload = os.urandom(BLOCK)
    if arm == "ws":
        import aiohttp

        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(f"https://{host}:{PORT}/", ssl=tls, max_msg_size=1 << 24)
            for _ in range(n):
                await ws.send_bytes(payload)
            await asyncio.sleep(1.0)
        return
    from node.link import dial

    link = await dial(host, PORT, ssl_context=tls, max_message=1 << 23, timeout=10)
    for _ in range(n):
        await link.send(payload)
    await asyncio.sleep(1.0)
    await link.close()


def _inner(args: argparse.Namespace) -> int:
    import uvloop

    uvloop.install()
    server, client = _contexts(Path(args.certs))
    if args.inner == "receive":
        print(json.dumps(asyncio.run(_receive(args.arm, args.n, server))), flush=True)
    else:
        asyncio.run(_send(args.arm, args.n, args.host, client))
    return 0


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _one(ns: tuple[str, str], arm: str, n: int, certs: Path,
         perf_out: Path | None = None) -> dict:
    py, me = sys.executable, str(Path(__file__).resolve())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    common = ["--arm", arm, "--n", str(n), "--certs", str(certs)]
    rx = subprocess.Popen(["ip", "netns", "exec", ns[1], py, me, "--inner", "receive", *common],
                          stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "listening":
            raise RuntimeError("the receiver did not start")
        prof = perfstat.record("perf", rx.pid, perf_out, freq=9999) if perf_out is not None else None
        subprocess.run(["ip", "netns", "exec", ns[0], py, me, "--inner", "send", *common,
                        "--host", "10.231.0.2"], check=True, env=env, timeout=600)
        out, _ = rx.communicate(timeout=60)
        res = json.loads(out.strip().splitlines()[-1])
        if prof is not None and perf_out is not None:
            perfstat.interrupt(prof)
            res["perf"] = perfstat.read_perf("perf", perf_out)
        return res
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbit", default="100,1000", help="tbf rates to run, comma separated")
    ap.add_argument("--mib", type=int, default=12, help="MiB per arm and rate")
    ap.add_argument("--arms", default=",".join(ARMS), help="arms to run, comma separated")
    ap.add_argument("--runs", type=int, default=2, help="runs per arm and rate (interleaved)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--perf", type=Path, metavar="DIR",
                    help="sample each receiver with Linux perf into DIR/<mbit>-<arm>-<run>.data "
                         "and report its shares by stage (benchmarks/perfstat.py)")
    ap.add_argument("--inner", choices=["receive", "send"], help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--certs", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.perf:
        args.perf.mkdir(parents=True, exist_ok=True)
    if args.inner:
        return _inner(args)
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    tag = f"plrx{os.getpid() % 100000}"
    ns = (f"{tag}-a", f"{tag}-b")
    rows = []
    n = max(2, args.mib * (1 << 20) // BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        _make_certificate(Path(tmp))  # the certificate both sides load
        try:
            for name in ns:
                _sh("ip", "netns", "add", name)
                _sh("ip", "-n", name, "link", "set", "lo", "up")
            _sh("ip", "link", "add", "va", "netns", ns[0], "type", "veth", "peer", "name", "vb",
                "netns", ns[1])
            for name, dev, ip in ((ns[0], "va", "10.231.0.1/24"), (ns[1], "vb", "10.231.0.2/24")):
                _sh("ip", "-n", name, "addr", "add", ip, "dev", dev)
                _sh("ip", "-n", name, "link", "set", dev, "up")
            for mbit in [int(x) for x in args.mbit.split(",")]:
                subprocess.run(["ip", "netns", "exec", ns[0], "tc", "qdisc", "del", "dev", "va",
                                "root"], capture_output=True, check=False)
                _sh("ip", "netns", "exec", ns[0], "tc", "qdisc", "add", "dev", "va", "root", "tbf",
                    "rate", f"{mbit}mbit", "burst", "32768", "latency", "100ms")
                for run in range(args.runs):
                    for arm in args.arms.split(","):
                        perf_out = (args.perf / f"{mbit}-{arm}-{run + 1}.data"
                                    if args.perf else None)
                        r = _one(ns, arm, n, Path(tmp), perf_out)
                        rows.append({"mbit": mbit, "arm": arm, "run": run + 1, **r})
                        print(f"{mbit:>5} Mbit {arm:13} run {run + 1}: {r}", flush=True)
        finally:
            for name in ns:
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    print(f"\n{'Mbit':>5} {'arm':13} {'run':>3} {'CPU-s/GB':>9} {'wake-ups/msg':>13} {'MB/s':>7}")
    for r in rows:
        print(f"{r['mbit']:>5} {r['arm']:13} {r['run']:>3} {r['cpu_s_per_gb']:>9.2f} "
              f"{r['wakeups_per_message']:>13.1f} {r['mb_per_s']:>7.1f}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_transport import write_results

    write_results(args.out, {"bench": "link_rx", "block_bytes": BLOCK, "mib": args.mib, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
