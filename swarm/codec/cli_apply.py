"""Apply a patch to a safetensors checkpoint and write the result.

The patch is checked against BASE (state digest), applied record by record
with per-tensor digest checks, and the whole result is checked against the
patch's target digest. On any failure nothing is written and the command
exits non-zero with a one-line reason.
"""

from __future__ import annotations

import argparse

from swarm.errors import PatchswarmError
from swarm.fsio import check_output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", metavar="BASE.safetensors", help="the version the patch applies to")
    p.add_argument("patch", metavar="PATCH", help="patch file made by `patchswarm diff`")
    p.add_argument("-o", "--output", required=True, metavar="OUT.safetensors")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where to hold the weights and apply (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import torch

    from swarm.codec import apply_patch
    from swarm.codec.safetensors_io import load_checkpoint, read_bytes, save_checkpoint

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PatchswarmError("--device cuda: no CUDA device is available")
    out = check_output_file(args.output, "-o")
    patch = read_bytes(args.patch)
    weights = load_checkpoint(args.base, device=args.device)
    report = apply_patch(weights, patch)
    save_checkpoint(weights, out)
    print(f"wrote {args.output}: {report.records} records, {report.changed:,} elements changed, "
          f"state {report.target_digest.hex()[:16]}")
    return 0
