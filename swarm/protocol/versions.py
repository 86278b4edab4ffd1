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
                 "short", "version")

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
        # a patch's short last chunk (under half a full one), as a bitset: it goes first
        # wherever a chunk is picked (``picker.first_pick``)
        n = manifest.chunk_count
        self.short = (1 << (n - 1) if n > 1 and 2 * manifest.chunk_length(n - 1)
                      < manifest.chunk_length(0) else 0)

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

    __slots__ = ("_seen_raw", "chain", "free", "stalled", "states", "unavailable", "wanted")

    def __init__(self) -> None:
        self.states: dict[int, VersionState] = {}
        self.chain: list[int] = []  # versions to apply, oldest first
        self.wanted: list[int] = []  # the incomplete versions of the chain
        self.stalled: set[int] = set()  # apply failed for good: never chained again
        self.unavailable: set[int] = set()  # no peer (nor the origin) showed it: skipped for now
        self.free: set[int] = set()  # anchors of the weights we are on: applied without fetching
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
        self.stalled.discard(v)  # a node runs for thousands of versions: nothing stays behind
        self.unavailable.discard(v)

    def seen(self, raw: bytes) -> int | None:
        """The version of manifest bytes verified before (so they are not verified twice)."""
        return self._seen_raw.get(raw)

    def remember(self, raw: bytes, v: int) -> None:
        if len(self._seen_raw) > 4 * (len(self.states) + 16):
            self._seen_raw.clear()
        self._seen_raw[raw] = v

    def replan(self, active: int | None) -> list[int]:
        """Work out the chain of versions to apply from ``active``, oldest first; set ``wanted``.

        The chain reaches the newest version it can and, among the ways there, fetches
        the fewest bytes: a patch applies to its parent version; a full checkpoint (an
        anchor) applies to anything older, and costs nothing when it holds exactly the
        weights we are on (its target digest is our version's: the trainer publishes an
        anchor of the weights it last patched to, so up-to-date nodes step over it and
        a joiner or a node back from a long outage takes the anchor and the patches after
        it instead of the whole chain). Versions that failed for good (``stalled``) or
        that nobody around holds (``unavailable``) are left out.
        """
        states = self.states
        skip = self.stalled | self.unavailable
        cand = sorted(v for v in states if v not in skip and (active is None or v > active))
        # best[v] = (bytes to fetch, previous version on the way, free) from ``active``
        best: dict[int | None, tuple[int, int | None, bool]] = {active: (0, None, False)}
        digest: dict[int | None, bytes | None] = {
            active: states[active].manifest.target_digest if active in states else None}
        for v in cand:
            m = states[v].manifest
            digest[v] = m.target_digest
            left = self._left(states[v])
            options: list[tuple[int, int | None, bool]] = []
            if m.kind == "full":
                for u, (cost, _prev, _free) in best.items():
                    free = digest.get(u) == m.target_digest
                    options.append((cost + (0 if free else left), u, free))
            elif m.parent_version in best and m.parent_version is not None:
                options.append((best[m.parent_version][0] + left, m.parent_version, False))
            if options:
                best[v] = min(options, key=lambda o: (o[0], -(o[1] if o[1] is not None else -1)))
        reach = [v for v in best if v is not None and v != active]
        chain: list[int] = []
        self.free = set()
        if reach:
            v: int | None = max(reach)
            while v is not None and v != active:
                chain.append(v)
                cost, prev, free = best[v]
                if free:
                    self.free.add(v)
                v = prev
            chain.reverse()
        self.chain = chain
        self.wanted = [v for v in chain if not states[v].complete and v not in self.free]
        return self.wanted

    @staticmethod
    def _left(st: VersionState) -> int:
        """Bytes of ``st`` still to fetch."""
        m = st.manifest
        n = m.chunk_count
        if not n:
            return 0
        return m.payload_length * (n - st.have.bit_count()) // n

    def retained_from(self, active: int | None, keep: int) -> int:
        """The oldest version to keep and announce: the last ``keep`` versions up to
        ``active``, and everything from the newest anchor (full) at or below it, so a
        joiner can always reach the newest version."""
        if active is None:
            return -1
        lo = active - keep + 1
        anchors = [v for v, st in self.states.items() if st.manifest.kind == "full" and v <= active]
        return min(lo, max(anchors)) if anchors else lo


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
        if not st.complete and v not in versions.free:
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
