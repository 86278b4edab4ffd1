"""The one-shot ``patchswarm publish`` (issue #11) against a real loopback fleet.

The origin sits in region-0 with two of the nodes, so ``--regions 2`` counts its
own region; the command waits for the 4 nodes before the hand-off, waits until
every node of both regions serves the version, and prints one JSON line with its
timings; ``--log-json`` logs say what it waited for. Then ``--full`` ships an
anchor the same way. With no node at all it says so and fails within its bounds.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lab.fleet import LoopbackFleet
from swarm.codec import state_digest
from trainer.served import served_view


def masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"enc.weight": torch.randn(256, 256, generator=g),
            "enc.bias": torch.randn(256, generator=g)}


def step(m: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 2e-3 * torch.randn(v.shape, generator=g) for k, v in m.items()}


def logs(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def test_publish_waits_for_every_region_its_own_included(tmp_path: Path) -> None:
    m = masters(0)
    with LoopbackFleet(2, 2, chunk_size=8 * 1024, swarm={"redial_s": 1.0}) as fleet:
        fleet.start_nodes_only(served_view(m, "bf16"))
        toml = fleet.workdir / "trainer.toml"
        toml.write_text(toml.read_text().replace('region = "trainer"', 'region = "region-0"'))
        for k, (version, extra) in enumerate(((2, []), (3, ["--full"]))):
            m = step(m, k + 1)
            path = tmp_path / f"step{k}.safetensors"
            save_file(m, str(path))
            r = fleet.publish_cli(path, "--regions", "2", "--nodes", "4", "--wait-peers-s", "30",
                                  "--timeout", "90", "--linger", "0", "--json", "--log-json",
                                  *extra)
            assert r.returncode == 0, fleet.trainer_log.read_text()[-3000:]
            doc = json.loads(r.stdout.strip().splitlines()[-1])
            assert doc["ok"] and doc["version"] == version and doc["missing"] == []
            assert doc["kind"] == ("full" if extra else "patch")
            t = doc["timings"]
            assert set(t["regions"]) == {"region-0", "region-1"}
            assert t["origin_up_s"] <= t["peers_s"] <= t["handoff_s"] <= t["done_s"]
            assert all(t["handoff_s"] <= s <= t["done_s"] for s in t["regions"].values())
            assert doc["encode_s"] >= 0 and doc["bytes"] > 0
            # every node serves it, bitwise the trainer's served view
            want = state_digest(served_view(m, "bf16")).hex()
            statuses = fleet.wait_version(version, timeout=30)
            assert {st["active_digest"] for st in statuses.values()} == {want}
        msgs = [e["msg"] for e in logs(fleet.trainer_log)]
        assert any(s.startswith("origin up at") for s in msgs)
        assert any(s.startswith("waiting up to") and "2 region(s) and 4 node(s)" in s
                   for s in msgs)
        assert any(s.startswith("peers: 2 region(s)") for s in msgs)
        assert any("handed to the swarm" in s for s in msgs)
        assert any(s.startswith("region region-0: version 3 there") for s in msgs)
        remembered = json.loads((fleet.workdir / "trainer-store" / "regions.json").read_text())
        assert remembered["regions"] == ["region-0", "region-1"]
        assert sorted(remembered["nodes"]) == ["n0-0", "n0-1", "n1-0", "n1-1"]


def test_publish_into_an_empty_swarm_says_so(tmp_path: Path) -> None:
    m = masters(0)
    with LoopbackFleet(1, 1, chunk_size=8 * 1024) as fleet:
        fleet.start_nodes_only(served_view(m, "bf16"), nodes=[])
        path = tmp_path / "new.safetensors"
        save_file(step(m, 1), str(path))
        r = fleet.publish_cli(path, "--wait-peers-s", "1", "--timeout", "1", "--json")
        assert r.returncode == 1
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        assert not doc["ok"] and doc["version"] == 2 and doc["timings"]["peers_s"] >= 1.0
        text = fleet.trainer_log.read_text()
        assert "no node connected within" in text
        assert "did not reach every region" in text
