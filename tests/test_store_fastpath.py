"""The store's CPU fast paths (docs/benchmarks.md, "Node CPU per GB received"):
chunks kept in memory (``put_chunk(..., keep=True)``), ``payload_view`` read in
place, and O_DIRECT writes/reads of aligned buffers with a fallback where the
file system refuses O_DIRECT. Every path must give the same bytes and the same
verdicts as the plain one."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import node.store as store_mod
from node.buffers import ALIGN, aligned_buffer
from node.store import ChunkStore
from swarm.errors import ChunkError, StoreError
from swarm.trust.chunks import split_payload
from tests.test_store import CHUNK, put_all, version


def aligned_copy(data) -> memoryview:
    b = aligned_buffer(len(data))
    b[:] = data
    return b


def chunk_path(root, v: int, i: int):
    return root / "versions" / f"{v:020d}" / "chunks" / f"{i:08d}"



def _put_version(s: ChunkStore) -> bytes:
    """Version 1's manifest and every chunk (aligned buffers) into ``s``; its payload."""
    payload, raw, m = version(1)
    s.put_manifest(raw, m)
    for i, c in enumerate(split_payload(payload, CHUNK)):
        s.put_chunk(1, i, aligned_copy(c))
    return payload

def test_aligned_buffer_is_aligned_and_sized() -> None:
    for n in (0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 17):
        b = aligned_buffer(n)
        assert len(b) == n and not b.readonly
        if n:
            assert store_mod._address(b) % ALIGN == 0


@settings(max_examples=25, deadline=None)
@given(keep=st.lists(st.booleans(), min_size=6, max_size=6),
       aligned=st.lists(st.booleans(), min_size=6, max_size=6),
       recent=st.sampled_from([0, CHUNK, 3 * CHUNK, 64 * CHUNK]))
def test_every_path_gives_the_same_bytes(tmp_path_factory, keep, aligned, recent) -> None:
    root = tmp_path_factory.mktemp("s")
    payload, raw, m = version(1)
    parts = split_payload(payload, CHUNK)
    with ChunkStore(root, recent_bytes=recent) as s:
        s.put_manifest(raw, m)
        for i, c in enumerate(parts):
            s.put_chunk(1, i, aligned_copy(c) if aligned[i] else bytes(c), keep=keep[i])
        assert s._recent_size <= recent
        for i, c in enumerate(parts):
            assert bytes(s.read_chunk(1, i)) == bytes(c)
        assert bytes(s.payload_view(1)) == payload == s.payload(1)
        assert s.payload_view(1).readonly
        for first in range(len(parts) + 1):  # the tail an apply decodes after a prestage
            assert bytes(s.payload_view(1, first)) == b"".join(bytes(c) for c in parts[first:])
        with pytest.raises(ValueError):
            s.payload_view(1, len(parts) + 1)
    with ChunkStore(root) as s:  # what reached the disk
        assert bytes(s.payload_view(1)) == payload
        assert [bytes(s.read_chunk(1, i)) for i in range(len(parts))] == [bytes(c) for c in parts]


def test_kept_chunks_serve_reads_and_are_bounded(tmp_path) -> None:
    payload, raw, m = version(1)
    parts = split_payload(payload, CHUNK)
    with ChunkStore(tmp_path, recent_bytes=2 * CHUNK) as s:
        s.put_manifest(raw, m)
        for i, c in enumerate(parts):
            s.put_chunk(1, i, aligned_copy(c), keep=True)
        assert set(s._recent) == {(1, 4), (1, 5)}  # the newest two
        hits = s.recent_hits
        assert bytes(s.read_chunk(1, 5)) == bytes(parts[5])
        assert s.recent_hits == hits + 1
        assert bytes(s.read_chunk(1, 0)) == bytes(parts[0])  # from disk
        assert s.recent_hits == hits + 1
        s.remove_version(1)
        assert not s._recent and s._recent_size == 0


def test_payload_view_drops_a_rotten_chunk(tmp_path) -> None:
    with ChunkStore(tmp_path) as s:
        payload = put_all(s, 1)
        chunk_path(tmp_path, 1, 2).write_bytes(b"\x00" * CHUNK)
        with pytest.raises(ChunkError, match="corrupt on disk"):
            s.payload_view(1)
        assert 2 not in s.have(1)
        with pytest.raises(StoreError, match="not complete"):
            s.payload_view(1)
        s.put_chunk(1, 2, split_payload(payload, CHUNK)[2])
        assert bytes(s.payload_view(1)) == payload


