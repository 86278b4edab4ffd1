"""Per-version state: one ``VersionState`` per manifest we hold, and the chain to fetch.

A version's chunk sets are ``int`` bitsets (bit ``i`` = chunk ``i``, see
``picker``). Everything the core knows about one version lives in its
``VersionState``, so forgetting a version is one ``del``.
"""

from __future__ import annotations

from typing import Any

from swarm.protocol import wire


class VersionState:
    """One version: its manifest, what we hold, what is on its way, who holds what."""

    __slots__ = ("announce", "avail", "dups", "full", "have", "inflight", "manifest", "raw",
                 "version")

    def __init__(self, manifest: Any, raw: bytes) -> None:
        self.version: int = manifest.version
        self.manifest = manifest
        self.raw = raw
        self.announce = wire.Announce(raw).encode()  # sent to every peer as it is
        self.full = (1 << manifest.chunk_count) - 1
        self.have = 0
        self.inflight = 0  # chunks requested from some peer
        self.dups = 0  # endgame: chunks requested twice
        self.avail: list[int] | None = None  # while wanted: peers holding each chunk

    @property
    def chunk_count(self) -> int:
        return self.manifest.chunk_count

    @property
    def complete(self) -> bool:
        return self.have == self.full

    def chunk_length(self, i: int) -> int:
        return self.manifest.chunk_length(i)

    def bitfield(self) -> bytes:
        return wire.Bitfield(self.version, wire.bits_to_bytes(self.have, self.chunk_count)).encode()


class VersionSet:
    """Every ``VersionState`` by version, the chain of versions to apply, and the wanted ones."""

    __slots__ = ("_seen_raw", "chain", "stalled", "states", "wanted")

    def __init__(self) -> None:
        self.states: dict[int, VersionState] = {}
        self.chain: list[int] = []  # versions to apply, oldest first
        self.wanted: list[int] = []  # the incomplete versions of the chain
        self.stalled: set[int] = set()  # apply failed for good: never chained again
        self._seen_raw: dict[bytes, int] = {}  # manifest bytes already verified -> version

    def __contains__(self, v: int) -> bool:
        return v in self.states

    def get(self, v: int) -> VersionState | None:
        return self.states.get(v)

    def add(self, manifest: Any, raw: bytes) -> VersionState:
        st = VersionState(manifest, raw)
        self.states[st.version] = st
        self._seen_raw[raw] = st.version
        return st

    def drop(self, v: int) -> None:
        self.states.pop(v, None)

    def seen(self, raw: bytes) -> int | None:
        """The version of manifest bytes verified before (so they are not verified twice)."""
        return self._seen_raw.get(raw)

    def remember(self, raw: bytes, v: int) -> None:
        if len(self._seen_raw) > 4 * (len(self.states) + 16):
            self._seen_raw.clear()
        self._seen_raw[raw] = v

    def replan(self, active: int | None) -> list[int]:
        """Work out the chain of versions to fetch from ``active``, oldest first; set ``wanted``."""
        by_parent: dict[int, int] = {}
        fulls = []
        for v, st in self.states.items():
            if v in self.stalled:
                continue
            m = st.manifest
            if m.kind == "full":
                fulls.append(v)
            elif m.parent_version is not None and m.parent_version < v:
                cur = by_parent.get(m.parent_version)
                if cur is None or v < cur:
                    by_parent[m.parent_version] = v
        chain: list[int] = []
        cur = active
        for _ in range(len(self.states) + 1):
            nxt = by_parent.get(cur) if cur is not None else None
            if nxt is None:
                later = [v for v in fulls if cur is None or v > cur]
                if not later:
                    break
                nxt = max(later)
            chain.append(nxt)
            cur = nxt
        self.chain = chain
        self.wanted = [v for v in chain if not self.states[v].complete]
        return self.wanted


class ApplyState:
    """The one version being applied, and the retries of failed applies."""

    __slots__ = ("applying", "retry_at", "tries")

    def __init__(self) -> None:
        self.applying: int | None = None
        self.tries: dict[int, int] = {}
        self.retry_at: float | None = None  # a failed apply is tried again then

    def next(self, versions: VersionSet, active: int | None) -> int | None:
        """The version to apply now (and mark it applying), or None."""
        if self.applying is not None or self.retry_at is not None or not versions.chain:
            return None
        v = versions.chain[0]
        st = versions.states[v]
        if not st.complete:
            return None
        if st.manifest.kind == "patch" and st.manifest.parent_version != active:
            return None
        self.applying = v
        return v

    def failed(self, v: int, *, retries: int, now: float, retry_s: float) -> int:
        """The apply of ``v`` failed: the attempt number; a retry is set while below ``retries``."""
        self.applying = None
        n = self.tries.get(v, 0) + 1
        self.tries[v] = n
        if n < retries:
            self.retry_at = now + retry_s
        return n
