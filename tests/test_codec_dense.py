"""Dense paths: op choice, blocked byte planes, and zstd frames with raw planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.codec import (
    apply_patch,
    encode_patch,
    read_patch_info,
    records,
    stage_patch,
    tensor_digest,
)
from swarm.codec import encode as enc
from swarm.codec.apply import PatchApplier
from swarm.codec.dtypes import BY_TORCH, DTYPES, bits_view
from swarm.codec.zstd_bounded import decompress_bounded
from swarm.errors import PatchFormatError
from tests.codec_cases import check_flip, clone, mutate, random_tensor, same_bits

B = records.BLOCK
sizes = st.sampled_from([0, 1, 5, 300, B - 1, B, B + 3, 3 * B + 7])


def _reference_planes(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits.view(np.uint8).reshape(-1, bits.itemsize).T)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), sizes, st.integers(0, 2**32 - 1))
def test_planes_shuffle_xor_unshuffle(dt, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt.np_view)
    b = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt.np_view)
    assert np.array_equal(records.shuffle_planes(a, dt.itemsize), _reference_planes(a))
    planes = records.shuffle_planes(a, dt.itemsize, xor_with=b)
    assert np.array_equal(planes, _reference_planes(a ^ b))
    back = records.unshuffle_bytes(planes.tobytes(), n, dt)
    assert back.flags.writeable and np.array_equal(back, a ^ b)
    work = a.copy()
    h = xxhash.xxh3_64()
    changed = records.xor_planes_into(work, planes, h)
    assert np.array_equal(work, b)
    assert changed == int(np.count_nonzero(a != b))
    assert h.digest() == xxhash.xxh3_64(b.tobytes()).digest()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 300, 5000, 200_000]),
       st.integers(0, 8), st.integers(0, 2**32 - 1))
def test_frames_with_raw_planes_are_standard_zstd(itemsize, n, random_planes, seed):
    """Low planes random (stored raw), high planes compressible: any zstd reader,
    one-shot or streaming, gets the planes back, and the frame declares their size."""
    rng = np.random.default_rng(seed)
    planes = np.zeros((itemsize, n), dtype=np.uint8)
    k = min(random_planes, itemsize)
    planes[:k] = rng.integers(0, 256, (k, n), dtype=np.uint8)
    planes[k:] = rng.integers(0, 3, (itemsize - k, n), dtype=np.uint8)
    frame = records.compress_planes(planes)
    raw = planes.tobytes()
    assert zstandard.get_frame_parameters(frame).content_size == len(raw)
    assert zstandard.ZstdDecompressor().decompress(frame) == raw
    assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == raw
    assert decompress_bounded(frame, len(raw), "t", PatchFormatError) == raw
    if n >= 5000 and k:
        assert records.raw_planes(planes) == k
        assert len(frame) >= k * n  # the random planes really are stored, not compressed


@st.composite
def dense_pairs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dt = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(2000,), (300, 300), (B + 5,)]))
    old = random_tensor(rng, dt, shape)
    kind = draw(st.sampled_from(["mutate", "redraw", "low bits"]))
    if kind == "mutate":
        new = mutate(rng, old, dt, draw(st.sampled_from([0.2, 0.5, 0.9, 1.0])))
    elif kind == "redraw":
        new = random_tensor(rng, dt, shape)
    else:  # random low byte(s), high bytes kept: raw planes + a compressed rest
        bits = bits_view(old.clone(), dt).numpy().copy()
        bits.view(np.uint8).reshape(-1, dt.itemsize)[:, 0] ^= rng.integers(
            0, 256, bits.size, dtype=np.uint8)
        new = torch.from_numpy(bits).view(dt.torch_dtype).reshape(shape)
    return {"t": old, "u": old.clone()}, {"t": new, "u": old.clone()}


@settings(max_examples=60, deadline=None)
@given(dense_pairs(), st.integers(1, 50_000))
def test_dense_roundtrip_every_dtype(pair, piece):
    old, new = pair
    patch = encode_patch(old, new).patch
    w = clone(old)
    apply_patch(w, patch)
    assert same_bits(w, new)
    w = clone(old)
    stage_patch(w, patch).finish()
    assert same_bits(w, new)
    w = clone(old)
    applier = PatchApplier(w)
    for i in range(0, len(patch), piece):
        applier.feed(patch[i:i + piece])
    applier.finish()
    assert same_bits(w, new)


@settings(max_examples=30, deadline=None)
@given(dense_pairs())
def test_known_old_digests_give_the_same_patch(pair):
    """``old_digests`` (a trainer's cache from the previous encode) only skips hashing."""
    old, new = pair
    first = encode_patch({}, old)
    assert first.digests == {n: tensor_digest(t) for n, t in old.items()}
    plain = encode_patch(old, new)
    cached = encode_patch(old, new, old_digests=first.digests)
    assert cached.patch == plain.patch and cached.digests == plain.digests
    assert plain.digests == {n: tensor_digest(t) for n, t in new.items()}


def _large(kind: str) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(enc.DENSE_SAMPLE_MIN + 1000, generator=g) * 0.02
    step = {"dense": 2.0 ** -5, "30%": 2.0 ** -9}[kind]
    new = w + torch.randn(w.shape, generator=g) * w.abs() * step
    return {"w": w.to(torch.bfloat16)}, {"w": new.to(torch.bfloat16)}


@pytest.mark.parametrize(("kind", "op"), [("dense", "DENSE"), ("30%", "SPARSE")])
def test_large_tensors_choose_from_estimates(kind, op):
    old, new = _large(kind)
    result = encode_patch(old, new)
    assert [t.op for t in result.tensors] == [op]
    w = clone(old)
    apply_patch(w, result.patch)
    assert same_bits(w, new)


@pytest.mark.parametrize("kind", ["dense", "30%"])
def test_sparse_size_estimate_is_close(kind):
    old, new = _large(kind)
    dt = BY_TORCH[torch.bfloat16]
    a, b = bits_view(old["w"], dt).numpy(), bits_view(new["w"], dt).numpy()
    idx = np.flatnonzero(a != b)
    real = len(records.encode_sparse(idx, a[idx], b[idx], dt)[0])
    est = records.estimate_sparse_bytes(a.size, idx.size, a[idx][::7], b[idx][::7], dt)
    assert abs(est / real - 1) < 0.03


def _dense_versions():
    rng = np.random.default_rng(5)
    f32, bf16 = BY_TORCH[torch.float32], BY_TORCH[torch.bfloat16]
    old = {"r": random_tensor(rng, f32, (40, 50)), "m": random_tensor(rng, bf16, (3000,)),
           "d": random_tensor(rng, bf16, (50, 40))}
    low = bits_view(old["m"].clone(), bf16).numpy().copy()
    low.view(np.uint8).reshape(-1, 2)[:, 0] ^= rng.integers(0, 256, low.size, dtype=np.uint8)
    new = {"r": random_tensor(rng, f32, (40, 50)),
           "m": torch.from_numpy(low).view(torch.bfloat16),
           "d": mutate(rng, old["d"], bf16, 0.9)}
    return old, new


DOLD, DNEW = _dense_versions()
DPATCH = encode_patch(DOLD, DNEW, threads=1).patch


def test_dense_fixture_has_raw_plane_frames():
    ops = {r["name"]: r["op"] for r in read_patch_info(DPATCH)["records"]}
    assert ops["r"] == ops["m"] == "DENSE"
    assert len(DPATCH) > 4 * 2000 + 3000  # "r" stored raw, "m" low plane raw


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(DPATCH) - 1), st.integers(1, 255))
def test_dense_byte_flip_is_refused_or_exact(pos, flip):
    check_flip(DPATCH, DOLD, DNEW, pos, flip)


