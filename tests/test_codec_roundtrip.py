"""Property tests: every patch reproduces the new version bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import apply_patch, encode_patch, read_patch_info, state_digest
from swarm.codec.dtypes import DTYPES
from tests.codec_cases import clone, mutate, random_tensor, same_bits

shapes = st.sampled_from([(), (0,), (1,), (7,), (3, 5), (64,), (17, 33), (2, 0, 3), (4, 4, 4)])
densities = st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0])


@st.composite
def version_pairs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old, new = {}, {}
    for i in range(draw(st.integers(1, 5))):
        dt = draw(st.sampled_from(DTYPES))
        shape = draw(shapes)
        t = random_tensor(rng, dt, shape)
        name = f"layer{i}.{dt.name}"
        fate = draw(st.sampled_from(["mutate", "mutate", "mutate", "add", "remove",
                                     "reshape", "retype", "same"]))
        if fate == "add":
            new[name] = t
            continue
        old[name] = t
        if fate == "remove":
            continue
        if fate == "same":
            new[name] = t.clone()
        elif fate == "reshape":
            new[name] = t.clone().reshape(-1) if t.dim() != 1 else t.clone().reshape(1, -1)
        elif fate == "retype":
            other = draw(st.sampled_from([d for d in DTYPES if d.code != dt.code]))
            new[name] = random_tensor(rng, other, shape)
        else:
            new[name] = mutate(rng, t, dt, draw(densities))
    return old, new


@settings(max_examples=150, deadline=None)
@given(version_pairs(), st.sampled_from(["auto", "on", "off"]))
def test_roundtrip_any_bits(pair, context):
    old, new = pair
    result = encode_patch(old, new, threads=1, context=context)
    weights = clone(old)
    report = apply_patch(weights, result.patch)
    assert same_bits(weights, new)
    assert report.target_digest == state_digest(new) == result.target_digest
    info = read_patch_info(result.patch)
    assert info["patch_bytes"] == len(result.patch)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(DTYPES), densities,
       st.sampled_from([1, 7, 8, 64, 1000]))
def test_streaming_apply_any_split(seed, dt, density, piece):
    rng = np.random.default_rng(seed)
    old = {"w": random_tensor(rng, dt, (40, 25)), "b": random_tensor(rng, dt, (25,))}
    new = {k: mutate(rng, v, dt, density) for k, v in old.items()}
    patch = encode_patch(old, new, threads=1).patch
    from swarm.codec import PatchApplier

    weights = clone(old)
    applier = PatchApplier(weights)
    for start in range(0, len(patch), piece):
        applier.feed(patch[start:start + piece])
    applier.finish()
    assert same_bits(weights, new)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(DTYPES), densities,
       st.lists(st.integers(1, 3000), min_size=1, max_size=12), st.booleans())
def test_streaming_apply_uneven_cuts_staged_or_not(seed, dt, density, pieces, stage):
    """Any cut of the stream (a length prefix split, a record filled in place over
    many feeds, several records in one feed) applies the same, staged or at once."""
    rng = np.random.default_rng(seed)
    old = {"w": random_tensor(rng, dt, (40, 25)), "b": random_tensor(rng, dt, (25,)),
           "e": random_tensor(rng, dt, (3,))}
    new = {k: mutate(rng, v, dt, density) for k, v in old.items()}
    patch = encode_patch(old, new, threads=1).patch
    from swarm.codec import PatchApplier

    weights = clone(old)
    applier = PatchApplier(weights, stage=stage)
    start, k = 0, 0
    while start < len(patch):
        n = pieces[k % len(pieces)]
        applier.feed(memoryview(patch)[start:start + n])
        start, k = start + n, k + 1
    applier.finish()
    assert same_bits(weights, new)


def test_a_patch_cut_inside_a_record_is_reported_truncated():
    rng = np.random.default_rng(3)
    old = {"w": random_tensor(rng, DTYPES[2], (64, 64))}
    new = {"w": mutate(rng, old["w"], DTYPES[2], 1.0)}
    patch = encode_patch(old, new, threads=1).patch
    from swarm.codec import PatchApplier
    from swarm.errors import PatchFormatError

    weights = clone(old)
    applier = PatchApplier(weights)
    applier.feed(patch[: len(patch) - 100])  # the record's body is being filled in place
    with pytest.raises(PatchFormatError, match="truncated"):
        applier.finish()
    assert same_bits(weights, old)  # nothing changed


def test_unchanged_tensors_have_no_record_and_empty_diff_is_tiny():
    rng = np.random.default_rng(0)
    w = {"a": random_tensor(rng, DTYPES[2], (100, 100))}
    result = encode_patch(w, clone(w), threads=1)
    assert read_patch_info(result.patch)["records"] == []
    weights = clone(w)
    apply_patch(weights, result.patch)
    assert same_bits(weights, w)


def test_sparse_ulp_changes_are_compact():
    """Mostly ±1 ULP changes at 1% cost well under 2 bytes per change."""
    rng = np.random.default_rng(1)
    old = {"w": torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0)).bfloat16()}
    new = {"w": old["w"].clone()}
    flat = new["w"].reshape(-1).view(torch.int16).numpy()
    idx = rng.choice(flat.size, 10_000, replace=False)
    flat[idx] += rng.choice([-1, 1], idx.size).astype(np.int16)
    result = encode_patch(old, new, threads=1)
    assert len(result.patch) < 10_000 * 1.6
    rec = read_patch_info(result.patch)["records"][0]
    assert rec["op"] == "SPARSE" and rec["changed"] == 10_000


def test_dense_change_uses_dense_record():
    rng = np.random.default_rng(2)
    old = {"w": random_tensor(rng, DTYPES[2], (256, 256))}
    new = {"w": old["w"].clone()}
    low = new["w"].reshape(-1).view(torch.int16).numpy()
    low ^= rng.integers(1, 256, size=low.size).astype(np.int16)  # every low byte changes
    result = encode_patch(old, new, threads=1)
    assert read_patch_info(result.patch)["records"][0]["op"] == "DENSE"
    weights = clone(old)
    apply_patch(weights, result.patch)
    assert same_bits(weights, new)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_give_identical_patches(threads):
    rng = np.random.default_rng(3)
    old = {f"t{i}": random_tensor(rng, DTYPES[i % len(DTYPES)], (50, 20)) for i in range(8)}
    new = {k: mutate(rng, v, DTYPES[i % len(DTYPES)], 0.05) for i, (k, v) in enumerate(old.items())}
    assert encode_patch(old, new, threads=threads).patch == encode_patch(old, new, threads=1).patch
