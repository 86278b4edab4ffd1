"""GPU check of both real engines: vLLM and SGLang fed by patchswarm nodes.

For a machine with a GPU (it cannot run on a CPU-only host, except the
``--sglang-contract`` rehearsal below). It

1. writes the served view (bf16) of a small local Hugging Face model as the
   base checkpoint and as a model directory both engines start from;
2. starts vLLM (``VllmProcess``: dev-mode endpoints and the patchswarm worker
   extension) and SGLang (``python -m sglang.launch_server``) on it;
3. starts one ``patchswarm node`` per engine on loopback (``[engine] kind``
   ``vllm`` / ``sglang``), waits until each node has synced its engine;
4. publishes ``--versions`` training steps with the real ``patchswarm publish``
   (FP32 masters + ``--lr`` * noise, served as bf16), and after each one waits
   until every engine serves it, while a client keeps sending short greedy
   requests to each engine (the longest request latency shows the pause);
5. checks bitwise identity: each node's ``active_digest`` is the trainer's
   target digest; SGLang's ``/get_weights_by_name`` rows equal the served view
   exactly (float32 of bf16); at the end, greedy token ids and logprobs of the
   patched engines equal those of fresh engines started from a checkpoint of
   the last version, and vLLM's per-parameter digests (``patchswarm_digest``)
   equal the fresh engine's;
6. writes everything (per version: path, bytes, commit and pause seconds,
   longest request, checks) as JSON to ``--out`` and exits 1 if a check failed.

Run (engines in their own venvs, e.g. from ``scripts/engine_venv.py``)::

    python benchmarks/gpu_engines_check.py --model-dir MODEL_DIR \\
        --vllm-python VLLM_VENV/bin/python --sglang-python SGLANG_VENV/bin/python \\
        --versions 3 --out gpu_engines_check.json

Rehearsal without a GPU: ``--engines sglang --sglang-contract`` runs the same
steps against the SGLang contract server (no reference engine, no logprob
comparison), on a random model when ``--model-dir`` is not given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from lab.fleet import LoopbackFleet, free_port  # noqa: E402
from swarm.codec import state_digest  # noqa: E402
from trainer.served import served_view  # noqa: E402

PROMPTS = [[151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30], [785, 6722, 315, 9625, 374],
           [40, 1079, 264, 1550, 5116, 315]]
CHECK_ROWS = 4  # rows of each checked tensor read back through /get_weights_by_name


# ----------------------------------------------------------------- helpers


def http_json(url: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2.0):
                return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise RuntimeError(f"{url}: no answer within {timeout:.0f} s")


def load_model_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model_dir}: no *.safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def write_model_dir(src: Path | None, weights: dict[str, torch.Tensor], dst: Path) -> Path:
    """A model directory: ``src``'s config and tokenizer files plus ``weights``."""
    dst.mkdir(parents=True, exist_ok=True)
    if src is not None:
        for p in src.iterdir():
            if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt")) \
                    and p.name != "model.safetensors.index.json":
                shutil.copy2(p, dst / p.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    return dst


class SGLangProcess:
    """``python -m sglang.launch_server`` (or the contract server), stopped by its PID group."""

    def __init__(self, python: str, model_dir: Path, port: int, log: Path, *, contract: bool,
                 mem_fraction: float) -> None:
        self.url = f"http://127.0.0.1:{port}"
        if contract:
            args = [sys.executable, "-m", "node.engines.testing.sglang_contract",
                    "--model-path", str(model_dir), "--port", str(port)]
        else:
            args = [python, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                    "--host", "127.0.0.1", "--port", str(port),
                    "--mem-fraction-static", str(mem_fraction), "--dtype", "bfloat16"]
        self.log = log
        out = open(log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        out.close()

    def wait_ready(self, timeout: float) -> float:
        return wait_http(self.url + "/health", timeout, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            import signal

            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class EngineFleet(LoopbackFleet):
    """One region, one node per engine; each node's config gets its ``[engine]``."""

    def __init__(self, sections: list[str], workdir: Path) -> None:
        super().__init__(1, len(sections), chunk_size=1024 * 1024, workdir=workdir,
                         keep_workdir=True, swarm={"redial_s": 1.0})
        self.sections = sections

    def _write_configs(self) -> None:
        super()._write_configs()
        for n, sec in zip(self.nodes, self.sections, strict=True):
            n.config.write_text(n.config.read_text() + "\n" + sec)


class Load:
    """A client sending short greedy requests to one engine; records the longest one."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self.url = kind, url
        self.stop_flag = threading.Event()
        self.latencies: list[float] = []
        self.errors = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        if self.kind == "sglang":
            http_json(self.url + "/generate", {"input_ids": PROMPTS[0],
                                               "sampling_params": {"max_new_tokens": 8,
                                                                   "temperature": 0}}, 120)
        else:
            http_json(self.url + "/v1/completions", {"model": "policy", "prompt": PROMPTS[0],
                                                     "max_tokens": 8, "temperature": 0}, 120)

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            t0 = time.perf_counter()
            try:
                self._one()
            except (urllib.error.URLError, OSError, ValueError):
                self.errors += 1
                time.sleep(0.05)
                continue
            self.latencies.append(time.perf_counter() - t0)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self.thread.join(180)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"requests": len(lat), "errors": self.errors,
                "median_s": round(lat[len(lat) // 2], 4) if lat else None,
                "max_s": round(lat[-1], 4) if lat else None}


def greedy(kind: str, url: str) -> list[dict[str, Any]]:
    """Token ids and logprobs of greedy completions of PROMPTS."""
    out = []
    for p in PROMPTS:
        if kind == "sglang":
            r = http_json(url + "/generate", {"input_ids": p, "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 16,
                                                                  "temperature": 0}}, 300)
            out.append({"ids": r["output_ids"],
                        "logprobs": [x[0] for x in r["meta_info"].get("output_token_logprobs", [])]})
        else:
            r = http_json(url + "/v1/completions", {"model": "policy", "prompt": p,
                                                    "max_tokens": 16, "temperature": 0,
                                                    "logprobs": 0, "return_token_ids": True}, 300)
            c = r["choices"][0]
            out.append({"ids": c.get("token_ids"),
                        "logprobs": (c.get("logprobs") or {}).get("token_logprobs")})
    return out


def sglang_rows_match(url: str, weights: dict[str, torch.Tensor], names: list[str]) -> dict:
    """SGLang's ``/get_weights_by_name`` rows == the served view, exactly."""
    bad = []
    for n in names:
        got = http_json(url + "/get_weights_by_name", {"name": n, "truncate_size": CHECK_ROWS})
        want = weights[n][:CHECK_ROWS].to(torch.float32)
        if not torch.equal(torch.tensor(got, dtype=torch.float32), want):
            bad.append(n)
    return {"checked": names, "mismatched": bad, "ok": not bad}


def vllm_digest(url: str) -> Any:
    r = http_json(url + "/collective_rpc", {"method": "patchswarm_digest", "args": []}, 300)
    return r.get("results")


# -------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, help="a local HF model directory (bf16 safetensors)")
    ap.add_argument("--engines", default="vllm,sglang")
    ap.add_argument("--vllm-python", default=sys.executable)
    ap.add_argument("--sglang-python", default=sys.executable)
    ap.add_argument("--sglang-contract", action="store_true",
                    help="rehearse against the SGLang contract server (no GPU)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3, help="size of each step, relative")
    ap.add_argument("--pause-mode", default="wait", choices=("keep", "wait", "abort"))
    ap.add_argument("--mem-fraction", type=float, default=0.2)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("gpu_engines_check.json"))
    ap.add_argument("--no-reference", action="store_true", help="skip the fresh reference engines")
    a = ap.parse_args(argv)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if not set(engines) <= {"vllm", "sglang"} or not engines:
        raise SystemExit("--engines: vllm and/or sglang")
    if "vllm" in engines and a.sglang_contract and not torch.cuda.is_available():
        raise SystemExit("vLLM needs a GPU here; rehearse with --engines sglang --sglang-contract")
    work = a.workdir or Path(tempfile.mkdtemp(prefix="patchswarm-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"engines": {}, "versions": [], "passed": False,
                              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                              "contract_rehearsal": a.sglang_contract, "pause_mode": a.pause_mode}

    # 1. the served base: bf16 of the model (or a random stand-in for the rehearsal)
    if a.model_dir is not None:
        raw = load_model_dir(a.model_dir)
    else:
        if not a.sglang_contract:
            raise SystemExit("--model-dir is required for real engines")
        g = torch.Generator().manual_seed(0)
        raw = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(512, 512, generator=g)
               for i in range(4)} | {"model.embed_tokens.weight": torch.randn(1000, 512, generator=g)}
    masters = {k: v.to(torch.float32) for k, v in raw.items()}
    base = served_view(masters, "bf16")
    report["model"] = {"dir": str(a.model_dir) if a.model_dir else None, "tensors": len(base),
                       "bytes": sum(t.numel() * t.element_size() for t in base.values())}
    model_v1 = write_model_dir(a.model_dir, base, work / "model-v1")
    check_names = [n for n in sorted(base) if base[n].dim() == 2][:3] + \
        [n for n in sorted(base) if base[n].dim() == 1][:1]

    procs: dict[str, Any] = {}
    urls: dict[str, str] = {}
    fleet = None
    try:
        # 2. the engines
        for kind in engines:
            port = free_port(["127.0.0.1"])
            if kind == "vllm":
                from node.engines.vllm import VllmProcess

                p = VllmProcess(a.vllm_python, model_v1, port, dtype="bfloat16",
                                log_path=work / "vllm.log", skip_tokenizer_init=False,
                                max_model_len=1024,
                                extra_args=["--gpu-memory-utilization", str(a.mem_fraction)]).start()
                ready = p.wait_ready(900)
            else:
                p = SGLangProcess(a.sglang_python, model_v1, port, work / "sglang.log",
                                  contract=a.sglang_contract, mem_fraction=a.mem_fraction)
                ready = p.wait_ready(900)
            procs[kind], urls[kind] = p, p.url
            report["engines"][kind] = {"url": p.url, "start_s": round(ready, 1), "versions": []}

        # 3. one node per engine
        sections = [f'[engine]\nkind = "{k}"\nurl = "{urls[k]}"\npause_mode = "{a.pause_mode}"\n'
                    f'timeout_s = 60\ncommit_timeout_s = 900\nprobe_s = 2\n' for k in engines]
        (work / "fleet").mkdir(exist_ok=True)
        fleet = EngineFleet(sections, work / "fleet")
        fleet.start_nodes_only(base, timeout=1800)
        by_kind = dict(zip(engines, fleet.nodes, strict=True))
        for kind, n in by_kind.items():
            st = fleet.status(n)["engine"]
            report["engines"][kind]["initial_sync"] = st["last_commit"]

        # 4. versions
        ok = True
        g = torch.Generator().manual_seed(1)
        for k in range(a.versions):
            version = k + 2
            masters = {n: v + a.lr * v.abs().mean() * torch.randn(v.shape, generator=g)
                       for n, v in masters.items()}
            ckpt = work / f"step{version}.safetensors"
            save_file(masters, str(ckpt))
            want = served_view(masters, "bf16")
            want_digest = state_digest(want).hex()
            loads = {kind: Load(kind, urls[kind]) for kind in engines}
            with contextlib.ExitStack() as stack:
                for ld in loads.values():
                    stack.enter_context(ld)
                time.sleep(1.0)
                t0 = time.monotonic()
                r = fleet.publish_cli(ckpt, "--wait-peers", "60", "--linger", "2", "--timeout", "900",
                                      "--regions", "1", timeout=1800)
                if r.returncode != 0:
                    raise RuntimeError(f"publish of version {version} failed: "
                                       f"{fleet.trainer_log.read_text()[-2000:]}")
                deadline = time.monotonic() + 1800
                while time.monotonic() < deadline:
                    sts = {kind: fleet.status(n) for kind, n in by_kind.items()}
                    if all(s and s["engine"]["served_version"] == version for s in sts.values()):
                        break
                    time.sleep(0.2)
                served_after = time.monotonic() - t0
                time.sleep(1.0)
            for kind in by_kind:
                s = sts[kind]
                e = s["engine"]
                entry: dict[str, Any] = {
                    "version": version, "served": e["served_version"] == version,
                    "node_digest_ok": s["active_digest"] == want_digest,
                    "last_commit": e["last_commit"], "engine_state": e["state"],
                    "requests_during_publish": loads[kind].summary(),
                    "publish_to_served_s": round(served_after, 2),
                }
                if kind == "sglang":
                    v = http_json(urls[kind] + "/get_weight_version")["weight_version"]
                    entry["engine_weight_version"] = v
                    entry["rows"] = sglang_rows_match(urls[kind], want, check_names)
                    entry_ok = entry["served"] and entry["node_digest_ok"] and entry["rows"]["ok"] \
                        and v == str(version)
                else:
                    entry_ok = entry["served"] and entry["node_digest_ok"]
                entry["ok"] = bool(entry_ok)
                ok = ok and entry["ok"]
                report["engines"][kind]["versions"].append(entry)
            report["versions"].append({"version": version, "digest": want_digest})
            print(json.dumps({"version": version, "ok": ok}), flush=True)

        # 5. the patched engines against fresh engines started from the last version
        patched = {kind: greedy(kind, urls[kind]) for kind in engines}
        digests = {"vllm": vllm_digest(urls["vllm"])} if "vllm" in engines else {}
        fleet.close()
        fleet = None
        for p in procs.values():
            p.stop()
        procs.clear()
        if not a.no_reference and not a.sglang_contract:
            model_last = write_model_dir(a.model_dir, want, work / "model-last")
            for kind in engines:
                port = free_port(["127.0.0.1"])
                if kind == "vllm":
                    from node.engines.vllm import VllmProcess

                    p = VllmProcess(a.vllm_python, model_last, port, dtype="bfloat16",
                                    log_path=work / "vllm-ref.log", skip_tokenizer_init=False,
                                    max_model_len=1024,
                                    extra_args=["--gpu-memory-utilization", str(a.mem_fraction)]
                                    ).start()
                    p.wait_ready(900)
                else:
                    p = SGLangProcess(a.sglang_python, model_last, port, work / "sglang-ref.log",
                                      contract=False, mem_fraction=a.mem_fraction)
                    p.wait_ready(900)
                procs[kind] = p
                ref = greedy(kind, p.url)
                same = ref == patched[kind]
                rep = report["engines"][kind]
                rep["reference_greedy_identical"] = same
                if kind == "vllm":
                    rep["reference_param_digests_identical"] = vllm_digest(p.url) == digests["vllm"]
                    same = same and rep["reference_param_digests_identical"]
                ok = ok and same
                p.stop()
                procs.pop(kind)
        report["passed"] = bool(ok)
    except Exception as exc:  # the report says what broke
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if fleet is not None:
            fleet.close()
        for p in procs.values():
            p.stop()
        report["workdir"] = str(work)
        a.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.out}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    raise SystemExit(main())