def test_dense_truncation_refused_and_rolled_back():
    for cut in range(0, len(DPATCH), 97):
        w = clone(DOLD)
        with pytest.raises(PatchFormatError):
            apply_patch(w, DPATCH[:cut])
        assert same_bits(w, DOLD)


@pytest.mark.parametrize("rest", [0.0, 0.05, 0.3, 1.0])
def test_scan_switches_to_planes_after_a_dense_start(rest):
    """The first eighth fully changed, the rest at ``rest``: whichever op wins, the
    scan's count, digests and (when it switched) planes are exact, and the patch
    round-trips."""
    rng = np.random.default_rng(3)
    dt = BY_TORCH[torch.bfloat16]
    n = 8 * B + 123
    old = random_tensor(rng, dt, (n,))
    bits = bits_view(old.clone(), dt).numpy().copy()
    change = rng.random(n) < rest
    change[: n // 8 + B] = True
    bits[change] ^= 1
    new = torch.from_numpy(bits).view(torch.bfloat16)
    a, b = bits_view(old, dt).numpy(), bits_view(new, dt).numpy()
    mask, k, planes, od, nd = enc._scan(a, b)
    assert k == int(np.count_nonzero(a != b))
    assert od == xxhash.xxh3_64(a.tobytes()).digest() and nd == xxhash.xxh3_64(b.tobytes()).digest()
    assert planes is not None and mask is None
    assert np.array_equal(planes, _reference_planes(a ^ b))
    w = {"t": old.clone()}
    apply_patch(w, encode_patch({"t": old}, {"t": new}).patch)
    assert same_bits(w, {"t": new})


def test_reused_plane_buffers_keep_every_record_exact(monkeypatch):
    """One encode_patch reuses its byte-plane buffer from tensor to tensor unless
    a record keeps views of it (raw blocks joined straight into the patch): a mix
    of raw-heavy (redrawn, new, random low byte) and compressible (dense update)
    tensors large enough for the scan's planes, in an order that alternates them,
    on one thread and two, gives the same patch as fresh buffers everywhere, and
    it applies exactly."""
    rng = np.random.default_rng(11)
    bf16, f32 = BY_TORCH[torch.bfloat16], BY_TORCH[torch.float32]
    n = 3 * enc.SCAN_BLOCK_BYTES // 2 + 77  # > one scan block: the scan writes planes
    old, new = {}, {}
    for i in range(3):
        o = random_tensor(rng, bf16, (n,))
        old[f"{i}a-redrawn"], new[f"{i}a-redrawn"] = o, random_tensor(rng, bf16, (n,))
        w = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 0.02)
        step = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) * 2.0 ** -5
        old[f"{i}b-dense"] = w.to(torch.bfloat16)
        new[f"{i}b-dense"] = (w * (1 + step)).to(torch.bfloat16)
        low = bits_view(o.clone(), bf16).numpy().copy()
        low.view(np.uint8).reshape(-1, 2)[:, 0] ^= rng.integers(0, 256, n, dtype=np.uint8)
        old[f"{i}c-low"], new[f"{i}c-low"] = o.clone(), torch.from_numpy(low).view(torch.bfloat16)
        new[f"{i}d-new"] = random_tensor(rng, f32, (n // 2,))
        old[f"{i}e-redrawn32"] = random_tensor(rng, f32, (n // 2,))
        new[f"{i}e-redrawn32"] = random_tensor(rng, f32, (n // 2,))  # every plane raw
    one = encode_patch(old, new, threads=1)
    two = encode_patch(old, new, threads=2)
    ops = {t.name: t.op for t in one.tensors}
    assert {ops[f"0{s}"] for s in ("a-redrawn", "b-dense", "c-low", "e-redrawn32")} == {"DENSE"}
    assert ops["0d-new"] == "FULL"
    monkeypatch.setattr(enc.Scratch, "planes", lambda self, w, m: np.empty((w, m), np.uint8))
    fresh = encode_patch(old, new, threads=1)
    assert one.patch == two.patch == fresh.patch
    w = clone(old)
    apply_patch(w, one.patch)
    assert same_bits(w, new)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 300, 200_000]), st.integers(0, 4),
       st.integers(0, 2**32 - 1))
def test_frame_parts_join_to_the_frame(itemsize, n, random_planes, seed):
    rng = np.random.default_rng(seed)
    planes = rng.integers(0, 3, (itemsize, n), dtype=np.uint8)
    k = min(random_planes, itemsize)
    planes[:k] = rng.integers(0, 256, (k, n), dtype=np.uint8)
    parts, views = records.compress_planes_parts(planes)
    assert views == (k > 0 and 2 * records.raw_planes(planes) >= itemsize)
    frame = b"".join(parts)
    assert frame == records.compress_planes(planes)
    assert zstandard.ZstdDecompressor().decompress(frame) == planes.tobytes()
