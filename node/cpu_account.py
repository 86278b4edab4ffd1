"""Where a node's CPU goes, stage by stage: a diagnostic, off unless asked for.

With ``PATCHSWARM_CPU_ACCOUNT=DIR`` in its environment a node wraps the functions of its
data path listed in ``STAGES`` and counts, for each, the calls and the CPU time of the
calling thread inside them (``time.thread_time``: time the thread ran, not time it
waited). At exit it writes ``DIR/<node id>.json``: ``{"stages": {name: [calls, cpu_s]},
"process_cpu_s": ..., "wall_s": ...}``. ``benchmarks/bench_wan.py --cpu-account`` sums
the nodes' files per run (docs/benchmarks.md, round 54).

Stages nest (a frame's decrypt runs inside the TLS layer's ``buffer_updated``), so each
figure includes the stages called from it. Each wrapped call costs two thread-clock reads
(~1-2 us): a node that accounts runs a few percent slower, so time it apart from runs
that measure speed.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "PATCHSWARM_CPU_ACCOUNT"

# (module, attribute path): the receive path, the send path, the core, chunk checks and
# the store, the apply (decode ahead, the apply's own decode, the commit)
STAGES: tuple[tuple[str, str], ...] = (
    ("node.tls_layer", "TlsProtocol.buffer_updated"),
    ("node.tls_layer", "TlsProtocol._frame_mark"),
    ("node.tls_layer", "TlsProtocol.write_app"),
    ("node.frames", "FrameReader.took"),
    ("node.frames", "FrameWriter.seal"),
    ("node.link", "LinkProtocol.buffer_updated"),
    ("node.link", "LinkProtocol._parse"),
    ("node.driver", "Driver.feed"),
    ("node.driver", "Driver._arm_timer"),
    ("node.driver", "Driver._place"),
    ("node.driver", "Driver._filled"),
    ("node.driver", "Driver._check_and_store"),
    ("swarm.protocol.core", "NodeCore.handle"),
    ("swarm.protocol.core", "NodeCore.next_wakeup"),
    ("node.store", "verify_chunk"),
    ("node.store", "ChunkStore.put_chunk"),
    ("node.store", "ChunkStore.read_chunk"),
    ("node.applying", "ApplyPipeline._prestage_step"),
    ("node.applying", "ApplyPipeline._part_pieces"),
    ("node.applying", "ApplyPipeline._apply_truth"),
    ("swarm.codec.apply", "PatchApplier._decode_record"),
    ("swarm.codec.apply", "PatchApplier.finish"),
    ("swarm.codec.apply", "_dense_ahead"),
    ("swarm.codec.apply", "_xor_flat"),
    ("swarm.codec.apply", "read_planes"),
    ("swarm.codec.planes", "decompress_bounded"),
    ("swarm.codec.records", "unshuffle_parts"),
)


class Accounts:
    """Calls and thread CPU seconds per stage, and the wrappers that count them."""

    def __init__(self) -> None:
        self.stages: dict[str, list[float]] = {}
        self.missing: list[str] = []  # stages named but not found (renamed since)
        self.t0 = time.process_time()
        self.w0 = time.monotonic()

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        entry = self.stages.setdefault(name, [0, 0.0])
        clock = time.thread_time

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                entry[0] += 1
                entry[1] += clock() - t

        return counted

    def report(self) -> dict[str, Any]:
        order = sorted(self.stages.items(), key=lambda kv: -kv[1][1])
        return {"stages": {k: [int(c), round(s, 4)] for k, (c, s) in order},
                "process_cpu_s": round(time.process_time() - self.t0, 3),
                "wall_s": round(time.monotonic() - self.w0, 1)}


def install(node_id: str, out_dir: str | os.PathLike[str],
            stages: tuple[tuple[str, str], ...] = STAGES, at_exit: bool = True) -> Accounts:
    """Wrap ``stages`` (each a module and an attribute path in it: a function or a class's
    method) and write the accounts to ``out_dir/<node_id>.json`` at exit (``at_exit``). A
    stage that is not there (renamed) is skipped and named in the file's ``missing``."""
    acc = Accounts()
    missing = acc.missing
    for mod_name, path in stages:
        try:
            owner: Any = importlib.import_module(mod_name)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):
            missing.append(f"{mod_name}:{path}")
            continue
        setattr(owner, attr, acc.wrap(fn, path))
    out = Path(out_dir) / f"{node_id}.json"

    def write() -> None:
        with open(out, "w") as fh:
            json.dump({**acc.report(), "missing": missing}, fh, indent=1)

    if at_exit:
        atexit.register(write)
    return acc


def install_from_env(node_id: str) -> Accounts | None:
    """``install`` where ``PATCHSWARM_CPU_ACCOUNT`` names a directory (made if need be)."""
    where = os.environ.get(ENV)
    if not where:
        return None
    Path(where).mkdir(parents=True, exist_ok=True)
    return install(node_id, where)


def summed(files: list[Path]) -> dict[str, Any]:
    """The accounts of several nodes added up (``bench_wan.py --cpu-account``)."""
    stages: dict[str, list[float]] = {}
    cpu = 0.0
    for f in files:
        data = json.loads(f.read_text())
        cpu += data.get("process_cpu_s", 0.0)
        for k, (c, s) in data.get("stages", {}).items():
            e = stages.setdefault(k, [0, 0.0])
            e[0] += c
            e[1] += s
    order = sorted(stages.items(), key=lambda kv: -kv[1][1])
    return {"nodes": len(files), "process_cpu_s": round(cpu, 2),
            "stages": {k: [int(c), round(s, 3)] for k, (c, s) in order}}
