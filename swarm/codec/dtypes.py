"""Served dtypes, their wire codes, and the bit-pattern ordinal used for ULP deltas.

The codec never does float arithmetic on weights: it compares and patches
*bit patterns* through an integer view of each tensor. For float dtypes the
bit pattern is mapped to an ordinal that is monotone in the float's value
(``-0.0`` just below ``+0.0``, NaNs at the ends), so a one-ULP step is an
ordinal delta of ±1. The map is a bijection on bit patterns: every pattern,
NaN payloads and subnormals included, round-trips exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swarm.errors import PatchFormatError


@dataclass(frozen=True)
class DType:
    code: int
    name: str
    torch_dtype: torch.dtype
    view: torch.dtype  # same-width integer dtype for the bit view
    width: int  # bits
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.width // 8

    @property
    def np_view(self) -> np.dtype:
        return _NP_VIEW[self.view]


_NP_VIEW = {
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}

DTYPES: tuple[DType, ...] = (
    DType(1, "float32", torch.float32, torch.int32, 32, True),
    DType(2, "float16", torch.float16, torch.int16, 16, True),
    DType(3, "bfloat16", torch.bfloat16, torch.int16, 16, True),
    DType(4, "float8_e4m3fn", torch.float8_e4m3fn, torch.int8, 8, True),
    DType(5, "float8_e5m2", torch.float8_e5m2, torch.int8, 8, True),
    DType(6, "float64", torch.float64, torch.int64, 64, True),
    DType(10, "int8", torch.int8, torch.int8, 8, False),
    DType(11, "uint8", torch.uint8, torch.uint8, 8, False),
    DType(12, "int16", torch.int16, torch.int16, 16, False),
    DType(13, "int32", torch.int32, torch.int32, 32, False),
    DType(14, "int64", torch.int64, torch.int64, 64, False),
    DType(15, "bool", torch.bool, torch.uint8, 8, False),
)
BY_CODE = {d.code: d for d in DTYPES}
BY_TORCH = {d.torch_dtype: d for d in DTYPES}


def dtype_of(t: torch.Tensor, name: str = "") -> DType:
    try:
        return BY_TORCH[t.dtype]
    except KeyError:
        raise PatchFormatError(f"tensor {name!r}: dtype {t.dtype} is not supported") from None


def dtype_by_code(code: int) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise PatchFormatError(f"unknown dtype code {code}") from None


def bits_view(t: torch.Tensor, dt: DType) -> torch.Tensor:
    """Flat integer view of a contiguous tensor's bit patterns (no copy)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=dt.view, device=t.device)
    return t.reshape(-1).view(dt.view)


def to_ordinal(bits: np.ndarray, dt: DType) -> np.ndarray:
    """Bit patterns (the integer view) -> int64 ordinals, monotone in value for floats."""
    x = bits.astype(np.int64)
    if dt.is_float:
        mag_mask = np.int64((1 << (dt.width - 1)) - 1)
        x ^= np.where(x < 0, mag_mask, np.int64(0))
    return x


def from_ordinal(ords: np.ndarray, dt: DType, what: str) -> np.ndarray:
    """Inverse of ``to_ordinal``; raises PatchFormatError on out-of-range ordinals."""
    info = np.iinfo(dt.np_view)
    if ords.size and (int(ords.min()) < int(info.min) or int(ords.max()) > int(info.max)):
        raise PatchFormatError(f"{what}: value delta leaves the {dt.name} range")
    x = ords.copy()
    if dt.is_float:
        mag_mask = np.int64((1 << (dt.width - 1)) - 1)
        x ^= np.where(x < 0, mag_mask, np.int64(0))
    return x.astype(dt.np_view)
