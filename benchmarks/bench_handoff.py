"""Trainer hand-off with the view file on: how long a publish holds the first byte back.

A ``Publisher`` with its shipped defaults (``persist_view``, the store's fsync on)
publishes ``--versions`` versions of a ``--mib`` MiB BF16 served view, in process and
not started (the hand-off to the origin's core is then a no-op, so what is timed is
the trainer's own work). Two patch shapes: ``dense`` (every value moves,
``bench_wan.dense_next``: the patch is as large as the view) and ``sparse``
(``--sparse-pct`` of the values move: RL's usual step, a patch of ~1 % of the view).

Per version, interleaved:

- ``hand-off``: ``publish_served`` until it returns: encode, sign, store the manifest
  and every chunk, set the active record, hand the version to the swarm. The view
  file (the whole served view, fsynced) is written after this, off the path;
- ``+ view``: that, then ``flush_view`` until the view file is on disk. Until round 20
  the view file was written inside the transaction before the manifest, so this is
  what the hand-off cost then (the same work, in another order).

Prints a table of medians and writes ``benchmarks/results/handoff_view.json``.

    python benchmarks/bench_handoff.py [--mib 64] [--versions 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sparse_next(prev: dict, pct: float, seed: int) -> dict:
    """``prev`` with ``pct`` % of its values moved by one BF16 step (an Adam step that
    crossed a rounding boundary)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in prev.items():
        bits = t.reshape(-1).view(torch.int16).clone()
        hit = torch.rand(bits.numel(), generator=g) < pct / 100
        bits[hit] += 1
        bits = torch.where((bits & 0x7F80) == 0x7F80, bits - 2, bits)  # stay finite
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


def _config(tmp: Path):
    from node.config import parse_config
    from patchswarm.cli import main as cli

    assert cli(["keygen", str(tmp / "trainer.key")]) == 0
    return parse_config({
        "node": {"id": "trainer", "region": "trainer", "model": "m", "role": "origin"},
        "network": {"listen": "127.0.0.1:9", "swarm_secret": "ab" * 32},
        "store": {"dir": "store"},
        "weights": {"base": "base.safetensors", "device": "cpu"},
        "publish": {"signing_key": "trainer.key"},
    }, tmp)


def run(shape: str, mib: int, versions: int, pct: float) -> dict:
    from safetensors.torch import save_file

    from benchmarks.bench_wan import dense_next, dense_pair
    from trainer.publisher import Publisher

    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as d:
        tmp = Path(d)
        base, view = dense_pair(mib << 20, seed=1)
        save_file(base, str(tmp / "base.safetensors"))
        pub = Publisher(_config(tmp), base=base)
        rows = []
        try:
            pub.publish_served(view)  # the first version: warm-up, not timed
            pub.flush_view()
            for k in range(versions):
                view = dense_next(view, 100 + k) if shape == "dense" else _sparse_next(view, pct, k)
                t0 = time.perf_counter()
                r = pub.publish_served(view)
                t1 = time.perf_counter()
                pub.flush_view()
                t2 = time.perf_counter()
                rows.append({"version": r.version, "patch_bytes": r.patch_bytes,
                             "encode_s": round(r.encode_s, 4), "handoff_s": round(t1 - t0, 4),
                             "handoff_plus_view_s": round(t2 - t0, 4)})
        finally:
            pub.close()
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("patch_bytes", "encode_s", "handoff_s", "handoff_plus_view_s")}
    med["ratio"] = round(med["handoff_plus_view_s"] / med["handoff_s"], 2)
    return {"shape": shape, "view_mib": mib, "rows": rows, "median": med}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=textwrap.dedent(__doc__).split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="served view size, MiB (default 64)")
    ap.add_argument("--versions", type=int, default=5, help="timed versions per shape (default 5)")
    ap.add_argument("--sparse-pct", type=float, default=1.0,
                    help="sparse shape: percent of values that move (default 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "handoff_view.json")
    a = ap.parse_args(argv)
    if a.mib < 1 or a.versions < 1 or not 0 < a.sparse_pct <= 100:
        ap.error("--mib and --versions must be >= 1, --sparse-pct in (0, 100]")
    results = [run(s, a.mib, a.versions, a.sparse_pct) for s in ("sparse", "dense")]
    print(f"{'shape':7} | {'view MiB':>8} | {'patch MB':>8} | {'hand-off s':>10} | "
          f"{'+ view file s':>13} | ratio")
    for r in results:
        m = r["median"]
        print(f"{r['shape']:7} | {r['view_mib']:8d} | {m['patch_bytes'] / 1e6:8.2f} | "
              f"{m['handoff_s']:10.3f} | {m['handoff_plus_view_s']:13.3f} | {m['ratio']:.2f}x")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
