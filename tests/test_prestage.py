"""Decoding a patch while it downloads (``InProcessWeights.prefeed``) and the driver's use
of it: the result is bit for bit the one-shot apply's, whatever the split, and a prefix
that no longer fits is forgotten, never applied."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.engines.inprocess import InProcessWeights
from swarm.codec import encode_patch
from swarm.errors import PatchApplyError
from tests.prestage_support import prestage_done, run_driver


def _states(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    old = {f"layer{k}.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16)
           for k in range(6)}
    old["norm"] = torch.randn(48, generator=g).to(torch.bfloat16)
    new = {}
    for name, t in old.items():
        step = torch.randn(t.shape, generator=g) * (0.5 if "layer1" in name else 0.01)
        new[name] = (t.float() * (1 + step)).to(torch.bfloat16)
    return old, new


def _holder(old: dict[str, torch.Tensor], version: int = 1) -> InProcessWeights:
    return InProcessWeights({k: v.clone() for k, v in old.items()}, version, "cpu")


OLD, NEW = _states()
RESULT = encode_patch(OLD, NEW, threads=1)
PATCH = RESULT.patch


def _bits(w: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.view(torch.int16).numpy().tobytes() for k, v in w.items()}


@settings(max_examples=40, deadline=None)
@given(chunk=st.integers(1, max(1, len(PATCH) // 2)), fraction=st.floats(0, 1))
def test_prefix_decoded_ahead_then_the_tail_gives_the_one_shot_result(chunk: int,
                                                                        fraction: float) -> None:
    w = _holder(OLD)
    chunks = [PATCH[o:o + chunk] for o in range(0, len(PATCH), chunk)]
    k = int(len(chunks) * fraction)
    fed = 0
    for c in chunks[:k]:
        fed = w.prefeed(2, RESULT.base_digest, fed, c)
    assert fed == sum(len(c) for c in chunks[:k])
    assert w.prefed(2) == fed
    w.stage(2, "patch", b"".join(chunks[k:]), RESULT.base_digest, offset=fed)
    digest = w.commit(2, RESULT.target_digest)
    assert digest == RESULT.target_digest
    assert _bits(w.weights) == _bits(NEW)


def test_prefix_of_another_base_is_not_decoded() -> None:
    w = _holder(OLD)
    assert w.prefeed(2, b"\x01" * 32, 0, PATCH[:100]) == 0
    assert w.prefeed(1, RESULT.base_digest, 0, PATCH[:100]) == 0  # not newer
    assert w.prefeed(2, RESULT.base_digest, 5, PATCH[5:100]) == 0  # not from the start
    assert w.prefed(2) == 0


def test_bytes_that_do_not_continue_the_prefix_are_ignored() -> None:
    w = _holder(OLD)
    assert w.prefeed(2, RESULT.base_digest, 0, PATCH[:50]) == 50
    assert w.prefeed(2, RESULT.base_digest, 80, PATCH[80:90]) == 50
    assert w.prefeed(2, RESULT.base_digest, 50, PATCH[50:70]) == 70


def test_prefix_is_forgotten_when_the_state_moves_on() -> None:
    """A prefix decoded against version 1's state is useless once another version is
    committed; staging with its offset is refused, a full stage works."""
    w = _holder(OLD)
    assert w.prefeed(2, RESULT.base_digest, 0, PATCH[:200]) == 200
    other = encode_patch(OLD, _states(1)[1], threads=1)
    w.stage(3, "patch", other.patch, other.base_digest)
    w.commit(3, other.target_digest)
    assert w.prefed(2) == 0
    with pytest.raises(PatchApplyError):
        w.stage(4, "patch", PATCH[200:], RESULT.base_digest, offset=200)


def test_garbage_prefix_is_dropped_and_the_full_stage_reports_it() -> None:
    w = _holder(OLD)
    bad = bytearray(PATCH)
    bad[:16] = b"\xff" * 16  # no patch header
    assert w.prefeed(2, RESULT.base_digest, 0, bytes(bad[:64])) == 0
    assert w.prefed(2) == 0
    with pytest.raises(Exception):  # noqa: B017 - the codec's own format error
        w.stage(2, "patch", bytes(bad), RESULT.base_digest)
    assert _bits(w.weights) == _bits(OLD)  # nothing served changed


def _signed(size: int):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarm.trust.chunks import split_payload
    from swarm.trust.keys import TrustStore, key_id
    from swarm.trust.manifest import build_manifest, sign_manifest

    key = Ed25519PrivateKey.from_private_bytes(b"\x05" * 32)
    m = build_manifest(PATCH, model="m", version=2, kind="patch", parent_version=1,
                       parent_digest=RESULT.base_digest, target_digest=RESULT.target_digest,
                       chunk_size=size, key_id=key_id(key), created_at=1.0)
    return m, sign_manifest(m, key), split_payload(PATCH, size), TrustStore([key.public_key()])


def _apply_after(tmp_path, prefix: int, *, prestage: bool) -> tuple[bytes, int]:
    """Every chunk stored, ``prefix`` bytes decoded ahead by hand (an earlier prestage
    that stopped there), then (``prestage``) the driver's prestage, then its apply:
    (the digest, the bytes it counted as decoded ahead)."""
    size = 2048
    m, signed, chunks, trust = _signed(size)
    w = _holder(OLD)

    async def body(drv, store) -> tuple[bytes, int]:
        store.put_manifest(signed, m)
        for i, c in enumerate(chunks):
            store.put_chunk(2, i, c)
        w.prefeed(2, RESULT.base_digest, 0, PATCH[:prefix])
        assert w.prefed(2) == prefix
        if prestage:
            drv._prestage_kick(2)  # goes on from there, slice by slice, to the end
            await prestage_done(drv)
            assert w.prefed(2) == len(PATCH)
        digest = await asyncio.to_thread(drv._apply_truth, 2)
        return digest, drv._ahead_bytes

    out = run_driver(tmp_path, trust, w, body)
    assert out[0] == RESULT.target_digest
    assert _bits(w.weights) == _bits(NEW)
    return out


def test_prestage_feeds_in_slices_and_goes_on_from_inside_a_chunk(tmp_path,
                                                                  monkeypatch) -> None:
    """Prestage feeds a chunk slice by slice (an apply waits for one slice at most) and
    goes on from inside a chunk, where an earlier prestage stopped; the weights end
    bitwise at the target."""
    import node.applying as drv_mod

    monkeypatch.setattr(drv_mod, "PRESTAGE_SLICE", 700)  # does not divide the chunk size
    _, ahead = _apply_after(tmp_path, 2048 + 300, prestage=True)
    assert ahead == len(PATCH)


def test_an_apply_starting_inside_a_chunk_reads_only_the_rest(tmp_path) -> None:
    _, ahead = _apply_after(tmp_path, 2048 + 1001, prestage=False)
    assert ahead == 2048 + 1001


def test_driver_decodes_stored_chunks_ahead_of_the_apply(tmp_path) -> None:
    """Real ``ChunkStore`` (signed manifest, verified chunks) and ``Driver``: chunks
    stored in order are decoded by the prestage task; the apply then reads and decodes
    only what is left, and the weights end bitwise at the target."""
    size = 2048
    m, signed, chunks, trust = _signed(size)
    assert len(chunks) >= 4
    w = _holder(OLD)

    async def body(drv, store) -> bytes:
        store.put_manifest(signed, m)
        for i, c in enumerate(chunks[:-1]):
            store.put_chunk(2, i, c)
            drv._prestage_kick(2)
            await prestage_done(drv)
        assert w.prefed(2) == size * (len(chunks) - 1)
        store.put_chunk(2, len(chunks) - 1, chunks[-1])
        return await asyncio.to_thread(drv._apply_truth, 2)

    assert run_driver(tmp_path, trust, w, body) == RESULT.target_digest
    assert _bits(w.weights) == _bits(NEW)
