"""A small pure-torch causal LM runner over Hugging Face Llama checkpoint names.

The in-process engine has no HTTP server of its own; the request gateway
(``node.gateway``) answers ``/generate`` and ``/v1/completions`` with this
runner, reading the node's checkpoint-coordinate truth directly. It is a
reference forward pass, not a serving engine: no batching, greedy decoding
only, one KV cache per request, float32 arithmetic.

Supported: ``LlamaForCausalLM`` (and the same layout under ``MistralForCausalLM``
and ``Qwen2ForCausalLM``, with q/k/v biases when present): token embeddings,
RMSNorm, rotary embeddings (plain, no ``rope_scaling``), grouped-query
attention, SwiGLU MLP, a separate or tied ``lm_head``. The shape comes from the
model's ``config.json`` (``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``tie_word_embeddings``); every
tensor's presence and shape is checked against it, so anything else (the
MiniLM demo's encoder, an unknown layout) is ``Unsupported`` with the reason.

Prompts are token ids; a string is taken as its UTF-8 bytes (ids 0..255).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import PatchswarmError

if TYPE_CHECKING:
    import torch

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MAX_CONFIG_BYTES = 1024 * 1024


class Unsupported(PatchswarmError):
    """The weights are not a causal LM this runner can serve (the message says why)."""


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    tied: bool
    bias: bool  # q/k/v projections carry biases (Qwen2)


def read_config(path: Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (bounded read); ``Unsupported`` when unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise Unsupported(f"cannot read the model config {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise Unsupported(f"model config {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise Unsupported(f"model config {path} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise Unsupported(f"model config {path} is not a JSON object")
    return cfg


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise Unsupported(f"model config: {key} must be a positive integer, got {v!r}")
    return v


def shape_of(weights: Mapping[str, torch.Tensor], cfg: dict[str, Any]) -> LlamaShape:
    """Check ``weights`` against ``cfg``; the shape, or ``Unsupported`` naming what differs."""
    arch = cfg.get("architectures") or []
    if not isinstance(arch, list) or not any(a in ARCHITECTURES for a in arch):
        raise Unsupported(f"model architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    if cfg.get("rope_scaling"):
        raise Unsupported("rope_scaling is not supported by the in-process runner")
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    head_dim = cfg.get("head_dim") or hidden // heads
    s = LlamaShape(
        vocab=_int(cfg, "vocab_size"), hidden=hidden, layers=_int(cfg, "num_hidden_layers"),
        heads=heads, kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=_int({"head_dim": head_dim}, "head_dim"),
        intermediate=_int(cfg, "intermediate_size"),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 1e4)),
        tied="lm_head.weight" not in weights,
        bias="model.layers.0.self_attn.q_proj.bias" in weights)
    if s.heads % s.kv_heads:
        raise Unsupported(f"num_attention_heads {s.heads} is not a multiple of "
                          f"num_key_value_heads {s.kv_heads}")
    for name, want in expected_tensors(s).items():
        t = weights.get(name)
        if t is None:
            raise Unsupported(f"tensor {name} is missing (not a {arch[0]} checkpoint?)")
        if tuple(t.shape) != want:
            raise Unsupported(f"tensor {name} has shape {tuple(t.shape)}, the config says {want}")
    return s


def expected_tensors(s: LlamaShape) -> dict[str, tuple[int, ...]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden),
                                       "model.norm.weight": (s.hidden,)}
    if not s.tied:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    for n in range(s.layers):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": (q, s.hidden),
                p + "self_attn.k_proj.weight": (kv, s.hidden),
                p + "self_attn.v_proj.weight": (kv, s.hidden),
                p + "self_attn.o_proj.weight": (s.hidden, q),
                p + "mlp.gate_proj.weight": (s.intermediate, s.hidden),
                p + "mlp.up_proj.weight": (s.intermediate, s.hidden),
                p + "mlp.down_proj.weight": (s.hidden, s.intermediate),
                p + "input_layernorm.weight": (s.hidden,),
                p + "post_attention_layernorm.weight": (s.hidden,)}
        if s.bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
    return out


def prompt_ids(prompt: Any, vocab: int) -> list[int]:
    """Token ids from a list of ints, or a string's UTF-8 bytes; ``ValueError`` otherwise."""
    if isinstance(prompt, str):
        ids = list(prompt.encode("utf-8"))
        if vocab < 256:
            raise ValueError(f"a text prompt needs a vocabulary of at least 256 ids (has {vocab})")
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                          for i in prompt):
        ids = list(prompt)
    else:
        raise ValueError("the prompt must be a string or a list of token ids")
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


