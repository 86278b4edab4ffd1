"""The ports the node's driver runs against: its chunk store and its trust anchors.

Each port is a ``typing.Protocol`` whose docstrings state the contract; the
adapters sit in their own files (``node.store.ChunkStore`` on a local disk,
``swarm.trust.keys.TrustStore`` in memory). The engine port belongs with the
engines (``node/engines/``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from swarm.trust.manifest import Manifest


class TrustPort(Protocol):
    """The trainer keys a node believes (``verify_manifest`` asks it by key id)."""

    def get(self, kid: str) -> Ed25519PublicKey:
        """The trusted public key ``kid``; ``ManifestError`` if unknown or revoked."""
        ...


class StorePort(Protocol):
    """Durable manifests and verified chunks of the versions a node holds.

    Every method may raise ``StoreError`` for a local fault (disk full, quota,
    I/O error): that is never a peer's fault. ``ChunkError`` means the bytes
    are not the chunk the manifest names.
    """

    def manifests(self) -> list[tuple[bytes, Manifest]]:
        """Every stored manifest, raw and decoded, oldest version first."""
        ...

    def manifest(self, version: int) -> Manifest:
        ...

    def put_manifest(self, raw: bytes, manifest: Manifest) -> None:
        """Keep a manifest the caller verified (``manifest`` decodes ``raw``).

        Idempotent for the same bytes; a different manifest for a version
        already held is refused (``StoreError``).
        """
        ...

    def have(self, version: int) -> set[int]:
        """Indices of the verified chunks held for ``version`` (empty if unknown)."""
        ...

    def put_chunk(self, version: int, index: int, data: bytes | memoryview, *,
                  keep: bool = False, hashed: bool = False,
                  digest: bytes | None = None) -> None:
        """Verify chunk ``index`` against the stored manifest and keep it durably.

        ``ChunkError`` if it is not that chunk: nothing is stored. This is the
        one check a received chunk gets before the core hears of it. ``keep``:
        the caller hands the buffer over unchanged for good; the store may serve
        reads of the chunk from it. ``hashed``: the caller built the manifest's hash
        from these very bytes (the trainer's own payload), so only the length is
        checked; never for bytes from a peer. ``digest``: the chunk's hash as the
        caller computed it over exactly ``data`` as it arrived (compared with the
        manifest's instead of hashing ``data`` again).
        """
        ...

    def read_chunk(self, version: int, index: int) -> bytes | memoryview:
        """The verified bytes of a held chunk (``ChunkError`` if it rotted: then dropped)."""
        ...

    def iter_payload(self, version: int) -> Iterator[bytes]:
        ...

    def payload(self, version: int) -> bytes:
        """The whole verified payload of a complete version."""
        ...

    def payload_view(self, version: int, first: int = 0) -> memoryview:
        """``payload`` as a read-only view of one buffer (no per-chunk copies), from
        chunk ``first`` on."""
        ...

    def set_active(self, version: int, digest: bytes) -> None:
        """Record ``version`` (state digest ``digest``) as the one the engine serves."""
        ...

    def gc(self, keep_last: int) -> list[int]:
        """Drop versions no longer needed, keeping the last ``keep_last``; the ones dropped."""
        ...
