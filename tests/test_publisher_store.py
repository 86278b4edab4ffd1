"""What a publish leaves in the trainer's store: every chunk on disk (read back after a
restart) and, while they fit, in memory, so the origin's pushes read them without a disk
read and a hash again."""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_handoff import _config  # noqa: E402
from benchmarks.bench_wan import dense_next, dense_pair  # noqa: E402
from node.store import ChunkStore  # noqa: E402
from swarm.trust.chunks import split_payload  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402


def test_published_chunks_are_served_from_memory_and_on_disk(tmp_path: Path) -> None:
    base, view = dense_pair(2 << 20, seed=1)
    save_file(base, str(tmp_path / "base.safetensors"))
    cfg = _config(tmp_path)
    pub = Publisher(cfg, base=base)
    try:
        r = pub.publish_served(dense_next(view, 2))
        store = pub.store
        payload = store.payload(r.version)
        hits = store.recent_hits
        parts = [bytes(store.read_chunk(r.version, i)) for i in range(r.chunks)]
        assert store.recent_hits - hits == r.chunks  # none read from disk
        assert parts == [bytes(c) for c in split_payload(payload, cfg.chunk_size)]
        # a payload over the store's memory for recent chunks is not kept (a kept slice
        # would pin all of it): its chunks come from disk
        store.recent_bytes = r.patch_bytes - 1
        r2 = pub.publish_served(dense_next(view, 3))
        hits = store.recent_hits
        assert all(store.read_chunk(r2.version, i) for i in range(r2.chunks))
        assert store.recent_hits == hits
    finally:
        pub.close()
    with ChunkStore(cfg.store_dir) as s:  # what reached the disk, read and hashed again
        assert b"".join(bytes(s.read_chunk(r.version, i)) for i in range(r.chunks)) == payload


def test_a_published_patch_carries_its_layout(tmp_path: Path) -> None:
    """The trainer's manifest names where the patch's header and each record lie, and
    carries the header (nodes decode records out of order, before the chunk holding
    the header arrived); the layout is signed and adds up."""
    from swarm.codec.format import record_layout

    base, view = dense_pair(2 << 20, seed=1)
    save_file(base, str(tmp_path / "base.safetensors"))
    pub = Publisher(_config(tmp_path), base=base)
    try:
        r = pub.publish_served(dense_next(view, 2))
        m = pub.store.manifest(r.version)
        payload = pub.store.payload(r.version)
        assert m.records == tuple(record_layout(payload))
        assert len(m.records) >= 2 and sum(m.records) == len(payload)
        assert m.header == payload[:m.records[0]]  # small: the manifest carries it
    finally:
        pub.close()
