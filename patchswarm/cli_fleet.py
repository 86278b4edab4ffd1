"""Show which version every rollout node serves, per region, from the origin's API.

``patchswarm fleet --api HOST:PORT`` (or ``--config trainer.toml``, which names the
origin's API address and token) reads the origin's ``/fleet`` and prints a live
table: one row per region, the number of its nodes serving each version, the
region's largest lag behind the latest version, and its stragglers by node id.
Nodes report their versions to the origin when they change (and every
``status_interval_s``), so the table trails the fleet by about a second.
``--once`` prints one table and exits; ``--json`` prints the origin's document
(one JSON object per line, per refresh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trainer.fleet import FleetView  # at import: a node-only install has no fleet command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--api", metavar="HOST:PORT", help="the origin's HTTP API address")
    where.add_argument("--config", metavar="FILE",
                       help="the trainer's TOML config: its [api] address and token")
    parser.add_argument("--token-file", metavar="FILE",
                        help="bearer token for the API (default with --config: api.token_file)")
    parser.add_argument("--json", action="store_true", help="print the JSON document instead")
    parser.add_argument("--once", action="store_true", help="print once and exit")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between refreshes (default 2)")


def _target(args: argparse.Namespace) -> tuple[str, str | None]:
    """(host:port, token) from the arguments."""
    from node.config import load_config
    from swarm.errors import ConfigError

    token = None
    if args.config:
        cfg = load_config(args.config)
        if cfg.role != "origin":
            raise ConfigError(f"{args.config}: node.role is {cfg.role!r}; the fleet view is "
                              "the origin's (use the trainer's config)")
        host, port = cfg.api_listen or (cfg.listen_host, cfg.listen_port)
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        addr, token = f"{host}:{port}", cfg.api_token
    else:
        from node.config import parse_addr

        host, port = parse_addr(args.api, "--api")
        addr = f"{host}:{port}"
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file: cannot read {args.token_file}: "
                              f"{exc.strerror or exc}") from None
    return addr, token


def fetch(addr: str, token: str | None, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``/fleet`` from the origin at ``addr``; ``PatchswarmError`` on any failure."""
    from swarm.errors import PatchswarmError

    req = urllib.request.Request(f"http://{addr}/fleet")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read(64 * 1024 * 1024)
    except urllib.error.HTTPError as exc:
        why = {401: "a bearer token is needed (--token-file)",
               404: "no fleet view there (is it the origin's API?)"}.get(exc.code, exc.reason)
        raise PatchswarmError(f"{addr}/fleet: HTTP {exc.code}: {why}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PatchswarmError(f"cannot reach the origin's API at {addr}: {reason}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise PatchswarmError(f"{addr}/fleet: not JSON") from None
    if not isinstance(doc, dict):
        raise PatchswarmError(f"{addr}/fleet: not a fleet document")
    return doc


def run(args: argparse.Namespace) -> int:
    from swarm.errors import ConfigError

    if not 0.1 <= args.interval <= 3600:
        raise ConfigError("--interval: must be 0.1..3600 seconds")
    addr, token = _target(args)
    live = not args.once and not args.json and sys.stdout.isatty()
    while True:
        doc = fetch(addr, token)
        if args.json:
            print(json.dumps(doc, sort_keys=True), flush=True)
        else:
            view = FleetView.from_json(doc)
            text = view.table()
            times = doc.get("publish_to_active_s") or {}
            if times:
                last = sorted(times, key=int)[-3:]
                text += "\npublish -> active (p50 / p100): " + ", ".join(
                    f"v{v} {times[v]['p50']:.2f} / {times[v]['p100']:.2f} s" for v in last)
            if live:
                sys.stdout.write("\x1b[H\x1b[2J")  # clear the screen: a live table
            print(f"origin {doc.get('origin', addr)} at {addr}, "
                  f"{time.strftime('%H:%M:%S')}\n{text}", flush=True)
        if args.once:
            return 0
        time.sleep(args.interval)
