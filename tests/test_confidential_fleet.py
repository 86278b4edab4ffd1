"""Confidential mode end to end: the trainer publishes encrypted versions for some
nodes' X25519 keys; every node verifies and relays ciphertext; only keyed nodes
open it, at apply. In process (fast) and with real ``patchswarm node`` processes."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lab.fleet import LoopbackFleet
from node.config import parse_config
from node.daemon import build_node
from node.store import ChunkStore
from swarm.codec import state_digest
from swarm.errors import ChunkError, ConfigError, PatchswarmError
from swarm.trust import confidential as cf
from swarm.trust.chunks import split_payload, verify_chunk
from swarm.trust.keys import TrustStore, generate_keypair, load_private_key, load_public_key
from trainer.publisher import Publisher

WINDOW = 32


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": (torch.randn(256, 64, generator=g) * 0.02).to(torch.bfloat16)
            for i in range(3)}


def _step(view: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() * (1 + torch.randn(v.shape, generator=g) * 2**-6)).to(torch.bfloat16)
            for k, v in view.items()}


def _windows(plaintext: bytes) -> set[bytes]:
    """Disjoint 32-byte windows of the plaintext that look like data (>= 12 distinct
    bytes): a file holding any 64 consecutive plaintext bytes holds one of them."""
    out = set()
    for i in range(0, len(plaintext) - WINDOW + 1, WINDOW):
        w = plaintext[i:i + WINDOW]
        if len(set(w)) >= 12:
            out.add(w)
    return out


def _leaks(root: Path, windows: set[bytes]) -> list[str]:
    """Files under ``root`` holding any of ``windows`` (at any offset)."""
    found = []
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if any(data[i:i + WINDOW] in windows for i in range(len(data) - WINDOW + 1)):
            found.append(str(f))
    return found


def _config(tmp: Path, name: str, role: str, extra: dict) -> dict:
    cfg: dict = {
        "node": {"id": name, "region": "r0", "model": "m", "role": role},
        "network": {"listen": "127.0.0.1:9", "swarm_secret": "11" * 32},
        "store": {"dir": f"{name}-store", "fsync": False},
        "weights": {"base": "base.safetensors", "device": "cpu"},
        "trust": {"trainer_keys": ["trainer.key.pub"]} if role == "node" else {},
    }
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return parse_config(cfg, tmp)


def test_confidential_in_process(tmp_path):
    """Keyed node decrypts and applies bitwise; a keyless or wrongly keyed node holds
    only verified ciphertext and cannot apply; tampered ciphertext is refused by hash."""
    generate_keypair(tmp_path / "trainer.key")
    generate_keypair(tmp_path / "a.x25519", kind="x25519")
    generate_keypair(tmp_path / "outsider.x25519", kind="x25519")
    (tmp_path / "recipients").mkdir()
    shutil.copy(tmp_path / "a.x25519.pub", tmp_path / "recipients" / "a.x25519.pub")
    base = _weights(0)
    save_file(base, str(tmp_path / "base.safetensors"))
    tcfg = _config(tmp_path, "trainer", "origin", {"publish": {
        "signing_key": "trainer.key", "chunk_size": 4096, "recipients": ["recipients"]}})
    pub = Publisher(tcfg, base=base, persist_view=False)
    served = _step(base, 1)
    res = pub.publish_served(served)
    m = pub.store.manifest(res.version)
    assert m.encrypted and m.chunk_count > 3
    ciphertext = pub.store.payload(res.version)
    plaintext = bytes(cf.decrypt_payload(m, ciphertext, load_private_key(tmp_path / "a.x25519")))
    windows = _windows(plaintext)
    assert len(windows) > 20 and not any(w in ciphertext for w in windows)

    def node(name: str, key: str | None):
        extra = {"trust": {"node_key": key}} if key else {}
        n = build_node(_config(tmp_path, name, "node", extra))
        n.store.put_manifest(pub.store.raw_manifest(res.version), m)
        for i, chunk in enumerate(split_payload(ciphertext, m.chunk_size)):
            n.store.put_chunk(res.version, i, chunk)  # hashes checked: ciphertext
        return n

    keyed = node("keyed", "a.x25519")
    assert keyed.driver._apply_truth(res.version) == res.target_digest
    assert state_digest(keyed.weights.weights) == state_digest(served)
    assert all(torch.equal(keyed.weights.weights[k].view(torch.int16), v.view(torch.int16))
               for k, v in served.items())

    for name, key, why in [("keyless", None, "has no \\[trust\\] node_key"),
                           ("outsider", "outsider.x25519", "not encrypted for this node's key")]:
        n = node(name, key)
        before = n.weights.digest
        with pytest.raises(cf.NoKeyError, match=f"no key for version {res.version}.*{why}"):
            n.driver._apply_truth(res.version)
        assert n.weights.digest == before and n.weights.version == 1  # still its good version
        assert n.store.complete(res.version)  # holds every (ciphertext) chunk: can relay it
        assert not _leaks(tmp_path / f"{name}-store", windows)
        n.store.close()
    assert _leaks(tmp_path / "keyed-store", windows) == []  # stores hold ciphertext only

    # Tampered ciphertext at a relay: refused by hash, before any key is involved.
    bad = bytearray(split_payload(ciphertext, m.chunk_size)[1])
    bad[7] ^= 0x01
    with pytest.raises(ChunkError):
        verify_chunk(m, 1, bytes(bad))
    relay = ChunkStore(tmp_path / "relay-store", trust=TrustStore.from_files(
        [tmp_path / "trainer.key.pub"]), fsync=False)
    relay.put_manifest(pub.store.raw_manifest(res.version), m)
    with pytest.raises(ChunkError, match="not stored"):
        relay.put_chunk(res.version, 1, bytes(bad))
    relay.close()
    # Ciphertext that passed the hash but does not authenticate (a trainer bug):
    # a local apply error, the node stays at its good version.
    forged = bytearray(ciphertext)
    forged[-3] ^= 0x01
    with pytest.raises(ChunkError, match="fails decryption"):
        cf.decrypt_payload(m, bytes(forged), load_private_key(tmp_path / "a.x25519"))
    keyed.store.close()
    pub.store.close()


def test_confidential_config_errors_name_the_key(tmp_path):
    generate_keypair(tmp_path / "trainer.key")
    generate_keypair(tmp_path / "a.x25519", kind="x25519")
    save_file(_weights(0), str(tmp_path / "base.safetensors"))
    sign = {"signing_key": "trainer.key"}
    with pytest.raises(ConfigError, match=r"publish.recipients: .*trainer.key.pub: an Ed25519 key"):
        _config(tmp_path, "t", "origin", {"publish": {**sign, "recipients": ["trainer.key.pub"]}})
    with pytest.raises(ConfigError, match=r"publish.recipients\[0\]: .*missing.pub does not exist"):
        _config(tmp_path, "t", "origin", {"publish": {**sign, "recipients": ["missing.pub"]}})
    with pytest.raises(ConfigError, match=r"publish.recipients: .*a.x25519: not a PEM public key"):
        _config(tmp_path, "t", "origin", {"publish": {**sign, "recipients": ["a.x25519"]}})
    with pytest.raises(ConfigError, match=r"trust.node_key: .*trainer.key is an Ed25519 key"):
        _config(tmp_path, "n", "node", {"trust": {"node_key": "trainer.key"}})
    with pytest.raises(ConfigError, match=r"trust.node_key: cannot read key file .*nope"):
        _config(tmp_path, "n", "node", {"trust": {"node_key": "nope"}})
    cfg = _config(tmp_path, "n", "node", {"trust": {"node_key": "a.x25519"}})
    assert cfg.node_key == tmp_path / "a.x25519"
    assert isinstance(load_public_key(tmp_path / "a.x25519.pub"), type(
        load_private_key(tmp_path / "a.x25519").public_key()))


@pytest.mark.slow
def test_confidential_fleet_keyless_relays_never_see_plaintext(tmp_path):
    """Two regions of real node processes: region-0 all keyed; region-1 one keyless
    relay and one keyed node. Keyed nodes end bitwise at the trainer's view; the
    keyless relay reaches the same version (it relays it) but its weights stay at
    the base, it reports ``no_key_versions``, and no file of it holds plaintext."""
    keyed = ["n0-0", "n0-1", "n1-1"]
    with LoopbackFleet(regions=2, nodes_per_region=2, workdir=tmp_path, node_keys=keyed,
                       chunk_size=16 * 1024) as fleet:
        fleet.start()
        base_digest = fleet.ready["digest"]
        reports = [fleet.publish(), fleet.publish()]
        final = reports[-1]["version"]
        status = fleet.wait_version(final, timeout=120)
        for n in fleet.nodes:
            st = status[n.name]
            if n.name in keyed:
                assert st["active_digest"] == reports[-1]["digest"], n.name
                assert st["no_key_versions"] == {}
            else:
                assert st["active_digest"] == base_digest  # never opened a version
                assert sorted(st["no_key_versions"]) == [str(r["version"]) for r in reports]
                assert "no key for version" in st["no_key_versions"][str(final)]
        # what the keyless relay forwarded (ciphertext): informative, the swarm picks
        # who serves whom; in the runs so far it served most of its region's chunks
        print("keyless relay n1-0 sent:", json.dumps(status["n1-0"]["chunks"]["sent"]))
    # Plaintext of every published patch, opened with a keyed node's key.
    tstore = ChunkStore(tmp_path / "trainer-store", trust=TrustStore.from_files(
        [tmp_path / "trainer.key.pub"]), fsync=False)
    key = load_private_key(tmp_path / "keys" / "n0-0.x25519")
    windows: set[bytes] = set()
    for r in reports:
        m = tstore.manifest(r["version"])
        assert m.encrypted
        windows |= _windows(bytes(cf.decrypt_payload(m, tstore.payload(r["version"]), key)))
    tstore.close()
    assert len(windows) > 100
    assert _leaks(tmp_path / "n1-0-store", windows) == []
    assert not any(w in (tmp_path / "n1-0.log").read_bytes() for w in windows)
    assert "no key for version" in (tmp_path / "n1-0.log").read_text()
    # The keyed node of the mixed region applied what it got, bitwise.
    view = load_file(str(tmp_path / "base.safetensors"))
    assert state_digest(view).hex() == base_digest


def test_publisher_cannot_rebuild_confidential_chain_without_a_key(tmp_path):
    generate_keypair(tmp_path / "trainer.key")
    generate_keypair(tmp_path / "a.x25519", kind="x25519")
    base = _weights(0)
    save_file(base, str(tmp_path / "base.safetensors"))
    pub_cfg = {"signing_key": "trainer.key", "chunk_size": 4096, "recipients": ["a.x25519.pub"]}
    pub = Publisher(_config(tmp_path, "t", "origin", {"publish": pub_cfg}), base=base,
                    persist_view=False)
    served = _step(base, 1)
    pub.publish_served(served)
    pub.store.close()
    with pytest.raises(PatchswarmError, match="is confidential; give the trainer") as failed:
        Publisher(_config(tmp_path, "t", "origin", {"publish": pub_cfg}), base=base,
                  persist_view=False)
    del failed  # the half-built publisher's store (and its lock) goes with the traceback
    gc.collect()
    # With a recipient's key the trainer rebuilds its view from the stored chain.
    pub = Publisher(_config(tmp_path, "t", "origin", {"publish": pub_cfg,
                                                     "trust": {"node_key": "a.x25519"}}),
                    base=base, persist_view=False)
    assert pub.version == 2 and state_digest(pub.view) == state_digest(served)
    pub.store.close()


def test_sealed_versions_write_the_view_file_before_they_commit(tmp_path, monkeypatch):
    """Plain versions write the trainer's view file after the hand-off (trainer.view_file);
    sealed ones before the commit point, as rebuilding a lost view from a sealed chain
    needs a recipient's key: the file is on disk when ``publish`` returns, and the older
    one is gone only once the version is committed."""
    generate_keypair(tmp_path / "trainer.key")
    generate_keypair(tmp_path / "a.x25519", kind="x25519")
    base = _weights(0)
    save_file(base, str(tmp_path / "base.safetensors"))
    pub_cfg = {"signing_key": "trainer.key", "chunk_size": 4096, "recipients": ["a.x25519.pub"]}
    pub = Publisher(_config(tmp_path, "t", "origin", {"publish": pub_cfg}), base=base)
    store = tmp_path / "t-store"
    try:
        monkeypatch.setattr(pub._saver, "submit", lambda *a: pytest.fail("sealed: no saver"))
        seen: list[list[str]] = []
        real = pub.store.put_manifest

        def put_manifest(*args, **kw):  # what is on disk when the store takes the version
            seen.append(sorted(p.name for p in store.glob("published*")))
            return real(*args, **kw)

        monkeypatch.setattr(pub.store, "put_manifest", put_manifest)
        v2 = pub.publish_served(_step(base, 1)).version
        assert sorted(p.name for p in store.glob("published*")) == [f"published-{v2}.safetensors"]
        v3 = pub.publish_served(_step(base, 2)).version
        assert seen[-1] == [f"published-{v2}.safetensors", f"published-{v3}.safetensors"]
        assert sorted(p.name for p in store.glob("published*")) == [f"published-{v3}.safetensors"]
    finally:
        pub.close()
    # no recipient key needed to restart: the view file is there
    again = Publisher(_config(tmp_path, "t", "origin", {"publish": pub_cfg}), base=base)
    assert again.version == v3 and state_digest(again.view) == state_digest(_step(base, 2))
    again.close()
