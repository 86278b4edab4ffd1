"""Anchors (full checkpoints) and gc (issue #12), trainer and store side.

- Hypothesis: for any publish sequence, ``anchor_every`` and ``keep_versions``, what
  gc keeps lets a node at any version (kept or not, or a fresh joiner) reach the
  newest version through the chain the protocol core plans (``VersionSet.replan``).
- ``Publisher``: ``publish_full``, ``anchor_every`` (the anchor is a version of its
  own with the state of the patch before it), gc of the origin's store, a restart
  that rebuilds the view from the newest anchor once the base chain is collected.
- A forged anchor (signed by another key, or a payload other than its digest) is
  refused with a clear error.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from node.config import load_config
from node.store import ChunkStore, retained
from patchswarm.cli import main as cli
from swarm.codec import state_digest
from swarm.errors import ManifestError, PatchApplyError
from swarm.protocol.versions import VersionSet
from trainer.served import served_view

BASE_VERSION = 1


def plan_versions(ops: list[str], anchor_every: int,
                  states: dict[int, int] | None = None) -> dict[int, int | None]:
    """Versions a ``Publisher`` makes for ``ops`` ("patch" | "full"): version -> parent
    (None: full checkpoint), with an anchor after every ``anchor_every``-th patch;
    ``states`` gets each version's state (an anchor has the state of the one before)."""
    links: dict[int, int | None] = {}
    states = states if states is not None else {}
    states[BASE_VERSION] = BASE_VERSION
    v, last_full = BASE_VERSION, BASE_VERSION
    for op in ops:
        v += 1
        states[v] = v
        if op == "full":
            links[v], last_full = None, v
            continue
        links[v] = v - 1
        if anchor_every and v - last_full >= anchor_every:
            v += 1
            links[v], last_full, states[v] = None, v, states[v - 1]
    return links


def fetch_chain(kept: dict[int, int | None], states: dict[int, int], active: int) -> list[int]:
    """The chain the protocol core plans from ``active`` over the kept manifests
    (a patch is 10 bytes, a full checkpoint 100)."""
    vs = VersionSet()
    for v, parent in kept.items():
        full = parent is None
        m = SimpleNamespace(version=v, kind="full" if full else "patch", parent_version=parent,
                            chunk_count=1, payload_length=100 if full else 10,
                            target_digest=states[v].to_bytes(32, "big"))
        vs.add(m, f"manifest-{v}".encode())
    vs.replan(active)
    return vs.chain


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.sampled_from(["patch"] * 6 + ["full"]), min_size=1, max_size=40),
       anchor_every=st.integers(0, 6), keep_versions=st.integers(1, 8))
def test_gc_never_strands_a_node(ops: list[str], anchor_every: int, keep_versions: int) -> None:
    states: dict[int, int] = {}
    links = plan_versions(ops, anchor_every, states)
    latest = max(links)
    keep = retained(links, keep_versions, active=latest)
    kept = {v: links[v] for v in keep}
    # what gc keeps: the newest keep_versions, and everything from the newest anchor on
    newest_full = max((v for v, p in links.items() if p is None), default=None)
    assert set(sorted(links)[-keep_versions:]) <= keep
    assert set(range(newest_full or BASE_VERSION + 1, latest + 1)) <= keep
    if newest_full is None:
        assert keep == set(links)  # no anchor yet: the whole chain back to the base
    # a node at any version (kept or collected), or a fresh joiner at the base
    for active in range(BASE_VERSION, latest + 1):
        chain = fetch_chain(kept, states, active)
        cur = active
        for v in chain:
            parent = kept[v]
            assert parent is None or parent == cur, (active, chain)
            cur = v
        assert cur == latest, (active, chain, sorted(keep))
        assert states.get(cur) == states[latest]


