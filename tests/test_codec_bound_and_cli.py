"""The entropy bound on hand-made cases, and the codec CLI contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from swarm.codec import entropy_bound, state_digest
from swarm.codec.bound import binary_entropy, empirical_entropy
from swarm.codec.dtypes import BY_TORCH
from swarm.codec.safetensors_io import load_checkpoint, save_checkpoint
from tests.codec_cases import mutate, random_tensor, same_bits


def _bf16(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def test_bound_two_plus_one_ulp_changes_of_eight():
    old = {"w": _bf16([0x3F80] * 8)}
    new = {"w": _bf16([0x3F81, 0x3F81] + [0x3F80] * 6)}
    b = entropy_bound(old, new)
    assert (b.elements, b.changed) == (8, 2)
    assert b.position_bits == pytest.approx(8 * binary_entropy(0.25))
    assert b.value_bits == 0.0  # one symbol: no information
    assert b.bytes == pytest.approx(8 * 0.8112781244591328 / 8)


def test_bound_signed_ulps_cross_zero_and_added_tensor():
    # -0.0 -> +0.0 is +1 ordinal; +0.0 -> -0.0 is -1: two symbols, 1 bit each.
    old = {"w": _bf16([0x8000, 0x0000, 0x3F80, 0x3F80])}
    new = {"w": _bf16([0x0000, 0x8000, 0x3F80, 0x3F80]), "extra": torch.zeros(3)}
    b = entropy_bound(old, new)
    assert b.changed == 2 and b.raw_bytes == 12
    assert b.value_bits == pytest.approx(2.0)
    assert b.position_bits == pytest.approx(4.0)


def test_entropy_helpers():
    assert binary_entropy(0.5) == 1.0 and binary_entropy(0.0) == 0.0
    assert empirical_entropy({1: 3, -1: 1}) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "patchswarm", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    rng = np.random.default_rng(5)
    bf16 = BY_TORCH[torch.bfloat16]
    old = {"x.weight": random_tensor(rng, bf16, (128, 64)), "x.bias": random_tensor(rng, bf16, (64,))}
    new = {k: mutate(rng, v, bf16, 0.1) for k, v in old.items()}
    save_checkpoint(old, d / "old.safetensors")
    save_checkpoint(new, d / "new.safetensors")
    return d, old, new


def test_cli_diff_apply_inspect_roundtrip(checkpoints):
    d, _old, new = checkpoints
    r = _cli("diff", str(d / "old.safetensors"), str(d / "new.safetensors"), "-o", str(d / "p.patch"), "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    for key in ("elements", "changed", "full_bytes", "patch_bytes", "entropy_bound_bytes", "encode_s"):
        assert key in stats
    assert stats["patch_bytes"] == (d / "p.patch").stat().st_size
    r = _cli("apply", str(d / "old.safetensors"), str(d / "p.patch"), "-o", str(d / "out.safetensors"))
    assert r.returncode == 0, r.stderr
    out = load_checkpoint(d / "out.safetensors")
    assert same_bits(out, new) and state_digest(out) == bytes.fromhex(stats["target_digest"])
    r = _cli("inspect", str(d / "p.patch"), "--json")
    info = json.loads(r.stdout)
    assert {rec["name"] for rec in info["records"]} == {"x.weight", "x.bias"}
    assert _cli("inspect", str(d / "p.patch")).stdout.startswith("patch format v1")


@pytest.mark.parametrize("damage", ["truncate", "wrong-base", "not-a-patch", "missing"])
def test_cli_apply_bad_input_one_line_no_output(checkpoints, damage):
    d, _old, _new = checkpoints
    subprocess.run([sys.executable, "-m", "patchswarm", "diff", str(d / "old.safetensors"),
                    str(d / "new.safetensors"), "-o", str(d / "q.patch")], check=True, timeout=120)
    patch = (d / "q.patch").read_bytes()
    base = d / "old.safetensors"
    if damage == "truncate":
        (d / "q.patch").write_bytes(patch[: len(patch) // 2])
    elif damage == "wrong-base":
        base = d / "new.safetensors"
    elif damage == "not-a-patch":
        (d / "q.patch").write_bytes(b"hello world, this is not a patch")
    else:
        (d / "q.patch").unlink()
    out = d / f"out-{damage}.safetensors"
    r = _cli("apply", str(base), str(d / "q.patch"), "-o", str(out))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("patchswarm apply: error:"), r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_cli_help_lists_commands():
    r = _cli("--help")
    assert r.returncode == 0
    for cmd in ("diff", "apply", "inspect"):
        assert cmd in r.stdout
