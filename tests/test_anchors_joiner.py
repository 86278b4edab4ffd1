"""A fresh joiner reaches the newest version through an anchor (issue #12), with real
node processes on loopback and the trainer's ``Publisher`` in this process.

The trainer publishes with ``anchor_every = 3`` and, while it runs, collects its store
(``keep_versions = 1``; the core announces the last 3 versions and forgets the
others), so when the joiner starts, the old patches are gone: it must take the
newest anchor and the patches after it, and end bitwise equal to the trainer's state. The bytes it
fetched are compared with what the whole chain of patches would have cost.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from lab.fleet import LoopbackFleet, NodeProc, until
from node.config import load_config
from swarm.codec import state_digest
from trainer.publisher import Publisher
from trainer.served import served_view


def masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"enc.weight": torch.randn(256, 256, generator=g),
            "enc.bias": torch.randn(256, generator=g),
            "emb.weight": torch.randn(500, 64, generator=g)}


def step(m: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 5e-4 * torch.randn(v.shape, generator=g) for k, v in m.items()}


def received(st: dict) -> int:
    return sum(st["bytes"]["received"].values())


@pytest.mark.parametrize(("window", "restart"), [
    (3, False),
    pytest.param(3, True, marks=pytest.mark.slow, id="and-a-collected-node-restarts"),
    pytest.param(10, False, marks=pytest.mark.slow, id="chain-announced-and-cheaper")])
def test_fresh_joiner_takes_the_newest_anchor(capsys, window: int, restart: bool) -> None:
    """``window``: versions the cores announce ([swarm] keep_versions). With 3, the old
    patches are neither announced nor kept: the joiner must take the anchor. With 10
    the whole chain is offered too, and it is cheaper: the core picks it by bytes."""
    m = masters(0)
    with LoopbackFleet(1, 3, chunk_size=8 * 1024,
                       swarm={"redial_s": 1.0, "keep_versions": window},
                       trainer_sections={"publish": {"anchor_every": 3},
                                         "store": {"keep_versions": 1}}) as fleet:
        first, joiner = fleet.nodes[:2], fleet.nodes[2]
        fleet.start_nodes_only(served_view(m, "bf16"), nodes=first)
        pub = Publisher(load_config(fleet.workdir / "trainer.toml"))
        pub.start()
        try:
            results = []
            for k in range(5):
                m = step(m, k + 1)
                results.append(pub.publish(m))
            latest = pub.version
            kinds = {r.version: r.kind for r in results}
            kinds |= {r.anchor.version: "full" for r in results if r.anchor is not None}
            assert kinds == {2: "patch", 3: "patch", 4: "patch", 5: "full", 6: "patch",
                             7: "patch"}
            assert latest == 7
            fleet.wait_version(latest, timeout=60, nodes=first)
            # the running origin's core forgets what it no longer announces (at a publish,
            # or at its next heartbeat once the version's pushes are done), and gc
            # removes it from the store: it keeps >= the window and the chain from the
            # newest anchor
            kept = [5, 6, 7] if window == 3 else list(range(2, 8))
            until("the running origin's store collected",
                  lambda: pub.collect() is not None and pub.store.versions() == kept, timeout=20)
            in_core = pub.node.driver.call(lambda: sorted(pub.node.core.manifests))
            assert in_core == kept
            fleet.start_node(joiner)
            statuses = fleet.wait_version(latest, timeout=90, nodes=[joiner])
            want = state_digest(served_view(m, "bf16")).hex()
            assert statuses[joiner.name]["active_digest"] == want
            assert {fleet.status(n)["active_digest"] for n in first} == {want}
            st = until("joiner's status", lambda: fleet.status(joiner))
            got = received(st)
            chain = sum(r.patch_bytes for r in results)  # every patch from the base
            anchor = next(r.anchor for r in results if r.anchor is not None)
            after = sum(r.patch_bytes for r in results if r.version > anchor.version)
            report = {"joiner_received": got, "whole_chain_patches": chain,
                      "anchor": anchor.patch_bytes, "anchor_plus_after": anchor.patch_bytes + after}
            with capsys.disabled():
                print("\njoiner bytes:", json.dumps(report))
            if window == 3:  # the anchor and the patches after it, not the collected chain
                assert anchor.patch_bytes <= got <= 1.5 * (anchor.patch_bytes + after) + 64 * 1024
            else:  # the cheaper whole chain (the anchor stepped over for free)
                assert got < anchor.patch_bytes and got <= 1.5 * chain + 64 * 1024

            if restart:
                _collect_and_restart(fleet, pub, first[0], m)
        finally:
            pub.close()


def _collect_and_restart(fleet: LoopbackFleet, pub: Publisher, node: NodeProc,
                         m: dict[str, torch.Tensor]) -> None:
    # a node with keep_versions = 1 keeps only what rebuilds its version from the
    # newest anchor it holds whole, and restarts to it from its own store, fetching nothing
    fleet.kill(node, signal.SIGTERM)
    text = node.config.read_text()
    node.config.write_text(text.replace("[store]\n", "[store]\nkeep_versions = 1\n", 1))
    fleet.start_node(node)
    fleet.wait_healthy(60, [node])
    m = step(m, 99)
    r = pub.publish(m)
    assert r.version == 8 and r.anchor is not None and r.anchor.version == 9
    fleet.wait_version(9, timeout=60, nodes=[node])
    store = fleet.workdir / f"{node.name}-store" / "versions"
    # it stepped over anchor 9 (the weights of 8) without its chunks: 5-8 rebuild it
    until("node gc", lambda: sorted(int(d.name) for d in store.iterdir()) == [5, 6, 7, 8, 9],
          timeout=10)
    fleet.kill(node, signal.SIGTERM)
    fleet.start_node(node)
    st = fleet.wait_version(9, timeout=60, nodes=[node])[node.name]
    assert st["active_digest"] == state_digest(served_view(m, "bf16")).hex()
    assert received(st) == 0
