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
run once per version, on disk as ``published.safetensors`` in the store
directory; the version and its digest are the store's active record.
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
PUBLISHED_VIEW = "published.safetensors"
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
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.published: dict[int, PublishResult] = {}

    # ------------------------------------------------------------ state

    def _load_last(self, base: dict[str, torch.Tensor] | None) -> tuple[int, dict]:
        from safetensors.torch import load_file

        from swarm.codec import state_digest

        rec = self.store.active()
        saved = self.cfg.store_dir / PUBLISHED_VIEW
        if rec is not None and rec.version > self.cfg.base_version and saved.exists():
            view = load_file(str(saved))
            if state_digest(view) != rec.digest:
                raise PatchswarmError(f"{saved} does not match the store's active record")
            return rec.version, view
        if base is not None:
            return self.cfg.base_version, {k: v.detach().cpu().contiguous() for k, v in base.items()}
        if self.cfg.base is None:
            raise ConfigError("weights.base: the publisher needs the base checkpoint nodes start from")
        try:
            return self.cfg.base_version, load_file(str(self.cfg.base))
        except FileNotFoundError:
            raise ConfigError(f"weights.base: {self.cfg.base} does not exist") from None

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
        enc = encode_patch(self.view, served, context=self.cfg.codec_context)
        parent, version = self.version, self.version + 1
        m = build_manifest(
            enc.patch, model=self.cfg.model, version=version, kind="patch",
            parent_version=parent, parent_digest=enc.base_digest,
            target_digest=enc.target_digest, chunk_size=self.cfg.chunk_size, key_id=self.key_id,
        )
        raw = sign_manifest(m, self.key)
        self.store.put_manifest(raw, m)
        for i, chunk in enumerate(split_payload(enc.patch, self.cfg.chunk_size)):
            self.store.put_chunk(version, i, chunk)
        if self.persist_view:
            self._save_view(served)
        self.store.set_active(version, enc.target_digest)
        self.version, self.view = version, served
        published_at = time.time()
        if self._loop is not None:
            self.node.driver.feed_threadsafe(lambda now: ev.Publish(now, raw))
        result = PublishResult(version, parent, len(enc.patch), m.chunk_count, enc.changed,
                               enc.elements, enc.target_digest, enc.encode_s, published_at)
        self.published[version] = result
        log.info("published version %d: %d bytes, %d chunks, %d changed of %d",
                 version, result.patch_bytes, result.chunks, enc.changed, enc.elements)
        return result

    def _save_view(self, served: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        dest = self.cfg.store_dir / PUBLISHED_VIEW
        tmp = dest.with_suffix(".tmp")
        save_file(served, str(tmp))
        os.replace(tmp, dest)

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
