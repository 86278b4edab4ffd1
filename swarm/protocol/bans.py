"""Corrupt-chunk strikes and bans, by node id, bounded and expiring.

A node id earns a strike per corrupt chunk it sends, counted across
reconnects; ``max_bad_chunks`` strikes ban it for ``ban_s``. Both tables are
bounded (``MAX_IDS``, the oldest entry goes first) and entries expire, so a
stream of made-up ids cannot grow them without limit (issue #10, attack 4).
With mutual TLS a node id is a certificate identity, so a strike or a ban
names a key holder, not a claim.
"""

from __future__ import annotations

MAX_IDS = 4096


class BanList:
    def __init__(self, ban_s: float, *, max_ids: int = MAX_IDS) -> None:
        self.ban_s = ban_s
        self.max_ids = max_ids
        self._strikes: dict[str, tuple[int, float]] = {}  # id -> (count, last strike)
        self._banned: dict[str, float] = {}  # id -> banned until

    def __len__(self) -> int:
        return len(self._banned)

    def banned(self, node_id: str, now: float) -> bool:
        until = self._banned.get(node_id)
        if until is None:
            return False
        if until <= now:
            del self._banned[node_id]
            self._strikes.pop(node_id, None)
            return False
        return True

    def strike(self, node_id: str, now: float) -> int:
        """One more corrupt chunk from ``node_id``; its count (strikes older than
        ``ban_s`` are forgotten)."""
        n, last = self._strikes.pop(node_id, (0, now))
        n = 1 if now - last > self.ban_s else n + 1
        self._strikes[node_id] = (n, now)
        _bound(self._strikes, self.max_ids)
        return n

    def ban(self, node_id: str, now: float) -> bool:
        """Ban ``node_id`` until ``now + ban_s``; True if it was not banned already."""
        first = not self.banned(node_id, now)
        self._banned.pop(node_id, None)
        self._banned[node_id] = now + self.ban_s
        _bound(self._banned, self.max_ids)
        return first


def _bound(table: dict, limit: int) -> None:
    while len(table) > limit:  # dicts keep insertion order: the oldest goes first
        del table[next(iter(table))]
