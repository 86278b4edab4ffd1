"""Signing keys, key ids and the trust store a node checks manifests against.

Trainers sign with Ed25519; nodes hold the public keys they trust, each named
by a key id (the first 16 bytes of SHA-256 over the raw 32-byte public key, as
32 lowercase hex digits). Several keys may be trusted at once (rotation), and a
revoked key id stays refused even if someone adds its key again.

Key files are PEM: PKCS#8 (unencrypted) for private keys, written mode 0600,
and SubjectPublicKeyInfo for public keys, so ``openssl pkey`` reads both. The
same helpers handle the X25519 keys nodes use to receive confidential versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from swarm.errors import ManifestError

if TYPE_CHECKING:
    from swarm.trust.manifest import Manifest

KEY_ID_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_KEY_FILE_BYTES = 16 * 1024

PublicKey = Ed25519PublicKey | X25519PublicKey
PrivateKey = Ed25519PrivateKey | X25519PrivateKey


def _raw_public(pub: PublicKey | bytes) -> bytes:
    if isinstance(pub, bytes | bytearray | memoryview):
        raw = bytes(pub)
        if len(raw) != 32:
            raise ValueError(f"a raw public key is 32 bytes, got {len(raw)}")
        return raw
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(pub: PublicKey | PrivateKey | bytes) -> str:
    """The 32-hex-digit id of a public key (a private key is named by its public half)."""
    if isinstance(pub, Ed25519PrivateKey | X25519PrivateKey):
        pub = pub.public_key()
    return hashlib.sha256(_raw_public(pub)).digest()[:16].hex()


def _read_key_file(path: str | os.PathLike[str]) -> bytes:
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ManifestError(f"cannot read key file {p}: {exc.strerror or exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ManifestError(f"key file {p} is too large to be a key")
    return data


def load_private_key(path: str | os.PathLike[str]) -> PrivateKey:
    """Load an Ed25519 or X25519 private key from a PEM (PKCS#8) file."""
    data = _read_key_file(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ManifestError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey | X25519PrivateKey):
        raise ManifestError(f"{path}: not an Ed25519 or X25519 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> PublicKey:
    """Load an Ed25519 or X25519 public key from a PEM file."""
    data = _read_key_file(path)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ManifestError(f"{path}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey | X25519PublicKey):
        raise ManifestError(f"{path}: not an Ed25519 or X25519 public key")
    return key


def _write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a new file at ``path`` atomically; refuse to overwrite."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if path exists: never clobber a key
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def generate_keypair(
    path: str | os.PathLike[str], *, kind: str = "ed25519"
) -> tuple[PrivateKey, str]:
    """Write a new private key to ``path`` (0600) and its public key to ``path.pub``.

    ``kind`` is ``"ed25519"`` (trainer signing key) or ``"x25519"`` (a node's key
    for confidential versions). Returns the private key and its key id. Refuses
    to overwrite an existing file (raises ``ManifestError``).
    """
    if kind == "ed25519":
        key: PrivateKey = Ed25519PrivateKey.generate()
    elif kind == "x25519":
        key = X25519PrivateKey.generate()
    else:
        raise ValueError(f"unknown key kind {kind!r}")
    p = Path(path)
    pub_path = p.with_name(p.name + ".pub")
    for target in (p, pub_path):
        if target.exists():
            raise ManifestError(f"{target} already exists; not overwriting a key")
    priv_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pub_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        _write_new_file(p, priv_pem, 0o600)
        _write_new_file(pub_path, pub_pem, 0o644)
    except FileExistsError as exc:
        raise ManifestError(f"{exc.filename} already exists; not overwriting a key") from None
    except OSError as exc:
        raise ManifestError(f"cannot write key file {p}: {exc.strerror or exc}") from None
    return key, key_id(key)


class TrustStore:
    """The trainer public keys a node accepts manifests from.

    Keys are added and revoked by key id; any number may be valid at once so a
    trainer can rotate keys without a flag day. Revocation is sticky.
    """

    def __init__(self, keys: Iterable[Ed25519PublicKey] = ()) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._revoked: set[str] = set()
        for k in keys:
            self.add(k)

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike[str]]) -> TrustStore:
        """A trust store holding the Ed25519 public keys in these PEM files."""
        store = cls()
        for path in paths:
            key = load_public_key(path)
            if not isinstance(key, Ed25519PublicKey):
                raise ManifestError(f"{path}: not an Ed25519 signing key")
            store.add(key)
        return store

    def add(self, pub: Ed25519PublicKey) -> str:
        """Trust ``pub``; returns its key id. Raises ``ManifestError`` if it was revoked."""
        if not isinstance(pub, Ed25519PublicKey):
            raise TypeError("trust store keys are Ed25519 public keys")
        kid = key_id(pub)
        if kid in self._revoked:
            raise ManifestError(f"key {kid} is revoked")
        self._keys[kid] = pub
        return kid

    def revoke(self, kid: str) -> None:
        """Stop trusting ``kid`` now and for good (known to this store or not)."""
        self._keys.pop(kid, None)
        self._revoked.add(kid)

    def is_trusted(self, kid: str) -> bool:
        return kid in self._keys

    def is_revoked(self, kid: str) -> bool:
        return kid in self._revoked

    def key_ids(self) -> list[str]:
        """The ids of every trusted key, sorted."""
        return sorted(self._keys)

    def get(self, kid: str) -> Ed25519PublicKey:
        """The trusted key named ``kid``; ``ManifestError`` if revoked or unknown."""
        if kid in self._revoked:
            raise ManifestError(f"key {kid} is revoked")
        try:
            return self._keys[kid]
        except KeyError:
            raise ManifestError(f"unknown signing key {kid}") from None

    def __len__(self) -> int:
        return len(self._keys)

    def check_applicable(
        self,
        m: Manifest,
        held_version: int | None,
        held_digest: bytes | None,
        *,
        model: str | None = None,
    ) -> None:
        """Raise ``ManifestError`` unless ``m`` may be applied on top of the held state.

        Refuses: a key revoked since the manifest was verified, another model,
        a version at or below the held one (replay, rollback), a patch when no
        state is held, and a patch whose parent version or digest is not the
        held state. A ``full`` checkpoint applies to any older (or no) state.
        """
        self.get(m.key_id)
        if model is not None and m.model != model:
            raise ManifestError(f"manifest is for model {m.model!r}, this node serves {model!r}")
        if held_version is not None and m.version <= held_version:
            raise ManifestError(
                f"version {m.version} is not newer than held version {held_version} "
                "(replay or rollback)"
            )
        if m.kind == "full":
            return
        if held_version is None or held_digest is None:
            raise ManifestError(
                f"version {m.version} is a patch on version {m.parent_version}, "
                "but no state is held (needs a full checkpoint first)"
            )
        if m.parent_version != held_version:
            raise ManifestError(
                f"version {m.version} patches version {m.parent_version}, "
                f"but version {held_version} is held"
            )
        if m.parent_digest != held_digest:
            raise ManifestError(
                f"version {m.version}: parent digest {m.parent_digest.hex() if m.parent_digest else None} "
                f"does not match the held state {held_digest.hex()}"
            )
