"""Builders of weight dicts with every bit pattern the codec must carry."""

from __future__ import annotations

import numpy as np
import torch

from swarm.codec.dtypes import DTYPES, DType

SPECIAL_BITS = {
    # dtype name -> bit patterns as unsigned ints: ±0, ±inf, NaN payloads, subnormals, max
    "float32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF,
                0x00000001, 0x807FFFFF, 0x7F7FFFFF],
    "bfloat16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0001, 0x807F, 0x7F7F],
    "float16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFFFF, 0x0001, 0x83FF, 0x7BFF],
    "float8_e4m3fn": [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81, 0x7E],
    "float8_e5m2": [0x00, 0x80, 0x7C, 0xFC, 0x7F, 0xFF, 0x01, 0x7B],
}


def random_tensor(rng: np.random.Generator, dt: DType, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dt.torch_dtype)
    if dt.name == "bool":
        raw = rng.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    t = torch.from_numpy(raw.copy()).view(dt.view).view(dt.torch_dtype)
    return t.reshape(shape)


def mutate(rng: np.random.Generator, t: torch.Tensor, dt: DType, density: float) -> torch.Tensor:
    """A copy with about ``density`` of elements changed: ±1 ULP mostly, some random
    bit patterns, some special values."""
    out = t.clone().contiguous()
    if dt.name == "bool":
        flat = out.reshape(-1).view(torch.uint8).numpy()
        mask = rng.random(flat.size) < density
        flat[mask] ^= 1
        return out
    flat = out.reshape(-1).view(dt.view).numpy()
    mask = rng.random(flat.size) < density
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return out
    kind = rng.random(idx.size)
    info = np.iinfo(flat.dtype)
    step = np.where(rng.random(idx.size) < 0.5, -1, 1)
    ulp = idx[kind < 0.8]
    cur = flat[ulp].astype(np.int64) + step[kind < 0.8]
    flat[ulp] = np.clip(cur, info.min, info.max).astype(flat.dtype)
    rnd = idx[(kind >= 0.8) & (kind < 0.95)]
    flat[rnd] = rng.integers(info.min, info.max, size=rnd.size, endpoint=True).astype(flat.dtype)
    specials = SPECIAL_BITS.get(dt.name)
    sp = idx[kind >= 0.95]
    if specials and sp.size:
        vals = np.array(specials, dtype=np.uint64)[rng.integers(0, len(specials), sp.size)]
        flat[sp] = vals.astype(np.dtype(f"u{dt.itemsize}")).view(flat.dtype)
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            return False
        if x.numel() == 0:
            continue
        if not torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                           y.contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True


def clone(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.items()}


ALL_DTYPES = DTYPES


def check_flip(patch: bytes, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
               pos: int, flip: int) -> None:
    """Apply ``patch`` with byte ``pos`` XORed by ``flip``: it must be refused with the
    weights exactly at ``old``, or (a flip that changes nothing that matters) give ``new``."""
    from swarm.codec import apply_patch
    from swarm.errors import PatchswarmError

    bad = bytearray(patch)
    bad[pos] ^= flip
    weights = clone(old)
    try:
        apply_patch(weights, bytes(bad))
    except PatchswarmError:
        assert same_bits(weights, old)
    else:
        assert same_bits(weights, new)
