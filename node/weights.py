"""The node's served weights, and the seam where inference engines plug in.

``EngineAdapter`` is the *port*: the contract the apply pipeline relies on.
``InProcessWeights`` is the implementation this project ships: the served view
held as torch tensors in this process, on ``cuda`` when present else ``cpu``.
SGLang and vLLM adapters will sit beside it and implement the same four
methods (e.g. by scattering the patch into the engine's parameters through a
worker extension, then flipping the engine's version).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.errors import ConfigError, PatchApplyError, PatchFormatError

if TYPE_CHECKING:
    import torch


def pick_device(wanted: str) -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU, else ``"cpu"``."""
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"weights.device: {wanted!r} requested but torch sees no CUDA device")
    return wanted


class EngineAdapter:
    """Port between the swarm and whatever serves the weights.

    Contract:

    - ``version`` / ``digest``: what is being served now. ``digest`` is
      ``swarm.codec.state_digest`` of the served tensors, the bitwise identity
      every node compares with the trainer's.
    - ``stage(version, kind, payload, base_digest)``: may run while the engine
      serves the active version. Checks that the payload fits the active state
      (its base digest) and prepares whatever it can without touching served
      weights. A failure raises and changes nothing.
    - ``commit(version, target_digest)``: makes the staged version the served
      one, atomically for readers (they see the old or the new version, never a
      mix). It verifies the resulting digest; on any failure the served state is
      restored to the previous version before raising, so the node never
      serves weights that are not a published version.
    - ``close()``: release the engine's resources.
    """

    version: int
    digest: bytes

    def stage(self, version: int, kind: str, payload: bytes, base_digest: bytes | None) -> None:
        raise NotImplementedError

    def commit(self, version: int, target_digest: bytes) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcessWeights(EngineAdapter):
    """The served view as torch tensors in this process.

    Patches are applied in place with the codec's all-or-nothing applier (a
    scatter of the changed values, no full-size copy); a ``full`` checkpoint
    replaces the state. ``lock`` is held during ``commit``, so a reader that
    takes it sees one whole version.
    """

    def __init__(self, weights: dict[str, torch.Tensor], version: int, device: str) -> None:
        from swarm.codec import state_digest, tensor_digest

        self.weights = weights
        self.device = device
        self.version = version
        # Per-tensor digests of the served state: an apply re-hashes only what it changed.
        self.tensor_digests = {k: tensor_digest(v) for k, v in weights.items()}
        self.digest = state_digest(weights, self.tensor_digests)
        self.lock = threading.RLock()
        self._staged: tuple[int, str, object] | None = None

    @classmethod
    def load(cls, path: Path, version: int, device: str = "auto") -> InProcessWeights:
        """Load a base safetensors checkpoint onto ``device`` (``auto``: cuda if present)."""
        from safetensors.torch import load_file

        dev = pick_device(device)
        try:
            weights = load_file(str(path), device=dev)
        except FileNotFoundError:
            raise ConfigError(f"weights.base: {path} does not exist") from None
        except Exception as exc:  # safetensors raises its own error types on bad files
            raise ConfigError(f"weights.base: {path} is not a readable safetensors file: {exc}") from None
        return cls(dict(weights), version, dev)

    def stage(self, version: int, kind: str, payload: bytes, base_digest: bytes | None) -> None:
        """Decode the patch against the served weights (they keep serving meanwhile)."""
        if version <= self.version:
            raise PatchApplyError(f"version {version} is not newer than active {self.version}")
        if kind == "patch":
            from swarm.codec import stage_patch

            if base_digest is not None and base_digest != self.digest:
                raise PatchApplyError(
                    f"version {version} patches another state than the active version {self.version}")
            with self.lock:
                # base digest checked, nothing changed
                applier = stage_patch(self.weights, payload, digests=self.tensor_digests)
            header = applier.header
            if header is not None and header.base_digest is not None and header.base_digest != self.digest:
                raise PatchApplyError(f"patch of version {version} has another base than ours")
            self._staged = (version, kind, applier)
        elif kind == "full":
            self._staged = (version, kind, payload)
        else:
            raise PatchFormatError(f"unknown payload kind {kind!r}")

    def commit(self, version: int, target_digest: bytes) -> bytes:
        """Apply what ``stage`` decoded: only the scatter and the digest checks run here."""
        if self._staged is None or self._staged[0] != version:
            raise PatchApplyError(f"version {version} was not staged")
        _, kind, staged = self._staged
        self._staged = None
        with self.lock:
            if kind == "patch":
                promised = staged.header.target_digest
                if promised is not None and promised != target_digest:
                    raise PatchApplyError(
                        f"version {version}: the patch targets another state than its manifest")
                if promised is None:
                    raise PatchApplyError(f"version {version}: patch carries no target digest")
                digest = staged.finish().target_digest  # checks the target; rolls back on failure
            else:
                digest = self._replace_full(staged, version, target_digest)
            self.version = version
            self.digest = digest
        return digest

    def _replace_full(self, payload: bytes, version: int, target_digest: bytes) -> bytes:
        from safetensors.torch import load as load_bytes

        from swarm.codec import state_digest

        try:
            new = {k: v.to(self.device) for k, v in load_bytes(payload).items()}
        except Exception as exc:
            raise PatchFormatError(f"version {version}: full checkpoint unreadable: {exc}") from None
        digest = state_digest(new)
        if digest != target_digest:
            raise PatchApplyError(f"version {version}: full checkpoint digest differs from the manifest")
        self.weights.clear()
        self.weights.update(new)
        from swarm.codec import tensor_digest

        self.tensor_digests = {k: tensor_digest(v) for k, v in new.items()}
        return digest

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the served state (for checks and tests), taken under the lock."""
        with self.lock:
            return {k: v.detach().to("cpu").clone() for k, v in self.weights.items()}

    def close(self) -> None:
        self.weights.clear()
