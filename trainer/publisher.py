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

1. encode the patch; 2. write the new view file (fsync + rename);
3. store the signed manifest and every chunk; 4. **set the active record**;
5. delete the previous view file; 6. hand the version to the swarm.

A trainer killed anywhere before step 4 rolls back on its next start: stored
versions above the active one and view files of other versions are deleted
*before the origin's core starts*, so an unfinished version is never shipped
and the next publish reuses its number. Killed after step 4, it resumes: the
version is complete and is seeded on start. A missing or damaged view file is
rebuilt from the base checkpoint and the stored chain of patches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import NodeConfig
from node.daemon import Node, build_node, install_uvloop, serve
from swarm.errors import ConfigError, ManifestError, PatchswarmError
from swarm.protocol import events as ev
from swarm.trust.chunks import split_payload
from swarm.trust.keys import TrustStore, key_id, load_private_key
from swarm.trust.manifest import build_manifest, sign_manifest

if TYPE_CHECKING:
    import torch

log = logging.getLogger("patchswarm.trainer")
PUBLISHED_VIEW = "published.safetensors"  # before 0.2: one view file, no version in its name
VIEW_PATTERN = "published-{version}.safetensors"
REGIONS_FILE = "regions.json"  # regions met by the last run: a one-shot publish waits for them


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
        self.node: Node = build_node(cfg, trust=self.trust)
        self.store = self.node.store
        self.version, self.view = self._load_last(base)
        self._view_digests: dict[str, bytes] | None = None  # tensor digests of self.view, once known
        self._recipient_keys: list | None = None  # confidential mode: loaded on first publish
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.published: dict[int, PublishResult] = {}

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
        keep = self._view_path(active)
        for stale in self.cfg.store_dir.glob("published-*.safetensors"):
            if stale != keep:
                stale.unlink(missing_ok=True)
        for tmp in self.cfg.store_dir.glob(".published-*.tmp"):
            tmp.unlink(missing_ok=True)
        if rec is None or rec.version <= self.cfg.base_version:
            return self.cfg.base_version, self._base_view(base)
        for path in (keep, self.cfg.store_dir / PUBLISHED_VIEW):
            view = self._read_view(path)
            if view is not None and state_digest(view) == rec.digest:
                return rec.version, view
        log.warning("no view file of version %d; rebuilding it from the stored patches",
                    rec.version)
        view = self._rebuild(rec.version, self._base_view(base))
        if state_digest(view) != rec.digest:
            raise PatchswarmError(f"the stored patches do not rebuild version {rec.version}'s "
                                  "recorded digest; restore the trainer's store")
        if self.persist_view:
            self._save_view(rec.version, view)
        return rec.version, view

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
        """Apply the stored chain base_version+1..version to ``base``."""
        from safetensors.torch import load as load_bytes

        from swarm.codec import apply_patch

        view = base
        for v in range(self.cfg.base_version + 1, version + 1):
            try:
                m = self.store.manifest(v)
                payload = self.store.payload(v)
            except PatchswarmError as exc:
                raise PatchswarmError(f"cannot rebuild version {version}: {exc}") from None
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
        return view

    def _view_path(self, version: int) -> Path:
        return self.cfg.store_dir / VIEW_PATTERN.format(version=version)

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        """Run the origin node (driver + API) on a background event-loop thread."""
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
        """Remember the regions met, drain the origin node and stop its thread."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._remember_regions(self.regions())
            except (PatchswarmError, OSError, TimeoutError, RuntimeError) as exc:
                log.warning("cannot record the regions met: %s", exc)
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Publisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ publish

    def publish(self, masters: dict[str, torch.Tensor]) -> PublishResult:
        """FP32 masters -> served view (``publish.served_dtype``) -> ``publish_served``."""
        from trainer.served import served_view

        return self.publish_served(served_view(masters, self.cfg.served_dtype))

    def publish_served(self, served: dict[str, torch.Tensor]) -> PublishResult:
        """Diff ``served`` against the last published view, sign, store and seed it."""
        from swarm.codec import encode_patch

        served = {k: v.detach().cpu().contiguous() for k, v in served.items()}
        enc = encode_patch(self.view, served, context=self.cfg.codec_context,
                           old_digests=self._view_digests)
        parent, version = self.version, self.version + 1
        payload, encryption = self._seal(enc.patch, version)
        m = build_manifest(
            payload, model=self.cfg.model, version=version, kind="patch",
            parent_version=parent, parent_digest=enc.base_digest,
            target_digest=enc.target_digest, chunk_size=self.cfg.chunk_size, key_id=self.key_id,
            encryption=encryption,
        )
        raw = sign_manifest(m, self.key)
        # The transaction of the module docstring; the active record is the commit point.
        try:
            if self.persist_view:
                self._save_view(version, served)
            _crash_point("view")
            self.store.put_manifest(raw, m)
            _crash_point("manifest")
            for i, chunk in enumerate(split_payload(payload, self.cfg.chunk_size)):
                self.store.put_chunk(version, i, chunk)
                if i == 0:
                    _crash_point("chunk")
            _crash_point("chunks")
            self.store.set_active(version, enc.target_digest)
        except BaseException:
            self._roll_back(version)
            raise
        _crash_point("active")
        self._view_path(parent).unlink(missing_ok=True)
        (self.cfg.store_dir / PUBLISHED_VIEW).unlink(missing_ok=True)
        self.version, self.view, self._view_digests = version, served, enc.digests
        published_at = time.time()
        if self._loop is not None:
            self.node.driver.feed_threadsafe(lambda now: ev.Publish(now, raw))
        result = PublishResult(version, parent, len(enc.patch), m.chunk_count, enc.changed,
                               enc.elements, enc.target_digest, enc.encode_s, published_at)
        self.published[version] = result
        log.info("published version %d: %d bytes, %d chunks, %d changed of %d",
                 version, result.patch_bytes, result.chunks, enc.changed, enc.elements)
        return result

    def _seal(self, patch: bytes, version: int) -> tuple[bytes | bytearray, dict | None]:
        """Confidential mode (``[publish] recipients``): the patch sealed per chunk for
        those nodes' X25519 keys, and the manifest's ``encryption`` field; else as is."""
        if not self.cfg.recipients:
            return patch, None
        from swarm.trust.confidential import encrypt_payload, load_recipients

        if self._recipient_keys is None:
            self._recipient_keys = load_recipients(self.cfg.recipients)
        return encrypt_payload(patch, self.cfg.chunk_size, self._recipient_keys,
                               model=self.cfg.model, version=version)

    def _save_view(self, version: int, served: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        from swarm.fsio import write_atomic

        write_atomic(self._view_path(version), lambda tmp: save_file(served, tmp),
                     "published view")

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
        """Regions of the nodes the origin has met."""
        if self._loop is None:
            return []
        return self.node.driver.call(self.node.core.regions_seen)

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
        try:
            data = json.loads((self.cfg.store_dir / REGIONS_FILE).read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(data, list) or not all(isinstance(r, str) for r in data):
            log.warning("%s: not a list of region names; ignored", REGIONS_FILE)
            return []
        return data[:10_000]

    def _remember_regions(self, regions: list[str]) -> None:
        if not regions:
            return
        dest = self.cfg.store_dir / REGIONS_FILE
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(regions)))
        os.replace(tmp, dest)

    @property
    def address(self) -> str:
        return self.cfg.advertise

    @property
    def store_dir(self) -> Path:
        return self.cfg.store_dir


def _crash_point(step: str) -> None:
    """Fault injection for tests only: ``PATCHSWARM_CRASH_AT=<step>`` SIGKILLs the
    trainer at that publish step (view, manifest, chunk, chunks, active)."""
    if os.environ.get("PATCHSWARM_CRASH_AT") == step:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
