"""Read and write safetensors checkpoints with clear errors and atomic writes."""

from __future__ import annotations

from pathlib import Path

import torch

from swarm.errors import PatchswarmError


def load_checkpoint(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise PatchswarmError(f"{path}: no such file")
    try:
        tensors = load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise PatchswarmError(f"{path}: not a readable safetensors file ({exc})") from None
    return {k: v.contiguous() for k, v in tensors.items()}


def save_checkpoint(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename: never a partial file."""
    from safetensors.torch import save_file

    from swarm.fsio import write_atomic

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda tmp: save_file(cpu, tmp))


def read_bytes(path: str | Path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PatchswarmError(f"{path}: cannot read ({exc.strerror})") from None
