"""A received chunk is hashed block by block as its blocks arrive (``wire.BlockAssembler``
with ``chunk_hasher``), and the store's one check compares that hash with the signed
manifest's: a driver on a link fed as a socket feeds it, a real ``ChunkStore``."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.link import PREFACE
from node.store import ChunkStore
from swarm.protocol import events as ev
from swarm.protocol import wire
from swarm.trust.chunks import chunk_hash, split_payload
from swarm.trust.keys import key_id
from swarm.trust.manifest import build_manifest, sign_manifest
from tests.test_cut_through import _driver
from tests.test_link import _feed, _frame
from tests.test_striped_links import _receiving, _spy

KEY = Ed25519PrivateKey.from_private_bytes(b"\x09" * 32)
CHUNK = 64 * 1024  # blocks of 20,000 bytes and more: placed in the chunk's buffer
CUTS = (0, 20_000, 40_000, CHUNK)


def _store(tmp: Path) -> tuple[ChunkStore, list[memoryview]]:
    payload = random.Random(5).randbytes(3 * CHUNK - 1000)
    m = build_manifest(payload, model="m", version=1, kind="full", parent_version=None,
                       parent_digest=None, target_digest=b"\x01" * 32, chunk_size=CHUNK,
                       key_id=key_id(KEY), created_at=1000.0)
    store = ChunkStore(tmp)
    store.put_manifest(sign_manifest(m, KEY), m)
    return store, split_payload(payload, CHUNK)


async def _receive(store: ChunkStore, chunk: bytes, steps: list[int]) -> tuple[list, list, int]:
    """Chunk 0 of version 1 arrives on link 7 in three blocks, read ``steps`` bytes at a
    time; returns (the store's put_chunk calls' digests, the ChunkReceived events, the blocks placed). The
    blocks are placed in the chunk's buffer as they come, or taken as whole messages
    where a read brings one whole: the hash covers either way."""
    digests: list[Any] = []
    put = store.put_chunk

    def spy(v: int, i: int, data: Any, **kw: Any) -> None:
        digests.append(kw.get("digest"))
        put(v, i, data, **kw)

    store.put_chunk = spy  # type: ignore[method-assign]
    drv = _driver([], store=store)
    drv.core.authenticated = lambda cid: True  # type: ignore[method-assign]
    drv._prestage_kick = lambda v: None  # type: ignore[method-assign]
    received = _spy(drv, ev.ChunkReceived)
    c, p0, p2, tasks = _receiving(drv)
    msgs = [wire.pack_block_header(1, 0, CHUNK, a) + chunk[a:b]
            for a, b in itertools.pairwise(CUTS)]
    try:
        _feed(p0, PREFACE + b"".join(_frame(m) for m in msgs), steps)
        for _ in range(500):
            if received:
                break
            await asyncio.sleep(0.01)
        assert c.blocks.pending is None and drv.blocks_placed + drv.blocks_copied == 3
        return digests, received, drv.blocks_placed
    finally:
        for p in (p0, p2):  # the links end, as a socket closing says it
            p.connection_lost(None)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize(("steps", "placed"), [([65536], False), ([7000, 300, 12_000], True)])
def test_a_chunk_is_stored_on_the_hash_its_blocks_had_as_they_came(tmp_path, steps,
                                                                    placed) -> None:
    """Whole messages (reads of a whole block) or blocks placed as they come."""
    store, parts = _store(tmp_path)
    with store:
        digests, received, n = asyncio.run(_receive(store, bytes(parts[0]), steps))
        assert (n > 0) == placed
        assert digests == [chunk_hash(parts[0])]  # taken as it came: no second pass
        assert [(e.conn, e.version, e.index, e.valid) for e in received] == [(7, 1, 0, True)]
        assert store.has_chunk(1, 0) and bytes(store.read_chunk(1, 0)) == bytes(parts[0])


def test_a_block_changed_on_the_way_is_refused_and_nothing_stored(tmp_path) -> None:
    """One byte of the middle block differs from the signed chunk: the hash taken as it
    came is the hash of the bytes that came, so the store refuses the chunk (the sender's
    fault: ``valid=False``) and keeps nothing."""
    store, parts = _store(tmp_path)
    bad = bytearray(parts[0])
    bad[30_000] ^= 0x01
    with store:
        digests, received, n = asyncio.run(_receive(store, bytes(bad), [9000]))
        assert n > 0
        assert digests == [chunk_hash(bad)] and digests[0] != chunk_hash(parts[0])
        assert [(e.index, e.valid) for e in received] == [(0, False)]
        assert not store.has_chunk(1, 0)
