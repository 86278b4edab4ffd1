"""The dense encoder's fast paths (issue #11): the scan's first-block switch and
in-scan samples, ``plan_op`` from the scan's planes and sample, zstd through the
CFFI backend into numpy memory. Each is only a faster
way to the same bytes: checked against the slow way, and every patch round-trips
bitwise (decode(encode(x)) == x) through the unchanged applier."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import apply_patch, encode_patch, records
from swarm.codec import encode as enc
from swarm.codec.dtypes import DTYPES, bits_view
from tests.codec_cases import clone, same_bits

STEP = {w: enc.SCAN_BLOCK_BYTES // w for w in (1, 2, 4, 8)}  # elements per scan block
SIZES = [0, 1, 2, 3, 7, 301, records.BLOCK + 1]
LARGE = {1: [STEP[1] + 5, 9 * STEP[1] + 3], 2: [STEP[2] - 1, 3 * STEP[2] + 7],
         4: [STEP[4] + 1], 8: [STEP[8] + 3]}
# how each byte plane of ``new`` differs from ``old``
PLANE_KINDS = ["equal", "random", "mixed", "sparse", "dense-low"]


def _pair(rng: np.random.Generator, dt, n: int, kinds: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``old`` random, ``new`` = old ^ XOR where plane j of the XOR is all-zero
    (equal), uniform random, random in half of the elements (mixed), rare
    (sparse), or a few low values in most elements (dense-low: what a
    multiplicative update does to a low mantissa byte)."""
    w = dt.itemsize
    old = rng.integers(0, 256, n * w, dtype=np.uint8)
    xor = np.zeros((n, w), dtype=np.uint8)
    for j in range(w):
        kind = kinds[j % len(kinds)]
        if kind == "random":
            xor[:, j] = rng.integers(0, 256, n, dtype=np.uint8)
        elif kind == "mixed":
            xor[:, j] = rng.integers(0, 256, n, dtype=np.uint8) * (rng.random(n) < 0.5)
        elif kind == "sparse":
            xor[:, j] = rng.integers(1, 256, n, dtype=np.uint8) * (rng.random(n) < 0.01)
        elif kind == "dense-low":
            xor[:, j] = rng.integers(0, 8, n, dtype=np.uint8)
    new = old ^ xor.reshape(-1)
    if dt.name == "bool":  # only 0/1 are bool bit patterns
        old, new = old & 1, new & 1
    return _as_tensor(old, dt), _as_tensor(new, dt)


def _as_tensor(raw: np.ndarray, dt) -> torch.Tensor:
    if raw.size == 0:
        return torch.empty(0, dtype=dt.torch_dtype)
    return torch.from_numpy(raw.copy()).view(dt.view).view(dt.torch_dtype)


def _round_trip(old: dict, new: dict, threads: int = 1) -> bytes:
    patch = encode_patch(old, new, threads=threads).patch
    w = clone(old)
    apply_patch(w, patch)
    assert same_bits(w, new)
    return patch


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(DTYPES), st.sampled_from(SIZES),
       st.lists(st.sampled_from(PLANE_KINDS), min_size=1, max_size=8), st.integers(0, 2**32 - 1))
def test_round_trip_every_dtype_and_plane_kind(dt, n, kinds, seed):
    rng = np.random.default_rng(seed)
    old, new = _pair(rng, dt, n, kinds)
    _round_trip({"t": old}, {"t": new})
    _round_trip({}, {"t": new})  # FULL


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([d for d in DTYPES if d.itemsize in LARGE]), st.data(),
       st.lists(st.sampled_from(PLANE_KINDS), min_size=1, max_size=8), st.integers(0, 2**32 - 1))
