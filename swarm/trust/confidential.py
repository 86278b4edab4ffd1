"""Confidential mode: chunks encrypted so relays carry only ciphertext.

Off by default. When on, the trainer draws a fresh 256-bit key per version and
seals each plaintext chunk with AES-256-GCM; the ciphertext chunks (each 16
bytes longer, the GCM tag) are what the manifest hashes, what the swarm moves
and what relays verify, so no node needs the key to check or forward a chunk.
The version key reaches each authorized node wrapped for its X25519 public key:
one ephemeral X25519 key per version, a key-encryption key per recipient from
HKDF-SHA256 over the shared secret, and AES-256-GCM around the version key.
All of that rides in the signed manifest's ``encryption`` field.

Nonces: the key is used for one version only, and chunk ``i`` is sealed once,
so the 96-bit nonce is simply ``0x00000000 || i (8 bytes, big endian)``; the
associated data binds model, version and index (see docs/manifest.md).
"""

from __future__ import annotations

import os
import re
import struct
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.errors import ChunkError, ManifestError
from swarm.trust.chunks import split_payload
from swarm.trust.keys import key_id

if TYPE_CHECKING:
    from collections.abc import Iterable

    from swarm.trust.manifest import Manifest

ALG = "aes-256-gcm"
TAG_LEN = 16
KEY_LEN = 32
WRAPPED_LEN = KEY_LEN + TAG_LEN
MAX_RECIPIENTS = 1024
WRAP_INFO = b"patchswarm key wrap v1"
WRAP_AAD = b"patchswarm version key"
CHUNK_AAD = b"patchswarm chunk\x00"
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
ENCRYPTION_KEYS = frozenset({"alg", "epk", "plaintext_length", "recipients"})


class NoKeyError(ManifestError):
    """This node holds no key the version is encrypted for: it can verify and relay
    the version's (ciphertext) chunks but not apply them. Nobody is to blame."""


def chunk_nonce(index: int) -> bytes:
    """The 12-byte GCM nonce of chunk ``index``: four zero bytes, then the index."""
    return b"\x00\x00\x00\x00" + struct.pack(">Q", index)


def chunk_aad(model: str, version: int, index: int) -> bytes:
    """Associated data of a chunk: binds the ciphertext to its model, version and place."""
    return CHUNK_AAD + model.encode() + b"\x00" + struct.pack(">QQ", version, index)


def plaintext_chunk_size(chunk_size: int) -> int:
    """Plaintext bytes per chunk when ciphertext chunks are ``chunk_size`` bytes."""
    return chunk_size - TAG_LEN


def _kek(shared: bytes, epk: bytes, recipient_pub: bytes, model: str, version: int) -> bytes:
    info = WRAP_INFO + b"\x00" + model.encode() + b"\x00" + struct.pack(">Q", version)
    return HKDF(
        algorithm=hashes.SHA256(), length=KEY_LEN, salt=epk + recipient_pub, info=info
    ).derive(shared)


