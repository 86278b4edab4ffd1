"""The one-line-error contract for CLI outputs (issue #10): a bad output path, a bad
payload or a full disk ends in one line on stderr, exit 1, and no stray or partial file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from patchswarm.cli import main


@pytest.fixture
def ckpts(tmp_path):
    old = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    new = {"w": torch.arange(64, dtype=torch.bfloat16)}
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    assert main(["diff", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"),
                 "-o", str(tmp_path / "x.patch")]) == 0
    return tmp_path


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def no_stray_files(directory: Path, *expected: str) -> None:
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(expected), names


@pytest.mark.parametrize("cmd", ["diff", "apply"])
def test_output_in_missing_directory(ckpts, capsys, cmd):
    out = ckpts / "missing" / "out.bin"
    args = ([cmd, str(ckpts / "old.safetensors"), str(ckpts / "new.safetensors")] if cmd == "diff"
            else [cmd, str(ckpts / "old.safetensors"), str(ckpts / "x.patch")])
    assert main([*args, "-o", str(out)]) == 1
    one_line_error(capsys, "does not exist")


@pytest.mark.parametrize("cmd", ["diff", "apply"])
def test_output_on_an_existing_directory(ckpts, capsys, cmd):
    (ckpts / "adir").mkdir()
    args = ([cmd, str(ckpts / "old.safetensors"), str(ckpts / "new.safetensors")] if cmd == "diff"
            else [cmd, str(ckpts / "old.safetensors"), str(ckpts / "x.patch")])
    assert main([*args, "-o", str(ckpts / "adir")]) == 1
    one_line_error(capsys, "is a directory")
    no_stray_files(ckpts, "old.safetensors", "new.safetensors", "x.patch", "adir")


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("cmd", ["diff", "apply"])
def test_output_in_read_only_directory(ckpts, capsys, cmd):
    ro = ckpts / "ro"
    if not _mount_tmpfs(ro, "ro,size=1m"):
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        args = ([cmd, str(ckpts / "old.safetensors"), str(ckpts / "new.safetensors")]
                if cmd == "diff" else [cmd, str(ckpts / "old.safetensors"), str(ckpts / "x.patch")])
        assert main([*args, "-o", str(ro / "out.bin")]) == 1
        one_line_error(capsys, "is not writable")
        assert list(ro.iterdir()) == []
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_full_disk_leaves_no_partial_output(ckpts, capsys):
    """A patch bigger than the space left: error, and neither the output nor a temp file."""
    full = ckpts / "full"
    if not _mount_tmpfs(full, "size=64k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        big_old = {"w": torch.zeros(1 << 18, dtype=torch.float32)}
        big_new = {"w": torch.randn(1 << 18, dtype=torch.float32)}  # ~1 MiB incompressible
        save_file(big_old, ckpts / "bo.safetensors")
        save_file(big_new, ckpts / "bn.safetensors")
        assert main(["diff", str(ckpts / "bo.safetensors"), str(ckpts / "bn.safetensors"),
                     "-o", str(full / "x.patch")]) == 1
        one_line_error(capsys, "cannot write", "No space left")
        assert list(full.iterdir()) == []
    finally:
        subprocess.run(["umount", str(full)], check=True)


@pytest.fixture
def key(tmp_path):
    assert main(["keygen", str(tmp_path / "k.key")]) == 0
    return tmp_path / "k.key"


def test_pack_garbage_safetensors_full(tmp_path, key, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + bytes(20))
    rc = main(["pack", str(bad), "--key", str(key), "--model", "m", "--version", "1", "--full",
               "-o", str(tmp_path / "out")])
    assert rc == 1
    one_line_error(capsys, "not a readable safetensors file")
    assert not (tmp_path / "out").exists()


def test_pack_refuses_a_patch_as_full(ckpts, key, capsys):
    rc = main(["pack", str(ckpts / "x.patch"), "--key", str(key), "--model", "m", "--version", "1",
               "--full", "-o", str(ckpts / "out")])
    assert rc == 1
    one_line_error(capsys, "is a patch; --full takes a whole safetensors checkpoint")


@pytest.mark.parametrize("size", ["0", "-5", str(1 << 40)])
def test_pack_bad_chunk_size(ckpts, key, capsys, size):
    rc = main(["pack", str(ckpts / "new.safetensors"), "--key", str(key), "--model", "m",
               "--version", "1", "--full", "--chunk-size", size, "-o", str(ckpts / "out")])
    assert rc == 1
    one_line_error(capsys, "--chunk-size must be")


def test_repack_replaces_old_pack_whole_and_keeps_it_on_failure(ckpts, key, capsys, monkeypatch):
    out = ckpts / "out"
    args = ["pack", str(ckpts / "new.safetensors"), "--key", str(key), "--model", "m", "--full",
            "--chunk-size", "100", "-o", str(out)]
    assert main([*args, "--version", "1"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert len(before) > 2
    # A disk that fills up while the new pack is written: the old pack stays whole.
    import swarm.trust.cli_pack as cli_pack

    calls = {"n": 0}
    real = cli_pack._write_synced

    def failing(path, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(cli_pack, "_write_synced", failing)
    assert main([*args, "--version", "2"]) == 1
    one_line_error(capsys, "No space left")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith(".")) == []
    monkeypatch.setattr(cli_pack, "_write_synced", real)
    assert main([*args, "--version", "2", "--chunk-size", "64"]) == 0
    assert main(["verify", str(out), "--trust", f"{key}.pub"]) == 0


def test_pack_refuses_to_replace_a_directory_that_is_not_a_pack(ckpts, key, capsys):
    (ckpts / "home").mkdir()
    (ckpts / "home" / "precious.txt").write_text("keep me")
    rc = main(["pack", str(ckpts / "new.safetensors"), "--key", str(key), "--model", "m",
               "--version", "1", "--full", "-o", str(ckpts / "home")])
    assert rc == 1
    one_line_error(capsys, "holds no pack")
    assert (ckpts / "home" / "precious.txt").read_text() == "keep me"
