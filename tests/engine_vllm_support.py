"""Helpers for the vLLM engine tests and benchmark: engine venv, a tiny Llama, greedy probes.

No model hub: the model is a random-init Llama written by the caller (config.json
+ model.safetensors), prompts are token ids (the engine runs with
``--skip-tokenizer-init``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import engine_venv  # noqa: E402

from lab.tiny_llama import TINY, llama_masters  # noqa: E402,F401  (one tiny Llama for the demo and the engine tests)

PROMPTS = [[1, 17, 230, 45, 999, 3], [5, 600, 601, 602], [77, 12, 1000, 8, 9, 10, 11, 500]]


def engine_python() -> Path:
    """Build or reuse the engine venv; raises RuntimeError with the reason if it cannot."""
    log = ROOT / ".cache" / "vllm-venv-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return engine_venv.build(engine_venv.DEFAULT_DEST, log=log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_step(masters: dict[str, torch.Tensor], seed: int, lr: float = 2e-3) -> dict[str, torch.Tensor]:
    """A small move of every master: a few percent of the BF16 served values change."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return {k: v + lr * v.abs().clamp_min(1e-3) * torch.randn(v.shape, generator=g)
            for k, v in masters.items()}


def write_model(dest: Path, served: dict[str, torch.Tensor], cfg: dict | None = None) -> Path:
    """A model directory vLLM can serve: config.json + model.safetensors (the served view)."""
    c = {**TINY, **(cfg or {})}
    dest.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(served.values())).dtype
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."), **c,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in served.items()}, str(dest / "model.safetensors"))
    return dest


def generate(url: str, prompt: list[int], max_tokens: int = 8, timeout: float = 120.0) -> dict:
    """Greedy continuation of token ids: {"tokens": [...], "logprobs": [...]} (exact floats).

    Uses vLLM's token-in/token-out endpoint (``--enable-scale-out``): no tokenizer needed."""
    body = {"token_ids": prompt,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0,
                                "ignore_eos": True, "detokenize": False}}
    req = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return {"tokens": choice.get("token_ids"), "logprobs": [c["logprob"] for c in content]}


def probe(url: str, prompts: list[list[int]] = PROMPTS) -> list[dict]:
    return [generate(url, p) for p in prompts]


ENGINE_ARGS = ("--enable-scale-out", "--max-num-seqs", "4", "--no-enable-prefix-caching")


def engine_env() -> dict[str, str]:
    """Small engines on a shared machine."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
