"""The fused loops of the dense record path (swarm/codec/_dense.c) against numpy's.

Every case runs both ways: the built extension (``records.fused``) and numpy's loops
(``records.fused = None``, as on a host the install could not compile it on). They must
agree bit for bit, and bad sizes must be refused before any byte is touched.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import apply_patch, encode_patch, records
from swarm.codec.dtypes import BY_TORCH, bits_view
from tests.codec_cases import same_bits

B = records.BLOCK
FUSED = records.fused  # as imported: the tests below set records.fused to None and back
needs_fused = pytest.mark.skipif(FUSED is None, reason="the fused loops are not built")


def _planes_of(bits: np.ndarray) -> np.ndarray:
    """Reference shuffle, written out: plane j holds byte j from the least significant."""
    u = bits.view(np.dtype(f"u{bits.itemsize}"))
    return np.stack([((u >> (8 * j)) & 0xFF).astype(np.uint8) for j in range(bits.itemsize)])


def test_the_install_builds_the_fused_loops_where_it_can():
    """The project's install compiles swarm/codec/_dense.c wherever a C compiler and
    Python's headers are (as on CI): a silent fallback there would hide a broken build."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if shutil.which(cc) is None or not headers:
        pytest.skip("no C compiler or no Python headers here: numpy's loops run")
    assert records.fused is not None, "pip install -e . did not build swarm.codec._dense"


@needs_fused
@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 1, 7, 300, B - 1, B + 5]),
       st.integers(0, 2**32 - 1), st.data())
def test_unshuffle_and_xor_into_match_numpy(itemsize, n, seed, data):
    rng = np.random.default_rng(seed)
    dt = np.dtype(f"u{itemsize}")
    x = rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(dt)
    x[rng.random(n) < 0.3] = 0  # unchanged elements, to count
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(dt)
    planes = _planes_of(x)
    s = data.draw(st.integers(0, n))
    e = data.draw(st.integers(s, n))
    out = np.full(e - s, 0xA5, dtype=dt)
    new = np.empty(e - s, dtype=dt)
    got = FUSED.unshuffle(planes, itemsize, n, s, e, out, base[s:e], new)
    assert np.array_equal(out, x[s:e])
    assert np.array_equal(new, base[s:e] ^ x[s:e])
    assert got == int(np.count_nonzero(x[s:e]))
    out2 = np.empty(e - s, dtype=dt)
    assert FUSED.unshuffle(planes, itemsize, n, s, e, out2) == got
    assert np.array_equal(out2, x[s:e])
    target = base[s:e].copy()
    assert FUSED.xor_into(planes, itemsize, n, s, e, target) == got
    assert np.array_equal(target, base[s:e] ^ x[s:e])


@needs_fused
def test_bad_sizes_are_refused_before_anything_is_written():
    planes = np.arange(2 * 10, dtype=np.uint8).reshape(2, 10)
    out = np.full(10, 7, dtype=np.uint16)
    f = FUSED
    cases = [
        lambda: f.unshuffle(planes, 3, 10, 0, 10, out),  # no such width
        lambda: f.unshuffle(planes, 2, 11, 0, 10, out),  # planes are not 2 x 11
        lambda: f.unshuffle(planes, 2, 10, 5, 4, out),  # start after stop
        lambda: f.unshuffle(planes, 2, 10, 0, 11, out),  # past the end
        lambda: f.unshuffle(planes, 2, 10, -1, 9, out),
        lambda: f.unshuffle(planes, 2, 10, 0, 9, out),  # out holds 10, not 9
        lambda: f.unshuffle(planes, 2, 10, 0, 10, out, out.copy(), None),  # base without new
        lambda: f.unshuffle(planes, 2, 10, 0, 10, out, out[:5].copy(), out.copy()),
        lambda: f.xor_into(planes, 2, 10, 0, 10, out[:9]),
    ]
    for case in cases:
        with pytest.raises(ValueError):
            case()
        assert (out == 7).all()
    with pytest.raises(TypeError):  # a read-only target
        f.xor_into(planes, 2, 10, 0, 10, bytes(20))
    with pytest.raises((TypeError, BufferError)):  # a strided target has no plain buffer
        f.xor_into(planes, 2, 10, 0, 5, np.zeros(10, dtype=np.uint16)[::2])


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 300, B + 3, 2 * B + 1]),
       st.integers(0, 2**32 - 1))
def test_records_helpers_agree_with_and_without_the_fused_loops(itemsize, n, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(f"u{itemsize}")
    x = rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(dt)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(dt)
    planes = _planes_of(x)
    results = []
    for built in (FUSED, None):
        records.fused = built
        out = np.empty(n, dtype=dt)
        new = np.empty(n, dtype=dt)
        counted = records.unshuffle_count(planes, 0, n, out, base, new)
        flat = base.copy()
        h = xxhash.xxh3_64()
        changed = records.xor_planes_into(flat, planes, h)
        torch_dt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
        back = records.unshuffle_bytes(planes.tobytes(), n, BY_TORCH[torch_dt])
        results.append((out.tobytes(), new.tobytes(), counted, flat.tobytes(), changed,
                        h.digest(), back.tobytes()))
    records.fused = FUSED
    assert results[0] == results[1]
    assert results[0][0] == x.tobytes() and results[0][2] == int(np.count_nonzero(x))


@pytest.fixture(autouse=True)
def _fused_restored():
    yield
    records.fused = FUSED


def test_strided_arrays_go_to_numpy(monkeypatch):
    """A view that is not C-contiguous (a strided tensor's bits) is not handed to C."""
    planes = np.zeros((2, 8), dtype=np.uint8)
    strided = np.zeros(16, dtype=np.uint16)[::2]
    assert not records.fusable(planes, strided)
    assert records.unshuffle_count(planes, 0, 8, np.empty(8, np.uint16), strided,
                                   np.empty(8, np.uint16)) == 0


def test_a_dense_patch_applies_the_same_with_and_without_the_fused_loops(monkeypatch):
    """A real dense patch (BF16, FP8, FP32, every value changed or most) staged and applied
    both ways: the same tensors, bit for bit, and the trainer's digest checks pass."""
    g = torch.Generator().manual_seed(5)
    old = {"w.bf16": torch.randn(300, 257, generator=g).to(torch.bfloat16),
           "w.f32": torch.randn(3 * B + 11, generator=g),
           "w.fp8": torch.randn(1000, 7, generator=g).to(torch.float8_e4m3fn)}
    new = {k: (v.float() + torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in old.items()}
    patch = encode_patch(old, new).patch
    applied = []
    for built in (FUSED, None):
        monkeypatch.setattr(records, "fused", built)
        w = {k: v.clone() for k, v in old.items()}
        apply_patch(w, patch)
        applied.append(w)
    assert same_bits(applied[0], new) and same_bits(applied[1], new)
    for k in new:
        dt = BY_TORCH[new[k].dtype]
        assert bits_view(applied[0][k], dt).numpy().tobytes() == \
            bits_view(applied[1][k], dt).numpy().tobytes()
