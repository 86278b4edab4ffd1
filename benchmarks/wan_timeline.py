"""Timeline of a fanout's cross-region chunk transfers, from the nodes' debug logs.

``bench_wan.py --keep-logs DIR`` keeps every node's log, written at DEBUG: a
``chunk_received`` line per chunk a node took in (its first block's wall time,
seconds to the last) and a ``chunk_sent`` line per chunk it sent (start, seconds,
whether it was a cut-through relay); the origin's ``origin.log`` holds its own
decisions, at DEBUG too: each ``push`` (border, the uplink window, whether the
border's connection had carried no push yet), each ``relay_ordered`` (source border,
target, on arrival or now) and each ``region_delivered`` (a border's HAVE for a
transfer the origin planned: push or relay, seconds from order to HAVE). This prints
the transfers between regions (and from the origin) and the origin's decisions in
time order, times from the first of them, and writes them as JSON::

    python benchmarks/wan_timeline.py DIR/run1-patchswarm [--version 2] [--out t.json]
    python benchmarks/wan_timeline.py DIR/run1-patchswarm --version 4 --inlets 0.25

A host's name comes from its netlab address (``10.213.<region>.<host + 1>``; the
origin is the last host of region 0).
"""

from __future__ import annotations

import argparse
import calendar
import json
import re
import time
from pathlib import Path
from typing import Any

RECEIVED = re.compile(r"chunk_received peer=(\S+) version=(\d+) index=(\d+) state=(\w+) "
                      r"first_block_at=([\d.]+) s=([\d.]+) relays=(\d+)")
SENT = re.compile(r"chunk_sent peer=(\S+) version=(\d+) index=(\d+) started_at=([\d.]+) "
                  r"s=([\d.]+) cut_through=(\w+)")
# origin.log: "<ISO time>Z origin DEBUG <event> key=value ..." (node.logs.TextFormatter)
DECISION = re.compile(r"^(\S+)Z origin DEBUG (push|relay_ordered|region_delivered) (.*)$")


def host_name(addr: str, origin: str) -> str:
    ip = addr.rsplit(":", 1)[0]
    if ip == origin:
        return "origin"
    parts = ip.split(".")
    return f"n{parts[2]}-{int(parts[3]) - 1}" if len(parts) == 4 else ip


def region(name: str) -> str:
    return "0" if name == "origin" else name[1:].split("-")[0]


def wall_time(stamp: str) -> float:
    """Seconds since the epoch of ``2026-12-02T06:51:18.127`` (UTC, TextFormatter's)."""
    whole, _, ms = stamp.partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(ms or 0) / 1000


