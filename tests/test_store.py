"""The node's chunk store: persistence, verification on load, gc, quota, disk full,
and a writer killed with SIGKILL at random points.

Run as a script (``python tests/test_store.py child ROOT``) this file is the
writer process the crash test kills.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the child process runs this file directly
    sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from node.store import ChunkStore  # noqa: E402
from swarm.errors import ChunkError, StoreError  # noqa: E402
from swarm.trust.chunks import split_payload  # noqa: E402
from swarm.trust.keys import TrustStore, key_id  # noqa: E402
from swarm.trust.manifest import build_manifest, sign_manifest  # noqa: E402

KEY = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
TRUST = TrustStore([KEY.public_key()])
CHUNK = 16 * 1024


def digest(v: int) -> bytes:
    return v.to_bytes(32, "big")


def version(v: int, *, kind: str | None = None, n_chunks: int = 6, parent: int | None = None):
    """(payload, raw manifest, manifest) of version v, the same in every process."""
    payload = random.Random(v).randbytes(n_chunks * CHUNK - 100)
    kind = kind or ("full" if v == 1 else "patch")
    parent = v - 1 if parent is None else parent
    m = build_manifest(
        payload,
        model="m",
        version=v,
        kind=kind,
        parent_version=None if kind == "full" else parent,
        parent_digest=None if kind == "full" else digest(parent),
        target_digest=digest(v),
        chunk_size=CHUNK,
        key_id=key_id(KEY),
        created_at=1000.0 + v,
    )
    return payload, sign_manifest(m, KEY), m


def put_all(store: ChunkStore, v: int, **kw) -> bytes:
    payload, raw, m = version(v, **kw)
    store.put_manifest(raw, m)
    for i, c in enumerate(split_payload(payload, CHUNK)):
        store.put_chunk(v, i, c)
    return payload


# ---------------------------------------------------------------- basics


def test_put_read_restart(tmp_path):
    payload, raw, m = version(1)
    with ChunkStore(tmp_path, trust=TRUST) as s:
        assert s.versions() == [] and s.active() is None
        s.put_manifest(raw, m)
        s.put_manifest(raw, m)  # idempotent
        parts = split_payload(payload, CHUNK)
        for i in (0, 2, 5):
            s.put_chunk(1, i, parts[i])
        s.put_chunk(1, 2, parts[2])  # idempotent
        assert s.have(1) == {0, 2, 5} and not s.complete(1)
        assert s.has_chunk(1, 2) and not s.has_chunk(1, 1) and not s.has_chunk(9, 0)
        assert s.read_chunk(1, 5) == parts[5]
        with pytest.raises(ChunkError, match="not held"):
            s.read_chunk(1, 1)
        with pytest.raises(StoreError, match="not complete"):
            s.payload(1)
    with ChunkStore(tmp_path, trust=TRUST) as s:  # restart: knows what it has
        assert s.versions() == [1] and s.manifests() == [(raw, m)]
        assert s.have(1) == {0, 2, 5}
        for i in (1, 3, 4):
            s.put_chunk(1, i, parts[i])
        assert s.complete(1) and s.payload(1) == payload
        assert s.used_bytes == len(raw) + len(payload)


def test_put_chunk_rechecks_the_hash(tmp_path):
    payload, raw, m = version(1)
    with ChunkStore(tmp_path) as s:
        s.put_manifest(raw, m)
        with pytest.raises(ChunkError, match="chunk 0 of version 1 hash mismatch"):
            s.put_chunk(1, 0, payload[CHUNK : 2 * CHUNK])
        with pytest.raises(ChunkError, match="out of range"):
            s.put_chunk(1, 6, b"")
        with pytest.raises(StoreError, match="not in the store"):
            s.put_chunk(2, 0, b"")
        assert s.have(1) == set()


def test_put_chunk_with_the_hash_taken_as_it_arrived(tmp_path):
    """``digest=`` (the chunk's hash taken block by block as it arrived,
    ``wire.BlockAssembler``) is checked against the manifest's in place of a second
    hash: the chunk it names is stored; a digest of other bytes is refused and nothing
    is stored; the length and index are still checked first."""
    from swarm.trust.chunks import chunk_hash

    payload, raw, m = version(1)
    parts = split_payload(payload, CHUNK)
    with ChunkStore(tmp_path) as s:
        s.put_manifest(raw, m)
        with pytest.raises(ChunkError, match="chunk 1 of version 1 hash mismatch; not stored"):
            s.put_chunk(1, 1, parts[1], digest=chunk_hash(parts[0]))
        with pytest.raises(ChunkError, match="length mismatch"):
            s.put_chunk(1, 1, parts[1][:-1], digest=chunk_hash(parts[1]))
        with pytest.raises(ChunkError, match="out of range"):
            s.put_chunk(1, 6, parts[1], digest=chunk_hash(parts[1]))
        assert s.have(1) == set()
        for i, c in enumerate(parts):
            s.put_chunk(1, i, c, digest=chunk_hash(c))
        assert s.complete(1) and s.payload(1) == payload


def test_put_chunk_hashed_checks_the_length_and_reading_back_the_hash(tmp_path):
    """``hashed=True`` (the trainer storing the payload it just hashed into the manifest)
    skips the second hash on the way in; a wrong length or index is still refused, and a
    read hashes what the disk holds, so a chunk that went bad is dropped there."""
    payload, raw, m = version(1)
    with ChunkStore(tmp_path) as s:
        s.put_manifest(raw, m)
        with pytest.raises(ChunkError, match=r"chunk 0 of version 1 \(16383 bytes\) is not one of the manifest's 6 chunks; not stored"):
            s.put_chunk(1, 0, payload[: CHUNK - 1], hashed=True)
        with pytest.raises(ChunkError, match=r"chunk 6 .* not one of"):
            s.put_chunk(1, 6, payload[:CHUNK], hashed=True)
        assert s.have(1) == set()
        for i, c in enumerate(split_payload(payload, CHUNK)):
            s.put_chunk(1, i, c, hashed=True)
        assert s.complete(1) and s.payload(1) == payload
        # bytes of the right length but not the chunk: stored (nothing hashed them), and
        # found out by the first read, which drops the file so the node fetches it again
    with ChunkStore(tmp_path / "b") as s:
        s.put_manifest(raw, m)
        s.put_chunk(1, 1, payload[:CHUNK], hashed=True)
        with pytest.raises(ChunkError, match="corrupt on disk; dropped"):
            s.read_chunk(1, 1)
        assert s.have(1) == set()


def test_manifest_must_match_and_not_equivocate(tmp_path):
    _, raw1, m1 = version(1)
    _, _, m2 = version(2)
    with ChunkStore(tmp_path) as s:
        with pytest.raises(StoreError, match="do not match"):
            s.put_manifest(raw1, m2)
        with pytest.raises(StoreError, match="malformed"):
            s.put_manifest(b"junk", m1)
        s.put_manifest(raw1, m1)
        _, other_raw, other = version(1, n_chunks=3)  # a second, different version 1
        with pytest.raises(StoreError, match="different manifest"):
            s.put_manifest(other_raw, other)


def test_corrupt_and_stray_files_are_dropped_on_load(tmp_path):
    with ChunkStore(tmp_path) as s:
        put_all(s, 1)
    vdir = tmp_path / "versions" / f"{1:020d}"
    c3 = vdir / "chunks" / f"{3:08d}"
    data = bytearray(c3.read_bytes())
    data[100] ^= 0xFF
    c3.write_bytes(data)  # bit rot
    (vdir / "chunks" / f"{4:08d}").write_bytes(b"torn")  # short file
    (vdir / "chunks" / "junk").write_bytes(b"?")
    (tmp_path / "tmp" / "chunk.part").write_bytes(b"half-written")
    (tmp_path / "versions" / f"{7:020d}" / "chunks").mkdir(parents=True)  # no manifest
    with ChunkStore(tmp_path) as s:
        assert s.versions() == [1]
        assert s.have(1) == {0, 1, 2, 5}
        assert not (tmp_path / "tmp" / "chunk.part").exists()
        assert not (tmp_path / "versions" / f"{7:020d}").exists()
        assert len(s.problems) == 3


def test_rot_after_load_is_caught_on_read(tmp_path):
    with ChunkStore(tmp_path) as s:
        payload = put_all(s, 1)
        path = tmp_path / "versions" / f"{1:020d}" / "chunks" / f"{0:08d}"
        path.write_bytes(b"\x00" * CHUNK)
        with pytest.raises(ChunkError, match="corrupt on disk"):
            s.read_chunk(1, 0)
        assert 0 not in s.have(1) and not s.complete(1)
        s.put_chunk(1, 0, payload[:CHUNK])
        assert s.payload(1) == payload


def test_trust_reverification_on_open(tmp_path):
    with ChunkStore(tmp_path) as s:
        put_all(s, 1)
    revoked = TrustStore([KEY.public_key()])
    revoked.revoke(key_id(KEY))
    with ChunkStore(tmp_path, trust=revoked) as s:
        assert s.versions() == [] and "revoked" in s.problems[0]
    mpath = tmp_path / "versions" / f"{1:020d}" / "manifest"
    raw = bytearray(mpath.read_bytes())
    raw[-1] ^= 1  # breaks the signature
    mpath.write_bytes(raw)
    with ChunkStore(tmp_path, trust=TRUST) as s:
        assert s.versions() == [] and "bad signature" in s.problems[0]


def test_active_record(tmp_path):
    with ChunkStore(tmp_path) as s:
        s.set_active(3, digest(3))
        s.set_active(4, digest(4))
    with ChunkStore(tmp_path) as s:
        rec = s.active()
        assert (rec.version, rec.digest) == (4, digest(4))
        with pytest.raises(StoreError):
            s.set_active(5, b"short")
        (tmp_path / "active").write_bytes(b"\x93garbage")
        with pytest.raises(StoreError, match="corrupt"):
            s.active()


def test_one_process_at_a_time(tmp_path):
    s = ChunkStore(tmp_path)
    with pytest.raises(StoreError, match="in use"):
        ChunkStore(tmp_path)
    s.close()
    ChunkStore(tmp_path).close()
    (tmp_path / "FORMAT").write_bytes(b"something else")
    with pytest.raises(StoreError, match="not a patchswarm store"):
        ChunkStore(tmp_path)


# -------------------------------------------------------------------- gc


def test_gc_keeps_last_k_and_the_chain_to_a_full_checkpoint(tmp_path):
    # 1 full, 2..4 patches, 5 full, 6..8 patches
    with ChunkStore(tmp_path) as s:
        for v in range(1, 9):
            put_all(s, v, kind="full" if v in (1, 5) else "patch", n_chunks=1)
        s.set_active(8, digest(8))
        assert s.gc(keep_last=2) == [1, 2, 3, 4]  # 7, 8 need 6 and full 5
        assert s.versions() == [5, 6, 7, 8]
        assert s.gc(keep_last=2) == []
    with ChunkStore(tmp_path) as s:
        assert s.versions() == [5, 6, 7, 8] and all(s.complete(v) for v in s.versions())
        with pytest.raises(StoreError):
            s.gc(keep_last=0)


def test_gc_keeps_the_active_version(tmp_path):
    with ChunkStore(tmp_path) as s:
        for v in range(1, 6):
            put_all(s, v, kind="full", n_chunks=1)
        s.set_active(2, digest(2))  # lagging behind staged versions
        assert s.gc(keep_last=1) == [1, 3, 4]
        assert s.versions() == [2, 5]
        used = s.used_bytes
    with ChunkStore(tmp_path) as s:
        assert s.used_bytes == used


# ------------------------------------------------------- quota, disk full


def test_quota_is_a_clear_error_and_keeps_earlier_versions(tmp_path):
    with ChunkStore(tmp_path, quota_bytes=10 * CHUNK) as s:
        p1 = put_all(s, 1)
        with pytest.raises(StoreError, match="quota"):
            put_all(s, 2)
        assert s.payload(1) == p1 and not s.complete(2)
        s.remove_version(2)
        s.gc(keep_last=1)
        assert s.versions() == [1]
    assert not list((tmp_path / "tmp").iterdir())


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 256 KiB tmpfs (needs root); skipped where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_is_a_clear_error_and_keeps_earlier_versions(tiny_fs):
    with ChunkStore(tiny_fs) as s:
        p1 = put_all(s, 1)  # ~96 KiB
        with pytest.raises(StoreError, match="disk full"):
            for v in range(2, 6):
                put_all(s, v)
        assert s.payload(1) == p1
        assert not list((tiny_fs / "tmp").iterdir())  # no temp file left behind
    with ChunkStore(tiny_fs) as s:  # and after a restart
        assert s.payload(1) == p1
        for v in s.versions()[1:]:
            s.remove_version(v)
        put_all(s, 6, kind="full")  # space is back
        assert s.complete(6)



# ------------------------------------------------- put_chunks (the trainer's batch)


def test_put_chunks_stores_a_whole_version_in_parallel(tmp_path):
    """The trainer's batch write: every chunk at its final name, the same bytes as
    ``put_chunk`` would leave, readable after a restart; chunks already held are
    skipped, and ``placed`` hears of each chunk as it goes into place."""
    payload, raw, m = version(1, n_chunks=9)
    parts = split_payload(payload, CHUNK)
    with ChunkStore(tmp_path, trust=TRUST) as s:
        s.put_manifest(raw, m)
        s.put_chunk(1, 4, parts[4])
        seen: list[int] = []
        s.put_chunks(1, list(parts), keep=True, workers=4, placed=seen.append)
        assert sorted(seen) == [0, 1, 2, 3, 5, 6, 7, 8]  # chunk 4 was held already
        assert s.complete(1) and s.payload(1) == payload
        assert s.used_bytes == len(raw) + len(payload)
        assert not list((tmp_path / "tmp").iterdir())
        s.put_chunks(1, list(parts))  # idempotent
    with ChunkStore(tmp_path, trust=TRUST) as s:
        assert s.complete(1) and s.payload(1) == payload


def test_put_chunks_checks_count_and_lengths_before_writing(tmp_path):
    payload, raw, m = version(1)
    parts = list(split_payload(payload, CHUNK))
    with ChunkStore(tmp_path) as s:
        s.put_manifest(raw, m)
        with pytest.raises(ChunkError, match="5 chunks given for version 1, whose manifest has 6"):
            s.put_chunks(1, parts[:5])
        bad = [*parts[:3], parts[3][:-1], *parts[4:]]
        with pytest.raises(ChunkError, match=r"chunk 3 of version 1 \(16383 bytes\) is not the manifest's"):
            s.put_chunks(1, bad)
        with pytest.raises(StoreError, match="not in the store"):
            s.put_chunks(2, parts)
        assert s.have(1) == set() and not list((tmp_path / "versions").glob("*/chunks/*"))


def test_put_chunks_quota_refuses_the_batch(tmp_path):
    with ChunkStore(tmp_path, quota_bytes=10 * CHUNK) as s:
        p1 = put_all(s, 1)
        payload, raw, m = version(2)
        s.put_manifest(raw, m)
        with pytest.raises(StoreError, match="quota"):
            s.put_chunks(2, list(split_payload(payload, CHUNK)))
        assert s.payload(1) == p1 and s.have(2) == set()


def test_put_chunks_failing_write_places_nothing(tmp_path, monkeypatch):
    """One chunk's write fails (after others were written): none of the batch goes into
    place, no temp file stays, the error is the store's; earlier versions are intact."""
    with ChunkStore(tmp_path) as s:
        p1 = put_all(s, 1)
        payload, raw, m = version(2, n_chunks=8)
        s.put_manifest(raw, m)
        real = s._write_tmp

        def flaky(dest, data, *, what):
            if dest.name == f"{5:08d}":
                time.sleep(0.05)  # the others are written by now
                raise StoreError(f"cannot write {what}: injected")
            return real(dest, data, what=what)

        monkeypatch.setattr(s, "_write_tmp", flaky)
        with pytest.raises(StoreError, match="cannot write chunk 5 of version 2: injected"):
            s.put_chunks(2, list(split_payload(payload, CHUNK)), workers=3)
        assert s.have(2) == set() and s.payload(1) == p1
        assert not list((tmp_path / "tmp").iterdir())
        assert not list((tmp_path / "versions" / f"{2:020d}" / "chunks").iterdir())
        monkeypatch.setattr(s, "_write_tmp", real)
        s.put_chunks(2, list(split_payload(payload, CHUNK)))  # and it goes through later
        assert s.payload(2) == payload


