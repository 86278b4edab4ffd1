"""One libtorrent peer of the emulated-WAN comparison (``benchmarks/bench_wan.py``).

Run once per emulated host, inside its network namespace::

    python benchmarks/wan_libtorrent.py make  --file F --torrent F.torrent [--piece-kib 256]
    python benchmarks/wan_libtorrent.py seed  --ip IP --torrent T --dir D
    python benchmarks/wan_libtorrent.py fetch --ip IP --torrent T --dir D --peers IP:PORT,...

``seed`` and ``fetch`` print ``{"event": "ready"}`` once listening, wait for
``go`` on stdin, then ``fetch`` dials ``--peers`` with ``connect_peer`` (no
tracker, no DHT: the bench hands each host its region, the seed and a few
hosts of other regions; peer exchange, on as in libtorrent's default swarm,
finds the rest) and prints ``{"event": "done", "t": CLOCK_MONOTONIC}`` once
it holds every piece. It keeps seeding until ``quit`` on stdin (or EOF), then
prints ``{"event": "stats", "from_peers": {ip: payload bytes}, "cpu_s": ..., "uploaded":
payload bytes sent}``.

The tuned settings (``TUNED``) are documented in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import sys
import time
import warnings
from pathlib import Path
from typing import Any

PORT = 6881

# Tuned for a LAN-speed region behind a 100 Mbit, 80 ms RTT uplink, 12 peers.
TUNED: dict[str, Any] = {
    # no discovery but the peers we are given (and peer exchange among them)
    "enable_dht": False, "enable_lsd": False, "enable_upnp": False, "enable_natpmp": False,
    # plaintext: encryption costs CPU on a shared 2-core box and buys nothing here
    "out_enc_policy": 2, "in_enc_policy": 2, "allowed_enc_level": 1,  # disabled, plaintext
    # TCP only: uTP's delay-based congestion control backs off on the holder's queueing
    "enable_outgoing_utp": False, "enable_incoming_utp": False,
    "connections_limit": 200, "allow_multiple_connections_per_ip": True,
    "connection_speed": 200, "smooth_connects": False, "peer_connect_timeout": 3,
    # deep request pipelines to fill 100 Mbit x 80 ms (1 MB in flight) per peer
    "max_out_request_queue": 1500, "max_allowed_in_request_queue": 2000,
    "request_queue_time": 2,
    # large send buffers so a fast uploader never starves a connection
    "send_buffer_watermark": 8 * 1024 * 1024, "send_buffer_low_watermark": 1024 * 1024,
    "send_buffer_watermark_factor": 150,
    # every peer unchoked: 11 downloaders, nothing to ration
    "unchoke_slots_limit": -1, "choking_algorithm": 0,  # fixed_slots
    "seed_choking_algorithm": 1,  # fastest_upload
    "active_downloads": -1, "active_seeds": -1, "active_limit": -1,
    "max_queued_disk_bytes": 16 * 1024 * 1024,
    "alert_mask": 0,
}


def make(args: argparse.Namespace) -> int:
    import libtorrent as lt

    fs = lt.file_storage()
    with warnings.catch_warnings():  # the file_storage path still works in 2.1
        warnings.simplefilter("ignore", DeprecationWarning)
        lt.add_files(fs, str(args.file))
        ct = lt.create_torrent(fs, args.piece_kib * 1024, flags=lt.create_torrent.v1_only)
    lt.set_piece_hashes(ct, str(Path(args.file).resolve().parent))
    Path(args.torrent).write_bytes(lt.bencode(ct.generate()))
    return 0


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _wait_line() -> str:
    return sys.stdin.readline().strip()


def peer(args: argparse.Namespace, seeding: bool) -> int:
    import libtorrent as lt

    settings = dict(TUNED, listen_interfaces=f"{args.ip}:{PORT}", outgoing_interfaces=args.ip)
    ses = lt.session(settings)
    info = lt.torrent_info(str(args.torrent))
    atp = lt.add_torrent_params()
    atp.ti = info
    atp.save_path = str(args.dir)
    atp.flags &= ~lt.torrent_flags.auto_managed
    atp.flags &= ~lt.torrent_flags.paused
    if seeding:
        atp.flags |= lt.torrent_flags.seed_mode  # the file is there: no hashing
    if args.no_pex:
        atp.flags |= lt.torrent_flags.disable_pex
    h = ses.add_torrent(atp)
    deadline = time.monotonic() + 30
    while not ses.is_listening() and time.monotonic() < deadline:
        time.sleep(0.05)
    _emit({"event": "ready"})
    if _wait_line() != "go":
        return 1
    t_go = time.monotonic()
    if not seeding:
        for p in filter(None, args.peers.split(",")):
            ip, _, port = p.partition(":")
            h.connect_peer((ip, int(port or PORT)))
    done = seeding
    deadline = t_go + args.timeout
    # payload bytes per connection, polled: a connection between two finished peers closes
    # and takes its counters with it
    seen: dict[tuple[str, int], int] = {}

    def account() -> None:
        for pi in h.get_peer_info():
            key = (pi.ip[0], pi.ip[1])
            seen[key] = max(seen.get(key, 0), int(pi.total_download))

    while True:
        if not done:
            account()
            st = h.status()
            if st.is_seeding:
                done = True
                account()
                _emit({"event": "done", "t": time.monotonic(), "t_go": t_go})
            elif time.monotonic() > deadline:
                _emit({"event": "timeout", "progress": st.progress})
                done = True
        if select.select([sys.stdin], [], [], 0.02 if not done else 1.0)[0]:
            line = sys.stdin.readline()
            if line == "" or line.strip() == "quit":
                break
    got: dict[str, int] = {}
    for (ip, _), n in seen.items():
        got[ip] = got.get(ip, 0) + n
    ru = resource.getrusage(resource.RUSAGE_SELF)
    _emit({"event": "stats", "from_peers": got, "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
           "uploaded": int(h.status().total_payload_upload)})
    ses.pause()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a .torrent (v1, no tracker) for one file")
    m.add_argument("--file", type=Path, required=True)
    m.add_argument("--torrent", type=Path, required=True)
    m.add_argument("--piece-kib", type=int, default=256)
    for name in ("seed", "fetch"):
        p = sub.add_parser(name, help=f"{name} the torrent on this host")
        p.add_argument("--ip", required=True, help="this host's address (listen and dial from)")
        p.add_argument("--torrent", type=Path, required=True)
        p.add_argument("--dir", type=Path, required=True, help="save path (the file's folder)")
        p.add_argument("--peers", default="", help="IP[:PORT],... to dial after go (fetch)")
        p.add_argument("--timeout", type=float, default=300.0)
        p.add_argument("--no-pex", action="store_true", help="no peer exchange")
    args = ap.parse_args(argv)
    try:
        import libtorrent  # noqa: F401
    except ImportError:
        print("wan_libtorrent: needs libtorrent (pip install -e '.[wan]')", file=sys.stderr)
        return 2
    if args.cmd == "make":
        return make(args)
    os.makedirs(args.dir, exist_ok=True)
    return peer(args, seeding=args.cmd == "seed")


if __name__ == "__main__":
    sys.exit(main())
