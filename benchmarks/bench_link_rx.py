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
- ``link-lowat``: ``node.link`` as shipped: since round 51 its own TLS layer, which after
  the handshake carries each message as one AES-256-GCM frame (``node.frames``) and
  wakes the link once a frame is all there;
- ``link-placed``: ``link-lowat`` with each message sent as a node sends a chunk block,
  a small header and the block as a view of the chunk, and the receiver placing the
  block in a chunk buffer (``Link.place_with``): since round 52 the header and the block
  go as two frames and the block's is opened straight into its place;
- ``link-records``: the link's own TLS layer with frames off (TLS records, marks that
  count exactly the ciphertext it holds);
- ``link-loop-tls``: the link on the event loop's TLS transport (rounds 47-50): the 2 ms
  hold between messages, inside one the socket's ``SO_RCVLOWAT`` (``read_lowat = 256
  KiB``) a record short of the message's end;
- ``link-lowat-tight``: an experiment, not a setting: ``link-loop-tls`` with each mark up
  to the message's very end (``TLS_RECORD_SLACK = 0``, ``LOWAT_MIN = 1``). Safe only because this
  sender never stops: a mark may then ask for up to a record's ciphertext that the loop's
  TLS layer already holds, and where nothing follows the message the link would sit on
  it until ``LOWAT_GUARD_S``. It shows what wake-ups beyond one a block cost.

Floors, to show what the machine, the cipher and the loop cost before any of the link's
own code runs (round 51):

- ``tcp-floor``: plain TCP, a blocking ``recv_into`` of up to 1 MiB with ``SO_RCVLOWAT``
  at a block: one system call per 256 KiB, so nearly all of it is the kernel's receive
  path (segments, ACKs, copies to user space) at this rate;
- ``tls-floor``: the same over TLS 1.3 through memory BIOs (as the loop's TLS transport
  does it): Python's ``ssl`` record layer on top, one read call per 16 KiB record;
- ``loop-tcp-floor`` / ``loop-tls-floor``: the event loop (uvloop) and its transport (TLS
  1.3: the loop's own TLS layer) under a buffered protocol that only counts the bytes,
  the socket's mark at a block: what the loop and its TLS layer cost before the link's
  framing;
- ``aead-floor``: plain TCP carrying 256 KiB frames sealed with AES-128-GCM
  (``cryptography``'s ``decrypt_into``, a fixed benchmark key): what a record layer of
  our own with block-sized records would cost (not a transport: no key exchange).

Every process tunes its allocator as a node does (``node.daemon.tune_malloc``; before
round 51 the link arms' receivers did not, and a 256 KiB message's buffer could come
back as fresh pages). The table gives the receiver process's CPU seconds per GB (utime + stime,
``getrusage``; the system part on its own), its voluntary context switches per message (how often its loop
slept and woke), the rate, and (since round 52) the sender process's CPU seconds per GB
sent, from its first message to a second after its last (a border node sends two to
three times what it receives). Needs root (namespaces, tc); everything it makes is
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
        "link-lowat": (0.002, 256 * 1024), "tcp-floor": None, "tls-floor": None,
        "aead-floor": None,
        "loop-tcp-floor": None, "loop-tls-floor": None,
        "link-lowat-tight": (0.002, 256 * 1024), "link-loop-tls": (0.002, 256 * 1024),
        "link-records": (0.002, 256 * 1024), "link-placed": (0.002, 256 * 1024)}
LOOP_TLS = ("link-lowat-tight", "link-loop-tls")  # link arms on the loop's TLS transport
FLOORS = ("tcp-floor", "tls-floor", "aead-floor")
LOOP_FLOORS = ("loop-tcp-floor", "loop-tls-floor")
BLOCK_HEAD = b"PSB1" + bytes(20)  # link-placed: a block message's header, as long as a node's
AEAD_KEY = bytes(range(16))  # aead-floor measures the cipher's cost, not trust
TAG = 16


