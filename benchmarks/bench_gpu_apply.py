"""Apply correctness and speed on a device: CUDA when present (``--device cuda``).

Makes a few real Adam-absorption versions of all-MiniLM-L6-v2 (BF16 and FP8
views), and for each patch: applies it to weights held on the device, checks
the result is bitwise equal to the trainer's new version, and times the apply
(decode + scatter + digests; best of N, ``torch.cuda.synchronize`` around it),
with and without the context model. Also reports the extra device memory the
apply allocated (``torch.cuda.max_memory_allocated`` over the weights).

    python benchmarks/bench_gpu_apply.py --device cuda [--steps 3]

Prints a table and writes benchmarks/results/apply-<device>.json. Runs on CPU
too (``--device cpu``) as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lab.minilm import PolicyTrainer, load_masters
from swarm.codec import apply_patch, encode_patch, state_digest
from trainer.served import served_view

RESULTS = Path(__file__).parent / "results"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    masters = load_masters()
    trainer = PolicyTrainer(masters.weights, lr=args.lr, seed=0)
    prev = {d: served_view(masters.weights, d) for d in ("bf16", "fp8")}
    rows = []
    print(f"device {args.device}; model {masters.source}")
    print(f"{'view':<5} {'ctx':<4} {'step':>4} {'patch B':>9} {'apply ms':>9} {'GB/s':>6} "
          f"{'extra MiB':>9} bitwise")
    for step in range(1, args.steps + 1):
        cur_masters = trainer.step()
        for view in prev:
            cur = served_view(cur_masters, view)
            full = sum(t.numel() * t.element_size() for t in cur.values())
            for context in ("off", "on"):
                patch = encode_patch(prev[view], cur, threads=1, context=context).patch
                base_dev = {k: v.to(args.device) for k, v in prev[view].items()}
                best = float("inf")
                extra = 0
                for _ in range(args.repeat):
                    work = {k: v.clone() for k, v in base_dev.items()}
                    if args.device.startswith("cuda"):
                        torch.cuda.reset_peak_memory_stats()
                        held = torch.cuda.memory_allocated()
                    _sync(args.device)
                    t0 = time.perf_counter()
                    apply_patch(work, patch)
                    _sync(args.device)
                    best = min(best, time.perf_counter() - t0)
                    if args.device.startswith("cuda"):
                        extra = max(extra, torch.cuda.max_memory_allocated() - held)
                got = {k: v.cpu() for k, v in work.items()}
                exact = state_digest(got) == state_digest(cur) and all(
                    torch.equal(got[k].reshape(-1).view(torch.uint8), cur[k].reshape(-1).view(torch.uint8))
                    for k in cur if cur[k].numel())
                row = {"view": view, "context": context, "step": step, "patch_bytes": len(patch),
                       "apply_s": best, "gbps": full / best / 1e9, "extra_bytes": extra,
                       "bitwise_equal": exact, "device": args.device}
                rows.append(row)
                print(f"{view:<5} {context:<4} {step:>4} {len(patch):>9,} {best * 1e3:>9.2f} "
                      f"{row['gbps']:>6.2f} {extra / 2**20:>9.1f} {'yes' if exact else 'NO'}")
            prev[view] = cur
    out = RESULTS / f"apply-{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device,
                               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    if not all(r["bitwise_equal"] for r in rows):
        raise SystemExit("bitwise mismatch")


if __name__ == "__main__":
    main()