def test_put_chunks_disk_full_is_a_clear_error(tiny_fs):
    with ChunkStore(tiny_fs) as s:
        p1 = put_all(s, 1)  # ~96 KiB
        payload, raw, m = version(2, n_chunks=12)  # ~192 KiB more: does not fit
        s.put_manifest(raw, m)
        with pytest.raises(StoreError, match="disk full"):
            s.put_chunks(2, list(split_payload(payload, CHUNK)), workers=4)
        assert s.payload(1) == p1 and s.have(2) == set()
        assert not list((tiny_fs / "tmp").iterdir())


# ------------------------------------------------------------ SIGKILL test

N_VERSIONS = 12
STEPS = (N_VERSIONS - 1) * (6 + 2)  # manifest, 6 chunks, active per version


def child(root: str) -> None:
    """Write versions 2.. into the store, reporting each durable step on stdout."""
    store = ChunkStore(root)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    rng = random.Random(os.getpid())
    for v in range(2, N_VERSIONS + 1):
        payload, raw, m = version(v)
        store.put_manifest(raw, m)
        out.write(f"manifest {v}\n")
        out.flush()
        parts = split_payload(payload, CHUNK)
        order = list(range(len(parts)))
        rng.shuffle(order)
        for i in order:
            store.put_chunk(v, i, parts[i])
            out.write(f"chunk {v} {i}\n")
            out.flush()
        store.set_active(v, digest(v))
        out.write(f"active {v}\n")
        out.flush()
    out.write("finished\n")
    out.flush()