def test_gc_examples() -> None:
    links = plan_versions(["patch"] * 7, anchor_every=3)
    # 2 3 4 patches, 5 anchor (state of 4), 6 7 8 patches, 9 anchor, 10 patch
    assert [v for v, p in links.items() if p is None] == [5, 9]
    assert retained(links, 1, active=10) == {9, 10}
    assert retained(links, 3, active=10) == {5, 6, 7, 8, 9, 10}  # 8 needs 5..7
    assert retained({2: 1, 3: 2}, 1, active=3) == {2, 3}  # no anchor: back to the base


# ---------------------------------------------------------------- the publisher


def masters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(128, 128, generator=torch.Generator().manual_seed(0)),
            "b": torch.randn(128, generator=torch.Generator().manual_seed(1))}
    return {k: v + seed * 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}


@pytest.fixture
def trainer(tmp_path: Path) -> Path:
    assert cli(["keygen", str(tmp_path / "trainer.key")]) == 0
    assert cli(["keygen", str(tmp_path / "forger.key")]) == 0
    save_file(served_view(masters(0)), str(tmp_path / "base.safetensors"))
    (tmp_path / "trainer.toml").write_text(textwrap.dedent(f"""
        [node]
        id = "trainer"
        region = "trainer"
        model = "m"
        role = "origin"
        [network]
        listen = "127.0.0.1:1"
        swarm_secret = "{'ab' * 32}"
        [store]
        dir = "{tmp_path / 'store'}"
        fsync = false
        keep_versions = 1
        [weights]
        base = "{tmp_path / 'base.safetensors'}"
        [publish]
        signing_key = "{tmp_path / 'trainer.key'}"
        chunk_size = 16384
        anchor_every = 3
        [swarm]
        keep_versions = 2
    """))
    return tmp_path


def test_publish_full_and_anchor_every(trainer: Path) -> None:
    from trainer.publisher import Publisher

    pub = Publisher(load_config(trainer / "trainer.toml"))
    try:
        kinds = {}
        for k in range(1, 8):
            r = pub.publish(masters(k))
            kinds[r.version] = r.kind
            if r.anchor is not None:
                a = r.anchor
                kinds[a.version] = a.kind
                assert a.version == r.version + 1 and a.target_digest == r.target_digest
                assert a.patch_bytes > 2 * r.patch_bytes  # a whole checkpoint
        assert kinds == {2: "patch", 3: "patch", 4: "patch", 5: "full", 6: "patch", 7: "patch",
                         8: "patch", 9: "full", 10: "patch"}
        f = pub.publish_full(masters(8))
        assert (f.version, f.kind, f.parent_version) == (11, "full", 10)
        assert pub.store.manifest(11).parent_version is None
        h = pub.publish_async(masters(9))  # counts anchors from the explicit full one
        assert h.version == 12 and h.result(60).anchor is None
        # keep_versions = 1, the core announces 2: the newest anchor's chain and 2 versions
        assert pub.store.versions() == [11, 12]
        want = state_digest(served_view(masters(9)))
        assert pub.store.active().digest == want
    finally:
        pub.close()
    # a restart with the view file gone rebuilds it from the anchor, not the base chain
    for f in (trainer / "store").glob("published-*.safetensors"):
        f.unlink()
    pub = Publisher(load_config(trainer / "trainer.toml"))
    try:
        assert pub.version == 12 and state_digest(pub.view) == want
        assert pub.publish(masters(10)).version == 13
    finally:
        pub.close()


