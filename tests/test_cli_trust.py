"""The keygen / pack / verify command lines, in the exact forms operators call."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from patchswarm.cli import main
from swarm.trust.keys import TrustStore, load_private_key
from swarm.trust.manifest import verify_manifest

ROOT = Path(__file__).resolve().parents[1]
A, B = "aa" * 32, "bb" * 32


@pytest.fixture
def keys(tmp_path):
    assert main(["keygen", str(tmp_path / "trainer.key")]) == 0
    assert main(["keygen", str(tmp_path / "other.key")]) == 0
    return tmp_path / "trainer.key", tmp_path / "other.key"


def pack(tmp_path, key, *extra, payload=None, name="out"):
    p = tmp_path / "payload.bin"
    if payload is not None or not p.exists():
        p.write_bytes(os.urandom(100_000) if payload is None else payload)
    out = tmp_path / name
    rc = main(["pack", str(p), "--key", str(key), "--model", "minilm", *extra, "-o", str(out)])
    return rc, out


def verify(out, *pubs):
    args = ["verify", str(out)]
    for p in pubs:
        args += ["--trust", str(p)]
    return main(args)


def test_keygen_writes_private_0600_and_public(keys, capsys):
    key, _ = keys
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert Path(f"{key}.pub").exists()
    assert main(["keygen", str(key)]) == 1
    assert "already exists" in capsys.readouterr().err


def test_pack_then_verify(tmp_path, keys, capsys):
    key, other = keys
    rc, out = pack(
        tmp_path,
        key,
        "--version", "5",
        "--parent-version", "4",
        "--parent-digest", A,
        "--target-digest", B,
        "--chunk-size", "30000",
    )  # fmt: skip
    assert rc == 0
    assert sorted(os.listdir(out / "chunks")) == [f"{i:08d}" for i in range(4)]
    assert verify(out, f"{key}.pub") == 0
    assert "ok: minilm version 5" in capsys.readouterr().out
    assert verify(out, f"{other}.pub", f"{key}.pub") == 0  # any trusted key will do
    m = verify_manifest((out / "manifest").read_bytes(), TrustStore.from_files([f"{key}.pub"]))
    assert (m.version, m.parent_version, m.parent_digest.hex(), m.target_digest.hex()) == (
        5, 4, A, B,
    )  # fmt: skip


def failure(out, *pubs, capsys) -> str:
    capsys.readouterr()
    assert verify(out, *pubs) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("patchswarm verify: error:")
    return err


def test_verify_names_what_failed(tmp_path, keys, capsys):
    key, other = keys
    rc, out = pack(tmp_path, key, "--version", "1", "--full", "--target-digest", B,
                   "--chunk-size", "30000")  # fmt: skip
    assert rc == 0
    assert "unknown signing key" in failure(out, f"{other}.pub", capsys=capsys)
    c2 = out / "chunks" / "00000002"
    data = bytearray(c2.read_bytes())
    data[7] ^= 1
    c2.write_bytes(data)
    assert "chunk 2 hash mismatch" in failure(out, f"{key}.pub", capsys=capsys)
    (out / "chunks" / "00000001").unlink()
    assert "missing chunk 1" in failure(out, f"{key}.pub", capsys=capsys)
    raw = bytearray((out / "manifest").read_bytes())
    raw[-10] ^= 1
    (out / "manifest").write_bytes(raw)
    assert "bad signature" in failure(out, f"{key}.pub", capsys=capsys)
    (out / "manifest").write_bytes(b"not a manifest")
    assert "not valid msgpack" in failure(out, f"{key}.pub", capsys=capsys)
    assert "cannot read" in failure(tmp_path / "nowhere", f"{key}.pub", capsys=capsys)


def test_pack_argument_errors(tmp_path, keys, capsys):
    key, _ = keys
    for extra, msg in [
        (["--version", "2", "--target-digest", B], "needs --parent-version"),
        (["--version", "2", "--parent-version", "1", "--target-digest", B], "--parent-digest"),
        (["--version", "2", "--full"], "--target-digest"),
        (["--version", "2", "--full", "--parent-version", "1", "--target-digest", B], "--full"),
        (["--version", "0", "--full", "--target-digest", B], "version"),
        (["--version", "2", "--full", "--target-digest", "abc"], "hex"),
        (["--version", "2", "--full", "--target-digest", B, "--chunk-size", "0"], "--chunk-size must be"),
    ]:
        rc, _ = pack(tmp_path, key, *extra)
        assert rc == 1
        assert msg in capsys.readouterr().err


def test_pack_reads_digests_from_a_codec_patch_and_a_checkpoint(tmp_path, keys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    from swarm.codec import encode_patch, state_digest

    key, _ = keys
    old = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][::97] = 1.0
    patch = encode_patch(old, new)
    (tmp_path / "p.patch").write_bytes(patch.patch)
    out = tmp_path / "patch-out"
    assert main(["pack", str(tmp_path / "p.patch"), "--key", str(key), "--model", "m",
                 "--version", "2", "--parent-version", "1", "-o", str(out)]) == 0  # fmt: skip
    m = verify_manifest((out / "manifest").read_bytes(), TrustStore.from_files([f"{key}.pub"]))
    assert m.parent_digest == state_digest(old) and m.target_digest == state_digest(new)
    (tmp_path / "w.safetensors").write_bytes(save(new))
    out = tmp_path / "full-out"
    assert main(["pack", str(tmp_path / "w.safetensors"), "--key", str(key), "--model", "m",
                 "--version", "2", "--full", "-o", str(out)]) == 0  # fmt: skip
    m = verify_manifest((out / "manifest").read_bytes(), TrustStore.from_files([f"{key}.pub"]))
    assert m.kind == "full" and m.target_digest == state_digest(new)


def test_confidential_pack(tmp_path, keys):
    from swarm.trust.confidential import decrypt_payload

    key, _ = keys
    node = tmp_path / "node.key"
    assert main(["keygen", "--x25519", str(node)]) == 0
    plaintext = os.urandom(50_000)
    rc, out = pack(tmp_path, key, "--version", "3", "--full", "--target-digest", B,
                   "--chunk-size", "10000", "--recipient", f"{node}.pub",
                   payload=plaintext)  # fmt: skip
    assert rc == 0 and verify(out, f"{key}.pub") == 0
    m = verify_manifest((out / "manifest").read_bytes(), TrustStore.from_files([f"{key}.pub"]))
    ct = b"".join((out / "chunks" / f"{i:08d}").read_bytes() for i in range(m.chunk_count))
    assert plaintext not in ct
    assert decrypt_payload(m, ct, load_private_key(node)) == plaintext


def test_real_process_exit_codes(tmp_path):
    """The installed entry point: exit status and a one-line reason, no traceback."""

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "patchswarm", *args],
            capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip

    key = tmp_path / "k"
    assert main(["keygen", str(key)]) == 0
    (tmp_path / "p").write_bytes(b"z" * 5000)
    assert main(["pack", str(tmp_path / "p"), "--key", str(key), "--model", "m", "--version", "1",
                 "--full", "--target-digest", B, "--chunk-size", "1000",
                 "-o", str(tmp_path / "o")]) == 0  # fmt: skip
    assert run("verify", str(tmp_path / "o"), "--trust", f"{key}.pub").returncode == 0
    (tmp_path / "o" / "chunks" / "00000003").write_bytes(b"y" * 1000)
    r = run("verify", str(tmp_path / "o"), "--trust", f"{key}.pub")
    assert r.returncode == 1
    assert r.stderr.strip() == "patchswarm verify: error: chunk 3 hash mismatch"