def crash_once(root: Path, rng: random.Random) -> None:
    """Kill a writer at a random moment, then check the store it left."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "child", str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        # let it get through a random number of steps, then kill it somewhere
        # inside the following one (the child does not wait for the reader)
        lines = [proc.stdout.readline().strip() for _ in range(rng.randrange(STEPS))]
        time.sleep(rng.uniform(0, 0.004))
        proc.send_signal(signal.SIGKILL)
        lines += proc.stdout.read().splitlines()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    done_chunks: dict[int, set[int]] = {}
    manifests, active = set(), 1
    for line in lines:
        word, *nums = line.split()
        if word == "manifest":
            manifests.add(int(nums[0]))
        elif word == "chunk":
            done_chunks.setdefault(int(nums[0]), set()).add(int(nums[1]))
        elif word == "active":
            active = int(nums[0])

    with ChunkStore(root, trust=TRUST) as s:
        assert not list((root / "tmp").iterdir())
        assert s.problems == []  # a killed writer never leaves a bad file at a final name
        rec = s.active()
        # the record is durable once reported, and never beyond the next version
        assert rec.version in (active, active + 1) and rec.digest == digest(rec.version)
        assert manifests <= set(s.versions())
        for v in s.versions():
            payload, raw, _ = version(v) if v > 1 else version(1)
            assert s.raw_manifest(v) == raw
            have = s.have(v)
            assert done_chunks.get(v, set()) <= have  # nothing verified is lost
            parts = split_payload(payload, CHUNK)
            for i in have:
                assert s.read_chunk(v, i) == parts[i]
        assert s.payload(1) == version(1)[0]  # the earlier version is intact
        # resume: fetch only the missing chunks, then the version is whole
        for v in s.versions():
            payload = version(v)[0]
            parts = split_payload(payload, CHUNK)
            for i in set(range(len(parts))) - s.have(v):
                s.put_chunk(v, i, parts[i])
            assert s.payload(v) == payload
        for v in s.versions()[1:]:
            s.remove_version(v)  # start the next round from version 1 again
        s.set_active(1, digest(1))


def run_crashes(tmp_path: Path, rounds: int, seed: int) -> None:
    with ChunkStore(tmp_path) as s:
        put_all(s, 1)
        s.set_active(1, digest(1))
    rng = random.Random(seed)
    for _ in range(rounds):
        crash_once(tmp_path, rng)


def test_sigkill_while_writing(tmp_path):
    run_crashes(tmp_path, rounds=10, seed=1)


@pytest.mark.slow
def test_sigkill_while_writing_many(tmp_path):
    run_crashes(tmp_path, rounds=60, seed=2)


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child(sys.argv[2])


# ------------------------------------------------------ model-based test


class StoreModel(RuleBasedStateMachine):
    """Random puts, restarts, bit rot, removals and gc against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.store = ChunkStore(self.root, trust=TRUST, fsync=False)
        self.model: dict[int, set[int]] = {}

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(v=st.integers(1, 5))
    def put_manifest(self, v):
        _, raw, m = version(v, kind="full", n_chunks=3)
        self.store.put_manifest(raw, m)
        self.model.setdefault(v, set())

    @rule(v=st.integers(1, 5), i=st.integers(0, 2))
    def put_chunk(self, v, i):
        payload, _, _ = version(v, kind="full", n_chunks=3)
        part = split_payload(payload, CHUNK)[i]
        if v not in self.model:
            with pytest.raises(StoreError):
                self.store.put_chunk(v, i, part)
            return
        self.store.put_chunk(v, i, part)
        self.model[v].add(i)

    @rule()
    def restart(self):
        self.store.close()
        self.store = ChunkStore(self.root, trust=TRUST, fsync=False)

    @rule(data=st.data())
    def rot(self, data):
        held = [(v, i) for v, s in self.model.items() for i in s]
        if not held:
            return
        v, i = data.draw(st.sampled_from(sorted(held)))
        path = self.root / "versions" / f"{v:020d}" / "chunks" / f"{i:08d}"
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x40
        path.write_bytes(raw)
        self.model[v].discard(i)  # the store must never serve it again
        if data.draw(st.booleans()):
            with pytest.raises(ChunkError):
                self.store.read_chunk(v, i)

    @rule(k=st.integers(1, 3))
    def gc(self, k):
        removed = self.store.gc(keep_last=k)
        for v in removed:
            del self.model[v]
        assert sorted(self.model)[-k:] == self.store.versions()[-k:]

    @invariant()
    def matches_model(self):
        assert self.store.versions() == sorted(self.model)
        for v, chunks in self.model.items():
            have = self.store.have(v)
            if have != chunks:  # rot not yet noticed: it is noticed on read
                for i in have - chunks:
                    with pytest.raises(ChunkError):
                        self.store.read_chunk(v, i)
                have = self.store.have(v)
            assert have == chunks
            payload, _, _ = version(v, kind="full", n_chunks=3)
            for i in chunks:
                assert self.store.read_chunk(v, i) == split_payload(payload, CHUNK)[i]
            assert self.store.complete(v) == (len(chunks) == 3)


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


def test_concurrent_readers_and_writers(tmp_path):
    with ChunkStore(tmp_path, fsync=False) as s:
        payloads = {1: put_all(s, 1, kind="full", n_chunks=4)}
        _, raw, m = version(2, kind="full", n_chunks=4)
        s.put_manifest(raw, m)
        p2 = version(2, kind="full", n_chunks=4)[0]
        errors: list[BaseException] = []

        def reader():
            try:
                for _ in range(50):
                    for i in range(4):
                        assert s.read_chunk(1, i) == split_payload(payloads[1], CHUNK)[i]
            except BaseException as exc:
                errors.append(exc)

        def writer(i):
            try:
                s.put_chunk(2, i, split_payload(p2, CHUNK)[i])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        threads += [threading.Thread(target=writer, args=(i % 4,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors
        assert s.payload(2) == p2
        assert s.used_bytes == len(raw) + len(p2) + len(s.raw_manifest(1)) + len(payloads[1])
