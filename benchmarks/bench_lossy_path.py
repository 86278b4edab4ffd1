"""One TCP flow over an emulated long lossy path, per congestion control (issue #11).

Why: the simulator's ``lossy-long`` scenario caps every flow near the Mathis ceiling
``MSS / RTT x 1.22 / sqrt(p)`` (~3 Mbit/s at 150 ms and 0.1 % loss), the behaviour of
a loss-based congestion control (CUBIC, Reno: most distributions' default). Since this
round a node asks for BBR on its peer sockets (``[network] congestion_control``). This
bench measures, on a real kernel, what one flow gets on such a path with each.

Builds (root) a ``lab.netlab`` lab: the trainer's site and one host, the path shaped
with tbf to ``--mbit`` both ways, ``--delay-ms`` one way (NFQUEUE holder, ``lab.delay``)
and, in the lossy lab, each TCP segment dropped with probability ``--loss``. Then per
run and per congestion control (set on the sending socket with ``TCP_CONGESTION``, as
``node.driver.set_congestion`` does), a sender on the trainer's host writes for
``--seconds`` and the receiver counts what arrives. Every arm runs on the lossless lab
too, in the same run: its rate is the baseline the lossy one is read against.

    sudo .venv/bin/python benchmarks/bench_lossy_path.py          # 150 ms, 0.1 %, 100 Mbit
    sudo .venv/bin/python benchmarks/bench_lossy_path.py --quick  # 1 run, 10 s

Prints a table and writes ``benchmarks/results/lossy_path.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_transport import write_results  # noqa: E402

PORT = 5001
MSS = 1448

RECEIVER = """
import json, selectors, socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", %(port)d)); s.listen(64)
print("listening", flush=True)
sel = selectors.DefaultSelector()
s.settimeout(%(seconds)f + 30)
for _ in range(%(flows)d):
    c, _ = s.accept(); c.setblocking(False); sel.register(c, selectors.EVENT_READ)
n = 0; t0 = None; marks = []; open_ = %(flows)d
while open_:
    for key, _ in sel.select(timeout=%(seconds)f + 30):
        d = key.fileobj.recv(1 << 20)
        if not d:
            sel.unregister(key.fileobj); key.fileobj.close(); open_ -= 1
            continue
        now = time.monotonic()
        if t0 is None: t0 = now
        n += len(d); marks.append((now - t0, n))
half = next((b for t, b in marks if t >= %(seconds)f / 2), n)
t_end = marks[-1][0] if marks else 0.0
print(json.dumps({"bytes": n, "elapsed_s": t_end, "second_half_bytes": n - half,
                  "second_half_s": max(1e-9, t_end - %(seconds)f / 2)}), flush=True)
"""

SENDER = """
import json, selectors, socket, time
socks = []; why = None
for _ in range(%(flows)d):
    s = socket.create_connection((%(ip)r, %(port)d), timeout=10)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, %(cc)r.encode())
    except OSError as exc:
        why = str(exc)
    s.setblocking(False); socks.append(s)
used = socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\\0")[0].decode()
sel = selectors.DefaultSelector()
for s in socks:
    sel.register(s, selectors.EVENT_WRITE)
buf = b"x" * 65536
end = time.monotonic() + %(seconds)f
while time.monotonic() < end:
    for key, _ in sel.select(timeout=0.5):
        try:
            key.fileobj.send(buf)
        except BlockingIOError:
            pass
retrans = 0
for s in socks:
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    retrans += int.from_bytes(info[100:104], "little")  # tcpi_total_retrans
    s.close()
