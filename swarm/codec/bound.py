"""The empirical i.i.d. entropy bound a patch is measured against (DESIGN.md §3).

For the tensors present in both versions with the same dtype and shape, let N
be their element count, k the number that changed, p = k/N, and Δ the ordinal
(ULP) delta of each change. The bound is ``N·H(p) + k·H(Δ)`` bits: positions as
i.i.d. Bernoulli(p) over all N elements, plus the empirical entropy of the
global distribution of Δ values. Tensors that are added, reshaped or re-typed
count at their raw size; removed tensors at zero. It ignores headers, so a
real patch (headers and per-tensor metadata included) is compared against it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from swarm.codec.dtypes import bits_view, dtype_of, to_ordinal


@dataclass(frozen=True)
class Bound:
    elements: int
    changed: int
    position_bits: float
    value_bits: float
    raw_bytes: int  # tensors carried whole (added, reshaped, re-typed)

    @property
    def bytes(self) -> float:
        return (self.position_bits + self.value_bits) / 8 + self.raw_bytes

    @property
    def fraction_changed(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def empirical_entropy(counts: Mapping[int, int] | Counter) -> float:
    total = sum(counts.values())
    if total == 0:
        return 0.0
    return -sum(c / total * math.log2(c / total) for c in counts.values() if c)


def entropy_bound(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> Bound:
    elements = changed = raw = 0
    deltas: Counter[int] = Counter()
    for name, b in new.items():
        a = old.get(name)
        b = b.detach().cpu().contiguous()
        if a is None or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            raw += b.numel() * b.element_size()
            continue
        a = a.detach().cpu().contiguous()
        dt = dtype_of(b, name)
        x, y = bits_view(a, dt).numpy(), bits_view(b, dt).numpy()
        idx = np.flatnonzero(x != y)
        elements += x.size
        changed += idx.size
        if idx.size:
            d = to_ordinal(y[idx], dt) - to_ordinal(x[idx], dt)
            values, counts = np.unique(d, return_counts=True)
            for v, c in zip(values.tolist(), counts.tolist(), strict=True):
                deltas[v] += c
    p = changed / elements if elements else 0.0
    return Bound(elements, changed, elements * binary_entropy(p),
                 changed * empirical_entropy(deltas), raw)
