"""Stage while serving, commit in a short pause: nothing changes before commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.codec import encode_patch, stage_patch
from swarm.codec.dtypes import BY_TORCH
from swarm.errors import PatchApplyError, PatchFormatError
from tests.codec_cases import clone, mutate, random_tensor, same_bits


def _pair(seed: int = 0):
    rng = np.random.default_rng(seed)
    bf16 = BY_TORCH[torch.bfloat16]
    old = {"w": random_tensor(rng, bf16, (128, 64)), "b": random_tensor(rng, bf16, (64,)),
           "gone": torch.zeros(3)}
    new = {"w": mutate(rng, old["w"], bf16, 0.05), "b": mutate(rng, old["b"], bf16, 1.0),
           "new": torch.ones(2, 2)}
    return old, new


@pytest.mark.parametrize("context", ["off", "on"])
def test_stage_changes_nothing_until_finish(context):
    old, new = _pair()
    patch = encode_patch(old, new, threads=1, context=context).patch
    weights = clone(old)
    staged = stage_patch(weights, patch)
    assert same_bits(weights, old)
    report = staged.finish()
    assert same_bits(weights, new)
    assert report.records == 4


def test_commit_after_weights_moved_rolls_back():
    old, new = _pair(1)
    patch = encode_patch(old, new, threads=1).patch
    weights = clone(old)
    staged = stage_patch(weights, patch)
    weights["w"].reshape(-1).view(torch.int16)[0] ^= 1  # served state moved under the stage
    before = clone(weights)
    with pytest.raises(PatchApplyError):
        staged.finish()
    assert same_bits(weights, before)


def test_stage_of_truncated_patch_fails_on_finish_without_change():
    old, new = _pair(2)
    patch = encode_patch(old, new, threads=1).patch
    weights = clone(old)
    staged = stage_patch(weights, patch[:-5])
    with pytest.raises(PatchFormatError, match="truncated"):
        staged.finish()
    assert same_bits(weights, old)


def test_digest_cache_is_used_and_updated():
    from swarm.codec import apply_patch, tensor_digest

    old, new = _pair(3)
    patch = encode_patch(old, new, threads=1).patch
    weights = clone(old)
    cache = {k: tensor_digest(v) for k, v in weights.items()}
    apply_patch(weights, patch, digests=cache)
    assert cache == {k: tensor_digest(v) for k, v in new.items()}
    # A stale cache is trusted for unchanged tensors: a wrong entry makes the base check fail.
    weights2 = clone(old)
    bad = {k: tensor_digest(v) for k, v in weights2.items()}
    bad["b"] = bytes(8)
    with pytest.raises(PatchApplyError, match="base state digest differs"):
        apply_patch(weights2, patch, digests=bad)
    assert same_bits(weights2, old)
