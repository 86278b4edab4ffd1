"""Show a patch's header and its records: op, dtype, shape, changes and bytes per tensor."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("patch", metavar="PATCH")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from swarm.codec import read_patch_info
    from swarm.codec.safetensors_io import read_bytes

    info = read_patch_info(read_bytes(args.patch))
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"patch format v{info['format_version']}, {info['patch_bytes']:,} bytes "
          f"({info['header_bytes']} header), {len(info['records'])} records")
    print(f"base   {info['base_digest']}\ntarget {info['target_digest']}")
    width = max((len(r["name"]) for r in info["records"]), default=4)
    print(f"{'tensor':<{width}}  {'op':<6} {'dtype':<14} {'shape':<16} {'changed':>10} {'bytes':>10}")
    for r in info["records"]:
        changed = "" if r["changed"] is None else f"{r['changed']:,}"
        shape = "x".join(map(str, r["shape"])) or "scalar"
        print(f"{r['name']:<{width}}  {r['op']:<6} {r['dtype']:<14} {shape:<16} "
              f"{changed:>10} {r['bytes']:>10,}")
    return 0
