"""The in-process weight holder: stage, atomic commit, digest checks, full checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from node.weights import InProcessWeights, pick_device
from swarm.codec import encode_patch, state_digest
from swarm.errors import PatchApplyError, PatchswarmError


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "b": torch.randn(100, generator=g).to(torch.bfloat16)}


def _moved(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in s.items()}
    out["a"][3, :5] += 1.0
    out["b"][7] = 0.5
    return out


@pytest.fixture
def holder(tmp_path: Path) -> InProcessWeights:
    save_file(_state(0), str(tmp_path / "base.safetensors"))
    return InProcessWeights.load(tmp_path / "base.safetensors", 1, "cpu")


def test_patch_commits_bitwise(holder: InProcessWeights) -> None:
    base, new = _state(0), _moved(_state(0))
    enc = encode_patch(base, new)
    assert holder.digest == state_digest(base)
    holder.stage(2, "patch", enc.patch, enc.base_digest)
    assert holder.version == 1  # staging does not touch the served state
    digest = holder.commit(2, enc.target_digest)
    assert digest == state_digest(new) and holder.version == 2
    snap = holder.snapshot()
    assert all(torch.equal(snap[k].view(torch.int16), new[k].view(torch.int16)) for k in new)


def test_patch_for_another_base_is_refused(holder: InProcessWeights) -> None:
    enc = encode_patch(_state(5), _moved(_state(5)))
    with pytest.raises(PatchswarmError):
        holder.stage(2, "patch", enc.patch, enc.base_digest)
    assert holder.version == 1 and holder.digest == state_digest(_state(0))


def test_wrong_promised_digest_leaves_base(holder: InProcessWeights) -> None:
    enc = encode_patch(_state(0), _moved(_state(0)))
    holder.stage(2, "patch", enc.patch, enc.base_digest)
    with pytest.raises(PatchApplyError):
        holder.commit(2, b"\x00" * 32)
    assert holder.version == 1 and holder.digest == state_digest(_state(0))
    assert state_digest(holder.snapshot()) == state_digest(_state(0))


def test_old_version_and_unstaged_commit_are_refused(holder: InProcessWeights) -> None:
    with pytest.raises(PatchApplyError):
        holder.stage(1, "patch", b"", None)
    with pytest.raises(PatchApplyError):
        holder.commit(3, b"\x00" * 32)


def test_full_checkpoint_replaces_state(holder: InProcessWeights) -> None:
    new = _state(9)
    holder.stage(4, "full", save(new), None)
    assert holder.commit(4, state_digest(new)) == state_digest(new)
    holder.stage(5, "full", save(_state(1)), None)
    with pytest.raises(PatchApplyError):
        holder.commit(5, state_digest(new))
    assert holder.version == 4 and holder.digest == state_digest(new)


def test_auto_device_is_cuda_only_when_present() -> None:
    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_loaded_weights_are_the_process_own_memory(tmp_path: Path) -> None:
    """safetensors maps the file privately: weights left on that mapping would change
    when the file is rewritten in place (pages never written show the file) and would
    copy every page on the first patch. The holder keeps its own copy."""
    path = tmp_path / "base.safetensors"
    state = {"a": torch.arange(4096, dtype=torch.int16).to(torch.bfloat16)}
    save_file(state, str(path))
    h = InProcessWeights.load(path, 1, "cpu")
    before = state_digest(h.weights)
    raw = bytearray(path.read_bytes())
    raw[-4096:] = bytes(4096)  # the tensor's tail, rewritten in place (same inode)
    with path.open("r+b") as f:
        f.write(raw)
    assert state_digest(h.weights) == before
    assert torch.equal(h.weights["a"], state["a"])
