"""The apply tail of a dense patch: from "last chunk stored" to "serving the new version".

A rollout node decodes the verified prefix of a patch while the rest downloads
(``InProcessWeights.prefeed``); after the last chunk it only decodes the tail and
commits (``stage(offset=...)`` + ``commit``). This times that tail, and what was
spent ahead, for one dense BF16 patch (every value changes to a random finite
BF16, so the patch barely compresses: DENSE records), two ways in the same run:

- ``ahead``: digests ahead (``InProcessWeights.digests_ahead = True``, the
  default): each DENSE record is un-shuffled, and the digest its tensor will have
  after the commit taken, when the record is decoded; the commit is one XOR pass
  per tensor and combines digests;
- ``before``: the old behaviour (``digests_ahead = False``): the commit un-shuffles,
  XORs and hashes every changed tensor.

Per round each way runs once on a fresh holder (the order alternating round by
round: AB, BA, ...): ``prefeed`` of every chunk but the last (``--chunk-mib``
each, as the node's prestage feeds stored chunks), then the tail, timed in wall
and CPU seconds (``time.process_time``: the whole process; on a shared machine
the CPU time is the steadier one). The committed weights and digest are checked
bitwise against the target every time. Medians over ``--rounds`` rounds, and
the ratio ahead / before, are reported: only ratios within one run compare
across machines and days.

The holder is set as with the in-process engine (``track_changes = False``,
``node.daemon``); ``--track-changes`` times it as with an external engine.

    python benchmarks/bench_apply_tail.py [--size-mib 64] [--chunk-mib 4] [--rounds 7]

Prints a table and writes benchmarks/results/apply_tail.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_wan import dense_pair  # noqa: E402  (the WAN bench's patch, same builder)

from node.engines.inprocess import InProcessWeights  # noqa: E402
from swarm.codec import encode_patch  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20
MODES = ("before", "ahead")


def _bits(w: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.view(torch.int16).numpy().tobytes() for k, v in w.items()}


def one_run(mode: str, base: dict, patch: bytes, base_digest: bytes, target: bytes,
            chunk: int, track_changes: bool, want: dict[str, bytes]) -> dict[str, float]:
    """Prefeed every chunk but the last, then stage the tail and commit; seconds."""
    w = InProcessWeights({k: v.clone() for k, v in base.items()}, 1, "cpu")
    w.digests_ahead = mode == "ahead"
    w.track_changes = track_changes
    last = (len(patch) - 1) // chunk * chunk  # the last chunk's offset
    view = memoryview(patch)
    c0, t0 = time.process_time(), time.perf_counter()
    fed = 0
    for off in range(0, last, chunk):
        fed = w.prefeed(2, base_digest, off, bytes(view[off:off + chunk]))
    c1, t1 = time.process_time(), time.perf_counter()
    if fed != last:
        raise SystemExit(f"prefeed kept {fed} of {last} bytes")
    w.stage(2, "patch", bytes(view[last:]), base_digest, offset=fed)
    c2, t2 = time.process_time(), time.perf_counter()
    digest = w.commit(2, target)
    c3, t3 = time.process_time(), time.perf_counter()
    if digest != target or _bits(w.weights) != want:
        raise SystemExit(f"{mode}: committed state is not the target")
    return {"prefeed_cpu": c1 - c0, "prefeed_wall": t1 - t0,
            "stage_cpu": c2 - c1, "stage_wall": t2 - t1,
            "commit_cpu": c3 - c2, "commit_wall": t3 - t2,
            "tail_cpu": c3 - c1, "tail_wall": t3 - t1, "total_cpu": c3 - c0}


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Time a dense patch's apply tail (stage of the last chunk + commit) "
                    "with digests ahead against the old commit, interleaved in one run.",
        epilog="Writes a JSON file (--out); see the module docstring for what is timed.")
    ap.add_argument("--size-mib", type=int, default=64, help="BF16 checkpoint size (default 64)")
    ap.add_argument("--chunk-mib", type=float, default=4.0,
                    help="chunk size fed to prefeed, as the node's prestage (default 4)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="rounds, each running both ways, order alternating (default 7; >= 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--track-changes", action="store_true",
                    help="also list changed positions at stage, as for an external engine")
    ap.add_argument("--out", type=Path, default=RESULTS / "apply_tail.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    chunk = int(args.chunk_mib * MiB)

    base, new = dense_pair(args.size_mib * MiB, args.seed)
    enc = encode_patch(base, new, threads=1)
    ops = sorted({t.op for t in enc.tensors})
    want = _bits(new)
    del new
    print(f"dense BF16 patch: {len(enc.patch) / MiB:.1f} MiB ({'/'.join(ops)} records, "
          f"{len(base)} tensors), chunks of {args.chunk_mib:g} MiB, {args.rounds} rounds",
          flush=True)

    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            runs[mode].append(one_run(mode, base, enc.patch, enc.base_digest, enc.target_digest,
                                      chunk, args.track_changes, want))
        print(f"  round {r + 1}: tail wall before {runs['before'][-1]['tail_wall']:.4f} s, "
              f"ahead {runs['ahead'][-1]['tail_wall']:.4f} s", flush=True)

    keys = list(runs["before"][0])
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in keys} for m in MODES}
    ratio = {k: med["ahead"][k] / med["before"][k] if med["before"][k] else float("nan")
             for k in keys}
    print()
    print(f"{'median seconds':<16} {'before':>9} {'ahead':>9} {'ahead/before':>13}")
    for k in ("tail_wall", "tail_cpu", "stage_cpu", "commit_wall", "commit_cpu",
              "prefeed_cpu", "total_cpu"):
        print(f"{k:<16} {med['before'][k]:>9.4f} {med['ahead'][k]:>9.4f} {ratio[k]:>13.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": platform.machine(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg()),
        "size_mib": args.size_mib, "chunk_mib": args.chunk_mib, "rounds": args.rounds,
        "track_changes": args.track_changes, "patch_bytes": len(enc.patch), "ops": ops,
        "timer": "perf_counter (wall), process_time (cpu)",
        "median": med, "ratio_ahead_over_before": ratio, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