def decisions(path: Path, version: int) -> list[dict[str, Any]]:
    """The origin's push / relay_ordered / region_delivered lines of ``version``."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(errors="replace").splitlines():
        m = DECISION.match(line)
        if not m:
            continue
        fields = dict(kv.split("=", 1) for kv in m[3].split() if "=" in kv)
        if fields.get("version") != str(version):
            continue
        t = wall_time(m[1])
        rows.append({"kind": m[2], "start": t, "end": t, "index": int(fields.get("index", -1)),
                     **{k: v for k, v in fields.items() if k not in ("version", "index")}})
    return rows


def timeline(logdir: Path, version: int, origin: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = decisions(logdir / "origin.log", version)
    for path in sorted([*logdir.glob("n*.log"), logdir / "origin.log"]):
        if not path.exists():
            continue
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


def row_text(r: dict[str, Any]) -> str:
    """One line of the printed timeline."""
    k = r["kind"]
    if k in ("sent", "received"):
        what = (f"sent{' cut-through' if r['cut_through'] else ''}" if k == "sent"
                else f"received ({r['state']}, relayed on {r['relayed_on']}x while arriving)")
        return (f"{r['start']:6.2f} {r['end']:6.2f} {r['end'] - r['start']:5.2f}  "
                f"{r['from']:>6} -> {r['to']:<6}  #{r['index']:<4} {what}")
    if k == "push":
        src, dst = "origin", r.get("border", "?")
        what = f"origin pushes (window {r.get('uplink_window')}{', cold link' if r.get('cold') == 'True' else ''})"
    elif k == "relay_ordered":
        src, dst = r.get("border", "?"), r.get("target", "?")
        what = "relay ordered" + (" (on arrival)" if r.get("on_arrival") == "True" else "")
    else:
        src, dst = "HAVE", r.get("border", "?")
        what = f"region {r.get('region')} has it ({r.get('via')}, {r.get('s')} s after the order)"
    return f"{r['start']:6.2f}               {src:>6} -> {dst:<6}  #{r['index']:<4} {what}"


def inlet_use(rows: list[dict[str, Any]], bucket_s: float, chunk_bytes: int,
              inlet_bps: float) -> dict[str, list[float]]:
    """Per remote region, the share of its inlet (``inlet_bps``) that chunk transfers into
    it filled in each ``bucket_s`` slice of the timeline: each received chunk's bytes
    spread evenly from its first block to its last. Approximate (a transfer's rate is not
    even, and a region's last chunk may be short), enough to see where an inlet idled:
    the start-up, a gap, the relays of the last chunks."""
    into: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["kind"] != "received" or region(r["from"]) == region(r["to"]):
            continue
        s, e = r["start"], r["end"]
        if e <= s:
            continue
        rate = chunk_bytes / (e - s)
        b = into.setdefault(region(r["to"]), {})
        t = s
        while t < e:
            k = int(t / bucket_s)
            nt = min(e, (k + 1) * bucket_s)
            b[k] = b.get(k, 0.0) + rate * (nt - t)
            t = nt
    return {reg: [round(b.get(k, 0.0) * 8 / (bucket_s * inlet_bps), 3) for k in range(max(b) + 1)]
            for reg, b in sorted(into.items())}


def relay_lags(rows: list[dict[str, Any]], hop_s: float = 0.045) -> list[dict[str, Any]]:
    """Per relay the origin ordered across regions: when it ordered it, when the chunk's
    first block reached the relaying border, when the border began sending it on, and
    ``lag``: how long after it could have begun that was (the later of the order plus
    ``hop_s``, a one-way trip, and the first block). A lag of ``cut_through_after_s``
    (0.2 s) is a relay that waited to learn the chunk arrives slowly; one of 0.3-0.9 s was,
    in round 39, an order that travelled behind its push's bytes (docs/benchmarks.md)."""
    first: dict[tuple[str, int], float] = {}
    began: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["kind"] == "received":
            first.setdefault((r["to"], r["index"]), r["start"])
        elif r["kind"] == "sent" and r["from"] != "origin":
            began.setdefault((r["from"], r["index"]), r["start"])
    out = []
    for r in rows:
        if r["kind"] != "relay_ordered":
            continue
        b, i = r.get("border", "?"), r["index"]
        fb, go = first.get((b, i)), began.get((b, i))
        if fb is None or go is None:
            continue
        out.append({"index": i, "border": b, "target": r.get("target", "?"),
                    "ordered": r["start"], "first_block": fb, "began": go,
                    "lag": round(go - max(r["start"] + hop_s, fb), 3)})
    return out


def last_inflow(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per remote region, the version's last chunk to come in from outside it: its index,
    from whom, when it ended, and, where a border of another region relayed it, ``lag``:
    how long after that border had it all the relay's last byte came in (cut-through
    relays trail their source by a queue's drain; on the emulated WAN of round 40 the
    version's last inflow came 0.1-0.7 s after its source was whole)."""
    received = [r for r in rows if r["kind"] == "received"]
    whole: dict[tuple[str, int], float] = {}
    for r in received:
        whole.setdefault((r["to"], r["index"]), r["end"])
    last: dict[str, dict[str, Any]] = {}
    for r in received:
        reg = region(r["to"])
        if reg != "0" and (reg not in last or r["end"] > last[reg]["end"]):
            last[reg] = r
    out = {}
    for reg, r in sorted(last.items()):
        src = None if r["from"] == "origin" else whole.get((r["from"], r["index"]))
        out[reg] = {"index": r["index"], "from": r["from"], "to": r["to"], "end": r["end"],
                    "via": "push" if r["from"] == "origin" else "relay",
                    "lag": None if src is None else round(r["end"] - src, 3)}
    return out


# "<ISO time>Z <node> <LEVEL> <event> key=value ..." (node.logs.TextFormatter)
STAMPED = re.compile(r"^(\S+)Z \S+ \w+ (manifest_accepted|chunk_received|version_complete) (.*)$")


def last_chunk_waits(logdir: Path, version: int) -> dict[str, dict[str, Any]]:
    """Per node, when it stored the version's last chunk (a patch's short one: 64 MiB and
    a header is 16 chunks and 1.8 KB) and when it had the version complete, both in
    seconds after it stored its last other chunk (from each log line's own time). A
    positive ``last``: the node waited for that chunk after all the others (round 41:
    sent last, it came 50-100 ms after them on the slowest nodes)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(logdir.glob("n*.log")):
        count = None
        stored: dict[int, float] = {}
        complete = None
        for line in path.read_text(errors="replace").splitlines():
            m = STAMPED.match(line)
            if m is None:
                continue
            f = dict(kv.split("=", 1) for kv in m[3].split() if "=" in kv)
            if f.get("version") != str(version):
                continue
            if m[2] == "manifest_accepted":
                count = int(f.get("chunks", 0)) or None
            elif m[2] == "chunk_received" and f.get("state") == "stored":
                stored.setdefault(int(f["index"]), wall_time(m[1]))
            elif complete is None:
                complete = wall_time(m[1])
        if count is None or count < 2 or count - 1 not in stored:
            continue
        others = [t for i, t in stored.items() if i != count - 1]
        if not others:
            continue
        ref = max(others)
        out[path.stem] = {"chunks": count, "last": round(stored[count - 1] - ref, 3),
                          "complete": None if complete is None else round(complete - ref, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logdir", type=Path, help="one run's logs (bench_wan.py --keep-logs DIR/run<k>-patchswarm)")
    ap.add_argument("--version", type=int, default=2, help="the version published (default 2)")
    ap.add_argument("--origin", default="10.213.0.4", help="the origin's address (default: netlab's)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    ap.add_argument("--inlets", type=float, default=None, metavar="S",
                    help="also print each remote region's inlet use in slices of S seconds "
                         "(%% of --inlet-mbit, chunks of --chunk-mib)")
    ap.add_argument("--relay-lags", action="store_true",
                    help="also print, per relay ordered, how long after it could have begun "
                         "the border began it (relay_lags)")
    ap.add_argument("--last-inflow", action="store_true",
                    help="also print, per remote region, the last chunk to come in and how "
                         "long after its relaying border had it whole (last_inflow)")
    ap.add_argument("--last-chunk", action="store_true",
                    help="also print, per node, when it stored the version's last chunk and "
                         "had the version complete, after its last other chunk "
                         "(last_chunk_waits)")
    ap.add_argument("--inlet-mbit", type=float, default=100.0)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    args = ap.parse_args()
    rows = timeline(args.logdir, args.version, args.origin)
    if not rows:
        raise SystemExit(f"no chunk transfers of version {args.version} in {args.logdir} "
                         "(were the nodes logging at debug? bench_wan.py --keep-logs)")
    print("start    end      s  from -> to       chunk  what")
    for r in rows:
        print(row_text(r))
    if args.inlets:
        print(f"inlet use, % of {args.inlet_mbit:g} Mbit/s per {args.inlets:g} s:")
        use = inlet_use(rows, args.inlets, int(args.chunk_mib * 2**20), args.inlet_mbit * 1e6)
        for reg, shares in use.items():
            print(f"  region {reg}: " + " ".join(f"{100 * x:3.0f}" for x in shares))
    if args.relay_lags:
        lags = relay_lags(rows)
        print("relays: ordered, first block at the border, begun, lag (s)")
        for x in lags:
            print(f"  #{x['index']:<3} {x['border']:>5} -> {x['target']:<5} {x['ordered']:6.2f} "
                  f"{x['first_block']:6.2f} {x['began']:6.2f} {x['lag']:+6.2f}")
        late = [x["lag"] for x in lags if x["lag"] > 0.1]
        print(f"  {len(late)} of {len(lags)} began over 0.1 s late, {sum(late):.2f} s in all")
    if args.last_inflow:
        print("last inflow per remote region: chunk, from -> to, ended, behind its source (s)")
        for reg, x in last_inflow(rows).items():
            behind = "pushed" if x["lag"] is None else f"{x['lag']:+.2f}"
            print(f"  region {reg}: #{x['index']:<3} {x['from']:>6} -> {x['to']:<5} "
                  f"{x['end']:6.2f} {behind}")
    if args.last_chunk:
        waits = last_chunk_waits(args.logdir, args.version)
        print("last chunk per node: stored, complete, s after its last other chunk")
        for name, x in waits.items():
            print(f"  {name:<5} #{x['chunks'] - 1:<3} {x['last']:+6.3f} {x['complete']}")
        if waits:
            print(f"  longest wait for it: {max(0.0, *(x['last'] for x in waits.values())):.3f} s")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