@pytest.mark.parametrize("extra", [b"x", b"\x00" * ALIGN])
def test_a_chunk_file_longer_than_its_chunk_is_rotten(tmp_path, extra) -> None:
    with ChunkStore(tmp_path) as s:
        put_all(s, 1)
        p = chunk_path(tmp_path, 1, 0)
        p.write_bytes(p.read_bytes() + extra)
        with pytest.raises(ChunkError, match="corrupt on disk"):
            s.read_chunk(1, 0)
        assert 0 not in s.have(1)


@pytest.mark.parametrize("bounce", [True, False])
def test_large_unaligned_writes_go_direct_through_an_aligned_copy(tmp_path, monkeypatch,
                                                                   bounce) -> None:
    """A large chunk in an unaligned buffer (a trainer's payload slice) is copied to an
    aligned one and written with O_DIRECT; a small one takes the page cache's path.
    Either way the bytes on disk are the chunk's, after a restart too."""
    if not store_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    monkeypatch.setattr(store_mod, "BOUNCE_MIN", 8 * 1024 if bounce else 1 << 30)
    payload, raw, m = version(1)
    parts = split_payload(payload, CHUNK)
    with ChunkStore(tmp_path) as s:
        s.put_manifest(raw, m)
        for i, c in enumerate(parts):
            s.put_chunk(1, i, memoryview(b"\0" + bytes(c))[1:])  # one byte off any alignment
        direct = {k for k in s._direct_written if k[0] == 1}
        if s._direct:  # the file system takes O_DIRECT
            assert direct == ({(1, i) for i in range(len(parts))} if bounce else set())
        assert [bytes(s.read_chunk(1, i)) for i in range(len(parts))] == [bytes(c) for c in parts]
    with ChunkStore(tmp_path) as s:
        assert bytes(s.payload_view(1)) == payload


def test_o_direct_refused_falls_back_to_plain_io(tmp_path, monkeypatch) -> None:
    """A file system without O_DIRECT (tmpfs answers EINVAL): same bytes, plain writes."""
    if not store_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & store_mod._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(store_mod.os, "open", no_direct)
    with ChunkStore(tmp_path) as s:
        payload = _put_version(s)
        assert not s._direct
        assert bytes(s.payload_view(1)) == payload
        assert bytes(s.read_chunk(1, 3)) == bytes(split_payload(payload, CHUNK)[3])


def test_o_direct_write_refused_midway_is_rewritten_plainly(tmp_path, monkeypatch) -> None:
    """O_DIRECT opens but the write is refused (EINVAL): the file is written again."""
    if not store_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_write = os.write
    fcntl = store_mod.fcntl

    def picky(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & store_mod._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(store_mod.os, "write", picky)
    with ChunkStore(tmp_path) as s:
        payload = _put_version(s)
        assert not s._direct
    with ChunkStore(tmp_path) as s:
        assert bytes(s.payload_view(1)) == payload


def test_on_a_real_tmpfs(tmp_path) -> None:
    """tmpfs refuses O_DIRECT on open: the store notices and works as before."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"needs root to mount a tmpfs: {r.stderr.strip()}")
    try:
        with ChunkStore(mnt) as s:
            payload = _put_version(s)
            assert bytes(s.payload_view(1)) == payload
        with ChunkStore(mnt) as s:
            assert s.payload(1) == payload
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_an_apply_payload_reuses_the_pooled_buffer(tmp_path, monkeypatch) -> None:
    """Past the chunks kept in memory, the apply's payload buffer took fresh pages every
    version (a quarter of a node's CPU at 384 MiB versions). With the pool's threshold
    at a chunk (as if these small chunks were 64 MiB ones): chunk reads come from the
    heap, every later payload reuses the buffer an earlier one gave back, and one still
    referenced is never handed out again."""
    import node.buffers
    from node.buffers import POOL

    monkeypatch.setattr(node.buffers, "POOLED_MIN", CHUNK)
    with ChunkStore(tmp_path, recent_bytes=0) as s:
        payload = _put_version(s)
        n = s.manifest(1).chunk_count

        def one_round() -> None:
            for i in range(n):
                assert bytes(s.read_chunk(1, i)) == payload[i * CHUNK:(i + 1) * CHUNK]
            assert bytes(s.payload_view(1)) == payload

        before = POOL.stats()
        one_round()
        held = s.payload_view(1)  # the apply still decoding it
        for _ in range(3):
            one_round()
        after = POOL.stats()
        assert after["taken"] - before["taken"] == 5  # payloads only, no chunk read
        assert after["allocated"] - before["allocated"] <= 2  # the first, and beside the held one
        assert after["reused"] - before["reused"] >= 3
        assert bytes(held) == payload
