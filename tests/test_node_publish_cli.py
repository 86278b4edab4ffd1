"""The one-shot ``patchswarm publish`` against a real loopback fleet.

Every ``patchswarm publish`` starts a fresh origin (same address, state from its
store), seeds one version and exits. Nodes must come back to it on their own:
border nodes redial a lost origin, the new origin grants borders again and keeps
seeding what it stored. Two versions in a row, each checked bitwise on every node.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from lab.fleet import LoopbackFleet
from swarm.codec import state_digest
from trainer.served import served_view


def _masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"enc.weight": torch.randn(384, 384, generator=g),
            "enc.bias": torch.randn(384, generator=g),
            "emb.weight": torch.randn(1000, 64, generator=g)}


def _step(masters: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small move of the FP32 masters: some BF16 values change, most do not."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 2e-3 * torch.randn(v.shape, generator=g) for k, v in masters.items()}


def test_one_shot_publish_cli_reaches_every_node(tmp_path: Path) -> None:
    masters = _masters(0)
    with LoopbackFleet(2, 2, chunk_size=8 * 1024, swarm={"redial_s": 1.0}) as fleet:
        fleet.start_nodes_only(served_view(masters, "bf16"))
        for k, version in enumerate((2, 3)):
            masters = _step(masters, k + 1)
            path = tmp_path / f"step{k}.safetensors"
            save_file(masters, str(path))  # FP32: the command makes the served view
            # the first run knows no regions yet; the second waits for those the first met
            extra = ["--regions", "2"] if k == 0 else []
            r = fleet.publish_cli(path, "--wait-peers", "30", "--linger", "3", "--timeout", "120",
                                  *extra)
            assert r.returncode == 0, fleet.trainer_log.read_text()[-2000:]
            assert f"version {version} seeded into 2 region(s)" in r.stdout
            statuses = fleet.wait_version(version, timeout=60)
            want = state_digest(served_view(masters, "bf16")).hex()
            assert {st["active_digest"] for st in statuses.values()} == {want}
        assert (fleet.workdir / "trainer-store" / "regions.json").exists()
