"""Signed manifests: round trips, canonical form, tampering, limits, fuzzing."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import ManifestError
from swarm.trust import manifest as mf
from swarm.trust.chunks import chunk_hash
from swarm.trust.keys import TrustStore, key_id
from swarm.trust.manifest import (
    Manifest,
    build_manifest,
    canonical_packb,
    decode_manifest_unverified,
    sign_manifest,
    verify_manifest,
)

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
KID = key_id(KEY)
TRUST = TrustStore([KEY.public_key()])
D1, D2 = b"\x11" * 32, b"\x22" * 32


def make(payload: bytes = b"x" * 10_000, **kw) -> Manifest:
    args = dict(
        model="minilm",
        version=5,
        kind="patch",
        parent_version=4,
        parent_digest=D1,
        target_digest=D2,
        chunk_size=4096,
        key_id=KID,
        created_at=1_700_000_000.5,
    )
    args.update(kw)
    return build_manifest(payload, **args)


def body_of(raw: bytes) -> dict:
    env = msgpack.unpackb(raw, raw=False)
    return msgpack.unpackb(env[2], raw=False)


def sign_body(body: dict, key: Ed25519PrivateKey = KEY, kid: str = KID) -> bytes:
    """Sign an arbitrary body the way a trainer would: lets tests reach field validation."""
    b = canonical_packb(body)
    return canonical_packb([mf.ENVELOPE_TAG, kid, b, key.sign(mf.SIGNING_CONTEXT + b)])


# ----------------------------------------------------------------- round trip

digests = st.binary(min_size=32, max_size=32)


@st.composite
def manifests(draw):
    chunk_size = draw(st.integers(1, 5000))
    payload = draw(st.binary(max_size=20_000))
    version = draw(st.integers(1, mf.MAX_VERSION))
    full = version == 1 or draw(st.booleans())
    return build_manifest(
        payload,
        model=draw(st.from_regex(mf.MODEL_RE, fullmatch=True)),
        version=version,
        kind="full" if full else "patch",
        parent_version=None if full else draw(st.integers(1, version - 1)),
        parent_digest=None if full else draw(digests),
        target_digest=draw(digests),
        chunk_size=chunk_size,
        key_id=KID,
        created_at=draw(st.floats(0, 4e9, allow_nan=False)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests())
def test_sign_verify_round_trip(m):
    raw = sign_manifest(m, KEY)
    assert verify_manifest(raw, TRUST) == m
    assert decode_manifest_unverified(raw) == m
    # canonical: one manifest, one encoding (Ed25519 signatures are deterministic)
    assert sign_manifest(verify_manifest(raw, TRUST), KEY) == raw


def test_chunk_geometry():
    m = make(b"a" * 10_000, chunk_size=4096)
    assert m.chunk_count == 3
    assert [m.chunk_length(i) for i in range(3)] == [4096, 4096, 10_000 - 8192]
    assert m.chunk_hashes[0] == chunk_hash(b"a" * 4096)
    assert m.chunk_offset(2) == 8192
    with pytest.raises(IndexError):
        m.chunk_length(3)
    exact = make(b"a" * 8192, chunk_size=4096)
    assert exact.chunk_count == 2 and exact.chunk_length(1) == 4096
    assert make(b"", chunk_size=4096).chunk_count == 0


def test_full_checkpoint_has_no_parent():
    m = make(kind="full", parent_version=None, parent_digest=None)
    assert verify_manifest(sign_manifest(m, KEY), TRUST).kind == "full"
    with pytest.raises(ManifestError, match="no parent"):
        make(kind="full", parent_version=None, parent_digest=D1)
    with pytest.raises(ManifestError, match="parent_version"):
        make(kind="patch", parent_version=None)


# ------------------------------------------------------------------ tampering


def test_signature_covers_every_body_byte():
    raw = sign_manifest(make(), KEY)
    env = msgpack.unpackb(raw, raw=False)
    body = env[2]
    for pos in range(0, len(body), max(1, len(body) // 64)):
        flipped = bytearray(body)
        flipped[pos] ^= 0x01
        forged = canonical_packb([env[0], env[1], bytes(flipped), env[3]])
        with pytest.raises(ManifestError, match="bad signature"):
            verify_manifest(forged, TRUST)


TAMPERS = {
    "model": "other-model",
    "version": 6,
    "kind": "full",
    "parent_version": 3,
    "parent_digest": b"\x33" * 32,
    "target_digest": b"\x44" * 32,
    "payload_length": 9_999,
    "chunk_size": 4095,
    "chunk_hashes": b"\x55" * 96,
    "created_at": 1.0,
    "key_id": "0" * 32,
    "encryption": None,
    "fmt": 1,
}


@pytest.mark.parametrize("field", sorted(TAMPERS))
def test_tampering_any_field_breaks_the_signature(field):
    raw = sign_manifest(make(), KEY)
    env = msgpack.unpackb(raw, raw=False)
    body = body_of(raw)
    new = TAMPERS[field]
    if body[field] == new:  # make the change real for fields whose value already matches
        new = {"encryption": {"x": 1}, "fmt": 2}[field]
    body[field] = new
    forged = canonical_packb([env[0], env[1], canonical_packb(body), env[3]])
    with pytest.raises(ManifestError, match="bad signature"):
        verify_manifest(forged, TRUST)


def test_signature_from_another_key_is_refused():
    other = Ed25519PrivateKey.generate()
    raw = sign_manifest(make(key_id=key_id(other)), other)
    with pytest.raises(ManifestError, match="unknown signing key"):
        verify_manifest(raw, TRUST)
    # claiming a trusted key id while signing with another key
    env = msgpack.unpackb(sign_manifest(make(), KEY), raw=False)
    forged = canonical_packb([env[0], env[1], env[2], other.sign(mf.SIGNING_CONTEXT + env[2])])
    with pytest.raises(ManifestError, match="bad signature"):
        verify_manifest(forged, TRUST)


def test_envelope_and_body_key_ids_must_agree():
    k2 = Ed25519PrivateKey.generate()
    trust = TrustStore([KEY.public_key(), k2.public_key()])
    body = body_of(sign_manifest(make(), KEY))  # names KID
    raw = sign_body(body, key=k2, kid=key_id(k2))
    with pytest.raises(ManifestError, match="another key"):
        verify_manifest(raw, trust)


def test_sign_with_wrong_key_is_refused():
    with pytest.raises(ManifestError, match="signed with key"):
        sign_manifest(make(), Ed25519PrivateKey.generate())


def test_revoked_key_is_refused():
    trust = TrustStore([KEY.public_key()])
    raw = sign_manifest(make(), KEY)
    trust.revoke(KID)
    with pytest.raises(ManifestError, match="revoked"):
        verify_manifest(raw, trust)


# --------------------------------------------------------- field validation


def valid_body() -> dict:
    return body_of(sign_manifest(make(), KEY))


BAD_FIELDS = [
    ("model", ""),
    ("model", "m" * 129),
    ("model", "has space"),
    ("model", "-leading-dash"),
    ("model", 7),
    ("version", 0),
    ("version", -1),
    ("version", "5"),
    ("version", 1.0),
    ("version", True),
    ("kind", "delta"),
    ("parent_version", 5),  # not below version
    ("parent_version", 0),
    ("parent_digest", b"\x00" * 31),
    ("parent_digest", None),
    ("target_digest", b"\x00" * 33),
    ("target_digest", "00" * 32),
    ("payload_length", -1),
    ("payload_length", 20_000),  # hash count no longer matches
    ("chunk_size", 0),
    ("chunk_size", mf.MAX_CHUNK_SIZE + 1),
    ("chunk_hashes", b"\x00" * 95),
    ("chunk_hashes", [b"\x00" * 32] * 3),
    ("created_at", float("nan")),
    ("created_at", float("inf")),
    ("created_at", -1.0),
    ("created_at", 5),
    ("encryption", {"alg": "rot13"}),
    ("encryption", [1, 2]),
]


@pytest.mark.parametrize(
    ("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS]
)
def test_invalid_field_is_refused_even_when_signed(field, value):
    body = valid_body()
    body[field] = value
    with pytest.raises(ManifestError):
        verify_manifest(sign_body(body), TRUST)


def test_missing_field_is_refused():
    for field in mf.REQUIRED_KEYS:
        body = valid_body()
        del body[field]
        with pytest.raises(ManifestError):
            verify_manifest(sign_body(body), TRUST)


def test_format_version_rules():
    body = valid_body()
    body["fmt"] = 2
    with pytest.raises(ManifestError, match="unsupported manifest format 2"):
        verify_manifest(sign_body(body), TRUST)
    # format 1 tolerates optional "opt." fields, and only those
    body = valid_body()
    body["opt.comment"] = "built by run 17"
    body["opt.extra"] = {"nested": [1, 2, b"x"]}
    assert verify_manifest(sign_body(body), TRUST) == make()
    body = valid_body()
    body["priority"] = 1
    with pytest.raises(ManifestError, match="unknown manifest field"):
        verify_manifest(sign_body(body), TRUST)
    body = valid_body()
    for i in range(mf.MAX_OPTIONAL_FIELDS + 1):
        body[f"opt.{i}"] = i
    with pytest.raises(ManifestError, match="too many optional"):
        verify_manifest(sign_body(body), TRUST)


def test_non_canonical_encodings_are_refused():
    body = valid_body()
    unsorted = msgpack.packb(dict(reversed(list(body.items()))), use_bin_type=True)
    raw = canonical_packb([mf.ENVELOPE_TAG, KID, unsorted, KEY.sign(mf.SIGNING_CONTEXT + unsorted)])
    with pytest.raises(ManifestError, match="not canonically encoded"):
        verify_manifest(raw, TRUST)
    f32 = msgpack.packb(mf._canonical(body), use_bin_type=True, use_single_float=True)
    raw = canonical_packb([mf.ENVELOPE_TAG, KID, f32, KEY.sign(mf.SIGNING_CONTEXT + f32)])
    with pytest.raises(ManifestError):
        verify_manifest(raw, TRUST)
    good = sign_manifest(make(), KEY)
    with pytest.raises(ManifestError):
        verify_manifest(good + b"\x00", TRUST)  # trailing bytes


def test_size_limits():
    with pytest.raises(ManifestError, match="exceeds"):
        verify_manifest(b"\x00" * (mf.MAX_MANIFEST_BYTES + 1), TRUST)
    with pytest.raises(ManifestError, match="chunk size"):
        make(chunk_size=mf.MAX_CHUNK_SIZE + 1)
    with pytest.raises(ManifestError, match="payload_length"):
        make(b"\x00" * (mf.MAX_CHUNK_COUNT + 1), chunk_size=1)
    body = valid_body()
    body["chunk_hashes"] = b"\x00" * (32 * (mf.MAX_CHUNK_COUNT + 1))
    body["payload_length"] = mf.MAX_CHUNK_COUNT + 1
    body["chunk_size"] = 1
    with pytest.raises(ManifestError):
        verify_manifest(sign_body(body), TRUST)
    body = valid_body()
    body["opt.deep"] = [[[[[[[[[[1]]]]]]]]]]
    with pytest.raises(ManifestError, match="deeply"):
        verify_manifest(sign_body(body), TRUST)


def test_largest_allowed_manifest_verifies():
    hashes = tuple(os.urandom(32) for _ in range(mf.MAX_CHUNK_COUNT))
    m = dataclasses.replace(
        make(b""), payload_length=mf.MAX_CHUNK_COUNT * 4096, chunk_size=4096, chunk_hashes=hashes
    )
    raw = sign_manifest(m, KEY)
    assert len(raw) <= mf.MAX_MANIFEST_BYTES
    assert verify_manifest(raw, TRUST).chunk_count == mf.MAX_CHUNK_COUNT


# ---------------------------------------------------------------------- fuzz


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_raise_manifest_error_only(data):
    with pytest.raises(ManifestError):
        verify_manifest(data, TRUST)
    with pytest.raises(ManifestError):
        decode_manifest_unverified(data)


VALID_RAW = sign_manifest(make(b"y" * 9000, chunk_size=1000), KEY)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_manifests_raise_manifest_error_only(data):
    raw = bytearray(VALID_RAW)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del raw[pos:]
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del raw[pos : pos + data.draw(st.integers(1, 8))]
    if bytes(raw) == VALID_RAW:
        return
    with pytest.raises(ManifestError):
        verify_manifest(bytes(raw), TRUST)


# signed-but-hostile bodies: everything past the signature must fail cleanly too
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(mf.REQUIRED_KEYS)), msgpack_values), st.data())
def test_signed_hostile_bodies_raise_manifest_error_only(overrides, data):
    body = valid_body() if data.draw(st.booleans()) else {}
    body.update(overrides)
    # any outcome but ManifestError (or success) fails the test
    with contextlib.suppress(ManifestError):
        verify_manifest(sign_body(body), TRUST)


def test_deeply_nested_input_does_not_crash():
    for raw in (b"\x91" * 100_000, b"\x81\xa1a" * 50_000, b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(ManifestError):
            verify_manifest(raw, TRUST)
