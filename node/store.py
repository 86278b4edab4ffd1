"""The node's durable chunk store: manifests, verified chunks, the active version.

Layout under ``root`` (format 1; docs/manifest.md explains the crash-safety):

    FORMAT                                  "patchswarm-store 1"
    LOCK                                    flock'ed by the one process using the store
    active                                  canonical msgpack {fmt, version, digest}
    tmp/                                    temporary files; emptied on open
    versions/<version:020d>/manifest        raw signed manifest envelope
    versions/<version:020d>/chunks/<i:08d>  chunk i, exactly as the manifest hashes it

Every file is written to ``tmp/``, fsync'ed, renamed into place and its
directory fsync'ed, so a file at its final name is whole: a killed writer leaves
at most a stray temp file, which the next open deletes. Chunks are still
re-hashed against the manifest the first time a version is looked at after
open (BLAKE3 runs at ~10 GB/s), and again on every read, so neither a torn
file nor bit rot is ever served: a bad chunk is deleted and reported missing.

Chunk files are written and read with ``O_DIRECT`` where the buffer sits at a
4096-byte aligned address (``node.buffers``: the node driver reassembles
received chunks in one) and the file system takes it: the bytes go between the
buffer and the disk without a kernel copy through the page cache, which was a
third of a node's CPU per GB received (docs/benchmarks.md, "Node CPU per GB
received"). A file system that refuses ``O_DIRECT`` (tmpfs) gets ordinary
writes; the crash-safety above is the same either way.

A chunk handed over with ``put_chunk(..., keep=True)`` (the node driver's
received chunks: a buffer nobody changes afterwards) is also kept in memory, up
to ``recent_bytes`` of the most recent ones, and reads of it are served from
that verified copy, without a disk read or a second hash: a node uploads most
chunks to its peers right after it received them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import msgpack
import numpy

from node.buffers import ALIGN, aligned_room
from swarm.errors import ChunkError, ManifestError, StoreError
from swarm.trust.chunks import verify_chunk
from swarm.trust.keys import TrustStore
from swarm.trust.manifest import (
    Manifest,
    canonical_packb,
    decode_manifest_unverified,
    verify_manifest,
)

STORE_FORMAT = b"patchswarm-store 1\n"
RECENT_BYTES = 64 * 1024 * 1024  # default memory for recently received chunks (keep=True)
BOUNCE_MIN = 256 * 1024  # an unaligned write this large is copied to an aligned buffer first
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data if len(view) else 0
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
PUT_WORKERS = 4  # put_chunks: chunk files written and fsync'ed at once
MAX_ACTIVE_BYTES = 1024


@dataclass(frozen=True)
class ActiveRecord:
    """The version this node serves, and the state digest it verified for it."""

    version: int
    digest: bytes


class ChunkStore:
    """Manifests and verified chunks of the versions a node holds, on disk.

    ``quota_bytes`` caps manifest plus chunk bytes; a write past it, or one the
    disk cannot take (ENOSPC), raises ``StoreError`` and leaves everything
    stored before it intact. With ``trust``, manifests are re-verified on open
    and ones that no longer verify (revoked key, corrupt file) are left out of
    ``manifests()`` and listed in ``problems``. One process at a time may open
    a store (``lock``); call ``close()`` (or use ``with``) before reopening it.
    """

    def __init__(
        self,
        root: Path | str,
        quota_bytes: int | None = None,
        *,
        trust: TrustStore | None = None,
        fsync: bool = True,
        lock: bool = True,
        recent_bytes: int = RECENT_BYTES,
    ) -> None:
        self.root = Path(root)
        self.quota_bytes = quota_bytes
        self.trust = trust
        self._fsync = fsync
        self._mutex = threading.RLock()
        self._manifests: dict[int, Manifest] = {}
        self._raw: dict[int, bytes] = {}
        self._have: dict[int, set[int]] = {}  # only versions scanned since open
        self._used = 0
        # verified chunks kept in memory (put_chunk keep=True), oldest first
        self._recent: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self._recent_size = 0
        self.recent_bytes = recent_bytes
        self.recent_hits = 0  # reads served from memory
        self._direct = bool(_O_DIRECT)  # cleared once the file system refuses O_DIRECT
        # chunks this process wrote with O_DIRECT: not in the page cache, so they are
        # read back with O_DIRECT too; any other file may be cached: ordinary reads
        self._direct_written: set[tuple[int, int]] = set()
        self.problems: list[str] = []
        self._lock_file = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if lock:
                self._acquire_lock()
            self._init_layout()
            self._load()
        except OSError as exc:
            self.close()
            raise StoreError(f"cannot open store {self.root}: {exc.strerror or exc}") from None
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ lifecycle

    def _acquire_lock(self) -> None:
        f = (self.root / "LOCK").open("a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StoreError(
                f"store {self.root} is in use by another process or an unclosed ChunkStore"
            ) from None
        self._lock_file = f

    def close(self) -> None:
        """Release the store's lock; the object must not be used afterwards."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _init_layout(self) -> None:
        tmp = self.root / "tmp"
        if tmp.exists():
            shutil.rmtree(tmp)  # leftovers of a killed writer or an interrupted gc
        tmp.mkdir()
        fmt = self.root / "FORMAT"
        if fmt.exists():
            if fmt.read_bytes()[:64] != STORE_FORMAT:
                raise StoreError(f"{self.root} is not a patchswarm store of format 1")
        else:
            self._atomic_write(fmt, STORE_FORMAT, what="store format marker")
        (self.root / "versions").mkdir(exist_ok=True)

    def _load(self) -> None:
        vroot = self.root / "versions"
        for d in sorted(vroot.iterdir()):
            version = _parse_int(d.name, 20)
            mpath = d / "manifest"
            if version is None or not d.is_dir():
                self.problems.append(f"ignoring unexpected entry {d.name} in versions/")
                continue
            if not mpath.exists():
                self._discard_dir(d)  # put_manifest never finished: nothing of it is usable
                continue
            raw = mpath.read_bytes()
            try:
                m = (
                    verify_manifest(raw, self.trust)
                    if self.trust is not None
                    else decode_manifest_unverified(raw)
                )
            except ManifestError as exc:
                self.problems.append(f"version {version}: stored manifest refused: {exc}")
                continue
            if m.version != version:
                self.problems.append(f"version {version}: directory holds manifest of {m.version}")
                continue
            self._manifests[version] = m
            self._raw[version] = raw
            self._used += len(raw)
            (d / "chunks").mkdir(exist_ok=True)
            for f in (d / "chunks").iterdir():
                self._used += f.stat().st_size

    # --------------------------------------------------------------- helpers

    def _vdir(self, version: int) -> Path:
        return self.root / "versions" / f"{version:020d}"

    def _cpath(self, version: int, index: int) -> Path:
        return self._vdir(version) / "chunks" / f"{index:08d}"

    def _sync_dir(self, d: Path) -> None:
        if not self._fsync:
            return
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _check_quota(self, extra: int, what: str) -> None:
        if self.quota_bytes is not None and self._used + extra > self.quota_bytes:
            raise StoreError(
                f"store quota of {self.quota_bytes} bytes reached writing {what} "
                f"({self._used} used, {extra} more needed); earlier versions are intact"
            )

    def _atomic_write(self, dest: Path, data: bytes | memoryview, *, what: str) -> bool:
        """Write ``dest`` via tmp/ + fsync + rename + directory fsync; True when its
        aligned part went with O_DIRECT."""
        tmp, wrote_direct = self._write_tmp(dest, data, what=what)
        try:
            os.replace(tmp, dest)
            self._sync_dir(dest.parent)
        except OSError as exc:
            self._fail_write(exc, what, [tmp])
        return wrote_direct

    def _fail_write(self, exc: OSError, what: str, tmps: list[Path]) -> NoReturn:
        for tmp in tmps:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if exc.errno in _DISK_FULL:
            raise StoreError(
                f"disk full writing {what} to {self.root}; earlier versions are intact"
            ) from None
        raise StoreError(f"cannot write {what}: {exc.strerror or exc}") from None

    def _write_tmp(self, dest: Path, data: bytes | memoryview, *, what: str) -> tuple[Path, bool]:
        """Write ``data`` to a fresh file in tmp/ named after ``dest`` and fsync it (not
        renamed yet); the file and whether its aligned part went with O_DIRECT."""
        tmp = self.root / "tmp" / f"{dest.name}.{os.getpid()}.{threading.get_ident()}.part"
        try:
            view = memoryview(data).cast("B")
            direct = len(view) - len(view) % ALIGN if self._direct else 0
            if direct and _address(view) % ALIGN:
                if direct >= BOUNCE_MIN:
                    # a large unaligned buffer (a trainer's payload slice, a whole-chunk
                    # message): one copy into an aligned one costs far less than the
                    # page cache's path (round 29: 4 MiB in ~2.4 ms against ~14 ms)
                    bounce = aligned_room(len(view))
                    bounce[:len(view)] = view
                    view = bounce[:len(view)]
                else:
                    direct = 0
            fd = self._open_write(tmp, direct > 0)
            try:
                wrote_direct = False
                if fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
                    done = self._write_direct(fd, view[:direct])
                    wrote_direct = done > 0
                    view = view[done:]
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return tmp, wrote_direct
        except OSError as exc:
            self._fail_write(exc, what, [tmp])

    def _open_write(self, tmp: Path, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if direct:
            try:
                return os.open(tmp, flags | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # this file system does not take O_DIRECT
        return os.open(tmp, flags, 0o644)

    def _write_direct(self, fd: int, view: memoryview) -> int:
        """Write the aligned ``view`` with O_DIRECT, then turn O_DIRECT off on ``fd``;
        the bytes written (0 after a refusal: the caller writes them all again)."""
        done = 0
        try:
            while done < len(view):
                done += os.write(fd, view[done:])
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._direct = False
            os.ftruncate(fd, 0)
            done = 0
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
        os.lseek(fd, done, os.SEEK_SET)
        return done

    def _discard_dir(self, d: Path) -> None:
        """Remove a version directory: rename it into tmp/ first, so it vanishes at once."""
        grave = self.root / "tmp" / f"gc-{d.name}-{os.getpid()}"
        try:
            os.replace(d, grave)
            self._sync_dir(d.parent)
            shutil.rmtree(grave, ignore_errors=True)
        except OSError as exc:
            raise StoreError(f"cannot remove {d}: {exc.strerror or exc}") from None

    def _scan(self, version: int) -> set[int]:
        """Re-verify the chunk files of ``version`` on first look since open."""
        have = self._have.get(version)
        if have is not None:
            return have
        m = self._manifests[version]
        have = set()
        cdir = self._vdir(version) / "chunks"
        for f in sorted(cdir.iterdir()):
            index = _parse_int(f.name, 8)
            ok = index is not None and _is_chunk(m, index, f.read_bytes())
            if ok:
                have.add(index)
            else:
                self.problems.append(f"version {version}: dropped bad chunk file {f.name}")
                self._used -= f.stat().st_size
                f.unlink()
        self._have[version] = have
        return have

    def _manifest(self, version: int) -> Manifest:
        try:
            return self._manifests[version]
        except KeyError:
            raise StoreError(f"version {version} is not in the store") from None

    # ------------------------------------------------------------ manifests

    def put_manifest(self, raw: bytes, manifest: Manifest) -> None:
        """Keep a manifest the caller verified. Idempotent for the same bytes; a
        different manifest for a version already held is refused (equivocation)."""
        try:
            decoded = decode_manifest_unverified(raw)
        except ManifestError as exc:
            raise StoreError(f"refusing to store a malformed manifest: {exc}") from None
        if decoded != manifest:
            raise StoreError(f"manifest bytes do not match version {manifest.version}'s fields")
        v = manifest.version
        with self._mutex:
            if v in self._raw:
                if self._raw[v] == bytes(raw):
                    return
                raise StoreError(f"a different manifest for version {v} is already stored")
            self._check_quota(len(raw), f"manifest of version {v}")
            d = self._vdir(v)
            try:
                if d.exists():
                    self._discard_dir(d)  # refused or half-made earlier
                (d / "chunks").mkdir(parents=True)
                self._sync_dir(d.parent)
            except OSError as exc:
                raise StoreError(f"cannot create {d}: {exc.strerror or exc}") from None
            self._atomic_write(d / "manifest", bytes(raw), what=f"manifest of version {v}")
            self._manifests[v] = manifest
            self._raw[v] = bytes(raw)
            self._have[v] = set()
            self._used += len(raw)

    def versions(self) -> list[int]:
        """Versions with a stored manifest, ascending."""
        return sorted(self._manifests)

    def manifest(self, version: int) -> Manifest:
        return self._manifest(version)

    def raw_manifest(self, version: int) -> bytes:
        self._manifest(version)
        return self._raw[version]

    def manifests(self) -> list[tuple[bytes, Manifest]]:
        """(raw envelope, manifest) of every stored version, ascending. Verified
        with ``trust`` on open if the store was given one, else only decoded:
        pass the raw bytes to ``verify_manifest`` before trusting them."""
        return [(self._raw[v], self._manifests[v]) for v in self.versions()]

    # --------------------------------------------------------------- chunks

    def put_chunk(self, version: int, index: int, data: bytes | bytearray | memoryview, *,
                  keep: bool = False, hashed: bool = False,
                  digest: bytes | None = None) -> None:
        """Keep chunk ``index`` of ``version``; re-checks its hash (``ChunkError``).

        ``keep``: the caller hands ``data`` over and never changes it: the store
        may keep it in memory (``recent_bytes``) and serve reads from it.
        ``hashed``: the caller built the manifest's hash of this chunk from these very
        bytes (the trainer storing its own payload): only the length is checked.
        ``digest``: the chunk's hash as the caller computed it over exactly ``data``
        while it arrived (``swarm.trust.chunks.chunk_hasher``): checked against the
        manifest's like a hash of ``data``, without a second pass over the bytes.
        """
        m = self._manifest(version)
        try:
            if hashed:
                n = memoryview(data).nbytes
                if not 0 <= index < m.chunk_count or n != m.chunk_length(index):
                    raise ChunkError(f"chunk {index} ({n} bytes) is not one of the manifest's "
                                     f"{m.chunk_count} chunks")
            else:
                verify_chunk(m, index, data, digest=digest)
        except ChunkError as exc:
            what = str(exc).replace(f"chunk {index}", f"chunk {index} of version {version}", 1)
            raise ChunkError(f"{what}; not stored") from None
        with self._mutex:
            have = self._scan(version)
            if index in have:
                return
            self._check_quota(len(data), f"chunk {index} of version {version}")
            if self._atomic_write(
                self._cpath(version, index), data, what=f"chunk {index} of version {version}"
            ):
                self._direct_written.add((version, index))
            have.add(index)
            self._used += len(data)
            if keep:
                self._remember(version, index, memoryview(data).cast("B").toreadonly())

    def put_chunks(self, version: int, chunks: Sequence[bytes | bytearray | memoryview], *,
                   keep: bool = False, workers: int = PUT_WORKERS,
                   placed: Callable[[int], None] | None = None) -> None:
        """Keep every chunk of ``version`` at once: the trainer storing its own payload,
        whose manifest it hashed from these very bytes (only lengths are checked, as
        ``put_chunk(..., hashed=True)``).

        The same durability as one ``put_chunk`` per chunk when it returns, for less
        wall time: the chunk files are written and fsync'ed in ``workers`` threads at
        once (a device takes parallel flushes far faster than serial ones), then renamed
        into place and their directory fsync'ed once, not once per chunk. If any write
        fails nothing of this call is renamed into place (its temp files are removed)
        and the first error is raised; a crash part-way leaves temp files (deleted at
        the next open) or whole chunk files, as before. ``keep`` as for ``put_chunk``;
        ``placed(i)`` is called as chunk ``i`` is renamed into place (fault injection)."""
        m = self._manifest(version)
        if len(chunks) != m.chunk_count:
            raise ChunkError(f"{len(chunks)} chunks given for version {version}, whose "
                             f"manifest has {m.chunk_count}; not stored")
        for i, data in enumerate(chunks):
            n = memoryview(data).nbytes
            if n != m.chunk_length(i):
                raise ChunkError(f"chunk {i} of version {version} ({n} bytes) is not the "
                                 f"manifest's ({m.chunk_length(i)} bytes); not stored")
        with self._mutex:
            have = self._scan(version)
            todo = [i for i in range(len(chunks)) if i not in have]
            size = sum(memoryview(chunks[i]).nbytes for i in todo)
            self._check_quota(size, f"{len(todo)} chunks of version {version}")
            # held across the writes, as put_chunk holds it across its one write
            written: dict[int, tuple[Path, bool]] = {}
            errors: list[StoreError] = []
            lock = threading.Lock()

            def one(i: int) -> None:
                try:
                    got = self._write_tmp(self._cpath(version, i), chunks[i],
                                          what=f"chunk {i} of version {version}")
                except StoreError as exc:
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    written[i] = got

            k = max(1, min(workers, len(todo)))
            if k == 1:
                for i in todo:
                    one(i)
                    if errors:
                        break
            else:
                with ThreadPoolExecutor(k, thread_name_prefix="store-put") as pool:
                    list(pool.map(one, todo))
            tmps = [t for t, _d in written.values()]
            if errors:
                for tmp in tmps:
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                raise errors[0]
            try:
                for i in todo:
                    os.replace(written[i][0], self._cpath(version, i))
                    if placed is not None:
                        placed(i)
                if todo:
                    self._sync_dir(self._cpath(version, 0).parent)
            except OSError as exc:
                self._fail_write(exc, f"chunks of version {version}",
                                 [t for t in tmps if t.exists()])
            for i in todo:
                if written[i][1]:
                    self._direct_written.add((version, i))
                have.add(i)
                self._used += memoryview(chunks[i]).nbytes
                if keep:
                    self._remember(version, i, memoryview(chunks[i]).cast("B").toreadonly())

    def _remember(self, version: int, index: int, view: memoryview) -> None:
        """Keep a verified chunk in memory, dropping the oldest past ``recent_bytes``."""
        n = len(view)
        if n > self.recent_bytes:
            return
        old = self._recent.pop((version, index), None)
        if old is not None:
            self._recent_size -= len(old)
        self._recent[(version, index)] = view
        self._recent_size += n
        while self._recent_size > self.recent_bytes:
            _, gone = self._recent.popitem(last=False)
            self._recent_size -= len(gone)

    def _forget(self, version: int, index: int | None = None) -> None:
        """Drop kept copies of one chunk, or of every chunk of ``version``."""
        keys = [k for k in self._recent if k[0] == version and (index is None or k[1] == index)]
        for k in keys:
            self._recent_size -= len(self._recent.pop(k))

    def have(self, version: int) -> set[int]:
        """Indices of the verified chunks held for ``version`` (empty if unknown)."""
        with self._mutex:
            if version not in self._manifests:
                return set()
            return set(self._scan(version))

    def has_chunk(self, version: int, index: int) -> bool:
        with self._mutex:
            return version in self._manifests and index in self._scan(version)

    def complete(self, version: int) -> bool:
        with self._mutex:
            m = self._manifests.get(version)
            return m is not None and len(self._scan(version)) == m.chunk_count

    def read_chunk(self, version: int, index: int) -> bytes | memoryview:
        """The verified bytes of a held chunk. A chunk that rotted on disk is
        deleted and ``ChunkError`` raised, so the caller fetches it again.
        A chunk kept in memory (``put_chunk(..., keep=True)``) is returned from
        there, as a read-only ``memoryview``."""
        m = self._manifest(version)
        with self._mutex:
            if index not in self._scan(version):
                raise ChunkError(f"chunk {index} of version {version} is not held")
            kept = self._recent.get((version, index))
            if kept is not None:
                self._recent.move_to_end((version, index))
                self.recent_hits += 1
                return kept
        # read and hash outside the lock: uploads may run in parallel threads
        n = m.chunk_length(index)
        buf = aligned_room(n)
        got = self._read_into(version, index, buf, n)
        data = buf[:n].toreadonly() if got == n else b""
        if _is_chunk(m, index, data):
            return data
        self._drop_rotten(version, index)

    def _drop_rotten(self, version: int, index: int) -> NoReturn:
        path = self._cpath(version, index)
        with self._mutex:
            self._direct_written.discard((version, index))
            have = self._have.get(version)
            if have is not None and index in have:
                have.discard(index)
                with contextlib.suppress(OSError):
                    self._used -= path.stat().st_size
                    path.unlink()
        raise ChunkError(f"chunk {index} of version {version} was corrupt on disk; dropped")

    def iter_payload(self, version: int) -> Iterator[bytes | memoryview]:
        """The verified chunks of a complete version, in order."""
        if not self.complete(version):
            raise StoreError(f"version {version} is not complete")
        for i in range(self._manifest(version).chunk_count):
            yield self.read_chunk(version, i)

    def payload(self, version: int) -> bytes:
        """The whole verified payload of a complete version."""
        return b"".join(self.iter_payload(version))

    def payload_view(self, version: int, first: int = 0) -> memoryview:
        """``payload(version)`` as a read-only view of one buffer, read in place; from
        chunk ``first`` on (the part an apply still has to decode when the chunks before
        were decoded while they downloaded).

        Every chunk is read straight into its slice of one buffer (or copied
        from memory when kept there) and checked there: no per-chunk ``bytes``
        and no final join. Same checks and errors as ``read_chunk``.
        """
        if not self.complete(version):
            raise StoreError(f"version {version} is not complete")
        m = self._manifest(version)
        if not 0 <= first <= m.chunk_count:
            raise ValueError(f"chunk {first} of a version of {m.chunk_count}")
        return self.chunks_view(version, first, m.chunk_count)

    def chunks_view(self, version: int, first: int, stop: int) -> memoryview:
        """Held chunks ``first`` to ``stop`` (exclusive) of ``version`` as one read-only
        view, read and checked as ``payload_view`` does (a chunk not held raises
        ``ChunkError``): the bytes of patch records that span chunks, in one piece."""
        m = self._manifest(version)
        if not 0 <= first <= stop <= m.chunk_count:
            raise ValueError(f"chunks {first}..{stop} of a version of {m.chunk_count}")
        length = sum(m.chunk_length(i) for i in range(first, stop))
        view = aligned_room(length)
        off = 0
        for i in range(first, stop):
            n = m.chunk_length(i)
            part = view[off:off + n]
            with self._mutex:
                if i not in self._scan(version):
                    raise ChunkError(f"chunk {i} of version {version} is not held")
                kept = self._recent.get((version, i))
            if kept is not None and len(kept) == n:
                part[:] = kept
                self.recent_hits += 1
            else:
                # the slice up to the next ALIGN boundary: O_DIRECT reads whole blocks
                room = view[off:min(len(view), off + -(-n // ALIGN) * ALIGN)]
                got = self._read_into(version, i, room, n)
                if got != n or not _is_chunk(m, i, part):
                    self._drop_rotten(version, i)
            off += n
        return view[:length].toreadonly()

    def _read_into(self, version: int, index: int, room: memoryview, n: int) -> int:
        """Read chunk file ``index`` (``n`` bytes expected) into the start of ``room``;
        the bytes read, or -1 when the file is not ``n`` bytes long. With O_DIRECT
        when ``room`` is aligned and a whole number of blocks (the file system
        permitting); ordinary reads otherwise."""
        path = self._cpath(version, index)
        direct = (self._direct and (version, index) in self._direct_written
                  and len(room) % ALIGN == 0 and len(room) >= n
                  and _address(room) % ALIGN == 0)
        got = 0
        try:
            fd = -1
            if direct:
                try:
                    fd = os.open(path, os.O_RDONLY | _O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct = direct = False
            if fd < 0:
                fd = os.open(path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != n:
                    return -1
                want = room if direct else room[:n]
                while got < n:
                    k = os.readv(fd, [want[got:]])
                    if not k:
                        break
                    got += k
            finally:
                os.close(fd)
        except OSError as exc:
            self.problems.append(f"version {version}: chunk {index} unreadable: {exc}")
            return 0
        return got

    @property
    def used_bytes(self) -> int:
        return self._used

    # --------------------------------------------------------------- active

    def set_active(self, version: int, digest: bytes) -> None:
        """Record atomically that ``version`` (state ``digest``) is now served."""
        if type(version) is not int or version < 0 or len(digest) != 32:
            raise StoreError("active record needs a version >= 0 and a 32-byte digest")
        data = canonical_packb({"fmt": 1, "version": version, "digest": bytes(digest)})
        with self._mutex:
            self._atomic_write(self.root / "active", data, what="active version record")

    def active(self) -> ActiveRecord | None:
        """The last recorded active version, or None if none was ever recorded."""
        path = self.root / "active"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read active record: {exc.strerror or exc}") from None
        try:
            obj = msgpack.unpackb(data[: MAX_ACTIVE_BYTES + 1], raw=False)
            ok = (
                len(data) <= MAX_ACTIVE_BYTES
                and isinstance(obj, dict)
                and set(obj) == {"fmt", "version", "digest"}
                and obj["fmt"] == 1
                and type(obj["version"]) is int
                and type(obj["digest"]) is bytes
                and len(obj["digest"]) == 32
            )
        except Exception:
            ok = False
        if not ok:
            raise StoreError(f"active record {path} is corrupt")
        return ActiveRecord(obj["version"], obj["digest"])

    # ------------------------------------------------------------------- gc

    def needed_for(self, version: int) -> set[int]:
        """``version`` and the stored chain back to its full checkpoint."""
        return chain_back(self._links(), version)

    def _links(self) -> dict[int, int | None]:
        """Version -> the stored version it is rebuilt from (``None``: from nothing).

        A patch needs its parent; a full checkpoint held whole needs nothing. A full
        one held without its chunks was *adopted* (an anchor of the weights the node
        was on, stepped over without fetching it, see docs/protocol.md): its state is
        the newest older stored version with the same target digest, so it needs that
        one's chain."""
        links: dict[int, int | None] = {}
        for v in sorted(self._manifests):
            m = self._manifests[v]
            if m.kind == "patch":
                links[v] = m.parent_version
            elif self.complete(v):
                links[v] = None
            else:
                same = [u for u in links if u < v
                        and self._manifests[u].target_digest == m.target_digest]
                links[v] = max(same) if same else None
        return links

    def newest_full(self, at_most: int | None = None) -> int | None:
        """The newest full checkpoint (anchor) held whole, at or below ``at_most`` if given."""
        fulls = [v for v, m in self._manifests.items()
                 if m.kind == "full" and (at_most is None or v <= at_most) and self.complete(v)]
        return max(fulls) if fulls else None

    def replay_chain(self, version: int, base_version: int) -> list[int]:
        """The stored versions that rebuild ``version``, oldest first: from the newest full
        checkpoint held whole at or below it (else from ``base_version + 1``). A full
        version in it that is held without chunks is an adopted anchor: take its number
        (its state is the one before it). ``StoreError`` if a version is missing."""
        start = self.newest_full(version)
        first = start if start is not None and start > base_version else base_version + 1
        missing = [v for v in range(first, version + 1) if v not in self._manifests]
        if missing:
            raise StoreError(f"cannot rebuild version {version}: version {missing[0]} is not "
                             "in the store")
        return list(range(first, version + 1))

    def gc(self, keep_last: int, also_keep: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Delete what no node needs: keep the newest ``keep_last`` versions, the active
        one, ``also_keep`` (e.g. what a running core still serves), and for every kept
        version the chain back to the full checkpoint (anchor) that rebuilds it, so the
        chain from the newest anchor to the latest version is always kept
        (``retained``). Returns the versions removed."""
        if keep_last < 1:
            raise StoreError("gc must keep at least one version")
        with self._mutex:
            try:
                rec = self.active()
            except StoreError:
                rec = None
            links = self._links()
            keep = retained(links, keep_last, None if rec is None else rec.version)
            for v in also_keep:
                if v in links:
                    keep |= chain_back(links, v)
            removed = [v for v in sorted(links) if v not in keep]
            for v in removed:
                self.remove_version(v)
            return removed

    def remove_version(self, version: int) -> None:
        """Delete one version and its chunks (e.g. one that failed to apply)."""
        with self._mutex:
            self._manifest(version)
            d = self._vdir(version)
            size = len(self._raw[version]) + sum(f.stat().st_size for f in (d / "chunks").iterdir())
            self._discard_dir(d)
            self._forget(version)
            self._direct_written = {k for k in self._direct_written if k[0] != version}
            self._used -= size
            del self._manifests[version], self._raw[version]
            self._have.pop(version, None)


def chain_back(links: dict[int, int | None], version: int) -> set[int]:
    """``version`` and the chain of parents back to a full checkpoint (``links[v]`` is
    ``None``) or to the first version not in ``links`` (the base every node starts from)."""
    chain = {version}
    parent = links.get(version)
    while parent is not None and parent not in chain and parent in links:
        chain.add(parent)
        parent = links[parent]
    return chain


def retained(links: dict[int, int | None], keep_last: int, active: int | None = None) -> set[int]:
    """The versions gc keeps, given each version's parent (``None``: full checkpoint).

    The newest ``keep_last`` versions and ``active``, each with its chain back to a full
    checkpoint or the base. Versions are published as a chain (every patch's parent is
    the version before it), so this is one contiguous run that ends at the latest
    version and starts at or below the newest anchor: a node at any kept version
    follows patches to the latest, and any other node (a joiner, one back from a long
    outage) takes the newest anchor and the patches after it. Without an anchor it
    reaches back to the base, so ``keep_versions`` never strands a node.
    """
    versions = sorted(links)
    keep = set(versions[-keep_last:]) if keep_last > 0 else set(versions)
    if active is not None and active in links:
        keep.add(active)
    for v in list(keep):
        keep |= chain_back(links, v)
    return keep


def _is_chunk(m: Manifest, index: int, data: bytes) -> bool:
    """``verify_chunk`` as a yes/no (the store's one chunk check, on write, open and read)."""
    try:
        verify_chunk(m, index, data)
    except ChunkError:
        return False
    return True


def _parse_int(name: str, width: int) -> int | None:
    if len(name) != width or not name.isdigit() or not name.isascii():
        return None
    return int(name)
