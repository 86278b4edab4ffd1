"""Confidential mode: per-version AES-256-GCM chunks, keys wrapped per node (X25519)."""

from __future__ import annotations

import copy
import os

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ChunkError, ManifestError
from swarm.trust import confidential as cf
from swarm.trust.chunks import split_payload, verify_chunk
from swarm.trust.keys import TrustStore, key_id
from swarm.trust.manifest import build_manifest, sign_manifest, verify_manifest

SIGNER = Ed25519PrivateKey.generate()
TRUST = TrustStore([SIGNER.public_key()])
NODES = [cf.new_node_key() for _ in range(3)]
OUTSIDER = cf.new_node_key()


def publish(plaintext: bytes, chunk_size: int = 1024, recipients=None, version: int = 7):
    recipients = [n.public_key() for n in NODES] if recipients is None else recipients
    ct, enc = cf.encrypt_payload(plaintext, chunk_size, recipients, model="m", version=version)
    m = build_manifest(
        ct,
        model="m",
        version=version,
        kind="full",
        parent_version=None,
        parent_digest=None,
        target_digest=b"\x01" * 32,
        chunk_size=chunk_size,
        key_id=key_id(SIGNER),
        encryption=enc,
    )
    raw = sign_manifest(m, SIGNER)
    return ct, verify_manifest(raw, TRUST)


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=5000), st.integers(17, 700))
def test_every_recipient_decrypts(plaintext, chunk_size):
    ct, m = publish(plaintext, chunk_size)
    assert m.encrypted and m.encryption["plaintext_length"] == len(plaintext)
    assert m.payload_length == len(ct)
    for node in NODES:
        assert cf.decrypt_payload(m, ct, node) == plaintext


def test_ciphertext_hides_plaintext_and_relays_verify_without_key():
    plaintext = b"secret weights " * 1000
    ct, m = publish(plaintext)
    assert b"secret weights" not in ct
    for i, chunk in enumerate(split_payload(ct, m.chunk_size)):
        verify_chunk(m, i, chunk)  # no key involved: hashes are over the ciphertext
        assert (
            cf.decrypt_chunk(m, cf.unwrap_key(m, NODES[0]), i, bytes(chunk))
            == plaintext[i * 1008 : (i + 1) * 1008]
        )


def test_fresh_key_per_version():
    plaintext = os.urandom(3000)
    ct1, m1 = publish(plaintext)
    ct2, m2 = publish(plaintext)
    assert ct1 != ct2 and cf.unwrap_key(m1, NODES[0]) != cf.unwrap_key(m2, NODES[0])
    assert m1.encryption["epk"] != m2.encryption["epk"]


def test_outsider_cannot_unwrap():
    _, m = publish(b"x" * 100)
    with pytest.raises(cf.NoKeyError, match="no key for version 7: it is not encrypted for"):
        cf.unwrap_key(m, OUTSIDER)


def test_tampered_ciphertext_fails_both_hash_and_decryption():
    plaintext = os.urandom(4000)
    ct, m = publish(plaintext)
    bad = bytearray(ct)
    bad[1500] ^= 1
    with pytest.raises(ChunkError, match="chunk 1 hash mismatch"):
        verify_chunk(m, 1, bytes(bad[1024:2048]))
    with pytest.raises(ChunkError, match="chunk 1 fails decryption"):
        cf.decrypt_payload(m, bytes(bad), NODES[1])


def test_chunks_are_bound_to_their_place():
    ct, m = publish(os.urandom(4000))
    key = cf.unwrap_key(m, NODES[0])
    chunks = split_payload(ct, 1024)
    with pytest.raises(ChunkError, match="chunk 0 fails"):
        cf.decrypt_chunk(m, key, 0, bytes(chunks[1]))  # swapped position
    _, other = publish(os.urandom(4000), version=8)
    with pytest.raises(ChunkError):
        cf.decrypt_chunk(other, key, 1, bytes(chunks[1]))  # another version


def test_wrapped_key_tampering_is_detected():
    _, m = publish(b"y" * 100)
    enc = copy.deepcopy(m.encryption)
    me = key_id(NODES[0].public_key())
    for r in enc["recipients"]:
        if r["id"] == me:
            r["wrapped"] = bytes([r["wrapped"][0] ^ 1]) + r["wrapped"][1:]
    forged = type(m)(**{**m.__dict__, "encryption": enc})
    with pytest.raises(ManifestError, match="does not open"):
        cf.unwrap_key(forged, NODES[0])


def test_nonces_are_distinct_per_chunk():
    nonces = {cf.chunk_nonce(i) for i in range(10_000)}
    assert len(nonces) == 10_000 and all(len(n) == 12 for n in nonces)


def test_plain_manifest_has_no_key():
    m = build_manifest(
        b"abc",
        model="m",
        version=1,
        kind="full",
        parent_version=None,
        parent_digest=None,
        target_digest=b"\x00" * 32,
        chunk_size=16,
        key_id=key_id(SIGNER),
    )
    assert not m.encrypted
    with pytest.raises(ManifestError, match="not encrypted"):
        cf.unwrap_key(m, NODES[0])


def test_encryption_field_validation():
    _, m = publish(os.urandom(2000))
    good = m.encryption
    wrong = [
        {**good, "alg": "chacha"},
        {**good, "epk": b"\x00" * 31},
        {**good, "plaintext_length": 1999},
        {**good, "plaintext_length": -1},
        {**good, "recipients": []},
        {**good, "recipients": [good["recipients"][0]] * 2},
        {**good, "recipients": list(reversed(good["recipients"]))},
        {**good, "recipients": [{"id": "zz", "wrapped": b"\x00" * 48}]},
        {**good, "recipients": [{"id": "0" * 32, "wrapped": b"\x00" * 47}]},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "epk"},
    ]
    for enc in wrong:
        with pytest.raises(ManifestError):
            cf.validate_encryption(enc, m)
    with pytest.raises(ManifestError, match="at least one recipient"):
        cf.encrypt_payload(b"x", 1024, [], model="m", version=1)
    with pytest.raises(ManifestError, match="chunk size"):
        cf.encrypt_payload(b"x", 16, [NODES[0].public_key()], model="m", version=1)
