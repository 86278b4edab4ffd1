"""A tiny random-init Llama causal LM and real AdamW steps on it (``patchswarm demo --async``).

``llama_masters`` makes FP32 masters in Hugging Face Llama tensor names,
``model_config`` its ``config.json`` (what the gateway's in-process runner,
``node.engines.tiny_lm``, reads), and ``LlamaTrainer`` takes AdamW steps of
next-token cross-entropy towards a fixed random token, computed with
``tiny_lm.forward`` itself (the served model's own arithmetic, in FP32).
The same shapes as ``tests/engine_vllm_support.py`` (``TINY``).
"""

from __future__ import annotations

from typing import Any

import torch

TINY: dict[str, int] = {
    "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 512,
}


def llama_masters(seed: int = 0, cfg: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """FP32 masters of a tiny Llama in Hugging Face checkpoint names."""
    c = {**TINY, **(cfg or {})}
    g = torch.Generator().manual_seed(seed)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out = {"model.embed_tokens.weight": w(v, h, std=0.5), "lm_head.weight": w(v, h, std=0.2),
           "model.norm.weight": 1.0 + w(h, std=0.1)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": w(h, i),
                p + "input_layernorm.weight": 1.0 + w(h, std=0.1),
                p + "post_attention_layernorm.weight": 1.0 + w(h, std=0.1)}
    return out


def model_config(cfg: dict[str, int] | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``config.json`` of that Llama (served as ``dtype``)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
        "torch_dtype": dtype, **TINY, **(cfg or {}),
    }


class LlamaTrainer:
    """AdamW on the FP32 masters: each ``step()`` lowers the cross-entropy of one fixed
    random next token after ``batch`` fixed random prompts, and returns the masters (owned by
    the trainer: publish or copy them before the next step)."""

    def __init__(self, masters: dict[str, torch.Tensor], cfg: dict[str, Any], *,
                 lr: float = 1e-5, seed: int = 0, batch: int = 2, prompt_len: int = 6) -> None:
        from node.engines import tiny_lm

        self._tiny = tiny_lm
        self.params = {k: v.clone().requires_grad_(True) for k, v in masters.items()}
        self.shape = tiny_lm.shape_of(self.params, cfg)
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.prompts = [torch.randint(3, self.shape.vocab, (prompt_len,), generator=self.gen
                                      ).tolist() for _ in range(batch)]
        self.target = int(torch.randint(3, self.shape.vocab, (1,), generator=self.gen).item())
        self.steps = 0
        self.last_loss = float("nan")

    def step(self) -> dict[str, torch.Tensor]:
        """One AdamW step; the new FP32 masters (no grad)."""
        self.opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for ids in self.prompts:
            logits, _ = self._tiny.forward(self.shape, self.params, ids, 0, None)
            loss = loss + torch.nn.functional.cross_entropy(
                logits[None], torch.tensor([self.target]))
        (loss / len(self.prompts)).backward()
        self.opt.step()
        self.steps += 1
        self.last_loss = float(loss.detach()) / len(self.prompts)
        return {k: v.detach() for k, v in self.params.items()}
