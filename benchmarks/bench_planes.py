"""Decode ahead of a dense patch's records, joined and decompressed vs read where they lie.

A node decodes each DENSE record ahead of the apply from the chunks that hold it. Two
ways, in one process, on the same patch held in separate chunk buffers (as a node's
store keeps them), interleaved run by run:

- ``joined`` (rounds 45-57): a record spanning chunks is joined into one buffer, zstd
  decodes the whole frame (copying its raw blocks), then the fused loop un-shuffles the
  planes, counts, XORs with the base and XXH3 hashes the new bits, block by block;
- ``in place`` (``swarm.codec.planes``): the raw blocks' bytes are read from the chunks
  where they lie, zstd decodes only the compressed blocks after them, the same loop
  reads each plane from its segment.

Two patches of a BF16 view: ``random`` (every value redrawn, as ``bench_wan.py`` and
``bench_node_cpu.py`` publish: every plane stored raw) and ``step`` (an Adam-like step,
new = old * (1 + 1e-2 * noise): the low plane raw, the high plane compressed).

Prints a table and writes ``benchmarks/results/planes.json``.

    python benchmarks/bench_planes.py --mib 64 --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_wan import dense_pair  # noqa: E402

from swarm.codec import encode_patch, records  # noqa: E402
from swarm.codec.dtypes import bits_view, dtype_of  # noqa: E402
from swarm.codec.format import DIGEST_BYTES, Op, decode_header, record_layout, record_span  # noqa: E402
from swarm.codec.planes import Pieces, read_planes  # noqa: E402
from swarm.codec.zstd_bounded import decompress_bounded  # noqa: E402
from swarm.errors import PatchFormatError  # noqa: E402


def step_pair(size_bytes: int, seed: int) -> tuple[dict, dict]:
    """A BF16 view and the next one after a small multiplicative step."""
    g = torch.Generator().manual_seed(seed)
    n = size_bytes // 2
    per = 4 * 1024 * 1024
    base, new = {}, {}
    for k in range(max(1, -(-n // per))):
        m = min(per, n - k * per)
        b = torch.randn(m, generator=g) * 0.05
        nb = b * (1 + 1e-2 * torch.randn(m, generator=g))
        base[f"layer{k}.weight"] = b.to(torch.bfloat16)
        new[f"layer{k}.weight"] = nb.to(torch.bfloat16)
    return base, new


def _records(patch: bytes, chunk: int) -> list[tuple[object, list[memoryview]]]:
    """Each DENSE record's body as the views of the separate chunk buffers it lies in."""
    chunks = [np.frombuffer(patch[i:i + chunk], dtype=np.uint8).copy()
              for i in range(0, len(patch), chunk)]
    header = decode_header(patch)
    starts = np.cumsum([0, *record_layout(patch)]).tolist()
    out = []
    for q, entry in enumerate(header.entries):
        s, e = starts[q + 1], starts[q + 2]
        pre = record_span(patch[s:s + 10], 0, entry)
        assert pre is not None and entry.op == Op.DENSE
        s += pre[0] + DIGEST_BYTES
        views = []
        for i in range(s // chunk, (e - 1) // chunk + 1):
            lo = i * chunk
            views.append(memoryview(chunks[i])[max(s, lo) - lo:min(e, lo + chunk) - lo])
        out.append((entry, views))
    return out


def _joined(entry, views, u) -> int:
    data = views[0] if len(views) == 1 else Pieces(views).join()
    raw = decompress_bounded(data, entry.numel * entry.dtype.itemsize, "r", PatchFormatError)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(entry.dtype.itemsize, entry.numel)
    n = entry.numel
    xor, scratch, h, changed = np.empty(n, u.dtype), np.empty(records.BLOCK, u.dtype), xxhash.xxh3_64(), 0
    for s in range(0, n, records.BLOCK):
        e = min(n, s + records.BLOCK)
        changed += records.unshuffle_count(planes, s, e, xor[s:e], u[s:e], scratch[:e - s])
        h.update(scratch[:e - s])
    return changed


def _in_place(entry, views, u) -> int:
    planes = read_planes(Pieces(views), entry.numel, entry.dtype.itemsize, "r")
    n = entry.numel
    xor, scratch, h, changed = np.empty(n, u.dtype), np.empty(records.BLOCK, u.dtype), xxhash.xxh3_64(), 0
    whole = planes.single()  # as swarm.codec.apply._dense_ahead
    for s in range(0, n, records.BLOCK):
        if whole is not None:
            e = min(n, s + records.BLOCK)
            changed += records.unshuffle_count(whole, s, e, xor[s:e], u[s:e], scratch[:e - s])
            h.update(scratch[:e - s])
            continue
        for a, b, parts in planes.parts(s, min(n, s + records.BLOCK)):
            changed += records.unshuffle_parts(parts, xor[a:b], u[a:b], scratch[:b - a])
            h.update(scratch[:b - a])
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="size of the BF16 view (MiB)")
    ap.add_argument("--chunk-kib", type=int, default=4096, help="chunk size (KiB), as published")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs of each way")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/planes.json"),
                    help="JSON of every run (default: benchmarks/results/planes.json)")
    args = ap.parse_args()
    result = {"bench": "planes", "mib": args.mib, "chunk_kib": args.chunk_kib,
              "fused": records.fused is not None, "patches": {}}
    print("patch | way | GB/s of record bytes per run | median | ratio to joined")
    for kind, make in (("random", dense_pair), ("step", step_pair)):
        old, new = make(args.mib << 20, 1)
        res = encode_patch(old, new, threads=1)
        recs = _records(res.patch, args.chunk_kib << 10)
        body = sum(sum(len(v) for v in views) for _, views in recs)
        base = {e.name: bits_view(old[e.name], dtype_of(old[e.name])).numpy() for e, _ in recs}
        base = {k: v.view(np.dtype(f"u{v.dtype.itemsize}")) for k, v in base.items()}
        times: dict[str, list[float]] = {"joined": [], "in place": []}
        counts = {}
        for _ in range(args.runs):
            for way, fn in (("joined", _joined), ("in place", _in_place)):
                t = time.thread_time()
                counts[way] = sum(fn(e, views, base[e.name]) for e, views in recs)
                times[way].append(time.thread_time() - t)
        assert counts["joined"] == counts["in place"]
        row = {}
        for way, ts in times.items():
            rates = [body / t / 1e9 for t in ts]
            row[way] = {"cpu_s": [round(t, 4) for t in ts], "gb_s": [round(r, 2) for r in rates],
                        "median_gb_s": round(statistics.median(rates), 2)}
        ratio = round(statistics.median(times["joined"]) / statistics.median(times["in place"]), 3)
        result["patches"][kind] = {"record_bytes": body, "records": len(recs), **row,
                                   "speedup": ratio}
        for way in times:
            print(f"{kind} | {way} | {' '.join(map(str, row[way]['gb_s']))} | "
                  f"{row[way]['median_gb_s']} | {ratio if way == 'in place' else 1.0}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
