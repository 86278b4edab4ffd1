"""Timeline of a fanout's cross-region chunk transfers, from the nodes' debug logs.

``bench_wan.py --keep-logs DIR`` keeps every node's log, written at DEBUG: a
``chunk_received`` line per chunk a node took in (its first block's wall time,
seconds to the last) and a ``chunk_sent`` line per chunk it sent (start, seconds,
whether it was a cut-through relay). This prints the transfers between regions
(and from the origin) in start order, times from the first transfer, and writes
them as JSON::

    python benchmarks/wan_timeline.py DIR/run1-patchswarm [--version 2] [--out t.json]

A host's name comes from its netlab address (``10.213.<region>.<host + 1>``; the
origin is the last host of region 0).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

RECEIVED = re.compile(r"chunk_received peer=(\S+) version=(\d+) index=(\d+) state=(\w+) "
                      r"first_block_at=([\d.]+) s=([\d.]+) relays=(\d+)")
SENT = re.compile(r"chunk_sent peer=(\S+) version=(\d+) index=(\d+) started_at=([\d.]+) "
                  r"s=([\d.]+) cut_through=(\w+)")


def host_name(addr: str, origin: str) -> str:
    ip = addr.rsplit(":", 1)[0]
    if ip == origin:
        return "origin"
    parts = ip.split(".")
    return f"n{parts[2]}-{int(parts[3]) - 1}" if len(parts) == 4 else ip


def region(name: str) -> str:
    return "0" if name == "origin" else name[1:].split("-")[0]


def timeline(logdir: Path, version: int, origin: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted(logdir.glob("n*.log")):
        me = path.stem
        for line in path.read_text(errors="replace").splitlines():
            m = RECEIVED.search(line)
            if m and int(m[2]) == version:
                peer = host_name(m[1], origin)
                if peer == "origin" or region(peer) != region(me):
                    t0 = float(m[5])
                    rows.append({"kind": "received", "from": peer, "to": me, "index": int(m[3]),
                                 "start": t0, "end": t0 + float(m[6]), "state": m[4],
                                 "relayed_on": int(m[7])})
                continue
            m = SENT.search(line)
            if m and int(m[2]) == version:
                peer = host_name(m[1], origin)
                if region(peer) != region(me):
                    t0 = float(m[4])
                    rows.append({"kind": "sent", "from": me, "to": peer, "index": int(m[3]),
                                 "start": t0, "end": t0 + float(m[5]),
                                 "cut_through": m[6] == "True"})
    if rows:
        base = min(r["start"] for r in rows)
        for r in rows:
            r["start"] = round(r["start"] - base, 3)
            r["end"] = round(r["end"] - base, 3)
    rows.sort(key=lambda r: (r["start"], r["kind"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logdir", type=Path, help="one run's logs (bench_wan.py --keep-logs DIR/run<k>-patchswarm)")
    ap.add_argument("--version", type=int, default=2, help="the version published (default 2)")
    ap.add_argument("--origin", default="10.213.0.4", help="the origin's address (default: netlab's)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = ap.parse_args()
    rows = timeline(args.logdir, args.version, args.origin)
    if not rows:
        raise SystemExit(f"no chunk transfers of version {args.version} in {args.logdir} "
                         "(were the nodes logging at debug? bench_wan.py --keep-logs)")
    print("start    end      s  from -> to       chunk  what")
    for r in rows:
        what = (f"sent{' cut-through' if r['cut_through'] else ''}" if r["kind"] == "sent"
                else f"received ({r['state']}, relayed on {r['relayed_on']}x while arriving)")
        print(f"{r['start']:6.2f} {r['end']:6.2f} {r['end'] - r['start']:5.2f}  "
              f"{r['from']:>6} -> {r['to']:<6}  #{r['index']:<4} {what}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
