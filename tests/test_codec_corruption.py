"""Bad patches: a clear PatchswarmError and the weights exactly at the base version."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarm.codec import PatchApplier, apply_patch, encode_patch, read_patch_info
from swarm.codec.dtypes import BY_TORCH
from swarm.errors import PatchApplyError, PatchFormatError, PatchswarmError
from tests.codec_cases import check_flip, clone, mutate, random_tensor, same_bits


def _versions(seed: int = 0):
    rng = np.random.default_rng(seed)
    old = {
        "a.weight": random_tensor(rng, BY_TORCH[torch.bfloat16], (64, 48)),
        "a.bias": random_tensor(rng, BY_TORCH[torch.bfloat16], (48,)),
        "b.weight": random_tensor(rng, BY_TORCH[torch.float8_e4m3fn], (32, 32)),
        "b.weight.scale": torch.tensor(0.25),
        "gone": random_tensor(rng, BY_TORCH[torch.int32], (5,)),
    }
    new = {
        "a.weight": mutate(rng, old["a.weight"], BY_TORCH[torch.bfloat16], 0.05),
        "a.bias": mutate(rng, old["a.bias"], BY_TORCH[torch.bfloat16], 0.5),
        "b.weight": mutate(rng, old["b.weight"], BY_TORCH[torch.float8_e4m3fn], 0.02),
        "b.weight.scale": torch.tensor(0.5),
        "added": random_tensor(rng, BY_TORCH[torch.float32], (3, 3)),
    }
    return old, new


OLD, NEW = _versions()
PATCH = encode_patch(OLD, NEW, threads=1).patch


def record_boundaries(patch: bytes) -> list[int]:
    info = read_patch_info(patch)
    bounds, pos = [info["header_bytes"]], info["header_bytes"]
    for r in info["records"]:
        pos += r["bytes"]
        bounds.append(pos)
    return bounds


def test_truncation_at_every_record_boundary_and_inside():
    cuts = set(record_boundaries(PATCH)[:-1])
    cuts |= {b + 1 for b in cuts} | {b - 1 for b in cuts} | {0, 3, 10, 19, 20}
    for cut in sorted(c for c in cuts if 0 <= c < len(PATCH)):
        weights = clone(OLD)
        with pytest.raises(PatchFormatError, match=r"truncated|bad magic"):
            apply_patch(weights, PATCH[:cut])
        assert same_bits(weights, OLD), f"weights changed after truncation at {cut}"


def test_streaming_truncation_rolls_back_applied_records():
    weights = clone(OLD)
    applier = PatchApplier(weights)
    applier.feed(PATCH[: record_boundaries(PATCH)[3]])  # three records applied
    assert not same_bits(weights, OLD)
    with pytest.raises(PatchFormatError, match="truncated"):
        applier.finish()
    assert same_bits(weights, OLD)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(PATCH) - 1), st.integers(1, 255))
@example(pos=499, flip=208)  # a flip in a zstd frame header that declared a huge size (issue #13)
def test_any_byte_flip_is_refused_or_exact(pos, flip):
    check_flip(PATCH, OLD, NEW, pos, flip)


def test_trailing_garbage_refused():
    weights = clone(OLD)
    with pytest.raises(PatchFormatError, match="trailing"):
        apply_patch(weights, PATCH + b"\x00")
    assert same_bits(weights, OLD)


def test_unknown_format_version_refused():
    bad = bytearray(PATCH)
    struct.pack_into("<H", bad, 4, 99)
    with pytest.raises(PatchFormatError, match="unsupported patch format version 99"):
        apply_patch(clone(OLD), bytes(bad))


def test_not_a_patch():
    with pytest.raises(PatchFormatError, match="bad magic"):
        apply_patch(clone(OLD), b"PK\x03\x04" + bytes(40))


def test_foreign_base_refused_before_mutation():
    other, _ = _versions(seed=7)
    weights = clone(other)
    with pytest.raises(PatchApplyError, match="base state digest differs"):
        apply_patch(weights, PATCH)
    assert same_bits(weights, other)


def test_foreign_base_without_base_check_rolls_back_on_digest():
    """Even with the up-front check off, per-record digests catch a wrong base."""
    weights = clone(OLD)
    weights["a.weight"].reshape(-1).view(torch.int16)[5] += 3
    before = clone(weights)
    with pytest.raises(PatchApplyError):
        apply_patch(weights, PATCH, check_base=False)
    assert same_bits(weights, before)


def test_wrong_shape_in_base_refused():
    weights = clone(OLD)
    weights["a.bias"] = torch.zeros(47, dtype=torch.bfloat16)
    before = clone(weights)
    with pytest.raises(PatchApplyError):
        apply_patch(weights, PATCH, check_base=False)
    assert same_bits(weights, before)


def test_failed_applier_refuses_more_input():
    weights = clone(OLD)
    applier = PatchApplier(weights)
    with pytest.raises(PatchFormatError):
        applier.feed(b"XXXX" + bytes(30))
    with pytest.raises(PatchApplyError, match="already failed"):
        applier.feed(PATCH)
    assert same_bits(weights, OLD)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    weights = clone(OLD)
    with pytest.raises(PatchswarmError):
        apply_patch(weights, data)
    assert same_bits(weights, OLD)
