"""Codec speed on dense and sparse patches, as ratios to baselines timed in the same run.

Cases are synthetic 64 MiB served checkpoints (eight 8 MiB 2-D tensors plus eight
small 1-D ones) in BF16, FP32 and FP8 e4m3, updated by multiplicative noise of a
chosen relative size, so that from ~0.1% to ~99% of the elements change; plus a
"replace" case (every tensor redrawn) and a "full" case (the node has none of
the tensors: FULL records). For each case, repeated ``--repeat`` times with the
measurements interleaved, medians reported:

- ``encode``: ``encode_patch(old, new, threads=1)``;
- ``apply``: what a node does, ``stage_patch(weights, patch, digests=cache)`` then
  ``.finish()`` (decode, in-place apply, every tensor's XXH3 target digest, the
  BLAKE3 state digest; the base state digest comes from the node's digest cache);
- ``node CPU-s/GB``: apply plus BLAKE3 of every 4 MiB chunk of the patch (as
  ``swarm.trust.chunks`` checks chunks on arrival), per GB of patch received;
- baselines: ``memcpy`` of the checkpoint (numpy copy), and the Stitch/slime-style
  codec ``XOR + byte-shuffle + zstd-3`` (numpy XOR of bit patterns, transpose to
  byte planes, zstd level 3 per tensor) with its inverse (decompress, un-shuffle,
  XOR in place; no digests).

With ``--e2e`` (default for the dense cases below, ``E2E_CASES``) it also times
the whole path a trainer and a node run, in CPU-seconds of the process (all
threads):

- ``trainer``: ``Publisher.publish_served`` (encode with the publisher's two
  encoder threads and its digest cache, chunk, BLAKE3 per chunk, sign, store
  every chunk; no view file, no fsync: the disk is not what is measured);
- ``served view``: ``trainer.served.served_view`` of FP32 masters (bf16/fp8 cases);
- ``node``: what ``node.driver`` does on ``ApplyVersion`` with the in-process
  engine: ``store.payload`` (read + BLAKE3 of every chunk) then
  ``InProcessWeights.stage`` + ``commit`` (decode, apply, digest checks).

Speeds are MB of served checkpoint per CPU-second (``time.process_time``, one
thread: torch, zstd and the encoder single-threaded), so descheduling on a shared
machine does not count; the ratios are what to compare across runs.

    python benchmarks/bench_dense.py [--repeat 3] [--cases all] [--out PATH]

Prints a table and writes benchmarks/results/dense.json.

A/B against another checkout (e.g. main's worktree), this script's measurement
code on both sides, the codec imported from each checkout in turn (PYTHONPATH):

    python benchmarks/bench_dense.py --ab BEFORE_ROOT --rounds 3 --repeat 3 \
        --cases "bf16 dense 93%,fp8 dense 90%" --out benchmarks/results/dense-ab.json

Each round runs every case once per side in its own process, the sides'
order alternating case by case and round by round (ABBA...), so the load of a
shared machine falls on both alike; per side and case the medians and minima
over rounds of each run's medians are reported, then every round's encode
speeds side by side (the JSON keeps every run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blake3
import numpy as np
import torch
import zstandard

from swarm.codec import encode_patch, stage_patch
from swarm.codec.digest import tensor_digest
from swarm.codec.dtypes import bits_view, dtype_of

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20
CHUNK = 4 * MiB
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
# name -> (dtype, relative step size; "replace" redraws, "full" = node has nothing)
CASES = {
    "bf16 dense 93%": ("bf16", 2.0 ** -5),
    "fp32 dense 99%": ("fp32", 2.0 ** -18),
    "fp8 dense 90%": ("fp8", 2.0 ** -1),
    "bf16 half ~30%": ("bf16", 2.0 ** -9),
    "fp32 half ~50%": ("fp32", 2.0 ** -24),
    "bf16 replace": ("bf16", "replace"),
    "fp32 replace": ("fp32", "replace"),
    "bf16 full (new tensors)": ("bf16", "full"),
    "bf16 sparse ~0.1%": ("bf16", 2.0 ** -17),
    "bf16 sparse ~1%": ("bf16", 2.0 ** -14),
    "bf16 sparse ~2%": ("bf16", 2.0 ** -13),
    "fp8 sparse ~0.5%": ("fp8", 2.0 ** -11),
}


def make_case(dtype: str, step: float | str, total: int = 64 * MiB, seed: int = 0
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    item = torch.empty(0, dtype=dt).element_size()
    small = 4096
    big = (total - 8 * small * item) // item // 8
    cols = 1024 if big % 1024 == 0 else 1
    scale = 1.0 if dtype == "fp8" else 0.02
    old, new = {}, {}
    shapes = [(f"layers.{i}.weight", (big // cols, cols)) for i in range(8)]
    shapes += [(f"layers.{i}.norm", (small,)) for i in range(8)]
    for name, shape in shapes:
        w = torch.randn(shape, generator=g) * scale
        if step == "replace" or step == "full":
            nw = torch.randn(shape, generator=g) * scale
        else:
            nw = w + torch.randn(shape, generator=g) * w.abs() * float(step)
        if step != "full":
            old[name] = w.to(dt).contiguous()
        new[name] = nw.to(dt).contiguous()
    return old, new


def changed_fraction(old: dict, new: dict) -> float:
    changed = total = 0
    for name, b in new.items():
        dt = dtype_of(b, name)
        total += b.numel()
        if name in old:
            changed += int(np.count_nonzero(bits_view(old[name], dt).numpy()
                                            != bits_view(b, dt).numpy()))
        else:
            changed += b.numel()
    return changed / max(1, total)


# ------------------------------------------------------------------ baselines


def baseline_encode(old: dict, new: dict) -> list[bytes]:
    """XOR + byte-shuffle + zstd-3 per tensor (Stitch/slime-style)."""
    cctx = zstandard.ZstdCompressor(level=3)
    out = []
    for name, b in new.items():
        dt = dtype_of(b, name)
        y = bits_view(b, dt).numpy()
        x = bits_view(old[name], dt).numpy() ^ y if name in old else y
        planes = x.view(np.uint8).reshape(-1, dt.itemsize).T.copy()
        out.append(cctx.compress(planes.tobytes()))
    return out


def baseline_apply(work: dict, new: dict, frames: list[bytes]) -> None:
    dctx = zstandard.ZstdDecompressor()
    for (name, b), frame in zip(new.items(), frames, strict=True):
        dt = dtype_of(b, name)
        raw = np.frombuffer(dctx.decompress(frame), dtype=np.uint8)
        x = raw.reshape(dt.itemsize, -1).T.copy().view(dt.np_view).reshape(-1)
        if name in work:
            flat = bits_view(work[name], dt).numpy()
            np.bitwise_xor(flat, x, out=flat)
        else:
            work[name] = torch.from_numpy(x).view(b.dtype).reshape(b.shape)


# ------------------------------------------------------------------ measuring


def cpu_timed(fn, setup=None) -> float:
    if setup is not None:
        setup()
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(name: str, old: dict, new: dict, repeat: int) -> dict:
    full = sum(t.numel() * t.element_size() for t in new.values())
    result = encode_patch(old, new, threads=1)
    patch = result.patch
    frames = baseline_encode(old, new)
    base_bytes = sum(len(f) for f in frames)
    cache = {n: tensor_digest(t) for n, t in old.items()}
    work = {n: t.clone() for n, t in old.items()}
    flat_src = np.concatenate([bits_view(t, dtype_of(t)).numpy().view(np.uint8).reshape(-1)
                               for t in new.values()])
    flat_dst = np.empty_like(flat_src)

    def reset() -> None:
        for n in list(work):
            if n not in old:
                del work[n]
        for n, t in old.items():
            if n in work:
                work[n].copy_(t)
            else:
                work[n] = t.clone()

    def apply() -> None:
        stage_patch(work, patch, digests=dict(cache)).finish()

    def node() -> None:
        for i in range(0, len(patch), CHUNK):
            blake3.blake3(memoryview(patch)[i:i + CHUNK]).digest()
        apply()

    # Check the apply once (and the baseline round trip) before timing.
    reset()
    apply()
    for n, t in new.items():
        assert torch.equal(bits_view(work[n], dtype_of(t)), bits_view(t, dtype_of(t))), n
    times: dict[str, list[float]] = {k: [] for k in
                                     ("memcpy", "base_enc", "base_apply", "enc", "apply", "node")}
    for _ in range(repeat):
        times["memcpy"].append(cpu_timed(lambda: np.copyto(flat_dst, flat_src)))
        times["base_enc"].append(cpu_timed(lambda: baseline_encode(old, new)))
        times["base_apply"].append(cpu_timed(lambda: baseline_apply(work, new, frames), reset))
        times["enc"].append(cpu_timed(lambda: encode_patch(old, new, threads=1)))
        times["apply"].append(cpu_timed(apply, reset))
        times["node"].append(cpu_timed(node, reset))
    med = {k: statistics.median(v) for k, v in times.items()}
    mbps = {k: full / max(v, 1e-9) / 1e6 for k, v in med.items()}
    ops = sorted({t.op for t in result.tensors})
    return {
        "case": name,
        "changed_pct": 100 * changed_fraction(old, new),
        "ops": ops,
        "full_bytes": full,
        "patch_bytes": len(patch),
        "baseline_bytes": base_bytes,
        "size_vs_baseline": len(patch) / base_bytes,
        "memcpy_mbps": mbps["memcpy"],
        "baseline_encode_mbps": mbps["base_enc"],
        "baseline_apply_mbps": mbps["base_apply"],
        "encode_mbps": mbps["enc"],
        "apply_mbps": mbps["apply"],
        "encode_x_baseline": mbps["enc"] / mbps["base_enc"],
        "apply_x_baseline": mbps["apply"] / mbps["base_apply"],
        "encode_x_memcpy": mbps["enc"] / mbps["memcpy"],
        "apply_x_memcpy": mbps["apply"] / mbps["memcpy"],
        "node_cpu_s_per_gb": med["node"] / (len(patch) / 1e9),
        "baseline_node_cpu_s_per_gb": med["base_apply"] / (base_bytes / 1e9),
        "times_s": times,
    }


E2E_CASES = ("bf16 dense 93%", "fp8 dense 90%", "bf16 replace")


def end_to_end(old: dict, new: dict, dtype: str, repeat: int) -> dict:
    """Trainer publish and node apply, whole path (see the module docstring)."""
    import shutil
    import tempfile

    from node.config import parse_config
    from node.engines.inprocess import InProcessWeights
    from swarm.trust.keys import generate_keypair
    from trainer.publisher import Publisher
    from trainer.served import served_view

    full = sum(t.numel() * t.element_size() for t in new.values())
    times: dict[str, list[float]] = {"trainer": [], "trainer_wall": [], "node": [], "served": []}
    patch_bytes = 0
    for _ in range(repeat):
        d = Path(tempfile.mkdtemp(prefix="bench-dense-"))
        try:
            generate_keypair(d / "t.key")
            cfg = parse_config({
                "node": {"id": "t", "region": "t", "model": "m", "role": "origin"},
                "network": {"listen": "127.0.0.1:9", "swarm_secret": "00" * 32},
                "store": {"dir": "store", "fsync": False},
                "publish": {"signing_key": "t.key"}}, d)
            pub = Publisher(cfg, base=old, persist_view=False)
            # what a running trainer holds: the digests of the view it published last
            pub._view_digests = getattr(encode_patch({}, old, threads=1), "digests", None)
            w0 = time.perf_counter()
            times["trainer"].append(cpu_timed(lambda: pub.publish_served(new)))  # noqa: B023
            times["trainer_wall"].append(time.perf_counter() - w0)
            v = pub.version
            m = pub.store.manifest(v)
            patch_bytes = m.payload_length
            w = InProcessWeights({k: t.clone() for k, t in old.items()}, v - 1, "cpu")
            w.track_changes = False  # as with the in-process engine (node.daemon)

            def node(w=w, m=m, store=pub.store, v=v) -> None:
                w.stage(v, m.kind, store.payload(v), m.parent_digest)
                assert w.commit(v, m.target_digest) == m.target_digest

            times["node"].append(cpu_timed(node))
            pub.store.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
        if dtype in ("bf16", "fp8"):
            masters = {k: t.float() for k, t in new.items()}
            times["served"].append(cpu_timed(lambda: served_view(masters, dtype)))  # noqa: B023
    med = {k: statistics.median(v) for k, v in times.items() if v}
    out = {
        "trainer_mbps": full / med["trainer"] / 1e6,
        "trainer_wall_mbps": full / med["trainer_wall"] / 1e6,
        "node_mbps": full / med["node"] / 1e6,
        "node_cpu_s_per_gb_received": med["node"] / (patch_bytes / 1e9),
        "e2e_times_s": times,
    }
    if "served" in med:
        out["served_view_mbps"] = full / med["served"] / 1e6  # of served bytes produced
    return out


AB_KEYS = ("patch_bytes", "baseline_bytes", "size_vs_baseline", "encode_mbps", "apply_mbps",
           "baseline_encode_mbps", "baseline_apply_mbps", "encode_x_baseline",
           "apply_x_baseline", "node_cpu_s_per_gb", "memcpy_mbps")


def run_ab(before: Path, names: list[str], rounds: int, repeat: int, mib: int, out: Path) -> None:
    """Interleaved A/B: every (round, case) runs this script once per side."""
    after = Path(__file__).resolve().parent.parent
    sides = {"before": before.resolve(), "after": after}
    runs: dict[str, dict[str, list[dict]]] = {s: {c: [] for c in names} for s in sides}
    load_before = list(os.getloadavg())
    flip = False
    with tempfile.TemporaryDirectory(prefix="bench-dense-ab-") as tmp:
        for rnd in range(rounds):
            for case in names:
                order = ["before", "after"] if not flip else ["after", "before"]
                flip = not flip
                for side in order:
                    path = Path(tmp) / f"{side}.json"
                    env = dict(os.environ, PYTHONPATH=str(sides[side]))
                    subprocess.run(
                        [sys.executable, __file__, "--cases", case, "--repeat", str(repeat),
                         "--mib", str(mib), "--e2e", "", "--out", str(path)],
                        env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
                    result = json.loads(path.read_text())
                    if not result["codec"].startswith(str(sides[side])):
                        raise SystemExit(f"{side}: imported the codec from {result['codec']}")
                    row = result["rows"][0]
                    runs[side][case].append({k: row[k] for k in AB_KEYS})
                    print(f"round {rnd + 1} {case:<24} {side:<6} encode {row['encode_mbps']:5.0f} "
                          f"MB/s ({row['encode_x_baseline']:.2f}x)  apply "
                          f"{row['apply_mbps']:5.0f} MB/s ({row['apply_x_baseline']:.2f}x)  "
                          f"patch {row['patch_bytes'] / 1e6:.2f} MB", flush=True)
    summary = {}
    print(f"\n{'case':<24} {'side':<6} {'patch MB':>8} {'enc MB/s':>8} {'min':>5} {'x base':>6} "
          f"{'apply MB/s':>10} {'min':>5} {'x base':>6}  (medians and minima over {rounds} rounds)")
    for case in names:
        summary[case] = {}
        for side in sides:
            rs = runs[side][case]
            med = {k: statistics.median(r[k] for r in rs) for k in AB_KEYS}
            med["encode_mbps_min"] = min(r["encode_mbps"] for r in rs)
            med["apply_mbps_min"] = min(r["apply_mbps"] for r in rs)
            med["encode_mbps_rounds"] = [r["encode_mbps"] for r in rs]
            summary[case][side] = med
            print(f"{case:<24} {side:<6} {med['patch_bytes'] / 1e6:>8.2f} "
                  f"{med['encode_mbps']:>8.0f} {med['encode_mbps_min']:>5.0f} "
                  f"{med['encode_x_baseline']:>6.2f} {med['apply_mbps']:>10.0f} "
                  f"{med['apply_mbps_min']:>5.0f} {med['apply_x_baseline']:>6.2f}")
    print("\nencode MB/s per CPU-second, every round (round i: before, after; "
          "after/before ratio of the same round)")
    for case in names:
        pairs = zip(runs["before"][case], runs["after"][case], strict=True)
        print(f"{case:<24} " + "  ".join(
            f"{b['encode_mbps']:.0f}/{a['encode_mbps']:.0f} ({a['encode_mbps'] / b['encode_mbps']:.2f})"
            for b, a in pairs))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "note": "A/B: before = the codec of the --ab checkout, after = this checkout's, the same "
                "measurement script; per (round, case) one process per side, order alternating",
        "machine": platform.machine(), "repeat": repeat, "rounds": rounds, "mib": mib,
        "timer": "process_time", "load_avg_before": load_before,
        "load_avg_after": list(os.getloadavg()), "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats per case (medians)")
    ap.add_argument("--cases", default="all", help="comma-separated case names, or 'all'")
    ap.add_argument("--mib", type=int, default=64, help="checkpoint size per case")
    ap.add_argument("--out", type=Path, default=RESULTS / "dense.json", help="JSON results")
    ap.add_argument("--e2e", default=",".join(E2E_CASES),
                    help="cases also timed end to end (trainer publish, node apply); '' for none")
    ap.add_argument("--ab", type=Path, default=None, metavar="BEFORE_ROOT",
                    help="A/B: time the codec of this checkout against BEFORE_ROOT's, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds (with --ab)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = list(CASES) if args.cases == "all" else [c.strip() for c in args.cases.split(",")]
    if args.ab is not None:
        run_ab(args.ab, names, args.rounds, args.repeat, args.mib, args.out)
        return
    print(f"{'case':<24} {'chg%':>6} {'op':<13} {'patch MB':>8} {'x base':>6} "
          f"{'enc MB/s':>8} {'x base':>6} {'x mcpy':>6} {'apply MB/s':>10} {'x base':>6} "
          f"{'x mcpy':>6} {'node s/GB':>9} {'base enc':>8} {'base app':>8} {'memcpy':>7}")
    rows = []
    for name in names:
        dtype, step = CASES[name]
        old, new = make_case(dtype, step, args.mib * MiB)
        r = measure(name, old, new, args.repeat)
        if name in args.e2e.split(","):
            r.update(end_to_end(old, new, dtype, args.repeat))
        rows.append(r)
        print(f"{name:<24} {r['changed_pct']:>6.2f} {'/'.join(r['ops']):<13} "
              f"{r['patch_bytes'] / 1e6:>8.2f} {r['size_vs_baseline']:>6.3f} "
              f"{r['encode_mbps']:>8.0f} {r['encode_x_baseline']:>6.2f} {r['encode_x_memcpy']:>6.3f} "
              f"{r['apply_mbps']:>10.0f} {r['apply_x_baseline']:>6.2f} {r['apply_x_memcpy']:>6.3f} "
              f"{r['node_cpu_s_per_gb']:>9.2f} {r['baseline_encode_mbps']:>8.0f} "
              f"{r['baseline_apply_mbps']:>8.0f} {r['memcpy_mbps']:>7.0f}", flush=True)
        if "trainer_mbps" in r:
            print(f"{'  end to end':<24} trainer publish {r['trainer_mbps']:.0f} MB/s CPU "
                  f"({r['trainer_mbps'] / r['memcpy_mbps']:.3f}x memcpy, wall "
                  f"{r['trainer_wall_mbps']:.0f} MB/s); node apply {r['node_mbps']:.0f} MB/s CPU "
                  f"({r['node_mbps'] / r['memcpy_mbps']:.3f}x memcpy), "
                  f"{r['node_cpu_s_per_gb_received']:.2f} CPU-s/GB received"
                  + (f"; served view {r['served_view_mbps']:.0f} MB/s"
                     if "served_view_mbps" in r else ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": platform.machine(), "processor": platform.processor(),
        "cpu_threads_torch": 1, "repeat": args.repeat, "mib": args.mib,
        "timer": "process_time", "load_avg": list(os.getloadavg()),
        "codec": str(Path(encode_patch.__code__.co_filename).resolve().parent), "rows": rows},
        indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