def _usage() -> tuple[float, int, float]:
    """(user + system CPU seconds, voluntary context switches, system CPU seconds)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw, r.ru_stime


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

    if arm in LOOP_FLOORS:
        return await _receive_loop_floor(arm, n, tls)
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

        if arm == "link-lowat-tight":  # an experiment: marks up to the message's end
            import node.link

            node.link.TLS_RECORD_SLACK, node.link.LOWAT_MIN = 0, 1

        async def on_link(link: Link) -> None:
            if arm == "link-placed":
                chunk = memoryview(bytearray(BLOCK))
                link.place_with(lambda header, k: chunk[:k], len(BLOCK_HEAD),
                                filled=lambda placed: True)
            for i in range(n):
                await link.recv()
                if i == 0:
                    first()
            last()

        server = LinkServer(on_link, ssl_context=tls, max_message=1 << 23,
                            guard=ConnectionGuard(max_total=4, max_per_ip=4, upgrade_timeout_s=30),
                            read_coalesce_s=ARMS[arm][0], read_lowat=ARMS[arm][1],
                            tls_layer="loop" if arm in LOOP_TLS else "own",
                            frames=arm != "link-records")
        await server.start("0.0.0.0", PORT)
    print("listening", flush=True)
    await asyncio.wait_for(done.wait(), 600)
    gb = (n - 1) * BLOCK / 1e9
    return {"cpu_s_per_gb": round((mark["u1"][0] - mark["u0"][0]) / gb, 2),
            "system_s_per_gb": round((mark["u1"][2] - mark["u0"][2]) / gb, 2),
            "wakeups_per_message": round((mark["u1"][1] - mark["u0"][1]) / (n - 1), 1),
            "mb_per_s": round(gb * 1e3 / (mark["t1"] - mark["t0"]), 1)}


async def _send(arm: str, n: int, host: str, tls: ssl.SSLContext) -> None:
    payload = os.urandom(BLOCK)
    if arm == "ws":
        import aiohttp

        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(f"https://{host}:{PORT}/", ssl=tls, max_msg_size=1 << 24)
            u0 = _usage()
            for _ in range(n):
                await ws.send_bytes(payload)
            await asyncio.sleep(1.0)
            _print_send_usage(u0, n)
        return
    from node.link import dial

    link = await dial(host, PORT, ssl_context=tls, max_message=1 << 23, timeout=10,
                      tls_layer="loop" if arm in LOOP_TLS else "own", frames=arm != "link-records")
    parts = (BLOCK_HEAD, memoryview(payload)) if arm == "link-placed" else (payload,)
    u0 = _usage()
    for _ in range(n):
        await link.send(*parts)
    await asyncio.sleep(1.0)
    _print_send_usage(u0, n)
    await link.close()


async def _receive_loop_floor(arm: str, n: int, tls: ssl.SSLContext) -> dict:
    """A loop floor's receiver: the loop's transport, a protocol that counts bytes."""
    import socket

    loop = asyncio.get_running_loop()
    done = loop.create_future()
    want, mark = n * BLOCK, {}

    class Count(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.buf, self.total = memoryview(bytearray(1 << 20)), 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, BLOCK)

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.buf

        def buffer_updated(self, nbytes: int) -> None:
            self.total += nbytes
            if "u0" not in mark and self.total >= BLOCK:
                mark["u0"], mark["t0"], mark["base"] = _usage(), time.perf_counter(), self.total
            if self.total >= want and not done.done():
                mark["u1"], mark["t1"] = _usage(), time.perf_counter()
                done.set_result(None)

    server = await loop.create_server(Count, "0.0.0.0", PORT,
                                      ssl=tls if arm == "loop-tls-floor" else None)
    print("listening", flush=True)
    await asyncio.wait_for(done, 600)
    server.close()
    gb = (want - mark["base"]) / 1e9
    return {"cpu_s_per_gb": round((mark["u1"][0] - mark["u0"][0]) / gb, 2),
            "system_s_per_gb": round((mark["u1"][2] - mark["u0"][2]) / gb, 2),
            "wakeups_per_message": round((mark["u1"][1] - mark["u0"][1]) / (n - 1), 1),
            "mb_per_s": round(gb * 1e3 / (mark["t1"] - mark["t0"]), 1)}


def _tls_server(conn, tls: ssl.SSLContext) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """A TLS 1.3 server over memory BIOs (as the link's), handshaken on a blocking socket."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = tls.wrap_bio(inc, out, server_side=True)
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            if out.pending:
                conn.sendall(out.read())
            data = conn.recv(65536)
            if not data:
                raise RuntimeError("the sender closed during the handshake") from None
            inc.write(data)
    if out.pending:
        conn.sendall(out.read())
    return obj, inc, out


def _receive_floor(arm: str, n: int, tls: ssl.SSLContext) -> dict:
    """A floor arm's receiver: blocking reads of up to 1 MiB that wake at a block
    (``SO_RCVLOWAT``), nothing done with the bytes; TLS through memory BIOs."""
    import socket

    ls = socket.create_server(("0.0.0.0", PORT))
    print("listening", flush=True)
    conn, _ = ls.accept()
    ls.close()
    obj = inc = None
    if arm == "tls-floor":
        obj, inc, _ = _tls_server(conn, tls)
    if arm == "aead-floor":
        return _receive_aead(conn, n)
    raw = memoryview(bytearray(1 << 20))
    buf = memoryview(bytearray(1 << 20))
    total, want, u0, t0, base, calls, lowat = 0, n * BLOCK, None, 0.0, 0, 0, 0
    while total < want:
        # wake at a block, or at what is left (the sender holds its end open after it)
        if min(BLOCK, want - total) != lowat:
            lowat = min(BLOCK, want - total)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
        got = conn.recv_into(raw, len(raw) if obj is not None else min(len(raw), want - total))
        if not got:
            raise RuntimeError(f"the sender closed after {total} of {want} bytes")
        calls += 1
        if obj is None:
            total += got
        else:
            inc.write(raw[:got])
            while True:
                try:
                    total += obj.read(len(buf), buf)
                except ssl.SSLWantReadError:
                    break
        if u0 is None and total >= BLOCK:  # from the first block, as the other arms
            u0, t0, base = _usage(), time.perf_counter(), total
    u1, t1 = _usage(), time.perf_counter()
    conn.close()
    gb = (total - base) / 1e9
    return {"cpu_s_per_gb": round((u1[0] - u0[0]) / gb, 2),
            "system_s_per_gb": round((u1[2] - u0[2]) / gb, 2),
            "wakeups_per_message": round((u1[1] - u0[1]) / (n - 1), 1),
            "mb_per_s": round(gb * 1e3 / (t1 - t0), 1), "reads_per_message": round(calls / n, 1)}


def _receive_aead(conn, n: int) -> dict:
    """``aead-floor``'s receiver: a frame's bytes in one wake-up, opened in place."""
    import socket

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, frame = AESGCM(AEAD_KEY), BLOCK + TAG
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, frame)
    raw, out = memoryview(bytearray(frame)), bytearray(BLOCK)
    u0, t0, calls, filled = None, 0.0, 0, 0
    for i in range(n):
        while filled < frame:  # asks for the frame's rest: wakes when it is all there
            got = conn.recv_into(raw[filled:], frame - filled)
            if not got:
                raise RuntimeError(f"the sender closed in frame {i} of {n}")
            calls += 1
            filled += got
        aead.decrypt_into(i.to_bytes(12, "big"), raw, None, out)
        filled = 0
        if i == 0:
            u0, t0 = _usage(), time.perf_counter()
    u1, t1 = _usage(), time.perf_counter()
    conn.close()
    gb = (n - 1) * BLOCK / 1e9
    return {"cpu_s_per_gb": round((u1[0] - u0[0]) / gb, 2),
            "system_s_per_gb": round((u1[2] - u0[2]) / gb, 2),
            "wakeups_per_message": round((u1[1] - u0[1]) / (n - 1), 1),
            "mb_per_s": round(gb * 1e3 / (t1 - t0), 1), "reads_per_message": round(calls / n, 1)}


