"""The node driver's apply pipeline: prestage (decode a version's verified prefix in
a low-priority thread while the rest downloads), apply (stage + commit on the node's
checkpoint truth, bitwise checked against the trainer's digest), and the engine
(hand it a ``WeightUpdate``, record what it serves, watch its health and bring it
back). ``ApplyPipeline`` is a part of ``node.driver.Driver`` (a mixin: it uses the
driver's loop, core, store and engine); the versions each step records are in
``node.driver``'s docstring."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from node.engines.base import CommitStats, EngineError, WeightUpdate
from node.engines.inprocess import merge_changes
from swarm.codec.planes import Pieces
from swarm.errors import ChunkError, PatchFormatError, PatchswarmError, StoreError
from swarm.protocol import events as ev
from swarm.trust.confidential import NoKeyError, decrypt_payload

log = logging.getLogger("patchswarm.node")

AHEAD_GRACE_TRIES = 3  # probes an engine ahead of a restarted node is given before a rebuild
APPLIES_KEPT = 16  # versions whose apply times /status shows (apply_seconds, apply_split, activated_at)


@dataclass
class _Layout:
    """What the prestage knows of a patch with a layout (``_prestage_records``)."""

    version: int
    starts: list[int]  # where each part begins (-1 the header, then the records), then the end
    seen: set[int] = field(default_factory=set)  # chunks looked at
    pending: set[int] = field(default_factory=set)  # parts to look at
    left: dict[int, int] = field(default_factory=dict)  # chunk -> its parts not decoded yet
    kept: dict[int, memoryview] = field(default_factory=dict)  # chunks read and still needed
    kept_bytes: int = 0
    failed: bool = False


@dataclass
class EngineState:
    """What the node knows about its engine (read by /status, /healthz, /metrics)."""

    kind: str
    state: str = "starting"  # starting | ok | behind | unhealthy
    reason: str = ""
    served_version: int | None = None  # last version the engine confirmed
    uncertain: bool = True  # the engine may hold a mix: rebuild it with a full update
    last_commit: CommitStats | None = None
    last_commit_at: float | None = None
    commits: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    commit_seconds: float = 0.0  # totals over all commits
    paused_seconds: float = 0.0
    next_retry_at: float | None = None  # monotonic
    since: float = field(default_factory=time.monotonic)

    @property
    def healthy(self) -> bool:
        return self.state == "ok"


PRESTAGE_NICE = 10  # niceness of the prestage thread (Linux: per thread)
# prestage feeds a chunk in slices of this many bytes and checks between them whether an
# apply waits: the apply waits for one slice's decode at most, which on a loaded host (the
# thread is niced) can be much longer than on an idle one
PRESTAGE_SLICE = 1 << 20
# a patch with a layout (``Manifest.records``) is decoded ahead record by record, in any
# order; a chunk read for a record that spans chunks is kept, up to this many bytes in all,
# until the other records in it are decoded (else each would read and hash it again)
PRESTAGE_KEEP = 128 << 20


def lower_thread_priority() -> None:
    """Lower the calling thread's scheduling priority to ``PRESTAGE_NICE`` (never
    raise it). Linux only (niceness is per thread there); elsewhere, or when the
    system refuses, the thread runs at normal priority."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere a thread id is no target for setpriority
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < PRESTAGE_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, PRESTAGE_NICE)
    except (AttributeError, OSError):
        pass


