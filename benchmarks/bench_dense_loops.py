"""The dense record path's loops: the fused C loops (``swarm/codec/_dense.c``) against
numpy's, timed in the same process, interleaved.

Per element width (1, 2, 4 bytes: FP8, BF16, FP32) and size (a block that stays in cache,
and a whole 8 MiB record that does not), both ways:

- ``unshuffle``: what the decode ahead does per block: ``records.unshuffle_count`` with
  the base, so the XOR, the count and ``base ^ xor`` for the digest (apply._dense_ahead);
- ``xor_into``: what an apply without the decode ahead does: ``records.xor_planes_into``
  (the weights XORed in place, the changed elements counted).

Reported: GB/s of elements (best of ``--repeat``), and the fused loops' speed as a ratio
to numpy's in the same run. Prints a table and writes
``benchmarks/results/dense_loops.json``.

    python benchmarks/bench_dense_loops.py [--repeat 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.codec import records  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIZES = {"in cache (64 Ki elements)": records.BLOCK, "8 MiB record": None}


def _case(itemsize: int, n: int, rng: np.random.Generator) -> dict:
    dt = np.dtype(f"u{itemsize}")
    return {"planes": rng.integers(0, 256, (itemsize, n), dtype=np.uint8),
            "base": rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(dt),
            "out": np.empty(n, dtype=dt), "new": np.empty(min(n, records.BLOCK), dtype=dt)}


def _unshuffle(c: dict) -> None:
    planes, base, out, new = c["planes"], c["base"], c["out"], c["new"]
    n = out.size
    for s in range(0, n, records.BLOCK):
        e = min(n, s + records.BLOCK)
        records.unshuffle_count(planes, s, e, out[s:e], base[s:e], new[:e - s])


def _xor_into(c: dict) -> None:
    records.xor_planes_into(c["base"], c["planes"])


def _best(fn, c: dict, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(c)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7, help="timed repeats per arm (best kept)")
    ap.add_argument("--out", type=Path, default=RESULTS / "dense_loops.json")
    args = ap.parse_args()
    built = records.fused
    if built is None:
        print("swarm.codec._dense is not built here (no C compiler at install): "
              "nothing to compare", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'loop':10s} {'width':>5s} {'size':28s} {'numpy GB/s':>10s} {'fused GB/s':>10s} "
          f"{'ratio':>6s}")
    for itemsize in (1, 2, 4):
        for label, n in SIZES.items():
            n = n or (8 << 20) // itemsize
            c = _case(itemsize, n, rng)
            for name, fn in (("unshuffle", _unshuffle), ("xor_into", _xor_into)):
                times = {"numpy": [], "fused": []}
                for _ in range(2):  # interleaved: numpy, fused, numpy, fused
                    for arm, mod in (("numpy", None), ("fused", built)):
                        records.fused = mod
                        times[arm].append(_best(fn, c, args.repeat))
                records.fused = built
                gbs = {arm: n * itemsize / min(ts) / 1e9 for arm, ts in times.items()}
                ratio = gbs["fused"] / gbs["numpy"]
                rows.append({"loop": name, "itemsize": itemsize, "size": label, "elements": n,
                             "numpy_gb_s": round(gbs["numpy"], 2),
                             "fused_gb_s": round(gbs["fused"], 2), "ratio": round(ratio, 2)})
                print(f"{name:10s} {itemsize:5d} {label:28s} {gbs['numpy']:10.2f} "
                      f"{gbs['fused']:10.2f} {ratio:6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "dense_loops", "repeat": args.repeat,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
