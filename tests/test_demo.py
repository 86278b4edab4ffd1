"""Integration: real node processes on loopback, real links, real AdamW versions.

The unmarked test runs a 2-region x 3-node fleet (7 OS processes) through two
versions and checks bitwise convergence, egress accounting and that a forged
announcement is refused. The slow ones kill a node mid-transfer and restart
it, and run a node that corrupts every chunk it sends (a plain node, then a border).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from lab.fleet import MODEL, LoopbackFleet
from swarm.protocol import handshake as hs
from swarm.protocol import wire
from tests.peer_client import connect, ending, join


def _cross_bytes(statuses: dict) -> int:
    return sum(st["bytes"]["received"]["cross_region"] + st["bytes"]["received"]["from_trainer"]
               for st in statuses.values())


def _forged_manifest() -> bytes:
    """A well-formed manifest signed by a key no node trusts."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.trust.keys import key_id
    from swarm.trust.manifest import build_manifest, sign_manifest

    key = Ed25519PrivateKey.generate()
    payload = os.urandom(1000)
    m = build_manifest(payload, model=MODEL, version=99, kind="full", parent_version=None,
                       parent_digest=None, target_digest=b"\x01" * 32, chunk_size=4096,
                       key_id=key_id(key))
    return sign_manifest(m, key)


async def _rogue_announce(addr: str, secret: bytes, manifest: bytes) -> str:
    """Join as a member that knows the swarm secret, announce ``manifest``; how it ended."""
    link = await join(addr, secret, "rogue")
    try:
        await link.send(wire.encode(wire.ANNOUNCE, manifest))
        return await asyncio.wait_for(ending(link), 10)
    finally:
        await link.close()


async def _old_release_hello(addr: str) -> str:
    """A node of a release before protocol negotiation (version 1) says HELLO."""
    link = await connect(addr)
    try:
        await link.send(hs.hello_frame(model=MODEL, node_id="old-release", region="region-0",
                                       addr="127.0.9.9:1", role="node", nonce=os.urandom(16),
                                       proto=1))
        return await asyncio.wait_for(ending(link), 10)
    finally:
        await link.close()


async def _claim_trainer_and_send_garbage(addr: str, version: int) -> str:
    """Attack 1 of the audit (issue #10): HELLO claiming node id "trainer", never
    AUTH, then two garbage chunks. It used to ban the trainer on every node."""
    link = await connect(addr)
    try:
        await link.send(hs.hello_frame(model=MODEL, node_id="trainer", region="trainer",
                                       addr="127.0.9.9:1", role="origin", nonce=os.urandom(16)))
        for i in range(2):
            await link.send(wire.pack_chunk(version, i, os.urandom(4096)))
        return await asyncio.wait_for(ending(link), 10)
    finally:
        await link.close()