def raise_thread_priority(tid: int, to: int) -> bool:
    """Set thread ``tid``'s niceness to ``to`` if that raises its priority (Linux; needs
    ``CAP_SYS_NICE`` or a ``RLIMIT_NICE`` that allows it): False where it was refused or
    is not lower than ``to`` already."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) <= to:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, to)
        return True
    except (AttributeError, OSError):
        return False


class ApplyPipeline:
    """The part of ``Driver`` that applies versions and keeps the engine on them
    (module docstring)."""

    # ------------------------------------------------------------ prestage

    def _prestage_kick(self, v: int) -> None:
        """A chunk of ``v`` was stored: decode what it extends of the patch's verified
        prefix, in the prestage thread (``_prestage_pool``: its own, at low priority),
        while later chunks still download. The apply then decodes only the tail
        (``InProcessWeights.prefeed``); at most one such task runs, none during an
        apply, and none once the driver stopped."""
        if self.weights is None or self._applying or self._pre_closed:
            return
        if self._pre_task is not None:
            self._pre_again = True
            return
        self._pre_task = self._spawn(self._prestage(v))

    async def _prestage(self, v: int) -> None:
        try:
            while True:
                self._pre_again = False
                if self._pre_closed:  # stopped: no new pool
                    return
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._prestage_pool(), self._prestage_step, v)
                if not self._pre_again or self._applying:
                    return
        except Exception:  # an optimisation only: the apply decodes everything itself
            log.exception("decoding version %d ahead of its apply failed", v)
        finally:
            self._pre_task = None

    def _prestage_pool(self) -> ThreadPoolExecutor:
        """The prestage thread: one, of its own (not the default executor that chunk
        reads, stores and applies share), at a lower scheduling priority, so decoding
        ahead yields the CPU to the event loop (uploads, relays, heartbeats) and to
        everything else the node does. Created on first use, shut down by ``stop``."""
        if self._pre_pool is None:
            self._pre_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prestage",
                                                initializer=self._prestage_init)
        return self._pre_pool

    def _prestage_init(self) -> None:
        self._pre_tid = threading.get_native_id()
        lower_thread_priority()

    def _boost_prestage(self) -> None:
        """An apply waits for the prestage thread to finish its slice: that slice now
        holds up the version, so the thread runs at the event loop's priority until its
        next step (which lowers it again). On a busy host a niced thread gets a sliver
        of a core: the emulated WAN's nodes (12 processes on 2 cores) waited up to
        0.17 s here for one slice. Where raising a priority is not allowed (no
        ``CAP_SYS_NICE``), the wait stays as it was."""
        tid = self._pre_tid
        if tid is None or self._pre_task is None:
            return
        try:
            mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        except (AttributeError, OSError):
            return
        if raise_thread_priority(tid, mine):
            self.prestage_boosts += 1

    async def _prestage_close(self) -> None:
        """Stop decoding ahead and join the prestage thread (it finishes at most the
        chunk it is feeding)."""
        self._pre_closed = True
        pool, self._pre_pool = self._pre_pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, True)

    def _prestage_step(self, v: int) -> None:
        """Decode what the stored chunks hold of the patch (prestage thread): with its
        layout, every record they hold whole (``_prestage_records``); else every
        chunk that continues the decoded prefix."""
        lower_thread_priority()  # again, after an apply's _boost_prestage
        w = self.weights
        try:
            m = self.store.manifest(v)
        except (StoreError, KeyError):
            return
        if w is None or m.kind != "patch" or getattr(m, "encryption", None) is not None \
                or m.parent_digest is None or m.parent_digest != w.digest:
            return
        if getattr(m, "records", None) is not None:
            self._prestage_records(v, m)
            return
        fed = w.prefed(v)
        i, start = divmod(fed, m.chunk_size)  # a chunk may be fed in part (slices)
        held = self.store.have(v)
        while i < m.chunk_count and i in held:
            try:
                data = memoryview(self.store.read_chunk(v, i))
            except (ChunkError, StoreError, OSError):
                return  # the apply reads it again and reports
            for off in range(start, len(data), PRESTAGE_SLICE):
                if self._applying or self._pre_closed:
                    return
                piece = data[off:off + PRESTAGE_SLICE]
                now = w.prefeed(v, m.parent_digest, fed, piece)
                if now != fed + len(piece):
                    return
                fed = now
            i, start = i + 1, 0

    def _prestage_records(self, v: int, m) -> None:
        """Decode each part of patch ``v`` (-1 its header, then its records) whose bytes
        the store holds whole, in any order, the header first. Parts are looked at
        when a chunk they overlap arrives, so a step costs the records of its new
        chunks, not all of them. The header comes from the manifest where it carries
        it (``Manifest.header``), else from its chunk; a chunk read for a record that spans it and its
        neighbours is kept (``PRESTAGE_KEEP``) until the records it holds are decoded,
        so each is read and hashed once (``_Layout``)."""
        w = self.weights
        lay = self._pre_layout
        if lay is None or lay.version != v:
            lay = self._pre_layout = _Layout(v, m.record_starts())
        if lay.failed:
            return  # a part failed: the apply decodes the patch itself and reports
        done = w.prefed_records(v)
        header = getattr(m, "header", None)
        if -1 not in done and header is not None:  # the manifest carries it: no chunk needed
            if not w.prefeed_record(v, m.parent_digest, -1, header):
                lay.failed = True
                return
            done.add(-1)
        starts, pending = lay.starts, lay.pending
        held = self.store.have(v)
        cs = m.chunk_size
        last = len(starts) - 2
        for i in held - lay.seen:  # parts q with a byte in chunk i
            lo = max(bisect.bisect_right(starts, i * cs) - 2, -1)
            hi = min(bisect.bisect_left(starts, (i + 1) * cs) - 1, last)
            parts = [q for q in range(lo, hi) if q not in done]
            pending.update(parts)
            lay.left[i] = len(parts)
        lay.seen |= held
        ready: list[int] = []
        for q in sorted(pending):
            if q in done:
                pending.discard(q)
            elif all(i in held for i in _chunks_of(starts, q, cs)):
                ready.append(q)
            else:
                pending.discard(q)  # the arrival of its missing chunk looks again
        if -1 not in done and (not ready or ready[0] != -1):
            return  # records wait for the header
        for q in ready:
            if self._applying or self._pre_closed:
                return
            try:
                data = self._part_pieces(v, lay, q, cs)
            except (ChunkError, StoreError, OSError):
                return  # the apply reads it again and reports
            ok = w.prefeed_record(v, m.parent_digest, q, data)
            pending.discard(q)
            if not ok:
                lay.failed = True
                lay.kept.clear()
                pending.clear()
                return
            for i in _chunks_of(starts, q, cs):
                lay.left[i] -= 1
                if lay.left[i] <= 0 and i in lay.kept:
                    lay.kept_bytes -= len(lay.kept.pop(i))

    def _part_pieces(self, v: int, lay: _Layout, q: int,
                     cs: int) -> memoryview | list[memoryview]:
        """Part ``q``'s bytes: a view of its chunk, or for a record the views of each
        of its chunks (each read once while the ``PRESTAGE_KEEP`` budget lasts), which
        the decoder reads where they lie (``swarm.codec.planes``); the header is joined."""
        s, e = lay.starts[q + 1], lay.starts[q + 2]
        pieces = []
        for i in _chunks_of(lay.starts, q, cs):
            data = lay.kept.get(i)
            if data is None:
                data = memoryview(self.store.read_chunk(v, i)).cast("B")
                if lay.left.get(i, 0) > 1 and lay.kept_bytes + len(data) <= PRESTAGE_KEEP:
                    lay.kept[i] = data  # another part still needs it
                    lay.kept_bytes += len(data)
            lo = i * cs
            pieces.append(data[max(s, lo) - lo:min(e, lo + len(data)) - lo])
        if len(pieces) == 1:
            return pieces[0]
        return pieces if q >= 0 else Pieces(pieces).join()

    def _read_parts(self, v: int, m, starts: list[int], parts: list[int]) -> dict[int, memoryview]:
        """The bytes of patch parts ``parts`` (-1: the header) of ``v``: each run of
        consecutive chunks they need is read once, into one buffer, and each part is a
        view of its run's buffer."""
        cs = m.chunk_size
        need = sorted({i for q in parts for i in _chunks_of(starts, q, cs)})
        runs: list[list[int]] = []
        for i in need:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        out: dict[int, memoryview] = {}
        for first, stop in runs:
            buf = self.store.chunks_view(v, first, stop)
            lo, hi = first * cs, first * cs + len(buf)
            for q in parts:
                s, e = starts[q + 1], starts[q + 2]
                if lo <= s and e <= hi:
                    out[q] = buf[s - lo:e - lo]
        return out

    # ---------------------------------------------------------------- apply

    async def _apply(self, version: int) -> None:
        t0 = time.perf_counter()
        self._applying = True
        try:
            if self._pre_task is not None:  # its thread finishes its current slice
                self._boost_prestage()
                await asyncio.shield(self._pre_task)
            await self._apply_locked(version, t0)
        finally:
            self._applying = False

    async def _apply_locked(self, version: int, t0: float) -> None:
        async with self._engine_lock:
            t_lock = time.perf_counter()
            try:
                if self.weights is None:
                    raise StoreError("this node has no weights to apply versions to")
                async with self._gated(version, self.engine is not None
                                       and self.engine.kind == "inprocess"):
                    digest = await asyncio.to_thread(self._apply_truth, version)
                t_truth = time.perf_counter()
            except NoKeyError as exc:
                # Confidential version not for us: the chunks are held and verified
                # (ciphertext), so the core moves on and relays this version and later
                # ones; the weights, the engine and the store's active record stay at
                # the last version this node could open (docs/security.md).
                no_key = self.no_key_versions
                no_key[version] = str(exc)
                while len(no_key) > 64:
                    del no_key[min(no_key)]
                held = self.weights.version if self.weights is not None else None
                log.warning("%s; relaying it without applying it (weights stay at version %s)",
                            exc, held)
                self.feed(ev.Applied(self.now(), version, True))
                return
            except (PatchswarmError, OSError, RuntimeError, ValueError) as exc:
                log.error("apply of version %d failed: %s", version, exc)
                self.feed(ev.Applied(self.now(), version, False, str(exc)[:200]))
                return
            except Exception as exc:  # a bug must not leave the core waiting for Applied
                log.exception("apply of version %d failed", version)
                self.feed(ev.Applied(self.now(), version, False,
                                     f"{type(exc).__name__}: {exc}"[:200]))
                return
            # The truth holds `version`, bitwise checked: only now does the engine hear of it.
            if self.engine is not None:
                await self._sync_engine()
        t1 = time.perf_counter()
        self.apply_seconds[version] = t1 - t0
        # where the time went: waiting (decode ahead, engine lock), the truth, the engine
        self.apply_split = {"wait_s": round(t_lock - t0, 4), "truth_s": round(t_truth - t_lock, 4),
                            **self._truth_split, "engine_s": round(t1 - t_truth, 4)}
        # for /status only (the log line says it in words)
        self.apply_splits[version] = {**self.apply_split, "ahead_bytes": self._ahead_bytes}
        self.activated_at[version] = time.time()
        for per_version in (self.apply_seconds, self.apply_splits, self.activated_at):
            while len(per_version) > APPLIES_KEPT:  # a node runs for thousands of versions
                del per_version[min(per_version)]
        st = self.engine_state
        if st.healthy:
            log.info("version %d active (digest %s, %.3f s: %s; %d bytes decoded ahead)",
                     version, digest.hex()[:16], self.apply_seconds[version],
                     ", ".join(f"{k} {v}" for k, v in self.apply_split.items()),
                     self._ahead_bytes)
        else:
            log.warning("version %d verified (digest %s) but the %s engine does not serve it: %s",
                        version, digest.hex()[:16], st.kind, st.reason)
        self.feed(ev.Applied(self.now(), version, True))

    def _apply_truth(self, version: int) -> bytes:
        """Stage + commit ``version`` on the checkpoint-coordinate truth (worker thread)."""
        m = self.store.manifest(version)
        w = self.weights
        t0 = time.perf_counter()
        c0 = time.thread_time()  # this worker thread's CPU: the apply's own cost
        self._ahead_bytes = 0
        self._truth_split = {}
        if m.kind == "full" and m.target_digest == w.digest:
            # an anchor of the weights we hold (the core did not fetch it): take its number
            digest = w.adopt(version, m.target_digest)
            self._truth_commit_s = time.perf_counter() - t0
            return self._after_truth_commit(version, digest)
        if m.kind == "patch" and getattr(m, "records", None) is not None \
                and getattr(m, "encryption", None) is None:
            try:
                return self._apply_records(version, m, t0, c0)
            except PatchFormatError as exc:
                # signed, so the trainer's mistake; the patch itself may be whole
                log.warning("version %d: the patch does not match its manifest's layout (%s); "
                            "decoding it in order", version, exc)
        skip = w.prefed(version) if getattr(m, "encryption", None) is None else 0
        self._ahead_bytes = skip
        if skip:  # decoded while it downloaded: only the rest is read and decoded
            first, part = divmod(skip, m.chunk_size)  # from within a chunk (slices)
            payload = self.store.payload_view(version, first)[part:]
        else:
            # a plain patch is decoded straight from one buffer read in place; a full
            # checkpoint (safetensors) and a confidential payload want bytes
            plain = m.kind == "patch" and getattr(m, "encryption", None) is None
            payload = self.store.payload_view(version) if plain else self.store.payload(version)
        if getattr(m, "encryption", None) is not None:
            # Confidential: chunks were verified as ciphertext; open them only here.
            # AES-GCM authenticates every chunk: a failure is local, nobody is blamed.
            node_key = self.node_key
            if node_key is None:
                raise NoKeyError(f"no key for version {version}: it is confidential and "
                                 "this node has no [trust] node_key")
            payload = bytes(decrypt_payload(m, payload, node_key))
        t1 = time.perf_counter()
        w.stage(version, m.kind, payload, m.parent_digest, offset=skip)
        t2 = time.perf_counter()
        digest = w.commit(version, m.target_digest)
        t3 = time.perf_counter()
        self._truth_commit_s = t3 - t2
        out = self._after_truth_commit(version, digest)
        self._truth_split = {"read_s": round(t1 - t0, 4), "stage_s": round(t2 - t1, 4),
                             "commit_s": round(t3 - t2, 4),
                             "record_s": round(time.perf_counter() - t3, 4),
                             "cpu_s": round(time.thread_time() - c0, 4)}
        return out

    def _apply_records(self, version: int, m, t0: float, c0: float) -> bytes:
        """``_apply_truth`` for a patch with a layout: the parts decoded ahead are kept,
        only the others are read (the runs of chunks they lie in) and decoded."""
        w = self.weights
        self._pre_layout = None  # the prestage's kept chunks: the parts left are read below
        starts = m.record_starts()
        header = getattr(m, "header", None)
        if header is not None and bytes(self._read_parts(version, m, starts, [-1])[-1]) != header:
            # records decoded with the manifest's copy may be wrong: decode in order
            raise PatchFormatError("the manifest's copy of the patch header differs from the "
                                   "patch's own")
        done = w.prefed_records(version)
        self._ahead_bytes = sum(starts[q + 2] - starts[q + 1] for q in done)
        read_s = 0.0

        def read(parts: list[int]) -> dict[int, memoryview]:
            nonlocal read_s
            r0 = time.perf_counter()
            try:
                return self._read_parts(version, m, starts, parts)
            finally:
                read_s = time.perf_counter() - r0

        t1 = time.perf_counter()
        w.stage_records(version, m.parent_digest, len(starts) - 2, read)
        t2 = time.perf_counter()
        digest = w.commit(version, m.target_digest)
        t3 = time.perf_counter()
        self._truth_commit_s = t3 - t2
        out = self._after_truth_commit(version, digest)
        self._truth_split = {"read_s": round(read_s, 4), "stage_s": round(t2 - t1 - read_s, 4),
                             "commit_s": round(t3 - t2, 4),
                             "record_s": round(time.perf_counter() - t3, 4),
                             "cpu_s": round(time.thread_time() - c0, 4)}
        return out

    def _after_truth_commit(self, version: int, digest: bytes) -> bytes:
        w = self.weights
        st = self.engine_state
        nothing_owed = st.served_version is not None and not st.uncertain and self._owed == {}
        self._owed = merge_changes(self._owed, w.last_changes, first=nothing_owed)
        if self.engine is None:
            self._record_active(version, digest)
        return digest

    def _record_active(self, version: int, digest: bytes) -> None:
        self.store.set_active(version, digest)
        if self.keep_versions:
            self.store.gc(self.keep_versions)

    # --------------------------------------------------------------- engine

    def _engine_update(self, target: int, served: int | None) -> WeightUpdate:
        """What takes the engine from ``served`` to the truth's ``target`` (worker thread)."""
        st = self.engine_state
        w = self.weights
        if self.engine.kind == "inprocess":
            return WeightUpdate(target, served, w.digest, (), full=False)
        incremental = (served is not None and served == st.served_version and not st.uncertain
                       and self._owed is not None)
        frac = self.engine_cfg.sparse_max_fraction if self.engine_cfg is not None else 1.0
        return w.weight_update(target, served, self._owed if incremental else None,
                               sparse_max_fraction=frac)

    async def _sync_engine(self) -> bool:
        """Bring the engine to the truth's version; call with ``_engine_lock`` held.

        Asks the engine what it serves first: already there -> nothing to send;
        at the version it last confirmed (and not uncertain) -> the changes
        since; anything else (restarted, uncertain, never synced) -> everything.
        """
        st = self.engine_state
        target = self.weights.version
        try:
            served = await asyncio.to_thread(self.engine.served_version)
            marked = self._commit_mark is not None and self._commit_mark.exists()
            if marked:
                st.uncertain = True
            if served == target and not marked:
                stats = None
                if st.kind == "inprocess":  # the truth's own commit was the engine's commit
                    stats = CommitStats(target, self._truth_commit_s, self._truth_commit_s,
                                        "inprocess", 0)
                self._engine_ok(target, stats)
                await self._record_served(target)
                return True
            if (served is not None and served > target and st.served_version is None and not marked
                    and st.consecutive_failures < AHEAD_GRACE_TRIES):
                # After a node restart the engine may already serve a version the node
                # verified before the crash but had not recorded: let the node re-apply
                # it from its store rather than take the engine back and forth.
                self._engine_failed(target, f"engine serves version {served}, newer than the "
                                    "node's verified version; waiting for the node to verify it",
                                    False)
                return False
            if served != st.served_version and st.served_version is not None:
                log.warning("%s engine serves %s, expected version %d (restarted?); rebuilding it",
                            st.kind, "no version" if served is None else f"version {served}",
                            st.served_version)
                st.uncertain = True
            update = await asyncio.to_thread(self._engine_update, target, served)
            await asyncio.to_thread(self.engine.stage, update)
            async with self._gated(target):
                await asyncio.to_thread(self._mark, target)
                stats = await asyncio.to_thread(self.engine.commit, update)
                await asyncio.to_thread(self._mark, None)
                self._engine_ok(target, stats)
        except EngineError as exc:
            if not exc.uncertain and not st.uncertain:
                await asyncio.to_thread(self._mark, None)
            self._engine_failed(target, str(exc), exc.uncertain)
            return False
        except Exception as exc:  # an adapter bug: the engine's state is unknown
            log.exception("%s engine adapter failed", st.kind)
            self._engine_failed(target, f"{type(exc).__name__}: {exc}", True)
            return False
        await self._record_served(target)
        return True

    def _gated(self, version: int, when: bool = True) -> AbstractAsyncContextManager[None]:
        """``commit_gate(version)`` around an engine commit, when one is set."""
        if self.commit_gate is None or not when:
            return contextlib.nullcontext()
        return self.commit_gate(version)

    def _mark(self, version: int | None) -> None:
        """Write (``version``) or remove (``None``) the commit-in-progress mark, durably."""
        p = self._commit_mark
        if p is None or self.engine.kind == "inprocess":
            return
        try:
            if version is None:
                p.unlink(missing_ok=True)
                return
            tmp = p.with_name(p.name + ".tmp")
            with open(tmp, "w") as f:
                f.write(f"{version}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except OSError as exc:
            log.warning("cannot %s %s: %s", "remove" if version is None else "write", p, exc)

    async def _record_served(self, version: int) -> None:
        """The store's active record: verified and served (see the module docstring)."""
        try:
            await asyncio.to_thread(self._record_active, version, self.weights.digest)
        except (PatchswarmError, OSError) as exc:
            # Local: the node keeps serving and patching from the verified version; a
            # restart rebuilds to the last recorded one and re-applies the rest from the store.
            log.error("cannot record active version %d: %s", version, exc)
            self.store_fault = f"cannot record active version {version}: {exc}"
        else:
            if self.store_fault is not None and self.store_fault.startswith("cannot record"):
                self.store_fault = None

    def _engine_ok(self, version: int, stats: CommitStats | None) -> None:
        st = self.engine_state
        was = st.state
        if self.core is not None and version != self.core.served_version:
            self.feed(ev.EngineServed(self.now(), version))  # the origin's fleet view
        st.served_version = version
        st.uncertain = False
        self._owed = {}
        st.state, st.reason = "ok", ""
        st.consecutive_failures = 0
        st.next_retry_at = None
        st.since = time.monotonic()
        if stats is not None:
            st.last_commit = stats
            st.last_commit_at = time.time()
            st.commits += 1
            st.commit_seconds += stats.commit_s
            st.paused_seconds += stats.paused_s
            if st.kind != "inprocess":
                log.info("%s engine serves version %d (%s, %d bytes, paused %.3f s, commit %.3f s)",
                         st.kind, version, stats.path, stats.bytes, stats.paused_s, stats.commit_s)
        if was != "ok":
            log.info("%s engine healthy again, serving version %d", st.kind, version)

    def _engine_failed(self, version: int, reason: str, uncertain: bool) -> None:
        st = self.engine_state
        st.failures += 1
        st.consecutive_failures += 1
        st.uncertain = st.uncertain or uncertain
        if st.uncertain:
            self._owed = None
        st.state = "unhealthy"
        served = "no version" if st.served_version is None else f"version {st.served_version}"
        st.reason = (f"{st.kind} engine failed to take version {version}"
                     f"{' mid-commit (state uncertain, will rebuild it)' if uncertain else ''}: "
                     f"{reason[:300]}; last confirmed {served}")
        st.since = time.monotonic()
        cap = self.engine_cfg.retry_max_s if self.engine_cfg is not None else 30.0
        delay = min(cap, 2.0 ** min(st.consecutive_failures - 1, 16))
        st.next_retry_at = time.monotonic() + delay
        log.error("%s (retry in %.0f s)", st.reason, delay)

    async def _watch_engine(self) -> None:
        """Probe the engine; bring it back to the verified version when needed."""
        probe = self.engine_cfg.probe_s if self.engine_cfg is not None else 5.0
        first = True
        while not self.draining:
            if not first:
                st = self.engine_state
                wait = probe
                if st.next_retry_at is not None:
                    wait = min(probe, max(0.05, st.next_retry_at - time.monotonic()))
                await asyncio.sleep(wait)
            first = False
            if self.draining:
                return
            st = self.engine_state
            if st.next_retry_at is not None and time.monotonic() < st.next_retry_at:
                continue
            if self._engine_lock.locked():
                continue  # an apply is talking to the engine
            async with self._engine_lock:
                if st.state == "ok" and st.served_version == self.weights.version:
                    try:
                        served = await asyncio.to_thread(self.engine.served_version)
                    except EngineError as exc:
                        self._engine_failed(self.weights.version, str(exc), False)
                        continue
                    if served == st.served_version:
                        continue
                    st.state = "behind"
                    st.reason = (f"{st.kind} engine serves "
                                 f"{'no version' if served is None else f'version {served}'}, "
                                 f"node verified version {self.weights.version}")
                    log.warning("%s; bringing it up to date", st.reason)
                await self._sync_engine()


def _chunks_of(starts: list[int], q: int, chunk_size: int) -> range:
    """The chunks holding part ``q`` of a patch (-1: its header) whose parts begin at
    ``starts`` (then its end)."""
    return range(starts[q + 1] // chunk_size, (starts[q + 2] - 1) // chunk_size + 1)
