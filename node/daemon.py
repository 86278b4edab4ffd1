"""Assemble and run one node: trust, store, weights, protocol core, driver, API, gateway.

Start-up order matters for crash recovery: the store is opened (it re-verifies
manifests and drops torn chunk files), the weights are rebuilt to the active
version the store recorded (base checkpoint + the stored chain of patches,
checked against the recorded digest), the core starts at that version, and
then learns every chunk already held (``LocalChunks``), so a restarted node
fetches only what it lacks. SIGTERM (or SIGINT) drains and exits cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from dataclasses import dataclass

from node import cpu_account
from node.api import add_routes
from node.config import NodeConfig
from node.driver import Driver, Faults, TlsContexts
from node.engines import make_engine
from node.engines.base import Engine
from node.engines.inprocess import InProcessWeights
from node.gateway import Gateway
from node.guard import ConnectionGuard
from node.logs import setup_logging
from node.store import ChunkStore
from swarm.errors import ConfigError, PatchswarmError
from swarm.protocol.core import NodeCore
from swarm.trust.keys import TrustStore
from swarm.trust.manifest import verify_manifest

log = logging.getLogger("patchswarm.node")


def faults_from_env() -> Faults:
    """Test-only fault injection: ``PATCHSWARM_FAULTS=corrupt_chunks``."""
    names = {n.strip() for n in os.environ.get("PATCHSWARM_FAULTS", "").split(",") if n.strip()}
    unknown = names - {"corrupt_chunks"}
    if unknown:
        raise ConfigError(f"PATCHSWARM_FAULTS: unknown fault(s) {sorted(unknown)}")
    return Faults(corrupt_chunks="corrupt_chunks" in names)


def open_trust(cfg: NodeConfig) -> TrustStore:
    return TrustStore.from_files(cfg.trainer_keys)


def truth_device(cfg: NodeConfig) -> str:
    """Where the checkpoint-coordinate truth lives: the CPU when an external engine
    owns the GPU (``weights.device = "auto"``), else ``weights.device``."""
    if cfg.engine.external and cfg.device == "auto":
        return "cpu"
    return cfg.device


def restore_weights(cfg: NodeConfig, store: ChunkStore) -> InProcessWeights:
    """Load the base and replay the stored versions up to the recorded active one.

    The replay starts at the newest full checkpoint (anchor) held whole at or below
    it (``ChunkStore.replay_chain``), so versions a node collected or never fetched
    before it are not needed; an anchor the node stepped over (held without its
    chunks: the weights of the version before it) only gives its number. Confidential
    versions are opened with ``[trust] node_key``. Anything missing or wrong: start
    from the base and let the store's versions be applied again.
    """
    assert cfg.base is not None
    device = truth_device(cfg)
    engine = InProcessWeights.load(cfg.base, cfg.base_version, device)
    rec = store.active()
    if rec is None or rec.version <= cfg.base_version:
        return engine
    try:
        key = None
        for v in store.replay_chain(rec.version, cfg.base_version):
            m = store.manifest(v)
            if m.kind == "full" and not store.complete(v):
                engine.adopt(v, m.target_digest)
                continue
            payload = store.payload(v)
            if m.encrypted:
                if cfg.node_key is None:
                    raise PatchswarmError(f"version {v} is confidential and [trust] node_key "
                                          "is not set")
                from swarm.trust.confidential import decrypt_payload
                from swarm.trust.keys import load_private_key

                key = key or load_private_key(cfg.node_key)
                payload = bytes(decrypt_payload(m, payload, key))
            engine.stage(v, m.kind, payload, m.parent_digest)
            engine.commit(v, m.target_digest)
        if engine.digest != rec.digest:
            raise PatchswarmError("rebuilt state does not match the recorded digest")
    except PatchswarmError as exc:
        log.warning("cannot rebuild active version %d from the store (%s); starting from the base",
                    rec.version, exc)
        engine = InProcessWeights.load(cfg.base, cfg.base_version, device)
    return engine


@dataclass
class Node:
    cfg: NodeConfig
    store: ChunkStore
    weights: InProcessWeights | None  # the checkpoint-coordinate truth
    engine: Engine | None  # what serves it ([engine] kind)
    core: NodeCore
    driver: Driver
    gateway: Gateway | None = None  # the version-pinned request gateway ([gateway])


def build_node(cfg: NodeConfig, *, weights: InProcessWeights | None = None,
               engine: Engine | None = None, trust: TrustStore | None = None,
               faults: Faults | None = None, loop_now: float = 0.0) -> Node:
    """Everything but the sockets; ``weights=None`` for a node loads them from config,
    ``engine=None`` builds the adapter ``[engine] kind`` names."""
    if trust is None:
        trust = open_trust(cfg)
    store = ChunkStore(cfg.store_dir, cfg.quota_bytes, trust=trust, fsync=cfg.fsync)
    try:
        for problem in store.problems:
            log.warning("store: %s", problem)
        if weights is None and cfg.role == "node":
            weights = restore_weights(cfg, store)
        if engine is None and weights is not None:
            engine = make_engine(cfg.engine, weights)
        if weights is not None and engine is not None and engine.kind == "inprocess":
            weights.track_changes = False  # the truth itself serves: nothing to hand over
        active = weights.version if weights is not None else None
        if cfg.role == "origin":
            rec = store.active()
            active = rec.version if rec is not None else cfg.base_version
        core = NodeCore(cfg.core_config(active_version=active),
                        verify_manifest=lambda raw: verify_manifest(raw, trust),
                        rng=random.Random(), now=loop_now)
    except BaseException:
        store.close()
        raise
    host, port = cfg.listen_host, cfg.listen_port
    tls = TlsContexts.from_files(cfg.tls.ca, cfg.tls.cert, cfg.tls.key) if cfg.tls else None
    if tls is None:
        log.warning("no [tls]: the swarm port speaks unencrypted links, so peers' "
                    "identities are not proven (see docs/security.md)")
    driver = Driver(core, store, trust, weights=weights, engine=engine, engine_cfg=cfg.engine,
                    host=host, port=port,
                    faults=faults if faults is not None else faults_from_env(),
                    keep_versions=cfg.keep_versions, tls=tls, api_addr=cfg.api_listen,
                    unsent_limit=cfg.unsent_limit_kib * 1024,
                    read_coalesce_s=cfg.read_coalesce_ms / 1000,
                    read_lowat=cfg.read_lowat_kib * 1024, frames=cfg.frames,
                    max_block=cfg.max_block_kib * 1024,
                    congestion=cfg.congestion_control,
                    congestion_restart_s=cfg.congestion_restart_s,
                    congestion_restart_idle_s=cfg.congestion_restart_idle_s,
                    warm_up_kib=cfg.warm_up_kib, warm_up_min_rtt_ms=cfg.warm_up_min_rtt_ms,
                    lanes=cfg.lanes, lanes_auto=cfg.lanes_auto,
                    guard=ConnectionGuard(max_total=cfg.max_connections,
                                          max_per_ip=cfg.max_connections_per_ip,
                                          upgrade_timeout_s=cfg.upgrade_timeout_s))
    gateway = None
    if cfg.gateway is not None and engine is not None:
        model_config = cfg.gateway.model_config
        if model_config is None and cfg.base is not None:
            model_config = cfg.base.parent / "config.json"
        gateway = Gateway(cfg.gateway, driver, model=cfg.model, model_config=model_config)
        driver.commit_gate = gateway.commit_hold
    if cfg.node_key is not None:  # confidential versions: opened at apply (Driver._apply_truth)
        from swarm.trust.keys import load_private_key

        driver.node_key = load_private_key(cfg.node_key)
    add_routes(driver.api_app if driver.api_app is not None else driver.app, driver, cfg.model,
               token=cfg.api_token, gateway=gateway)
    return Node(cfg, store, weights, engine, core, driver, gateway)


async def serve(node: Node, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    """Run ``node`` until ``stop`` is set, then drain."""
    try:
        await node.driver.start()
    except OSError as exc:
        raise ConfigError(f"network.listen: cannot listen on {node.cfg.listen_host}:"
                          f"{node.cfg.listen_port}: {exc.strerror or exc}") from None
    node.driver.resume_from_store()
    if node.gateway is not None:
        try:
            await node.gateway.start()
        except OSError as exc:
            await node.driver.stop(drain_s=0)
            raise ConfigError(f"gateway.listen: cannot listen on {node.gateway.cfg.host}:"
                              f"{node.gateway.cfg.port}: {exc.strerror or exc}") from None
    log.info("node %s (%s, region %s) listening on %s:%d, active version %s",
             node.cfg.node_id, node.cfg.role, node.cfg.region, node.cfg.listen_host,
             node.cfg.listen_port, node.core.active_version)
    if node.engine is not None and node.engine.kind != "inprocess":
        ec = node.cfg.engine
        log.info("engine: %s at %s (pause_mode %s, exchange %s); syncing it to version %s",
                 ec.kind, ec.url, ec.pause_mode, ec.exchange_dir, node.core.active_version)
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("draining")
    if node.gateway is not None:
        await node.gateway.stop()
    await node.driver.stop()
    node.store.close()
    if node.engine is not None:
        node.engine.close()
    if node.weights is not None:
        node.weights.close()


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MALLOC_MMAP_THRESHOLD = 256 * 1024 * 1024
MALLOC_TRIM_THRESHOLD = 512 * 1024 * 1024


def tune_malloc(keep_bytes: int = 0) -> bool:
    """Reuse freed chunk- and payload-sized buffers instead of asking the kernel again.

    A node allocates and frees a 4 MiB buffer per chunk it receives or reads,
    256 KiB per link message, and payload-sized buffers per apply (the
    payload, the decoded planes). By default glibc serves blocks that large with
    a fresh ``mmap``, gives each worker thread an arena of its own that cannot
    hold them, and trims the heap as soon as its top is free, so every buffer
    came back as new pages: page faults and zeroing in the kernel were a large
    share of a node's CPU per GB received (docs/benchmarks.md, "Node CPU per GB
    received"). Here every thread allocates from the one main heap, blocks up
    to 256 MiB come from it, and up to 512 MiB of freed heap is kept for reuse:
    the process's resident size stays near its peak instead. Skipped where the
    C library is not glibc, or where the operator set any of glibc's
    ``MALLOC_*_`` variables (their settings win). ``keep_bytes``: keep at least
    that much freed heap (``warm_heap``), plus room for the node's own buffers.
    """
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                     "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim = min(max(MALLOC_TRIM_THRESHOLD, keep_bytes + MALLOC_MMAP_THRESHOLD), 2**31 - 1)
    return all([mallopt(_M_ARENA_MAX, 1), mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD),
                mallopt(_M_TRIM_THRESHOLD, trim)])


_MADV_HUGEPAGE = 14
WARM_PIECE = 64 * 1024 * 1024  # below MALLOC_MMAP_THRESHOLD: every piece comes from the heap


def warm_heap(nbytes: int) -> int:
    """Touch ``nbytes`` of heap once, at start, and free it: the node's first version
    then finds warm memory, as every later version does.

    The first touch of fresh memory is the kernel's to pay (a page fault, and the
    page zeroed): 1.43 CPU-s per GiB on the VM of docs/benchmarks.md, against 0.05
    for memory touched before. A node keeps its freed heap (``tune_malloc``), so
    from its second version on the chunk buffers kept for uploads, the staged edits
    and the records decoded ahead all reuse memory the process touched already;
    the first version paid for all of it (~26,000 page faults for a 64 MiB dense
    patch, ~30 % of that version's CPU). Here that cost moves to start-up, before
    any version is in flight. Call after ``tune_malloc`` succeeded (otherwise the
    freed pieces go back to the kernel) and after the weights are loaded (so the
    base checkpoint does not take the warm memory). Huge pages where the kernel
    allows them on request (``madvise``), as numpy asks for its large arrays.
    Returns the bytes warmed (0 where the C library is not glibc).
    """
    if nbytes <= 0:
        return 0
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        malloc, free, madvise = libc.malloc, libc.free, libc.madvise
    except (OSError, AttributeError):
        return 0
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    pieces: list[int] = []
    done = 0
    try:
        while done < nbytes:
            n = min(WARM_PIECE, nbytes - done)
            ptr = malloc(n)
            if not ptr:
                break
            pieces.append(ptr)
            start = -(-ptr // (2 << 20)) * (2 << 20)  # the 2 MiB-aligned interior
            if ptr + n - start >= 2 << 20:
                madvise(start, (ptr + n - start) // (2 << 20) * (2 << 20), _MADV_HUGEPAGE)
            ctypes.memset(ptr, 0, n)
            done += n
    finally:
        for ptr in reversed(pieces):  # freed top-down: they merge into the heap's free top
            free(ptr)
    return done


def run_node(cfg: NodeConfig) -> int:
    """Blocking entry point of ``patchswarm node``."""
    setup_logging(cfg.node_id, cfg.log_level, cfg.log_format)
    if cpu_account.install_from_env(cfg.node_id) is not None:
        log.warning("CPU accounting on (%s): a diagnostic that slows the node a little",
                    cpu_account.ENV)
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    uv = install_uvloop()
    keep = cfg.warm_memory_mib * 1024 * 1024
    tuned = tune_malloc(keep)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        node = build_node(cfg, loop_now=loop.time())
        t0 = time.perf_counter()
        warmed = warm_heap(keep) if tuned else 0
        log.info("event loop: %s; malloc tuned for chunk buffers: %s; warmed %d MiB of heap "
                 "in %.2f s", "uvloop" if uv else "asyncio", tuned, warmed >> 20,
                 time.perf_counter() - t0)
        await serve(node, stop)

    asyncio.run(main())
    return 0
