"""Diff two safetensors checkpoints (served views) into a lossless patch.

The patch turns OLD into NEW bit for bit. With --json, prints one object with
elements, changed, full_bytes, patch_bytes, entropy_bound_bytes, encode_s and
the ratios, for scripts.
"""

from __future__ import annotations

import argparse
import json
import os

from swarm.errors import PatchswarmError
from swarm.fsio import check_output_file, write_atomic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("old", metavar="OLD.safetensors", help="the version the receiver holds")
    p.add_argument("new", metavar="NEW.safetensors", help="the version to ship")
    p.add_argument("-o", "--output", required=True, metavar="OUT.patch", help="patch file to write")
    p.add_argument("--json", action="store_true", help="print statistics as one JSON object")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="encoder threads (default: %(default)s)")
    p.add_argument("--context", choices=("auto", "on", "off"), default="auto",
                   help="magnitude-bucket position models: smaller patches, slower encode; "
                        "auto = for 8-bit floats only (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from swarm.codec import encode_patch, entropy_bound
    from swarm.codec.safetensors_io import load_checkpoint

    out = check_output_file(args.output, "-o")
    if args.threads < 1:
        raise PatchswarmError(f"--threads must be at least 1, not {args.threads}")
    old = load_checkpoint(args.old)
    new = load_checkpoint(args.new)
    result = encode_patch(old, new, threads=args.threads, context=args.context)
    write_atomic(out, result.patch, "-o")
    bound = entropy_bound(old, new)
    full = sum(t.numel() * t.element_size() for t in new.values())
    stats = {
        "elements": bound.elements,
        "changed": bound.changed,
        "changed_fraction": bound.fraction_changed,
        "full_bytes": full,
        "patch_bytes": result.patch_bytes,
        "entropy_bound_bytes": round(bound.bytes, 1),
        "ratio_to_bound": result.patch_bytes / bound.bytes if bound.bytes else None,
        "bytes_per_changed": result.patch_bytes / bound.changed if bound.changed else None,
        "compression": full / result.patch_bytes if result.patch_bytes else None,
        "encode_s": round(result.encode_s, 4),
        "records": sum(1 for t in result.tensors if t.record_bytes),
        "base_digest": result.base_digest.hex(),
        "target_digest": result.target_digest.hex(),
    }
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"wrote {out}: {result.patch_bytes:,} bytes for {bound.changed:,} of "
              f"{bound.elements:,} elements changed ({bound.fraction_changed:.3%}); "
              f"{full / max(1, result.patch_bytes):,.0f}x smaller than the checkpoint, "
              f"{stats['ratio_to_bound'] or 0:.3f}x the entropy bound; {result.encode_s:.3f} s")
    return 0
