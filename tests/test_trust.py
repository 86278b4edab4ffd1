"""Trust store, key ids, key files, and the applicability rules (replay, rollback, parent)."""

from __future__ import annotations

import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from swarm.errors import ManifestError
from swarm.trust.keys import (
    TrustStore,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
)
from swarm.trust.manifest import build_manifest, sign_manifest, verify_manifest

K1 = Ed25519PrivateKey.generate()
K2 = Ed25519PrivateKey.generate()
S4, S5, S6 = b"\x04" * 32, b"\x05" * 32, b"\x06" * 32


def manifest(version, *, kind="patch", parent=None, parent_digest=S4, key=K1, model="m"):
    full = kind == "full"
    return build_manifest(
        b"payload",
        model=model,
        version=version,
        kind=kind,
        parent_version=None if full else (version - 1 if parent is None else parent),
        parent_digest=None if full else parent_digest,
        target_digest=S6,
        chunk_size=4,
        key_id=key_id(key),
    )


def test_key_id_shape_and_stability():
    kid = key_id(K1.public_key())
    assert len(kid) == 32 and int(kid, 16) >= 0 and kid == kid.lower()
    assert key_id(K1) == kid  # a private key is named by its public half
    assert key_id(K2) != kid
    with pytest.raises(ValueError):
        key_id(b"short")


def test_rotation_several_keys_valid_at_once():
    trust = TrustStore([K1.public_key()])
    r1 = sign_manifest(manifest(5), K1)
    r2 = sign_manifest(manifest(6, key=K2), K2)
    verify_manifest(r1, trust)
    with pytest.raises(ManifestError, match="unknown signing key"):
        verify_manifest(r2, trust)
    trust.add(K2.public_key())
    assert trust.key_ids() == sorted([key_id(K1), key_id(K2)])
    verify_manifest(r1, trust)
    verify_manifest(r2, trust)
    trust.revoke(key_id(K1))  # rotation complete: the old key goes
    with pytest.raises(ManifestError, match="revoked"):
        verify_manifest(r1, trust)
    verify_manifest(r2, trust)
    assert len(trust) == 1 and trust.is_revoked(key_id(K1)) and not trust.is_trusted(key_id(K1))


def test_revocation_is_sticky_and_may_precede_the_key():
    trust = TrustStore()
    trust.revoke(key_id(K1))
    with pytest.raises(ManifestError, match="revoked"):
        trust.add(K1.public_key())
    with pytest.raises(ManifestError, match="revoked"):
        trust.get(key_id(K1))
    with pytest.raises(TypeError):
        trust.add(X25519PrivateKey.generate().public_key())


def test_check_applicable_accepts_the_next_patch_and_any_newer_full():
    trust = TrustStore([K1.public_key()])
    trust.check_applicable(manifest(5), 4, S4)
    trust.check_applicable(manifest(9, kind="full"), 4, S4)
    trust.check_applicable(manifest(1, kind="full"), None, None)
    trust.check_applicable(manifest(5), 4, S4, model="m")


@pytest.mark.parametrize(
    ("m", "held_version", "held_digest", "reason"),
    [
        (manifest(4, parent=3), 4, S4, "not newer"),  # replay
        (manifest(3, parent=2), 4, S4, "not newer"),  # rollback
        (manifest(4, kind="full"), 4, S4, "not newer"),  # full checkpoint replayed
        (manifest(6, parent=5), 4, S4, "patches version 5"),  # gap
        (manifest(5), 4, S5, "does not match"),  # same parent version, other state
        (manifest(5), None, None, "no state is held"),
    ],
)
def test_check_applicable_refusals(m, held_version, held_digest, reason):
    trust = TrustStore([K1.public_key()])
    with pytest.raises(ManifestError, match=reason):
        trust.check_applicable(m, held_version, held_digest)


def test_check_applicable_refuses_other_model_and_revoked_key():
    trust = TrustStore([K1.public_key()])
    with pytest.raises(ManifestError, match="model"):
        trust.check_applicable(manifest(5, model="other"), 4, S4, model="m")
    trust.revoke(key_id(K1))
    with pytest.raises(ManifestError, match="revoked"):
        trust.check_applicable(manifest(5), 4, S4)


def test_key_files_round_trip(tmp_path):
    path = tmp_path / "trainer.key"
    key, kid = generate_keypair(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (tmp_path / "trainer.key.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert key_id(load_private_key(path)) == kid == key_id(load_public_key(f"{path}.pub"))
    trust = TrustStore.from_files([f"{path}.pub"])
    verify_manifest(sign_manifest(manifest(5, key=key), key), trust)
    with pytest.raises(ManifestError, match="already exists"):
        generate_keypair(path)
    assert not list(tmp_path.glob(".*tmp"))


def test_x25519_key_files(tmp_path):
    path = tmp_path / "node.key"
    _, kid = generate_keypair(path, kind="x25519")
    assert isinstance(load_private_key(path), X25519PrivateKey)
    assert key_id(load_public_key(f"{path}.pub")) == kid
    with pytest.raises(ManifestError, match="not an Ed25519 signing key"):
        TrustStore.from_files([f"{path}.pub"])


@pytest.mark.parametrize(
    "content", [b"", b"garbage", b"-----BEGIN PUBLIC KEY-----\nAAAA\n", b"x" * 20_000]
)
def test_bad_key_files_raise_manifest_error(tmp_path, content):
    p = tmp_path / "bad"
    p.write_bytes(content)
    with pytest.raises(ManifestError):
        load_public_key(p)
    with pytest.raises(ManifestError):
        load_private_key(p)
    with pytest.raises(ManifestError, match="cannot read"):
        load_public_key(tmp_path / "missing")
