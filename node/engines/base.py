"""The engine port: the contract between a node and the inference engine it feeds.

The node keeps the *checkpoint-coordinate truth* (the served view as the trainer
names and lays out its tensors). It stages and commits every verified patch
there and checks the trainer's target digest there; only then does it hand the
engine a ``WeightUpdate`` of the changed tensors, in checkpoint coordinates.
The engine's own loader maps them onto its fused, packed or tensor-parallel
parameters, so the node never needs to know the engine's layout.

Contract every adapter keeps (one adapter per module beside this one):

- ``served_version()`` asks the engine *now* which version it serves (``None``
  when no version was ever set); an unreachable engine raises ``EngineError``.
- ``stage(update)`` may run while the engine serves the previous version. It
  prepares what it can (write the exchange file, copy to the device) and changes
  no served weight. A failure raises ``EngineError(uncertain=False)``.
- ``commit(update)`` pauses generation as configured (``keep`` / ``wait`` /
  ``abort``), applies the update inside the engine, sets the engine's weight
  version, resumes generation, and then checks that the engine reports
  ``update.version``. Readers see the old or the new version, never a mix.
  A failure before any weight changed raises ``EngineError(uncertain=False)``;
  once the engine may have changed weights it raises ``EngineError(uncertain=True)``
  and the node rebuilds the engine from its checkpoint-coordinate truth (a
  ``full`` update) before it serves again.
- ``close()`` releases the adapter's resources (not the engine process).

Pause modes (``[engine] pause_mode``), as vLLM names them: ``wait`` (default)
lets in-flight requests finish on the old version and holds new ones until
the commit is done; ``keep`` freezes in-flight requests and resumes them on
the new weights; ``abort`` aborts them (only when configured).

The values of a ``WeightUpdate`` built by the node are the truth's own tensors,
not copies: they are valid until the node commits the next version on the
truth, which it never does while an adapter call is running.

Adapters are synchronous: the node's driver calls them from a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from swarm.errors import PatchswarmError

if TYPE_CHECKING:
    import torch


class EngineError(PatchswarmError):
    """The engine refused, failed or is unreachable.

    ``uncertain`` is True when the failure happened after the engine may have
    begun changing its weights: the node must not trust what it serves until it
    has been rebuilt to a known version.
    """

    def __init__(self, message: str, *, uncertain: bool = False) -> None:
        super().__init__(message)
        self.uncertain = uncertain


@dataclass(frozen=True)
class TensorUpdate:
    """One changed tensor, whole, in checkpoint coordinates (CPU, exact bits)."""

    name: str
    value: torch.Tensor
    changed: torch.Tensor | None = None  # flat int64 indices of changed elements; None = whole

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.value.element_size()


@dataclass(frozen=True)
class WeightUpdate:
    """What the engine must load to go from ``base_version`` to ``version``."""

    version: int
    base_version: int | None  # None for a full rebuild
    target_digest: bytes  # verified on the node's checkpoint-coordinate state
    tensors: tuple[TensorUpdate, ...]
    full: bool = False  # True: ``tensors`` is the whole state (rebuild / catch-up)

    @property
    def changed_bytes(self) -> int:
        """Bytes of the tensors this update touches (whole tensors)."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class CommitStats:
    version: int
    paused_s: float  # seconds generation was held (by our pause or the engine's own update lock)
    commit_s: float  # the whole commit call
    path: str  # how it was loaded: "inprocess", "inplace-sparse", "subset-reload", "dense", "disk"
    bytes: int  # bytes handed to the engine


@runtime_checkable
class Engine(Protocol):
    """See the module docstring for the contract."""

    kind: str

    def served_version(self) -> int | None: ...

    def stage(self, update: WeightUpdate) -> None: ...

    def commit(self, update: WeightUpdate) -> CommitStats: ...

    def close(self) -> None: ...