print(json.dumps({"used": used, "refused": why, "total_retrans": retrans}), flush=True)
"""


def _one(lab: Any, cc: str, seconds: float, flows: int = 1) -> dict[str, Any]:
    dst = lab.ip_host(0, 0)
    rx = subprocess.Popen([*lab.exec_prefix(lab.ns_host(0, 0)), sys.executable, "-c",
                           RECEIVER % {"port": PORT, "seconds": seconds, "flows": flows}],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "listening":
            raise SystemExit("bench_lossy_path: the receiver did not start")
        tx = subprocess.run([*lab.exec_prefix(lab.ns_trainer), sys.executable, "-c",
                             SENDER % {"ip": dst, "port": PORT, "cc": cc, "seconds": seconds,
                                              "flows": flows}],
                            capture_output=True, text=True, timeout=seconds + 60)
        if tx.returncode != 0:
            raise SystemExit(f"bench_lossy_path: sender failed: {tx.stderr.strip()[-400:]}")
        got = json.loads(rx.communicate(timeout=seconds + 60)[0].strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(5)
    sent = json.loads(tx.stdout.strip().splitlines()[-1])
    mbit = got["bytes"] * 8 / max(1e-9, got["elapsed_s"]) / 1e6
    late = got["second_half_bytes"] * 8 / got["second_half_s"] / 1e6
    return {"cc": cc, "flows": flows, "used": sent["used"], "refused": sent["refused"],
            "retransmits": sent["total_retrans"], "bytes": got["bytes"],
            "mbit_s": round(mbit, 2), "second_half_mbit_s": round(late, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ccs", default="cubic,reno,bbr",
                    help="congestion controls to compare, comma-separated (default cubic,reno,bbr)")
    ap.add_argument("--flows", default="1",
                    help="parallel TCP connections per arm, comma-separated: the sender "
                         "spreads its bytes over them, the rate is their sum (default 1)")
    ap.add_argument("--mbit", type=float, default=100.0, help="path rate, tbf both ways (100)")
    ap.add_argument("--delay-ms", type=float, default=75.0, help="one-way delay (75: 150 ms RTT)")
    ap.add_argument("--loss", type=float, default=0.001, help="per-segment loss (0.001)")
    ap.add_argument("--seconds", type=float, default=20.0, help="each flow sends this long (20)")
    ap.add_argument("--runs", type=int, default=2, help="runs per arm (2)")
    ap.add_argument("--quick", action="store_true", help="1 run of 10 s")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lossy_path.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.seconds = 1, 10.0
    from lab.netlab import NetLab, delay_available

    why = delay_available()
    if why:
        print(f"bench_lossy_path: {why}", file=sys.stderr)
        return 2
    ccs = [c.strip() for c in args.ccs.split(",") if c.strip()]
    ks = [int(k) for k in args.flows.split(",") if k.strip()]
    if not ks or min(ks) < 1 or max(ks) > 64:
        ap.error("--flows: counts in 1..64")
    rtt = 2 * args.delay_ms / 1e3
    mathis = MSS * 8 / rtt * math.sqrt(3 / (2 * args.loss)) / 1e6 if args.loss else math.inf
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for loss in (0.0, args.loss):
        with NetLab(1, 1, uplink_mbit=args.mbit, delay_ms=args.delay_ms, loss=loss) as lab:
            for k in range(args.runs):
                for cc in ccs:
                    for nf in ks:
                        r = _one(lab, cc, args.seconds, nf)
                        r.update(loss=loss, run=k + 1)
                        rows.append(r)
                        print(f"loss {loss:<6} run {k + 1} {cc:6} ({r['used']}) x{nf:<2}: "
                              f"{r['mbit_s']:7.2f} Mbit/s, second half "
                              f"{r['second_half_mbit_s']:7.2f}, {r['retransmits']} retransmits",
                              flush=True)
            stats = lab.delay_stats()
        rows.append({"holder": stats, "loss": loss})
    flows = [r for r in rows if "cc" in r]
    summary = []
    print(f"\n{args.mbit:g} Mbit/s path, {rtt * 1e3:g} ms RTT, {args.seconds:g} s per flow; "
          f"Mathis ceiling at {args.loss:g} loss: {mathis:.2f} Mbit/s")
    print(f"{'cc':8} {'flows':>5} {'lossless Mbit/s':>16} {'lossy Mbit/s':>13} "
          f"{'lossy 2nd half':>15} {'lossy / lossless':>17}")
    for cc in ccs:
        for nf in ks:
            arm = [r for r in flows if r["cc"] == cc and r["flows"] == nf]
            clean = statistics.median(r["mbit_s"] for r in arm if r["loss"] == 0)
            lossy = [r for r in arm if r["loss"] > 0]
            m = statistics.median(r["mbit_s"] for r in lossy)
            late = statistics.median(r["second_half_mbit_s"] for r in lossy)
            summary.append({"cc": cc, "flows": nf, "lossless_mbit_s": clean, "lossy_mbit_s": m,
                            "lossy_second_half_mbit_s": late, "ratio": round(m / clean, 3)})
            print(f"{cc:8} {nf:5d} {clean:16.2f} {m:13.2f} {late:15.2f} {m / clean:17.3f}")
    write_results(args.out, {
        "bench": "lossy_path", "flows": ks, "mbit": args.mbit, "delay_ms": args.delay_ms, "loss": args.loss,
        "seconds": args.seconds, "runs": args.runs, "mathis_mbit_s": round(mathis, 3),
        "summary": summary, "rows": rows, "wall_s": round(time.monotonic() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
