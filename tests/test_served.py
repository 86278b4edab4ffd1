"""Served views: the FP8 fast path is bitwise the reference formula."""

from __future__ import annotations

import pytest
import torch

from trainer.served import FP8_MAX, served_view


def _reference_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = float(v.abs().max())
    exp = 0 if amax == 0.0 else int(torch.ceil(torch.log2(torch.tensor(amax / FP8_MAX))))
    scale = torch.tensor(2.0**exp, dtype=torch.float32)
    return (v / scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("mag", [0.0, 1e-42, 1e-30, 1e-3, 0.02, 1.0, 300.0, 1e30])
def test_fp8_view_matches_reference(mag):
    g = torch.Generator().manual_seed(3)
    v = torch.randn(64, 33, generator=g) * mag
    v[0, 0] = -mag * 7  # a negative extreme
    got = served_view({"w": v, "b": v[0]}, "fp8")
    want, scale = _reference_fp8(v)
    assert torch.equal(got["w"].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got["w.scale"], scale)
    assert got["b"].dtype == torch.bfloat16
