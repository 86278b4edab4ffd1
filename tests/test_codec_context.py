"""Magnitude-bucket context models: exact inverse, block boundaries, real gains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import apply_patch, encode_patch, read_patch_info
from swarm.codec import context as ctx
from swarm.codec.dtypes import BY_TORCH
from tests.codec_cases import check_flip, clone, same_bits

FLOAT_DTYPES = [d for d in BY_TORCH.values() if ctx.supports(d)]


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(FLOAT_DTYPES), st.integers(1, 5000),
       st.floats(0.0, 1.0), st.integers(0, 2), st.sampled_from([7, 64, 1000, 1 << 20]))
def test_ranks_invert_exactly(seed, dt, n, density, nthresh, block):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8).view(dt.np_view)
    idx = np.flatnonzero(rng.random(n) < density)
    limit = (1 << (dt.width - 1)) - 1
    thresholds = sorted(set(rng.integers(1, limit, size=nthresh).tolist()))
    old_block = ctx.BLOCK
    ctx.BLOCK = block
    try:
        ranks = ctx.encode_ranks(bits, idx, thresholds, dt)
        assert sum(r.size for r in ranks) == idx.size
        back = ctx.decode_positions(lambda a, b: bits[a:b], n, ranks, thresholds, dt, "t")
    finally:
        ctx.BLOCK = old_block
    assert np.array_equal(back, idx)


def _adam_like(n_rows: int, n_cols: int, seed: int, dtype=torch.bfloat16):
    """Every weight moves by ~1e-4; small weights cross their rounding boundary more."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n_rows, n_cols, generator=g) * 0.02
    step = torch.sign(torch.randn(n_rows, n_cols, generator=g)) * 1e-5
    return {"w": master.to(dtype)}, {"w": (master + step).to(dtype)}


@pytest.mark.parametrize(("dtype", "scale", "step"),
                         [(torch.bfloat16, 1.0, 1e-5), (torch.float8_e4m3fn, 100.0, 2e-2)])
def test_context_model_beats_plain_on_adam_like_steps(dtype, scale, step):
    g = torch.Generator().manual_seed(1)
    master = torch.randn(400, 300, generator=g) * 0.02 * scale
    moved = master + torch.sign(torch.randn(400, 300, generator=g)) * step
    old, new = {"w": master.to(dtype)}, {"w": moved.to(dtype)}
    plain = encode_patch(old, new, threads=1, context="off").patch
    with_ctx = encode_patch(old, new, threads=1, context="on").patch
    assert read_patch_info(with_ctx)["records"][0]["op"] == "SPARSE_CTX"
    assert len(with_ctx) < 0.95 * len(plain)
    for patch in (plain, with_ctx):
        weights = clone(old)
        apply_patch(weights, patch)
        assert same_bits(weights, new)


def test_context_across_many_blocks(monkeypatch):
    monkeypatch.setattr(ctx, "BLOCK", 4096)
    old, new = _adam_like(300, 200, seed=3)
    result = encode_patch(old, new, threads=1, context="on")
    assert read_patch_info(result.patch)["records"][0]["op"] == "SPARSE_CTX"
    weights = clone(old)
    apply_patch(weights, result.patch)
    assert same_bits(weights, new)


def test_context_record_on_wrong_base_rolls_back():
    old, new = _adam_like(300, 200, seed=4)
    patch = encode_patch(old, new, threads=1, context="on").patch
    weights = clone(old)
    weights["w"].reshape(-1).view(torch.int16)[::7] ^= 0x4000  # move many magnitudes
    before = clone(weights)
    with pytest.raises(Exception) as info:
        apply_patch(weights, patch, check_base=False)
    assert "digest" in str(info.value) or "range" in str(info.value) or "bucket" in str(info.value)
    assert same_bits(weights, before)


_OLD, _NEW = _adam_like(200, 120, seed=9)
_CTX_PATCH = encode_patch(_OLD, _NEW, threads=1, context="on").patch


def test_ctx_fixture_uses_context():
    assert read_patch_info(_CTX_PATCH)["records"][0]["op"] == "SPARSE_CTX"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(_CTX_PATCH) - 1), st.integers(1, 255))
def test_ctx_byte_flip_is_refused_or_exact(pos, flip):
    check_flip(_CTX_PATCH, _OLD, _NEW, pos, flip)