def ids_text(ids: list[int]) -> str:
    """Ids 0..255 as UTF-8 bytes (invalid sequences replaced); larger ids as ``<|id|>``."""
    out, buf = [], bytearray()
    for i in ids:
        if i < 256:
            buf.append(i)
            continue
        out.append(buf.decode("utf-8", "replace"))
        buf = bytearray()
        out.append(f"<|{i}|>")
    out.append(buf.decode("utf-8", "replace"))
    return "".join(out)


class Decoder:
    """Greedy decoding of one request, one token per ``step``.

    ``step(weights, version)`` reads ``weights`` (the caller holds whatever lock
    keeps them still during the call). The KV cache belongs to one version:
    when ``version`` differs from the cache's, the prefix (prompt and tokens so
    far) is recomputed on the new weights, so every token after a commit is a
    function of the new version's weights alone.
    """

    def __init__(self, shape: LlamaShape, prompt: list[int]) -> None:
        self.shape = shape
        self.ids = list(prompt)
        self.prompt_len = len(prompt)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cache_version: int | None = None
        self.versions: list[int] = []  # the version each generated token came from

    @property
    def output(self) -> list[int]:
        return self.ids[self.prompt_len:]

    def step(self, weights: Mapping[str, torch.Tensor], version: int) -> int:
        import torch

        with torch.no_grad():
            if self.cache is None or self.cache_version != version:
                logits, self.cache = forward(self.shape, weights, self.ids, 0, None)
                self.cache_version = version
            else:
                logits, self.cache = forward(self.shape, weights, self.ids[-1:],
                                             len(self.ids) - 1, self.cache)
        tok = int(torch.argmax(logits).item())
        self.ids.append(tok)
        self.versions.append(version)
        return tok


def greedy(shape: LlamaShape, weights: Mapping[str, torch.Tensor], prompt: list[int],
           max_new_tokens: int, version: int = 0) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt`` (a reference for tests and checks)."""
    d = Decoder(shape, prompt)
    for _ in range(max_new_tokens):
        d.step(weights, version)
    return d.output


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rope(x: torch.Tensor, pos0: int, theta: float) -> torch.Tensor:
    """Rotary embedding in Hugging Face's half-split layout; ``x``: [tokens, heads, dim]."""
    import torch

    n, _, d = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = torch.outer(torch.arange(pos0, pos0 + n, dtype=torch.float32, device=x.device), inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _lin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ w.float().t()
    return y + b.float() if b is not None else y


def forward(s: LlamaShape, w: Mapping[str, torch.Tensor], ids: list[int], pos0: int,
            cache: list[tuple[torch.Tensor, torch.Tensor]] | None
            ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Logits of the last position, and the KV cache extended by ``ids`` (at ``pos0``)."""
    import torch

    dev = w["model.embed_tokens.weight"].device
    idx = torch.tensor(ids, dtype=torch.long, device=dev)
    x = w["model.embed_tokens.weight"][idx].float()
    n = len(ids)
    rep = s.heads // s.kv_heads
    new_cache = []
    for layer in range(s.layers):
        p = f"model.layers.{layer}."
        h = _rms(x, w[p + "input_layernorm.weight"], s.rms_eps)
        q = _lin(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
        k = _lin(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
        v = _lin(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
        q = _rope(q.view(n, s.heads, s.head_dim), pos0, s.rope_theta)
        k = _rope(k.view(n, s.kv_heads, s.head_dim), pos0, s.rope_theta)
        v = v.view(n, s.kv_heads, s.head_dim)
        if cache is not None:
            k = torch.cat([cache[layer][0], k])
            v = torch.cat([cache[layer][1], v])
        new_cache.append((k, v))
        kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, keys, dim]
        vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        qq = q.transpose(0, 1)  # [heads, n, dim]
        scores = qq @ kk.transpose(1, 2) / (s.head_dim ** 0.5)
        keys = kk.shape[1]
        qpos = torch.arange(pos0, pos0 + n, device=dev)[:, None]
        kpos = torch.arange(keys, device=dev)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ vv  # [heads, n, dim]
        x = x + _lin(att.transpose(0, 1).reshape(n, s.heads * s.head_dim),
                     w[p + "self_attn.o_proj.weight"])
        h = _rms(x, w[p + "post_attention_layernorm.weight"], s.rms_eps)
        gate = torch.nn.functional.silu(_lin(h, w[p + "mlp.gate_proj.weight"]))
        x = x + _lin(gate * _lin(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
    x = _rms(x[-1], w["model.norm.weight"], s.rms_eps)
    head = w["model.embed_tokens.weight"] if s.tied else w["lm_head.weight"]
    return _lin(x, head), new_cache
