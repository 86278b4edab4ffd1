"""Chunk selection: bitsets as Python ints, rarest-first with random ties.

A version's chunk set is an ``int`` whose bit ``i`` stands for chunk ``i``;
set algebra (``peer & ~have & ~inflight``) is then a handful of big-int
operations instead of loops. Only the final choice walks the candidate bits.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def iter_bits(x: int) -> Iterator[int]:
    """Indices of the set bits of ``x``, lowest first."""
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def lowest(x: int) -> int:
    return (x & -x).bit_length() - 1


def first_pick(cand: int, short: int) -> int:
    """The chunk of ``cand`` to send first: a short one of ``short`` (a patch's short last
    chunk) if there is one, else the lowest. A short chunk costs its path next to nothing
    at any time, while sent last it queues behind the version's last full chunks on
    the same connections and then crosses every hop after them: on the emulated WAN some
    node of a version waited up to 0.1 s for it after its last full chunk."""
    s = cand & short
    return lowest(s if s else cand)


def popcount(x: int) -> int:
    return x.bit_count()


def pick_rarest(cand: int, avail: list[int], rng: random.Random) -> int:
    """The candidate held by the fewest peers; ties broken uniformly at random."""
    best = -1
    best_a = 1 << 60
    ties = 0
    while cand:
        low = cand & -cand
        i = low.bit_length() - 1
        cand ^= low
        a = avail[i]
        if a < best_a:
            best_a = a
            best = i
            ties = 1
        elif a == best_a:
            ties += 1
            if rng.random() * ties < 1.0:
                best = i
    return best


def pick_some(cand: int, avail: list[int], rng: random.Random, k: int) -> list[int]:
    """Up to ``k`` rarest candidates (random order within a rarity level)."""
    if k == 1:
        return [pick_rarest(cand, avail, rng)] if cand else []
    items = [(avail[i], rng.random(), i) for i in iter_bits(cand)]
    if len(items) > k:
        items.sort()
        items = items[:k]
    return [i for _, _, i in items]
