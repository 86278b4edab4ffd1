"""Update files for an engine process on the same host (atomic, named by version).

An update crosses to an external engine as a directory holding one
``model.safetensors`` with the update's tensors (whole, checkpoint names,
exact bits), written under a temporary name and renamed into place, so an
engine never sees a half-written update:

    <exchange_dir>/v<version>-<nonce>/model.safetensors

The safetensors metadata says what it is (``patchswarm.version``,
``patchswarm.base_version``, ``patchswarm.target_digest``, ``patchswarm.full``).
With ``with_changed=True`` the flat indices of sparse changes travel as extra
int64 tensors named ``<name>.__changed__`` (for a loader that scatters only
those); engines that load every tensor in the file (SGLang's disk loader) get
the weights alone. Directories are removed after the commit (``remove``), and
leftovers of a crashed node at start (``sweep``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from node.engines.base import EngineError, WeightUpdate

FILE_NAME = "model.safetensors"
CHANGED_SUFFIX = ".__changed__"


def write_update(exchange_dir: Path, update: WeightUpdate, *, with_changed: bool = False) -> Path:
    """Write ``update`` atomically; returns the directory the engine should load."""
    from safetensors.torch import save_file

    tensors = {}
    for t in update.tensors:
        tensors[t.name] = t.value.detach().contiguous()
        if with_changed and t.changed is not None:
            tensors[t.name + CHANGED_SUFFIX] = t.changed.to(dtype=_int64()).contiguous()
    meta = {
        "patchswarm.version": str(update.version),
        "patchswarm.base_version": "" if update.base_version is None else str(update.base_version),
        "patchswarm.target_digest": update.target_digest.hex(),
        "patchswarm.full": "1" if update.full else "0",
    }
    nonce = uuid.uuid4().hex[:8]
    final = exchange_dir / f"v{update.version}-{nonce}"
    tmp = exchange_dir / f".tmp-v{update.version}-{nonce}"
    try:
        exchange_dir.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        path = tmp / FILE_NAME
        save_file(tensors, str(path), metadata=meta)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EngineError(f"cannot write the update of version {update.version} into "
                          f"{exchange_dir}: {exc.strerror or exc}") from None
    return final


def remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def sweep(exchange_dir: Path) -> int:
    """Remove update directories left by an earlier run; returns how many."""
    n = 0
    if not exchange_dir.is_dir():
        return 0
    for p in exchange_dir.iterdir():
        if p.is_dir() and (p.name.startswith("v") or p.name.startswith(".tmp-v")):
            shutil.rmtree(p, ignore_errors=True)
            n += 1
    return n


def _int64():  # torch imported lazily (the swarm side of the node does not need it)
    import torch

    return torch.int64
