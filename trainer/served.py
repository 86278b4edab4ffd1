"""Turn FP32 master weights into the *served* view a rollout engine loads.

- ``bf16``: every floating tensor rounded to bfloat16 (round-to-nearest-even).
- ``fp8``: 2-D weight matrices as float8_e4m3fn with a per-tensor power-of-two
  scale stored beside them as ``<name>.scale`` (fp32 scalar); other tensors in
  bf16. Power-of-two scales only move when a tensor's absolute maximum crosses
  a binade, so small RL steps keep them — and Adam absorption — stable, as with
  MX-style block scaling.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def served_view(masters: dict[str, torch.Tensor], dtype: str = "bf16") -> dict[str, torch.Tensor]:
    if dtype == "bf16":
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in masters.items()}
    if dtype == "fp8":
        out: dict[str, torch.Tensor] = {}
        for name, v in masters.items():
            v = v.detach()
            if v.dim() == 2:
                amax = float(v.abs().max())
                exp = 0 if amax == 0.0 else int(torch.ceil(torch.log2(torch.tensor(amax / FP8_MAX))))
                scale = torch.tensor(2.0**exp, dtype=torch.float32)
                out[name] = (v / scale).to(torch.float8_e4m3fn).contiguous()
                out[name + ".scale"] = scale
            else:
                out[name] = v.to(torch.bfloat16).contiguous()
        return out
    raise ValueError(f"unknown served dtype {dtype!r} (expected 'bf16' or 'fp8')")
