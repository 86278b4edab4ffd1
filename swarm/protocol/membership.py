"""The address book: who exists, in which region, at which address.

Bounded per region (random eviction), sampled uniformly for peer exchange and
for dialling. Entries come from handshakes and PEERS frames; an entry is just
a hint, a peer is only trusted once its own handshake checks out.
"""

from __future__ import annotations

import random


class AddressBook:
    __slots__ = ("_all", "_cap", "_entries", "_regions", "_rng")

    def __init__(self, cap_per_region: int, rng: random.Random) -> None:
        self._cap = cap_per_region
        self._rng = rng
        self._entries: dict[str, tuple[str, str, int]] = {}  # id -> (region, addr, flags)
        self._regions: dict[str, list[str]] = {}
        self._all: list[str] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._entries

    def ids(self) -> list[str]:
        return list(self._all)

    def get(self, node_id: str) -> tuple[str, str, int] | None:
        return self._entries.get(node_id)

    def add(self, node_id: str, region: str, addr: str, flags: int = 0) -> None:
        old = self._entries.get(node_id)
        if old is not None:
            if old[0] == region:
                self._entries[node_id] = (region, addr, flags)
                return
            self.remove(node_id)
        lst = self._regions.setdefault(region, [])
        if len(lst) >= self._cap:
            self.remove(lst[self._rng.randrange(len(lst))])
        self._entries[node_id] = (region, addr, flags)
        lst.append(node_id)
        self._all.append(node_id)

    def remove(self, node_id: str) -> None:
        old = self._entries.pop(node_id, None)
        if old is None:
            return
        for lst in (self._regions[old[0]], self._all):
            i = lst.index(node_id)
            lst[i] = lst[-1]
            lst.pop()

    def sample(self, region: str | None, k: int) -> list[tuple[str, str, str, int]]:
        """Up to ``k`` random entries ``(id, region, addr, flags)`` of ``region`` (None: any)."""
        lst = self._all if region is None else self._regions.get(region, [])
        ids = lst if len(lst) <= k else self._rng.sample(lst, k)
        return [(i, *self._entries[i]) for i in ids]

    def region_count(self, region: str) -> int:
        """Entries of ``region`` (bounded by the per-region cap)."""
        return len(self._regions.get(region, ()))

    def region_ids(self, region: str) -> list[str]:
        return list(self._regions.get(region, ()))

    def regions(self) -> list[str]:
        """Regions with at least one entry."""
        return [r for r, lst in self._regions.items() if lst]
