"""What TCP did under a fanout's slow cross-region transfers (``bench_wan.py --tcp-trace``).

For each chunk a node took in from another region (or from the origin) that took at
least ``--min-s`` seconds, prints the sender's socket toward it as sampled by ``ss -tin``
four times a second (``tcp-trace.txt`` in the run's kept logs): the congestion window
and what is in flight, BBR's bottleneck-rate estimate and the pacing rate, the smoothed
round trip, retransmissions. Round 22 read this to tell a flow stuck in loss recovery
(window collapsed, retransmissions climbing) from one paced at a stale estimate (window
open, nothing lost, BBR's estimate a tenth of the path's rate)::

    python benchmarks/wan_tcp.py DIR/run1-patchswarm --version 2 [--min-s 1.5] [--out t.json]

Times are seconds from the version's first cross-region transfer, as in
``wan_timeline.py``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import wan_timeline as wt

BW = re.compile(r"bbr:\(bw:(\S+?),")
RATE = re.compile(r"(\d+(?:\.\d+)?)([KMG]?)bps")
SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def mbit(text: str | None) -> float | None:
    """``12811488bps`` / ``12.8Mbps`` -> Mbit/s."""
    m = RATE.fullmatch(text or "")
    return round(float(m[1]) * SCALE[m[2]] / 1e6, 2) if m else None


def parse_trace(path: Path) -> list[dict[str, Any]]:
    """Every socket sample: time, namespace, local and peer address, the TCP_INFO fields."""
    rows: list[dict[str, Any]] = []
    t, ns, head = 0.0, "", None
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("@ "):
            _, stamp, ns = line.split()
            t = float(stamp)
            continue
        if not line.startswith(("\t", " ")):
            parts = line.split()
            head = parts if len(parts) >= 4 else None
            continue
        if head is None:
            continue
        toks = line.split()
        f: dict[str, Any] = {k: v for k, _, v in (x.partition(":") for x in toks
                                                   if ":" in x and "(" not in x)}
        for k in ("pacing_rate", "delivery_rate"):
            if k in toks:
                f[k] = toks[toks.index(k) + 1]
        m = BW.search(line)
        rows.append({"t": t, "ns": ns, "send_q": int(head[1]), "local": head[2],
                     "peer": head[3], "cwnd": f.get("cwnd"), "unacked": f.get("unacked"),
                     "rtt_ms": (f.get("rtt") or "").split("/")[0] or None,
                     "retrans": f.get("retrans"), "lost": f.get("lost"),
                     "bbr_bw_mbit": mbit(m[1]) if m else None,
                     "pacing_mbit": mbit(f.get("pacing_rate")),
                     "delivery_mbit": mbit(f.get("delivery_rate"))})
        head = None
    return rows


def ip_of(name: str, origin: str) -> str:
    """``n1-2`` -> ``10.213.1.3`` (netlab's addresses); ``origin`` -> the origin's."""
    if name == "origin":
        return origin
    r, h = name[1:].split("-")
    return f"10.213.{r}.{int(h) + 1}"


def slow_transfers(logdir: Path, version: int, origin: str, min_s: float
                   ) -> tuple[float, list[dict[str, Any]]]:
    """(the version's first cross-region transfer, epoch s; its transfers over ``min_s``)."""
    rows = []
    for path in sorted(logdir.glob("n*.log")):
        me = path.stem
        for line in path.read_text(errors="replace").splitlines():
            m = wt.RECEIVED.search(line)
            if m and int(m[2]) == version:
                peer = wt.host_name(m[1], origin)
                if peer == "origin" or wt.region(peer) != wt.region(me):
                    t0 = float(m[5])
                    rows.append({"from": peer, "to": me, "index": int(m[3]),
                                 "start": t0, "end": t0 + float(m[6])})
    base = min((r["start"] for r in rows), default=0.0)
    return base, [r for r in rows if r["end"] - r["start"] >= min_s]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logdir", type=Path, help="one run's kept logs, with tcp-trace.txt")
    ap.add_argument("--version", type=int, default=2, help="the version published (default 2)")
    ap.add_argument("--min-s", type=float, default=1.5,
                    help="transfers at least this long (default 1.5 s)")
    ap.add_argument("--origin", default="10.213.0.4", help="the origin's address (default: netlab's)")
    ap.add_argument("--siblings", action="store_true",
                    help="also show, per sample, the sender's other busy sockets into the same "
                         "region (which flows shared the inlet, at what estimate)")
    ap.add_argument("--out", type=Path, default=None, help="write the transfers and samples as JSON")
    args = ap.parse_args()
    trace = args.logdir / "tcp-trace.txt"
    if not trace.exists():
        raise SystemExit(f"wan_tcp: no {trace} (run bench_wan.py with --keep-logs and --tcp-trace)")
    samples = parse_trace(trace)
    base, slow = slow_transfers(args.logdir, args.version, args.origin, args.min_s)
    out = []
    for tr in slow:
        src, dst = ip_of(tr["from"], args.origin), ip_of(tr["to"], args.origin)
        rows = [dict(s, t=round(s["t"] - base, 2), at=s["t"]) for s in samples
                if s["local"].rsplit(":", 1)[0] == src and s["peer"].rsplit(":", 1)[0] == dst
                and tr["start"] - 0.5 <= s["t"] <= tr["end"] + 0.3]
        print(f"\n{tr['from']} -> {tr['to']}  chunk {tr['index']}  "
              f"{tr['start'] - base:.2f}-{tr['end'] - base:.2f} s ({tr['end'] - tr['start']:.2f} s)")
        print("     t  send_q   cwnd unacked  rtt_ms  bbr_bw  pacing  deliv  retrans  lost")
        net = dst.rsplit(".", 1)[0] + "."
        for s in rows:
            line = (f"{s['t']:6.2f} {s['send_q']:7d} {s['cwnd'] or '-':>6} {s['unacked'] or '-':>7} "
                    f"{s['rtt_ms'] or '-':>7} {s['bbr_bw_mbit'] or '-':>7} {s['pacing_mbit'] or '-':>7} "
                    f"{s['delivery_mbit'] or '-':>6} {s['retrans'] or '-':>8} {s['lost'] or '-':>5}")
            if args.siblings:
                near = [o for o in samples if o["t"] == s["at"]
                        and o["local"].rsplit(":", 1)[0] == src and o["send_q"] > 0
                        and o["peer"].startswith(net) and not o["peer"].startswith(dst + ":")]
                line += "  | others: " + (", ".join(
                    f"{wt.host_name(o['peer'], args.origin)} {o['delivery_mbit']}" for o in near)
                    or "none")
            print(line)
        out.append({**tr, "start": round(tr["start"] - base, 3), "end": round(tr["end"] - base, 3),
                    "samples": rows})
    if not slow:
        print(f"no cross-region transfer of version {args.version} took {args.min_s} s or more")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