def test_fleet_converges_bitwise_with_one_copy_per_region() -> None:
    with LoopbackFleet(2, 3, chunk_size=32 * 1024) as fleet:
        fleet.start(timeout=120)
        patch_bytes = []
        for _ in range(2):
            pub = fleet.publish()
            patch_bytes.append(pub["patch_bytes"])
            statuses = fleet.wait_version(pub["version"], timeout=60)
            assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
        # every region took in each chunk from outside at least once, and (on a clean
        # loopback) nothing more than one copy per region
        cross = _cross_bytes(statuses)
        assert 2 * sum(patch_bytes) <= cross <= 1.05 * 2 * sum(patch_bytes)
        trainer = fleet.trainer_status()
        assert trainer is not None
        assert sum(trainer["bytes"]["sent"].values()) <= 2 * sum(patch_bytes)
        assert all(st["bad_chunks"] == 0 for st in statuses.values())
        # every chunk a node took from another region was a relay some border carried out
        # (at once, the moment it was stored, or while it arrived: cut-through), and counted as such
        relayed_in = sum(st["chunks"]["received"]["cross_region"] for st in statuses.values())
        carried = sum(st["relays"]["at_once"] + st["relays"]["on_arrival"]
                      + st["relays"]["cut_through"] for st in statuses.values())
        assert carried >= relayed_in and (carried > 0) == (relayed_in > 0)
        # BBR on the peer links: a link whose chunk starts after idle starts BBR over
        # (node.tcp.CongestionRestart); a node that sent chunks says how often
        for st in statuses.values():
            tr = st["transport"]
            if tr["congestion_control"] != "bbr":
                assert tr["congestion_restarts"] == 0, tr
        # a node's link warm-ups are off unless [network] warm_up_kib is set, and the
        # origin's (on) look only at links of 20 ms or longer: none on loopback
        assert all(st["transport"]["warm_up"]["links"] == 0 for st in statuses.values())
        if all(st["transport"]["congestion_control"] == "bbr" for st in statuses.values()):
            assert sum(st["transport"]["congestion_restarts"] for st in statuses.values()) > 0
        # each node says where its apply's time went, its CPU included (/status)
        for st in statuses.values():
            split = st["apply_split"][str(pub["version"])]
            assert split["cpu_s"] >= 0.0 and {"read_s", "stage_s", "commit_s"} <= set(split)
        # a member that announces a manifest signed by an untrusted key is cut off
        secret = bytes.fromhex((fleet.workdir / "swarm.secret").read_text().strip())
        target = fleet.nodes[0]
        ended = asyncio.run(_rogue_announce(target.addr, secret, _forged_manifest()))
        assert ended.startswith("closed")
        st = fleet.status(target)
        assert st["active_version"] == pub["version"] and st["staged_versions"] == []
        assert fleet.http(target.addr, "/healthz") == b"ok\n"
        metrics = fleet.http(target.addr, "/metrics").decode()
        assert "patchswarm_active_version" in metrics
        assert 'patchswarm_relays_total{' in metrics and 'outcome="on_arrival"' in metrics
        # the peer sockets' TCP congestion control ([network] congestion_control)
        assert 'patchswarm_peer_congestion_control{' in metrics and 'algorithm="' in metrics
        assert "patchswarm_congestion_restarts_total{" in metrics
        # an outsider claiming to be the trainer is cut off before any chunk is read,
        # and bans nobody: every node still takes the next version from the trainer
        for n in fleet.nodes:
            ended = asyncio.run(_claim_trainer_and_send_garbage(n.addr, pub["version"]))
            assert "chunk before the handshake" in ended, ended
        # a node of an older release (no protocol version in common) is refused at its
        # HELLO, with the versions named, and counted
        ended = asyncio.run(_old_release_hello(fleet.nodes[0].addr))
        assert "protocol version 1 is too old" in ended, ended
        pub = fleet.publish()
        statuses = fleet.wait_version(pub["version"], timeout=60)
        assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
        assert all(st["bad_chunks"] == 0 for st in statuses.values())
        st0 = statuses[fleet.nodes[0].name]
        assert st0["transport"]["version_refused"] == 1 and st0["protocol"] == list(hs.SPEAKS)
        assert {p["proto"] for p in st0["peers"]} == {wire.PROTOCOL_VERSION}


@pytest.mark.slow
def test_killed_node_resumes_from_its_store() -> None:
    with LoopbackFleet(2, 3, chunk_size=4 * 1024) as fleet:
        fleet.start(timeout=120)
        v2 = fleet.publish()
        fleet.wait_version(v2["version"], timeout=60)
        victim = fleet.nodes[4]
        v3 = fleet.publish()
        fleet.kill(victim, signal.SIGKILL)  # mid-transfer of v3 (~80 chunks of 4 KiB)
        others = [n for n in fleet.nodes if n is not victim]
        fleet.wait_version(v3["version"], timeout=90, nodes=others)
        fleet.start_node(victim)
        fleet.wait_healthy(60, [victim])
        st = fleet.wait_version(v3["version"], timeout=60, nodes=[victim])[victim.name]
        assert st["active_digest"] == v3["digest"]
        # v2 came back from the store: the restarted node fetched at most v3 again
        # (endgame duplicates aside)
        got = sum(st["bytes"]["received"].values()) - st["dup_chunks"] * 4 * 1024
        assert got <= v3["patch_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("liar", ["n0-2", "n0-0"])
def test_corrupt_chunk_sender_is_detected_and_the_rest_converge(liar: str) -> None:
    """A node that flips a byte in every chunk it sends: its peers ban it by node id and
    report it to the origin. n0-2 joins after region-0's two borders, so it only serves its
    region; n0-0 is usually a border, holding chunks its region got from nowhere else,
    which the origin then sends into the region again."""
    env = {liar: {"PATCHSWARM_FAULTS": "corrupt_chunks"}}
    with LoopbackFleet(2, 3, chunk_size=4 * 1024, node_env=env) as fleet:
        fleet.start(timeout=120)
        honest = [n for n in fleet.nodes if n.name != liar]
        bad = 0
        for _ in range(2):
            pub = fleet.publish()
            statuses = fleet.wait_version(pub["version"], timeout=90, nodes=honest)
            assert {st["active_digest"] for st in statuses.values()} == {pub["digest"]}
            bad = sum(st["bad_chunks"] for st in statuses.values())
        assert bad >= 1
        # a ban holds across reconnects: no honest node took more than max_bad_chunks (2)
        assert all(st["bad_chunks"] <= 2 for st in statuses.values())
        assert all(p["id"] != liar for st in statuses.values() if st["bad_chunks"] >= 2
                   for p in st["peers"])