def _raw(pub: X25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def wrap_key(
    version_key: bytes, recipients: Iterable[X25519PublicKey], *, model: str, version: int
) -> dict[str, Any]:
    """The ``encryption`` field (minus ``plaintext_length``) giving ``version_key`` to each recipient."""
    eph = X25519PrivateKey.generate()
    epk = _raw(eph.public_key())
    entries: dict[str, bytes] = {}
    for pub in recipients:
        rpub = _raw(pub)
        kek = _kek(eph.exchange(pub), epk, rpub, model, version)
        entries[key_id(rpub)] = AESGCM(kek).encrypt(b"\x00" * 12, version_key, WRAP_AAD)
    if not entries:
        raise ManifestError("confidential mode needs at least one recipient")
    if len(entries) > MAX_RECIPIENTS:
        raise ManifestError(f"more than {MAX_RECIPIENTS} recipients")
    return {
        "alg": ALG,
        "epk": epk,
        "recipients": [{"id": k, "wrapped": entries[k]} for k in sorted(entries)],
    }


def unwrap_key(manifest: Manifest, node_key: X25519PrivateKey) -> bytes:
    """This node's copy of the version key; ``ManifestError`` if it is not a recipient."""
    enc = manifest.encryption
    if enc is None:
        raise ManifestError(f"version {manifest.version} is not encrypted")
    rpub = _raw(node_key.public_key())
    kid = key_id(rpub)
    for r in enc["recipients"]:
        if r["id"] == kid:
            break
    else:
        raise NoKeyError(f"no key for version {manifest.version}: it is not encrypted for "
                         f"this node's key {kid}")
    epk = enc["epk"]
    try:
        shared = node_key.exchange(X25519PublicKey.from_public_bytes(epk))
        kek = _kek(shared, epk, rpub, manifest.model, manifest.version)
        return AESGCM(kek).decrypt(b"\x00" * 12, r["wrapped"], WRAP_AAD)
    except (InvalidTag, ValueError):
        raise ManifestError(
            f"version {manifest.version}: wrapped key for {kid} does not open"
        ) from None


def encrypt_payload(
    plaintext: bytes | bytearray | memoryview,
    chunk_size: int,
    recipients: Iterable[X25519PublicKey],
    *,
    model: str,
    version: int,
) -> tuple[bytearray, dict[str, Any]]:
    """Seal ``plaintext`` chunk by chunk; returns (ciphertext payload, ``encryption`` field).

    Ciphertext chunks are ``chunk_size`` bytes (the last may be shorter), so the
    manifest built over the ciphertext with the same ``chunk_size`` lines up.
    """
    pcs = plaintext_chunk_size(chunk_size)
    if pcs < 1:
        raise ManifestError(f"chunk size must exceed {TAG_LEN} bytes in confidential mode")
    version_key = AESGCM.generate_key(bit_length=256)
    enc = wrap_key(version_key, recipients, model=model, version=version)
    pieces = split_payload(plaintext, pcs)
    enc["plaintext_length"] = sum(len(p) for p in pieces)
    aead = AESGCM(version_key)
    out = bytearray(enc["plaintext_length"] + TAG_LEN * len(pieces))
    view = memoryview(out)
    for i, chunk in enumerate(pieces):  # sealed in place: no per-chunk copies
        start = i * chunk_size
        aead.encrypt_into(
            chunk_nonce(i),
            chunk,
            chunk_aad(model, version, i),
            view[start : start + len(chunk) + TAG_LEN],
        )
    return out, enc


def decrypt_chunk(manifest: Manifest, version_key: bytes, index: int, data: bytes) -> bytes:
    """Open ciphertext chunk ``index``; ``ChunkError`` if it fails authentication."""
    try:
        return AESGCM(version_key).decrypt(
            chunk_nonce(index), bytes(data), chunk_aad(manifest.model, manifest.version, index)
        )
    except InvalidTag:
        raise ChunkError(f"chunk {index} fails decryption") from None


def decrypt_payload(
    manifest: Manifest, payload: bytes | bytearray | memoryview, node_key: X25519PrivateKey
) -> bytearray:
    """The plaintext of a complete, verified ciphertext payload, for this node."""
    version_key = unwrap_key(manifest, node_key)
    assert manifest.encryption is not None
    aead = AESGCM(version_key)
    pieces = split_payload(payload, manifest.chunk_size)
    out = bytearray(max(0, len(payload) - TAG_LEN * len(pieces)))
    if len(out) != manifest.encryption["plaintext_length"]:
        raise ChunkError("payload length does not match the manifest")
    view = memoryview(out)
    pcs = plaintext_chunk_size(manifest.chunk_size)
    for i, chunk in enumerate(pieces):
        start = i * pcs
        try:
            aead.decrypt_into(
                chunk_nonce(i),
                chunk,
                chunk_aad(manifest.model, manifest.version, i),
                view[start : start + len(chunk) - TAG_LEN],
            )
        except (InvalidTag, ValueError):
            raise ChunkError(f"chunk {i} fails decryption") from None
    return out


def validate_encryption(enc: Any, m: Manifest) -> None:
    """Check the shape and sizes of a manifest's ``encryption`` field (format 1)."""
    if not isinstance(enc, dict) or set(enc) != ENCRYPTION_KEYS:
        raise ManifestError(f"field encryption must have exactly {sorted(ENCRYPTION_KEYS)}")
    if enc["alg"] != ALG:
        raise ManifestError(f"unsupported encryption {enc['alg']!r}")
    if type(enc["epk"]) is not bytes or len(enc["epk"]) != 32:
        raise ManifestError("encryption.epk must be 32 bytes")
    pcs = plaintext_chunk_size(m.chunk_size)
    pl = enc["plaintext_length"]
    if pcs < 1 or type(pl) is not int or pl < 0:
        raise ManifestError("encryption.plaintext_length invalid or chunk size too small")
    n = -(-pl // pcs)
    if n != m.chunk_count or pl + n * TAG_LEN != m.payload_length:
        raise ManifestError("encryption.plaintext_length does not match the ciphertext length")
    recips = enc["recipients"]
    if not isinstance(recips, list) or not 1 <= len(recips) <= MAX_RECIPIENTS:
        raise ManifestError(f"encryption.recipients must list 1..{MAX_RECIPIENTS} entries")
    seen: set[str] = set()
    if not all(isinstance(r, dict) for r in recips):
        raise ManifestError("each encryption recipient must be a map")
    ids = [r.get("id") for r in recips]
    if not all(type(i) is str for i in ids) or ids != sorted(ids):
        raise ManifestError("encryption recipients must be sorted by id")
    for r in recips:
        if not isinstance(r, dict) or set(r) != {"id", "wrapped"}:
            raise ManifestError("each encryption recipient has exactly id and wrapped")
        if type(r["id"]) is not str or not _HEX32.match(r["id"]) or r["id"] in seen:
            raise ManifestError("encryption recipient ids must be distinct 32-hex-digit key ids")
        if type(r["wrapped"]) is not bytes or len(r["wrapped"]) != WRAPPED_LEN:
            raise ManifestError(f"encryption recipient wrapped key must be {WRAPPED_LEN} bytes")
        seen.add(r["id"])


def load_recipients(paths: Iterable[str | os.PathLike[str]]) -> list[X25519PublicKey]:
    """X25519 public keys from PEM files; ``ManifestError`` naming the file that is
    not one (an Ed25519 key, a private key, garbage)."""
    from swarm.trust.keys import load_public_key

    keys = []
    for p in paths:
        pub = load_public_key(p)
        if not isinstance(pub, X25519PublicKey):
            raise ManifestError(f"{p}: an Ed25519 key, not a node's X25519 key "
                                "(make one with `patchswarm keygen --x25519 FILE`)")
        keys.append(pub)
    return keys


def new_node_key() -> X25519PrivateKey:
    """A fresh X25519 key for a node (``keys.generate_keypair(kind="x25519")`` writes one)."""
    return X25519PrivateKey.generate()


__all__ = [
    "ALG",
    "NoKeyError",
    "chunk_aad",
    "chunk_nonce",
    "decrypt_chunk",
    "decrypt_payload",
    "encrypt_payload",
    "load_recipients",
    "new_node_key",
    "unwrap_key",
    "validate_encryption",
    "wrap_key",
]