def test_anchor_applies_on_a_node_truth_and_a_forged_one_is_refused(trainer: Path) -> None:
    from node.engines.inprocess import InProcessWeights
    from swarm.trust.chunks import split_payload
    from swarm.trust.keys import TrustStore, load_private_key
    from swarm.trust.manifest import build_manifest, sign_manifest, verify_manifest
    from trainer.publisher import Publisher

    pub = Publisher(load_config(trainer / "trainer.toml"))
    try:
        r = pub.publish_full(masters(3))
        raw = pub.store.raw_manifest(r.version)
        payload = pub.store.payload(r.version)
    finally:
        pub.close()
    trust = TrustStore.from_files([trainer / "trainer.key.pub"])
    m = verify_manifest(raw, trust)
    assert m.kind == "full" and m.parent_version is None
    # a fresh joiner at the base takes the anchor whole, bitwise the trainer's state
    w = InProcessWeights.load(trainer / "base.safetensors", 1, "cpu")
    w.stage(m.version, m.kind, payload, m.parent_digest)
    assert w.commit(m.version, m.target_digest) == state_digest(served_view(masters(3)))
    # forged: signed by a key the nodes do not trust
    forger = load_private_key(trainer / "forger.key")
    from swarm.trust.keys import key_id

    fm = build_manifest(payload, model="m", version=m.version + 1, kind="full",
                        parent_version=None, parent_digest=None, target_digest=m.target_digest,
                        chunk_size=16384, key_id=key_id(forger))
    with pytest.raises(ManifestError, match="key"):
        verify_manifest(sign_manifest(fm, forger), trust)
    # forged content under a trusted signature: the state is not the one it names
    other = load_file(str(trainer / "base.safetensors"))
    from safetensors.torch import save as save_bytes

    bad = save_bytes(other)
    w2 = InProcessWeights.load(trainer / "base.safetensors", 1, "cpu")
    w2.stage(m.version, "full", bad, None)
    with pytest.raises(PatchApplyError, match="full checkpoint digest differs from the manifest"):
        w2.commit(m.version, m.target_digest)
    # the store keeps only what the manifest hashes: a chunk of another payload is refused
    store = ChunkStore(trainer / "node-store", trust=trust, fsync=False)
    try:
        store.put_manifest(raw, m)
        from swarm.errors import ChunkError

        with pytest.raises(ChunkError, match="not stored"):
            store.put_chunk(m.version, 0, next(iter(split_payload(bad, 16384))))
    finally:
        store.close()


def test_gc_keeps_what_rebuilds_an_adopted_anchor(tmp_path: Path) -> None:
    """A node steps over an anchor of the weights it holds without fetching it (it
    holds its manifest, no chunks): gc keeps the patches that rebuild that state."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.trust.chunks import split_payload
    from swarm.trust.keys import key_id
    from swarm.trust.manifest import build_manifest, sign_manifest

    key = Ed25519PrivateKey.generate()
    d = [bytes([i]) * 32 for i in range(8)]

    def put(store: ChunkStore, v: int, kind: str, digest: bytes, chunks: bool = True) -> None:
        payload = bytes([v]) * 3000
        m = build_manifest(payload, model="m", version=v, kind=kind,
                           parent_version=v - 1 if kind == "patch" else None,
                           parent_digest=d[v - 1] if kind == "patch" else None,
                           target_digest=digest, chunk_size=1024, key_id=key_id(key))
        store.put_manifest(sign_manifest(m, key), m)
        if chunks:
            for i, c in enumerate(split_payload(payload, 1024)):
                store.put_chunk(v, i, c)

    with ChunkStore(tmp_path / "s", fsync=False) as store:
        put(store, 2, "full", d[2])            # an anchor held whole
        put(store, 3, "patch", d[3])
        put(store, 4, "patch", d[4])
        put(store, 5, "full", d[4], chunks=False)  # adopted: the state of 4
        store.set_active(5, d[4])
        assert store.newest_full() == 2
        assert store.gc(1) == []               # 5 is rebuilt by 2, 3, 4
        put(store, 6, "patch", d[6])
        put(store, 7, "full", d[6])            # held whole this time
        store.set_active(7, d[6])
        assert store.gc(1) == [2, 3, 4, 5, 6]
        assert store.replay_chain(7, 1) == [7]


def test_publish_async_copies_the_weights_it_is_given(trainer: Path) -> None:
    from trainer.publisher import Publisher

    pub = Publisher(load_config(trainer / "trainer.toml"))
    try:
        served = served_view(masters(1))
        want = state_digest(served)
        h = pub.publish_async(served, served_dtype=None)
        for t in served.values():
            t.zero_()  # the training loop moves on at once
        assert h.result(60).target_digest == want
    finally:
        pub.close()
