"""``Publisher``: the trainer's side of patchswarm, as a Python API for training loops.

    pub = Publisher(load_config("configs/trainer.toml"))
    pub.start()                          # the origin node: listens, seeds, tracks regions
    for step in training:
        ...
        result = pub.publish(masters)    # FP32 masters -> served view -> patch -> sign -> seed
        pub.wait_seeded(result.version)  # optional: until every region holds every chunk

Each ``publish`` turns the masters into the served view (BF16, or FP8 with
scales), diffs it against the last published view, cuts the patch into chunks,
signs the manifest with the trainer's Ed25519 key, stores it in the origin's
store, and hands it to the origin's protocol core (a ``NodeCore`` with
role "origin", run by the same real driver as every node). From there the
core's seeding policy pushes each chunk into each region once.

The published view is kept in memory and, so that ``patchswarm publish`` can
run once per version, on disk as ``published-<version>.safetensors`` in the
store directory; the version and its digest are the store's active record.

Publishing is a transaction whose commit point is the store's active record:

1. encode the patch; 2. store the signed manifest and every chunk;
3. **set the active record**; 4. hand the version to the swarm;
5. write the new view file (fsync + rename) and delete older ones, on a thread
   of its own, after the hand-off (``trainer.view_file``: the whole view is
   50-2000x the patch, and the swarm need not wait for it). Sealed versions
   (confidential mode) write it before step 2 instead, and delete the older
   ones after step 3: rebuilding a lost view from a sealed chain needs a
   recipient's key.

A trainer killed anywhere before step 3 rolls back on its next start: stored
versions above the active one and their view files are deleted *before the
origin's core starts*, so an unfinished version is never shipped and the next
publish reuses its number. Killed after step 3, it resumes: the version is
complete and is seeded on start. A view file not written yet (killed in step 5),
missing or damaged is rebuilt from the newest older view file and the stored
patches after it, else from the newest stored full checkpoint (else the base)
and the stored chain of patches after it.

**Anchors** (``publish_full``, ``[publish] anchor_every = N``): a full checkpoint
of the served view as a version of its own. The store and the protocol core hold
one manifest per version (a second one is refused as equivocation), so an anchor
cannot sit *alongside* a patch under one number: with ``anchor_every = N`` every
N-th publish ships its patch as version v as usual and then an anchor of the
*same* state as version v+1 (a node at v-1 has a patch to v, a node at v steps
over the anchor without fetching it, a joiner or a node whose chain was
collected takes the newest anchor and the patches after it). The origin's store
is collected (``[store] keep_versions``) at start and after each publish: the
newest ``keep_versions`` versions and the chain back to the newest anchor stay
(``node.store.retained``), and nothing the running core holds goes.
docs/control-plane.md has the details.

**Bounded staleness** (``[publish] max_lag = k``): before version v is stored and
handed to the swarm, ``publish`` waits (encoding meanwhile) until
``max_lag_fraction`` of the nodes that report to the origin serve v-k or newer,
for at most ``max_lag_timeout_s``; then ``StalenessTimeout`` names the laggards
and nothing is published. ``publish_async`` runs the same in a worker thread and
returns a ``PublishHandle`` at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import NodeConfig, encode_threads
from node.daemon import Node, build_node, install_uvloop, serve, tune_malloc, warm_heap
from swarm.errors import ConfigError, ManifestError, PatchswarmError
from swarm.protocol import events as ev
from swarm.trust.chunks import split_payload
from swarm.trust.keys import TrustStore, key_id, load_private_key
from swarm.trust.manifest import build_manifest, patch_layout, sign_manifest
from trainer.fleet import FleetView, StalenessTimeout
from trainer.view_file import PUBLISHED_VIEW, VIEW_PATTERN, ViewSaver, drop_views_below, view_files

if TYPE_CHECKING:
    import torch

    from node.store import ActiveRecord

log = logging.getLogger("patchswarm.trainer")
REGIONS_FILE = "regions.json"  # regions and nodes met by the last run: a one-shot publish
MAX_REMEMBERED = 10_000          # waits for them (bounded by its --wait-peers-s)


@dataclass(frozen=True)
class PublishResult:
    version: int
    parent_version: int
    patch_bytes: int
    chunks: int
    changed: int
    elements: int
    target_digest: bytes
    encode_s: float
    published_at: float  # wall clock (time.time()) when handed to the swarm
    kind: str = "patch"  # "patch" | "full" (an anchor, or publish_full)
    lag_wait_s: float = 0.0  # seconds max_lag held this publish back
    anchor: PublishResult | None = None  # the anchor published right after (anchor_every)


@dataclass(frozen=True)
class Prepared:
    """A version encoded, not yet signed, stored nor handed to the swarm (``commit``)."""

    version: int
    parent: int
    kind: str
    payload: bytes
    parent_digest: bytes | None
    target_digest: bytes
    served: dict
    changed: int
    elements: int
    encode_s: float
    digests: dict | None = None  # tensor digests of ``served``, when the encoder knew them


class PublishHandle:
    """What ``publish_async`` returns: the version it will publish and its outcome."""

    def __init__(self, version: int, future: Future) -> None:
        self.version = version
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> PublishResult:
        """The ``PublishResult``; re-raises what the publish raised (``StalenessTimeout``,
        ``StoreError``, ...); ``TimeoutError`` if not done within ``timeout``."""
        return self._future.result(timeout)

    def __repr__(self) -> str:
        return f"PublishHandle(version={self.version}, done={self.done()})"


_warmed = threading.Lock()
_warm_done: bool | None = None  # warm_memory's result, once it ran in this process


def warm_memory(mib: int) -> bool:
    """``[node] warm_memory_mib`` for an origin, once per process: glibc keeps the heap it
    freed (``node.daemon.tune_malloc``: one arena, blocks up to 256 MiB from the heap) and
    ``mib`` MiB of it are touched now (``warm_heap``). 0 leaves this process's malloc as
    it is (a training process that tunes its own). Returns whether it was done.

    A dense version's encode takes its byte planes, the patch and its chunks from memory
    freed after the last version; glibc otherwise hands blocks that large back to the
    kernel, and each version's first touch of them was page faults and zeroed pages: on
    the emulated WAN's trainer a first dense 64 MiB version's encode took 0.35-0.44 s,
    warm 0.06-0.08 s (docs/benchmarks.md round 33)."""
    global _warm_done
    if mib <= 0:
        return False
    with _warmed:
        if _warm_done is not None:
            return _warm_done
        t0 = time.perf_counter()
        keep = mib << 20
        tuned = tune_malloc(keep)
        warmed = warm_heap(keep) if tuned else 0
        log.info("origin memory: malloc tuned for encode buffers: %s; warmed %d MiB of heap "
                 "in %.2f s", tuned, warmed >> 20, time.perf_counter() - t0)
        _warm_done = tuned
        return tuned


class Publisher:
    """Publish versions of the served weights from a trainer; see the module docstring."""

    def __init__(self, cfg: NodeConfig, *, base: dict[str, torch.Tensor] | None = None,
                 persist_view: bool = True) -> None:
        if cfg.role != "origin":
            raise ConfigError("node.role: a publisher needs role = \"origin\"")
        assert cfg.signing_key is not None
        key = load_private_key(cfg.signing_key)
        if not hasattr(key, "sign"):
            raise ManifestError(f"{cfg.signing_key}: not an Ed25519 signing key")
        self.cfg = cfg
        self.key = key
        self.key_id = key_id(key)
        self.trust = TrustStore([key.public_key()])
        extra = TrustStore.from_files(cfg.trainer_keys)
        for kid in extra.key_ids():
            if kid != self.key_id:
                self.trust.add(extra.get(kid))
        self.persist_view = persist_view
        self._saver = ViewSaver(self._write_view)  # the view file, after each hand-off
        self.node: Node = build_node(cfg, trust=self.trust)
        self.store = self.node.store
        try:
            self.version, self.view = self._load_last(base)
        except BaseException:
            self.store.close()  # release the store's lock: a retry must be able to open it
            raise
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.published: dict[int, PublishResult] = {}
        self._view_digests: dict[str, bytes] | None = None  # tensor digests of self.view, once known
        self._recipient_keys: list | None = None  # confidential mode: loaded on first publish
        # publishes run one at a time on one worker thread, in the order asked for
        self._worker: ThreadPoolExecutor | None = None
        self._plan_lock = threading.Lock()
        self._generation = 0  # bumped by a failed publish: the ones queued behind it fail
        self._next = self.version + 1
        self._planned_full = self.store.newest_full() or self.cfg.base_version
        self._collect()  # before the origin's core starts: it never learns of what goes

    # ------------------------------------------------------------ state

    def _load_last(self, base: dict[str, torch.Tensor] | None) -> tuple[int, dict]:
        """Roll back an unfinished publish, then load the view of the active version."""
        from swarm.codec import state_digest

        rec = self.store.active()
        active = rec.version if rec is not None else self.cfg.base_version
        for v in self.store.versions():
            if v > active:
                log.warning("rolling back version %d: its publish did not finish", v)
                self.store.remove_version(v)
        views = view_files(self.cfg.store_dir)
        for v, stale in views.items():
            if v > active:  # a rolled-back version's
                stale.unlink(missing_ok=True)
        for tmp in self.cfg.store_dir.glob(".published-*.tmp"):
            tmp.unlink(missing_ok=True)
        if rec is None or rec.version <= self.cfg.base_version:
            return self.cfg.base_version, self._base_view(base)
        for path in (self._view_path(active), self.cfg.store_dir / PUBLISHED_VIEW):
            view = self._read_view(path)
            if view is not None and state_digest(view) == rec.digest:
                drop_views_below(self.cfg.store_dir, active)
                return rec.version, view
        older = sorted((v for v in views if self.cfg.base_version <= v < active), reverse=True)
        view = self._replay_from_view(older[0], rec) if older else None
        if view is None:
            log.warning("no view file of version %d; rebuilding it from the stored patches",
                        rec.version)
            view = self._rebuild(rec.version, self._base_view(base))
            if state_digest(view) != rec.digest:
                raise PatchswarmError(f"the stored patches do not rebuild version "
                                      f"{rec.version}'s recorded digest; restore the trainer's "
                                      "store")
        if self.persist_view:
            self._write_view(rec.version, view)
        return rec.version, view

    def _replay_from_view(self, k: int, rec: ActiveRecord) -> dict[str, torch.Tensor] | None:
        """Version ``rec.version``'s view from version ``k``'s view file and the stored
        versions after ``k``, or None (unreadable, a version missing, not the recorded
        digest): the caller then rebuilds from the chain's start."""
        from swarm.codec import state_digest

        view = self._read_view(self._view_path(k))
        if view is None:
            return None
        try:
            chain = self.store.replay_chain(rec.version, self.cfg.base_version)
        except PatchswarmError:
            return None
        if not chain or chain[0] > k + 1:
            return None  # a full checkpoint after k starts the chain: rebuild from it
        log.warning("no view file of version %d; replaying the stored patches after version "
                    "%d's view file", rec.version, k)
        try:
            view = self._apply_chain(view, [v for v in chain if v > k], rec.version)
        except PatchswarmError as exc:
            log.warning("%s; rebuilding from the chain's start", exc)
            return None
        if state_digest(view) != rec.digest:
            log.warning("version %d's view file and the patches after it do not give version "
                        "%d's recorded digest; rebuilding from the chain's start", k, rec.version)
            return None
        return view

    def _base_view(self, base: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if base is not None:
            return {k: v.detach().cpu().contiguous() for k, v in base.items()}
        if self.cfg.base is None:
            raise ConfigError("weights.base: the publisher needs the base checkpoint nodes start from")
        try:
            return load_file(str(self.cfg.base))
        except FileNotFoundError:
            raise ConfigError(f"weights.base: {self.cfg.base} does not exist") from None

    @staticmethod
    def _read_view(path: Path) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:  # missing, torn or not safetensors: rebuilt from the store
            if path.exists():
                log.warning("%s unreadable (%s)", path, exc)
            return None

    def _rebuild(self, version: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply the stored chain to ``version`` (from its newest full checkpoint, else
        from ``base``)."""
        try:
            chain = self.store.replay_chain(version, self.cfg.base_version)
        except PatchswarmError as exc:
            raise PatchswarmError(f"cannot rebuild version {version}: {exc}") from None
        return self._apply_chain(base, chain, version)

    def _apply_chain(self, view: dict[str, torch.Tensor], chain: list[int],
                     version: int) -> dict[str, torch.Tensor]:
        """Apply the stored versions ``chain`` (oldest first) to ``view``."""
        from safetensors.torch import load as load_bytes

        from swarm.codec import apply_patch

        try:
            for v in chain:
                m = self.store.manifest(v)
                if m.kind == "full" and not self.store.complete(v):
                    continue  # an adopted anchor: the state of the version before it
                payload = self.store.payload(v)
                if m.encrypted:  # confidential: only a recipient's key opens the stored chain
                    if self.cfg.node_key is None:
                        raise PatchswarmError(
                            f"cannot rebuild version {version}: version {v} is confidential; give "
                            "the trainer [trust] node_key of a recipient, or keep its view file")
                    from swarm.trust.confidential import decrypt_payload

                    payload = bytes(decrypt_payload(m, payload, load_private_key(self.cfg.node_key)))
                if m.kind == "full":
                    view = dict(load_bytes(payload))
                else:
                    apply_patch(view, payload)
        except PatchswarmError as exc:
            raise PatchswarmError(f"cannot rebuild version {version}: {exc}") from None
        return view

    def _view_path(self, version: int) -> Path:
        return self.cfg.store_dir / VIEW_PATTERN.format(version=version)

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        """Run the origin node (driver + API) on a background event-loop thread.

        First, once per process, the heap is made ready for the encode as a node
        daemon's is for its chunks (``warm_memory``)."""
        warm_memory(self.cfg.warm_memory_mib)
        ready = threading.Event()

        def main() -> None:
            install_uvloop()

            async def runner() -> None:
                self._loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()
                started = asyncio.Event()
                task = asyncio.ensure_future(serve(self.node, self._stop, started))
                await asyncio.wait([task, asyncio.ensure_future(started.wait())],
                                   return_when=asyncio.FIRST_COMPLETED)
                ready.set()
                await task

            try:
                asyncio.run(runner())
            except BaseException as exc:  # surfaced to the caller by start()/close()
                self._error = exc
                ready.set()

        self._thread = threading.Thread(target=main, name="patchswarm-origin", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise PatchswarmError("origin node did not start in time")
        if self._error is not None:
            raise self._error

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued publishes, remember the regions met, drain the origin node and
        stop its thread."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._saver.flush()
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._remember_regions(self.regions())
            except (PatchswarmError, OSError, TimeoutError, RuntimeError) as exc:
                log.warning("cannot record the regions met: %s", exc)
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
        elif self._thread is None:
            self.store.close()  # never started: the origin node's drain did not close it
        self._thread = None

    def __enter__(self) -> Publisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ publish

    def publish(self, masters: dict[str, torch.Tensor]) -> PublishResult:
        """FP32 masters -> served view (``publish.served_dtype``) -> ``publish_served``."""
        return self.publish_async(masters).result()

    def publish_served(self, served: dict[str, torch.Tensor]) -> PublishResult:
        """Diff ``served`` against the last published view, sign, store and seed it
        (after ``max_lag`` allows it; an anchor follows when ``anchor_every`` says so)."""
        return self.publish_async(served, served_dtype=None).result()

    def publish_full(self, masters: dict[str, torch.Tensor]) -> PublishResult:
        """Publish the served view of ``masters`` as a full checkpoint (an anchor)."""
        return self.publish_async(masters, full=True).result()

    def publish_full_served(self, served: dict[str, torch.Tensor]) -> PublishResult:
        """Publish ``served`` (already the served view) as a full checkpoint (an anchor)."""
        return self.publish_async(served, served_dtype=None, full=True).result()

    def publish_async(self, weights: dict[str, torch.Tensor], *, full: bool = False,
                      served_dtype: str | None = "config",
                      gate: Callable[[], None] | None = None) -> PublishHandle:
        """Queue a publish and return at once; publishes run in order on one worker
        thread (encode, ``gate()``, ``max_lag`` wait, store, hand-off). ``served_dtype=None``:
        the tensors already are the served view; ``"config"``: ``publish.served_dtype``.
        ``gate``: called after the encode, before anything is stored (``patchswarm
        publish`` waits for peers there); what it raises fails the publish.
        A training loop keeps stepping meanwhile; the weights are copied to the CPU
        here, so the caller may change its tensors after this returns."""
        from trainer.served import served_view

        dtype = self.cfg.served_dtype if served_dtype == "config" else served_dtype
        served = served_view(weights, dtype) if dtype is not None else weights

        def own(name: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach().cpu().contiguous()
            src = weights.get(name)  # still the caller's storage: copy it
            return t.clone() if src is not None and t.data_ptr() == src.data_ptr() else t

        served = {k: own(k, v) for k, v in served.items()}
        with self._plan_lock:
            version, gen = self._next, self._generation
            anchor = (not full and self.cfg.anchor_every > 0
                      and version - self._planned_full >= self.cfg.anchor_every)
            self._next = version + (2 if anchor else 1)
            if full or anchor:
                self._planned_full = version + (1 if anchor else 0)
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="patchswarm-publish")
            future = self._worker.submit(self._run_publish, served, version, gen, full, anchor,
                                         gate)
        return PublishHandle(version, future)

    def _run_publish(self, served: dict[str, torch.Tensor], version: int, gen: int,
                     full: bool, anchor: bool, gate: Callable[[], None] | None) -> PublishResult:
        try:
            if gen != self._generation or version != self.version + 1:
                raise PatchswarmError(f"version {version} not published: an earlier publish "
                                      "queued before it failed")
            prepared = self.prepare_full(served) if full else self.prepare_served(served)
            if gate is not None:
                gate()
            waited = self.honour_max_lag(version)
            result = self.commit(prepared, lag_wait_s=waited)
            if anchor:
                a = self.commit(self.prepare_full(served))
                log.info("anchor: version %d is a full checkpoint of version %d (%d bytes)",
                         a.version, version, a.patch_bytes)
                result = dataclasses.replace(result, anchor=a)
                self.published[version] = result
            return result
        except BaseException:
            with self._plan_lock:
                if gen == self._generation:
                    self._generation += 1
                    self._next = self.version + 1
                    self._planned_full = self.store.newest_full() or self.cfg.base_version
            raise

    def honour_max_lag(self, version: int) -> float:
        """``[publish] max_lag``: wait until enough of the fleet serves ``version - max_lag``."""
        k = self.cfg.max_lag
        need = version - k
        if k <= 0 or need <= self.cfg.base_version:
            return 0.0
        if self._loop is None:
            log.warning("publish.max_lag: the origin is not started, so no node reports its "
                        "version; version %d is published without waiting", version)
            return 0.0
        t0 = time.monotonic()
        view = self.wait(need, self.cfg.max_lag_fraction, timeout=self.cfg.max_lag_timeout_s)
        waited = time.monotonic() - t0
        if waited > 0.5:
            log.info("max_lag: waited %.1f s for %.0f%% of %d node(s) to serve version %d",
                     waited, 100 * view.served_fraction(need), len(view), need)
        return waited

    def prepare_served(self, served: dict[str, torch.Tensor]) -> Prepared:
        """Encode the patch from the last published view to ``served`` and sign its
        manifest, as the next version; nothing is stored or sent (see ``commit``)."""
        from swarm.codec import encode_patch

        served = {k: v.detach().cpu().contiguous() for k, v in served.items()}
        enc = encode_patch(self.view, served, context=self.cfg.codec_context,
                           old_digests=self._view_digests,
                           threads=encode_threads(self.cfg.encode_threads))
        return Prepared(self.version + 1, self.version, "patch", enc.patch, enc.base_digest,
                        enc.target_digest, served, enc.changed, enc.elements, enc.encode_s,
                        enc.digests)

    def prepare_full(self, served: dict[str, torch.Tensor]) -> Prepared:
        """The full checkpoint (safetensors bytes, what ``node.engines`` loads for a
        manifest of kind "full") of ``served`` as the next version, signed."""
        from safetensors.torch import save as save_bytes

        from swarm.codec import state_digest

        t0 = time.perf_counter()
        served = {k: v.detach().cpu().contiguous() for k, v in served.items()}
        payload = save_bytes(served)
        digest = state_digest(served)
        elements = sum(t.numel() for t in served.values())
        return Prepared(self.version + 1, self.version, "full", payload, None, digest, served,
                        elements, elements, time.perf_counter() - t0)

    def commit(self, p: Prepared, *, lag_wait_s: float = 0.0) -> PublishResult:
        """Sign ``p``'s manifest, store it (the transaction of the module docstring),
        hand it to the swarm and collect the store. ``p`` must be the next version."""
        if p.version != self.version + 1:
            raise PatchswarmError(f"version {p.version} was prepared for another state "
                                  f"(the last published version is {self.version})")
        version, parent = p.version, p.parent
        payload, encryption = self._seal(p.payload, version)
        m = build_manifest(
            payload, model=self.cfg.model, version=version, kind=p.kind,
            parent_version=parent if p.kind == "patch" else None, parent_digest=p.parent_digest,
            target_digest=p.target_digest, chunk_size=self.cfg.chunk_size, key_id=self.key_id,
            encryption=encryption,
            # a plain patch's layout: nodes decode each record as soon as they hold it
            **(patch_layout(payload) if p.kind == "patch" and encryption is None else {}),
        )
        raw = sign_manifest(m, self.key)
        # The transaction of the module docstring; the active record is the commit point.
        # Sealed versions (confidential mode) write the view first: without it a restart
        # needs a recipient's key to rebuild the view from the sealed chain.
        view_first = self.persist_view and encryption is not None
        view_data = p.payload if p.kind == "full" else None
        try:
            if view_first:
                self._write_view(version, p.served, view_data, drop=False)
            self.store.put_manifest(raw, m)
            _crash_point("manifest")
            # A payload that fits the store's memory for recent chunks stays there too
            # (immutable bytes): the origin's pushes read it from there, not from disk with
            # a hash again. A larger one is not: a kept slice pins the whole payload.
            keep = len(payload) <= self.store.recent_bytes
            # hashed into the manifest from these very bytes a moment ago; written and
            # fsync'ed in parallel, durable (like the manifest) before the commit point
            self.store.put_chunks(version, list(split_payload(payload, self.cfg.chunk_size)),
                                  keep=keep,
                                  placed=lambda i: _crash_point("chunk") if i == 0 else None)
            _crash_point("chunks")
            self.store.set_active(version, m.target_digest)
        except BaseException:
            self._roll_back(version)
            raise
        _crash_point("active")
        self.version, self.view, self._view_digests = version, p.served, p.digests
        published_at = time.time()
        if self._loop is not None:
            self.node.driver.feed_threadsafe(lambda now: ev.Publish(now, raw))
        _crash_point("handed")
        if view_first:
            drop_views_below(self.cfg.store_dir, version)
        elif self.persist_view:  # the whole view: after the hand-off (trainer.view_file)
            self._saver.submit(version, p.served, view_data)
        result = PublishResult(version, parent, len(p.payload), m.chunk_count, p.changed,
                               p.elements, m.target_digest, p.encode_s, published_at,
                               kind=p.kind, lag_wait_s=lag_wait_s)
        self.published[version] = result
        log.info("published version %d (%s): %d bytes, %d chunks, %d changed of %d, "
                 "encoded in %.3f s (%d threads)", version, p.kind, result.patch_bytes,
                 result.chunks, p.changed, p.elements, p.encode_s,
                 encode_threads(self.cfg.encode_threads))
        self._collect()
        return result

    def collect(self) -> list[int]:
        """``[store] keep_versions``: drop what no node needs (never the chain from the
        newest anchor, nor a version the core still holds); the versions removed. Runs
        after every publish. While the origin runs, its core forgets at each publish
        (and heartbeat) the versions it no longer announces, those whose pushes are done
        (``NodeCore._forget_old``), so a long-running trainer's store stays at about
        ``anchor_every`` + ``keep_versions`` versions; at start, before the core runs,
        the rule alone applies."""
        return self._collect()

    def _collect(self) -> list[int]:
        """``collect``; logs what it removed or why it could not."""
        keep = self.cfg.keep_versions
        if not keep:
            return []
        core = self.node.core
        in_core: set[int] = set()
        if self._loop is not None:
            in_core = set(self.node.driver.call(lambda: list(core.manifests)))
        try:
            removed = self.store.gc(max(keep, core.cfg.keep_versions), in_core)
        except PatchswarmError as exc:
            log.warning("store gc failed: %s", exc)
            return []
        if removed:
            log.info("store gc: removed versions %s", _ranges(removed))
            for v in removed:
                self.published.pop(v, None)
        return removed

    def _seal(self, patch: bytes, version: int) -> tuple[bytes | bytearray, dict | None]:
        """Confidential mode (``[publish] recipients``): the payload sealed per chunk for
        those nodes' X25519 keys, and the manifest's ``encryption`` field; else as is."""
        if not self.cfg.recipients:
            return patch, None
        from swarm.trust.confidential import encrypt_payload, load_recipients

        if self._recipient_keys is None:
            self._recipient_keys = load_recipients(self.cfg.recipients)
        return encrypt_payload(patch, self.cfg.chunk_size, self._recipient_keys,
                               model=self.cfg.model, version=version)

    def _write_view(self, version: int, served: dict[str, torch.Tensor],
                    payload: bytes | None = None, *, drop: bool = True) -> None:
        """Write ``version``'s view file (fsync + rename; ``payload``: a full version's
        safetensors bytes as they are), then (``drop``) delete the older ones."""
        from safetensors.torch import save_file

        from swarm.fsio import write_atomic

        _crash_point("view_start")
        data = payload if payload is not None else (lambda tmp: save_file(served, tmp))
        write_atomic(self._view_path(version), data, "published view")
        _crash_point("view")
        if drop:
            drop_views_below(self.cfg.store_dir, version)

    def flush_view(self, timeout: float | None = None) -> bool:
        """Wait until the newest published view is on disk (``close`` does); False on
        timeout."""
        return self._saver.flush(timeout)

    def _roll_back(self, version: int) -> None:
        """Undo a publish that failed before its commit point (disk full, ...)."""
        try:
            if version in self.store.versions():
                self.store.remove_version(version)
            self._view_path(version).unlink(missing_ok=True)
        except (PatchswarmError, OSError) as exc:  # the next start rolls it back
            log.warning("cannot roll back version %d now (%s); the next start will", version, exc)

    # ------------------------------------------------------------ progress

    def progress(self, version: int) -> dict[str, int]:
        """Chunks of ``version`` that reached each region (from the origin's view)."""
        if self._loop is None:
            return {}
        return self.node.driver.call(lambda: self.node.driver.region_progress(version))

    def regions(self) -> list[str]:
        """Regions of the nodes the origin has met: linked, heard of, or reporting
        (the origin's own region too, when nodes of it are met)."""
        if self._loop is None:
            return []
        core = self.node.core

        def met() -> list[str]:
            seen = set(core.regions_seen())  # other regions than ours
            seen |= {p["region"] for p in core.peer_list()
                     if p.get("region") and p.get("role") != "origin"}
            seen |= {e.region for e in core.fleet()}
            return sorted(seen)

        return self.node.driver.call(met)

    def nodes(self) -> dict[str, str]:
        """Node id -> region of the nodes linked to the origin or reporting to it."""
        if self._loop is None:
            return {}
        core = self.node.core

        def met() -> dict[str, str]:
            out = {e.node_id: e.region for e in core.fleet()}
            out.update({p["id"]: p["region"] for p in core.peer_list()
                        if p.get("role") != "origin"})
            return out

        return self.node.driver.call(met)

    def fleet(self) -> FleetView:
        """Which version every reporting node serves, per region, and who lags."""
        if self._loop is None:
            return FleetView([], latest=self.version)
        core, driver = self.node.core, self.node.driver
        entries, now = driver.call(lambda: (core.fleet(), driver.now()))
        return FleetView(entries, latest=self.version, now=now)

    def wait(self, version: int, fraction: float = 1.0, timeout: float = 300.0, *,
             min_nodes: int = 0, poll_s: float = 0.2,
             on_progress: Callable[[FleetView], None] | None = None) -> FleetView:
        """Until ``fraction`` of the reporting nodes (and at least ``min_nodes`` of them)
        serve ``version`` or newer; ``StalenessTimeout`` naming the laggards otherwise."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        deadline = time.monotonic() + timeout
        while True:
            view = self.fleet()
            if on_progress is not None:
                on_progress(view)
            if len(view) >= min_nodes and view.served_fraction(version) >= fraction - 1e-9:
                return view
            if time.monotonic() >= deadline:
                raise StalenessTimeout(version, fraction, timeout, view)
            time.sleep(poll_s)

    def wait_seeded(self, version: int, timeout: float = 300.0, *, regions: int | None = None,
                    on_progress: Callable[[dict[str, int]], None] | None = None,
                    poll_s: float = 0.1) -> bool:
        """Until every region (at least ``regions`` of them) holds every chunk of ``version``."""
        total = self.published[version].chunks
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            prog = self.progress(version)
            if on_progress is not None:
                on_progress(prog)
            want = regions if regions is not None else max(1, len(self.regions()))
            if len(prog) >= want and all(n >= total for n in prog.values()):
                return True
            time.sleep(poll_s)
        return False

    def remembered_regions(self) -> list[str]:
        """Regions the previous run of this origin met (empty if unknown or unreadable)."""
        return sorted(self._remembered()[0])

    def remembered_nodes(self) -> dict[str, str]:
        """Node id -> region of the nodes the previous run met (at most ``MAX_REMEMBERED``)."""
        return self._remembered()[1]

    def _remembered(self) -> tuple[set[str], dict[str, str]]:
        try:
            data = json.loads((self.cfg.store_dir / REGIONS_FILE).read_text())
        except (OSError, ValueError):
            return set(), {}
        if isinstance(data, list):  # before 0.3: a list of region names
            data = {"regions": data, "nodes": {}}
        regions = data.get("regions") if isinstance(data, dict) else None
        nodes = data.get("nodes", {}) if isinstance(data, dict) else None
        if (not isinstance(regions, list) or not all(isinstance(r, str) for r in regions)
                or not isinstance(nodes, dict)
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in nodes.items())):
            log.warning("%s: not the regions and nodes met; ignored", REGIONS_FILE)
            return set(), {}
        return set(regions[:MAX_REMEMBERED]), dict(list(nodes.items())[:MAX_REMEMBERED])

    def _remember_regions(self, regions: list[str]) -> None:
        nodes = self.nodes()
        if not regions and not nodes:
            return
        data = {"regions": sorted(regions),
                "nodes": dict(sorted(nodes.items())[:MAX_REMEMBERED])}
        dest = self.cfg.store_dir / REGIONS_FILE
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, dest)

    @property
    def address(self) -> str:
        return self.cfg.advertise

    @property
    def store_dir(self) -> Path:
        return self.cfg.store_dir


def _ranges(vs: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7" (for logs)."""
    runs: list[list[int]] = []
    for v in sorted(vs):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _crash_point(step: str) -> None:
    """Fault injection for tests only: ``PATCHSWARM_CRASH_AT=<step>`` SIGKILLs the
    trainer at that publish step (manifest, chunk, chunks, active, handed; view_start
    and view in the view file's thread)."""
    if os.environ.get("PATCHSWARM_CRASH_AT") == step:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