def _send_floor(arm: str, n: int, host: str, tls: ssl.SSLContext) -> None:
    import socket

    payload = os.urandom(BLOCK)
    conn = socket.create_connection((host, PORT), timeout=60)
    sock = tls.wrap_socket(conn) if arm == "tls-floor" else conn
    u0 = _usage()
    if arm == "aead-floor":
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        aead = AESGCM(AEAD_KEY)
        for i in range(n):
            sock.sendall(aead.encrypt(i.to_bytes(12, "big"), payload, None))
    for _ in range(n if arm != "aead-floor" else 0):
        sock.sendall(payload)
    time.sleep(1.0)
    _print_send_usage(u0, n)
    sock.close()


def _print_send_usage(u0: tuple[float, int, float], n: int) -> None:
    """The sender's CPU per GB, from before its first message to after its last one
    left (a second's idle wait after it costs next to nothing)."""
    u1, gb = _usage(), n * BLOCK / 1e9
    print(json.dumps({"send_cpu_s_per_gb": round((u1[0] - u0[0]) / gb, 2),
                      "send_system_s_per_gb": round((u1[2] - u0[2]) / gb, 2)}), flush=True)


def _inner(args: argparse.Namespace) -> int:
    from node.daemon import tune_malloc

    tune_malloc()  # as a node's process (round 51: the link arms allocate per message)
    if args.arm in LOOP_FLOORS and args.inner == "send":  # the blocking floors' sender
        args.arm = args.arm.removeprefix("loop-")
    if args.arm in FLOORS:
        server, client = _contexts(Path(args.certs))
        if args.inner == "receive":
            print(json.dumps(_receive_floor(args.arm, args.n, server)), flush=True)
        else:
            _send_floor(args.arm, args.n, args.host, client)
        return 0
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
        tx = subprocess.run(["ip", "netns", "exec", ns[0], py, me, "--inner", "send", *common,
                             "--host", "10.231.0.2"], check=True, env=env, timeout=600,
                            stdout=subprocess.PIPE, text=True)
        out, _ = rx.communicate(timeout=60)
        res = json.loads(out.strip().splitlines()[-1])
        res.update(json.loads(tx.stdout.strip().splitlines()[-1]))
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
    ap.add_argument("--burst-kib", type=float, default=None, metavar="KIB",
                    help="tbf burst (default 32 KiB, as the WAN lab's uplinks; its host links "
                         "take ~4 ms of data: 488 KiB at 1 Gbit/s). A burst under a GSO "
                         "packet makes tbf cut every one of them up")
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
                burst = int(args.burst_kib * 1024) if args.burst_kib else 32768
                _sh("ip", "netns", "exec", ns[0], "tc", "qdisc", "add", "dev", "va", "root", "tbf",
                    "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms")
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
    print(f"\n{'Mbit':>5} {'arm':16} {'run':>3} {'CPU-s/GB':>9} {'system':>7} "
          f"{'wake-ups/msg':>13} {'MB/s':>7} {'sender CPU-s/GB':>16} {'system':>7}")
    for r in rows:
        print(f"{r['mbit']:>5} {r['arm']:16} {r['run']:>3} {r['cpu_s_per_gb']:>9.2f} "
              f"{r.get('system_s_per_gb', float('nan')):>7.2f} "
              f"{r['wakeups_per_message']:>13.1f} {r['mb_per_s']:>7.1f} "
              f"{r['send_cpu_s_per_gb']:>16.2f} {r['send_system_s_per_gb']:>7.2f}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_transport import write_results

    write_results(args.out, {"bench": "link_rx", "block_bytes": BLOCK, "mib": args.mib,
                             "burst_kib": args.burst_kib or 32, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