def test_round_trip_past_the_scan_block(dt, data, kinds, seed):
    """Tensors longer than one scan block (the dense switch, the in-scan samples)."""
    n = data.draw(st.sampled_from(LARGE[dt.itemsize]))
    rng = np.random.default_rng(seed)
    old, new = _pair(rng, dt, n, kinds)
    _round_trip({"t": old, "u": old[: n // 3].clone()}, {"t": new, "u": new[: n // 3].clone()},
                threads=2)


@pytest.mark.parametrize("head,rest", [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (0.0, 0.3),
                                       (0.3, 0.0), (1.0, 0.05)])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_scan_is_exact_whichever_probe_switches(head, rest, width):
    """First block changed at ``head``, the rest at ``rest``: the count, digests,
    planes or mask, and the SPARSE sample are exact whether the scan switched
    after the first block, after the eighth, or never."""
    import xxhash

    rng = np.random.default_rng(int(10 * head + rest * 100 + width))
    step = STEP[width]
    n = 10 * step + 17
    a = rng.integers(0, 256, n * width, dtype=np.uint8).view(f"u{width}")
    change = rng.random(n) < rest
    change[:step] = rng.random(step) < head
    b = a ^ (change * rng.integers(1, 1 << (8 * width - 1), n, dtype=np.uint64)).astype(a.dtype)
    a, b = a.view(f"i{width}"), b.view(f"i{width}")
    samples: list[np.ndarray] = []
    mask, k, planes, od, nd = enc._scan(a, b, samples=samples)
    assert k == int(np.count_nonzero(a != b))
    assert od == xxhash.xxh3_64(a.tobytes()).digest() and nd == xxhash.xxh3_64(b.tobytes()).digest()
    if planes is None:
        assert np.array_equal(mask, a != b)
    else:
        assert mask is None
        x = (a ^ b).view(np.uint8).reshape(-1, width).T
        assert np.array_equal(planes, x)
    assert head < enc.DENSE_SCAN_FRACTION or planes is not None  # a dense start switches
    stride = max(1, n // enc.SPARSE_SAMPLE)
    assert np.array_equal(samples[0], a[::stride]) and np.array_equal(samples[1], b[::stride])


@pytest.mark.parametrize("n", [0, 1, 5, enc.SPARSE_SAMPLE + 1, enc.DENSE_SAMPLE_MIN + 3])
@pytest.mark.parametrize("fraction", [0.2, 0.6, 0.95])
def test_plan_op_same_from_scan_planes_and_sample(n, fraction):
    """``plan_op`` given the scan's planes and sample decides, and pays, exactly
    as from the inputs alone."""
    rng = np.random.default_rng(n + int(100 * fraction))
    dt = next(d for d in DTYPES if d.name == "bfloat16")
    a = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.int16)
    change = rng.random(n) < fraction
    step = rng.integers(1, 4, n).astype(np.int16) * np.where(rng.random(n) < 0.5, -1, 1).astype(np.int16)
    b = np.where(change, a + step, a).astype(np.int16)
    k = int(np.count_nonzero(a != b))
    samples: list[np.ndarray] = []
    _, k2, planes, _, _ = enc._scan(a, b, samples=samples)
    assert k2 == k
    if planes is None:
        planes = records.shuffle_planes(a, 2, xor_with=b)
    plain = enc.plan_op(a, b, k, dt)
    fast = enc.plan_op(a, b, k, dt, planes, (samples[0], samples[1]))
    assert plain == fast


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([0, 1, 1000, records.DIRECT_MIN_BYTES - 1, records.DIRECT_MIN_BYTES,
                        3 * records.DIRECT_MIN_BYTES + 5]),
       st.sampled_from(["zero", "random", "low", "mixed"]), st.booleans(), st.integers(0, 2**32 - 1))
def test_direct_zstd_frames_equal_the_c_backend(n, kind, narrow, seed):
    """The CFFI path writes byte for byte the frame the C backend writes."""
    rng = np.random.default_rng(seed)
    data = {"zero": np.zeros(n, np.uint8), "random": rng.integers(0, 256, n, dtype=np.uint8),
            "low": rng.integers(0, 6, n, dtype=np.uint8),
            "mixed": rng.integers(0, 256, n, dtype=np.uint8) * (rng.random(n) < 0.1)}[kind]
    got = records.zstd_compress(data, records.ZSTD_DENSE_LEVEL, narrow)
    want = records._compressor(records.ZSTD_DENSE_LEVEL, narrow).compress(data)
    assert bytes(got) == want


def test_direct_zstd_is_used_and_falls_back(monkeypatch):
    data = np.random.default_rng(0).integers(0, 9, records.DIRECT_MIN_BYTES, dtype=np.uint8)
    if records._lib is not None:  # the wheel ships the CFFI backend (CI's does)
        assert isinstance(records.zstd_compress(data, 1, True), memoryview)
    monkeypatch.setattr(records, "_lib", None)
    assert isinstance(records.zstd_compress(data, 1, True), bytes)
    old = torch.from_numpy(data.copy()).view(torch.int8)
    new = torch.from_numpy(data[::-1].copy()).view(torch.int8)
    _round_trip({"t": old}, {"t": new})


def test_dense_patch_same_with_and_without_fast_paths(monkeypatch):
    """A realistic dense update (BF16 and FP8, several tensors over the direct and
    huge-page thresholds of numpy's arrays): the same patch bytes with every fast path switched off."""
    rng = np.random.default_rng(5)
    n = 3 * enc.SCAN_BLOCK_BYTES + 11
    old, new = {}, {}
    for i, dt in enumerate((torch.bfloat16, torch.float8_e4m3fn, torch.float32)):
        w = torch.from_numpy(rng.standard_normal(n * (4 if i == 1 else 1), dtype=np.float32))
        step = torch.from_numpy(rng.standard_normal(w.numel(), dtype=np.float32))
        old[f"{i}"] = (w * 0.02).to(dt)
        new[f"{i}"] = (w * 0.02 * (1 + step * 2.0 ** -5)).to(dt)
    fast = _round_trip(old, new)
    monkeypatch.setattr(records, "_lib", None)
    plain = enc.plan_op
    monkeypatch.setattr(enc, "plan_op", lambda o, n_, k, dt, planes=None, sample=None:
                        plain(o, n_, k, dt))
    assert encode_patch(old, new, threads=1).patch == fast
    assert bits_view(new["0"], next(d for d in DTYPES if d.name == "bfloat16")).numel() == n
