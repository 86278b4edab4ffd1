"""The node's checkpoint-coordinate truth, and the engine that serves it in-process.

``InProcessWeights`` holds the served view as torch tensors in this process
(the checkpoint's names and layout, exact bits). Every node keeps one: the
driver stages and commits each verified patch on it and checks the trainer's
target digest there. With ``[engine] kind = "inprocess"`` it is also what
serves (``InProcessEngine``, on ``cuda`` when present); with an external engine
(vLLM, SGLang) it lives on the CPU and the driver hands the engine a
``WeightUpdate`` built from it (``weight_update``) after each verified commit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from node.engines.base import CommitStats, EngineError, TensorUpdate, WeightUpdate
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
    """The checkpoint-coordinate holder's own contract (the engine port is
    ``node.engines.base.Engine``).

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
        self._staged_changes: dict[str, object] | None = None
        # A patch decoded while it downloads (``prefeed``): [version, base digest,
        # applier in stage mode, payload bytes fed]
        self._pre: list | None = None
        # A patch decoded record by record, in any order (``prefeed_record``): [version,
        # base digest, applier fed out of order, indices decoded (-1: the header)]
        self._pre_rec: list | None = None
        # What the last commit changed: name -> flat int64 indices, None (whole tensor)
        # or False (deleted); None as a whole after a full checkpoint (everything).
        self.last_changes: dict[str, object] | None = None
        # Only an external engine needs the changed positions (they cost a pass over
        # every changed element and, for dense records, an index array as large).
        self.track_changes = True
        # Digests ahead (``swarm.codec.apply``): DENSE/FULL records' target digests and
        # DENSE un-shuffles are done when a record is decoded (prefeed, stage), so the
        # commit is one XOR pass per dense tensor. False: all of it at commit (the
        # baseline of benchmarks/bench_apply_tail.py).
        self.digests_ahead = True

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
        if dev == "cpu":
            # safetensors maps the file privately on the CPU: the weights would then be
            # the file's pages, so the first patch would copy every page it writes (one
            # copy-on-write fault per 4 KiB, ~16,000 for a 64 MiB model, during the first
            # version) and a page never written would show a later in-place change of
            # the file (``cp`` over it). Our own memory instead, paid here at start. The
            # mapping saves no memory for long: a patch's changes are spread over the
            # tensors (a 4 KiB page holds 2,048 BF16 values), so the first versions
            # write nearly every page anyway.
            weights = {name: t.clone() for name, t in weights.items()}
        return cls(dict(weights), version, dev)

    def prefeed(self, version: int, base_digest: bytes | None, offset: int,
                data: bytes | memoryview) -> int:
        """Decode the next verified bytes of patch ``version`` (from payload ``offset``)
        while the rest downloads, so that ``stage`` only has the tail left to decode.

        Nothing served changes (stage mode). Each complete DENSE/FULL record also gets
        the digest its tensor will have after the commit (``digests_ahead``). Only a patch of exactly the state held
        now is decoded; bytes that do not continue what was fed are ignored. Any
        failure forgets the prefix: ``stage`` then decodes the whole payload and
        reports the error itself. Returns the bytes fed so far (0: none kept)."""
        from swarm.codec.apply import PatchApplier

        with self.lock:
            pre = self._pre
            if pre is not None and (pre[0] != version or pre[1] != self.digest):
                pre = self._pre = None  # another version, or the state moved on
            if pre is None:
                if offset != 0 or version <= self.version or base_digest is None \
                        or base_digest != self.digest:
                    return 0
                pre = self._pre = [version, base_digest,
                                   PatchApplier(self.weights, stage=True,
                                                digests=self.tensor_digests,
                                                ahead=self.digests_ahead), 0]
            if offset != pre[3]:
                return pre[3]
            try:
                pre[2].feed(data)
            except Exception:  # stage() decodes it all again and reports the error
                self._pre = None
                return 0
            pre[3] += len(data)
            return pre[3]

    def prefeed_record(self, version: int, base_digest: bytes | None, index: int,
                       data: bytes | memoryview) -> bool:
        """Decode part ``index`` of patch ``version`` while the rest downloads, in any
        order: -1 is its header (which comes first), 0.. its records, each whole with
        its length prefix (the manifest's ``records`` layout says where each lies).
        Nothing served changes. Only a patch of exactly the state held now is decoded.
        Any failure forgets what was decoded: the apply then decodes every record
        itself and reports the error. Returns whether the part is decoded."""
        from swarm.codec.apply import PatchApplier

        with self.lock:
            pre = self._pre_rec
            if pre is not None and (pre[0] != version or pre[1] != self.digest):
                pre = self._pre_rec = None  # another version, or the state moved on
            if pre is None:
                if index != -1 or version <= self.version or base_digest is None \
                        or base_digest != self.digest:
                    return False
                applier = PatchApplier(self.weights, stage=True, digests=self.tensor_digests,
                                       ahead=self.digests_ahead)
                try:
                    applier.feed_header(data)
                except Exception:
                    return False
                self._pre_rec = [version, base_digest, applier, {-1}]
                return True
            if index in pre[3]:
                return True
            try:
                pre[2].feed_record(index, data)
            except Exception as exc:  # the apply decodes it all again and reports the error
                self._pre_rec = None
                logging.getLogger("patchswarm.node").info(
                    "decoding version %d ahead stopped at record %d (%s); its apply decodes "
                    "every record", version, index, exc)
                return False
            pre[3].add(index)
            return True

    def prefed_records(self, version: int) -> set[int]:
        """The parts of ``version`` (-1: the header) that ``prefeed_record`` decoded on
        the state held now."""
        with self.lock:
            pre = self._pre_rec
            if pre is None or pre[0] != version or pre[1] != self.digest:
                return set()
            return set(pre[3])

    def stage_records(self, version: int, base_digest: bytes | None, count: int,
                      read: Callable[[list[int]], Mapping[int, bytes | memoryview]]) -> None:
        """``stage`` for a patch of ``count`` records decoded part by part: what
        ``prefeed_record`` decoded is kept, and ``read(parts)`` gives the bytes of the
        parts still to decode (-1: the header), which are decoded here."""
        from swarm.codec.apply import PatchApplier

        self._check_stageable(version, base_digest)
        with self.lock:
            pre, self._pre_rec = self._pre_rec, None
            self._pre = None
            if pre is not None and pre[0] == version and pre[1] == self.digest:
                applier, done = pre[2], pre[3]
            else:
                applier = PatchApplier(self.weights, stage=True, digests=self.tensor_digests,
                                       ahead=self.digests_ahead)
                done = set()
            missing = [k for k in range(-1, count) if k not in done]
            try:
                parts = read(missing) if missing else {}
                for k in missing:
                    if k not in parts:
                        raise PatchFormatError(f"version {version}: part {k} of the patch not read")
                    if k == -1:
                        applier.feed_header(parts[k])
                    else:
                        applier.feed_record(k, parts[k])
                records = len(applier.header.entries)  # type: ignore[union-attr]
                if records != count:
                    raise PatchFormatError(f"version {version}: the patch has {records} "
                                           f"records, its manifest's layout {count}")
            except BaseException:
                applier.staged = None
                raise
            self._stage_applier(version, applier)

    def prefed(self, version: int) -> int:
        """Payload bytes of ``version`` already decoded by ``prefeed`` on the state
        held now (0: none)."""
        with self.lock:
            pre = self._pre
            if pre is None or pre[0] != version or pre[1] != self.digest:
                return 0
            return pre[3]

    def stage(self, version: int, kind: str, payload: bytes, base_digest: bytes | None,
              offset: int = 0) -> None:
        """Decode the patch against the served weights (they keep serving meanwhile).

        ``offset``: ``payload`` starts there, the bytes before it were decoded by
        ``prefeed`` (``prefed(version)`` of them, else this refuses)."""
        self._check_stageable(version, base_digest if kind == "patch" else None)
        if kind == "patch":
            from swarm.codec import stage_patch

            with self.lock:
                # base digest checked, nothing changed
                pre, self._pre = self._pre, None
                self._pre_rec = None
                if offset:
                    if pre is None or pre[0] != version or pre[1] != self.digest \
                            or pre[3] != offset:
                        raise PatchApplyError(
                            f"version {version}: {offset} bytes were to be decoded already")
                    applier = pre[2]
                    try:
                        applier.feed(payload)
                    except BaseException:
                        applier.staged = None
                        raise
                else:
                    applier = stage_patch(self.weights, payload, digests=self.tensor_digests,
                                          ahead=self.digests_ahead)
            self._stage_applier(version, applier)
        elif kind == "full":
            self._staged = (version, kind, payload)
            self._staged_changes = None
        else:
            raise PatchFormatError(f"unknown payload kind {kind!r}")

    def _check_stageable(self, version: int, base_digest: bytes | None) -> None:
        if version <= self.version:
            raise PatchApplyError(f"version {version} is not newer than active {self.version}")
        if base_digest is not None and base_digest != self.digest:
            raise PatchApplyError(
                f"version {version} patches another state than the active version {self.version}")

    def _stage_applier(self, version: int, applier) -> None:
        """Hold ``applier`` (every record of ``version`` decoded) for ``commit``."""
        header = applier.header
        if header is None:
            raise PatchFormatError(f"version {version}: truncated patch (no complete header)")
        if header.base_digest is not None and header.base_digest != self.digest:
            raise PatchApplyError(f"patch of version {version} has another base than ours")
        changes: dict[str, object] | None = None
        if self.track_changes:
            changes = {}
            for name, op, flat in applier.staged_changes():
                changes[name] = False if op == "delete" else (
                    None if flat is None else torch_from_numpy(flat))
        self._staged = (version, "patch", applier)
        self._staged_changes = changes

    def commit(self, version: int, target_digest: bytes) -> bytes:
        """Apply what ``stage`` decoded: only the scatter (one XOR pass per dense tensor)
        and the digest checks run here; the changed tensors' digests were mostly taken
        ahead, at decode (``digests_ahead``), and the state digest is still checked
        against ``target_digest``, with a bitwise rollback on any failure."""
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
            self.last_changes = self._staged_changes
            self._staged_changes = None
        return digest

    def adopt(self, version: int, target_digest: bytes) -> bytes:
        """Take ``version``, an anchor (full checkpoint) of exactly the weights held now,
        without its payload: nothing changes but the version number."""
        with self.lock:
            if version <= self.version:
                raise PatchApplyError(f"version {version} is not newer than active {self.version}")
            if target_digest != self.digest:
                raise PatchApplyError(f"version {version} holds other weights than ours")
            self.version = version
            self.last_changes = {}
        return self.digest

    def weight_update(self, version: int, base_version: int | None,
                      changes: dict[str, object] | None, *,
                      sparse_max_fraction: float = 1.0) -> WeightUpdate:
        """The ``WeightUpdate`` from ``base_version`` to the state held now.

        ``changes`` maps tensor names to their changed flat indices (``None``:
        the whole tensor); ``None`` as a whole, or a deleted tensor, makes it a
        full update (engines cannot drop a parameter). Values are the tensors
        held here, not copies: valid until the next commit on this holder, so the
        caller hands them to the engine before it commits again."""
        with self.lock:
            if version != self.version:
                raise PatchApplyError(f"update for version {version}, but the state is at {self.version}")
            full = changes is None or any(v is False for v in changes.values())
            if full:
                names = sorted(self.weights)
            else:
                names = sorted(n for n in changes if n in self.weights)
            tensors = []
            for name in names:
                t = self.weights[name]
                if t.device.type != "cpu":
                    t = t.detach().to("cpu")
                flat = None if full else changes[name]
                if flat is not None and flat.numel() > sparse_max_fraction * max(1, t.numel()):
                    flat = None  # most of it changed: ship it whole
                tensors.append(TensorUpdate(name, t, flat))
            return WeightUpdate(version=version, base_version=None if full else base_version,
                                target_digest=self.digest, tensors=tuple(tensors), full=full)

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


def torch_from_numpy(a: object) -> torch.Tensor:
    import torch

    return torch.from_numpy(a)


def merge_changes(acc: dict[str, object] | None, new: dict[str, object] | None,
                  first: bool) -> dict[str, object] | None:
    """Fold what one more commit changed into what the engine still lacks.

    ``first``: ``acc`` is empty (nothing owed yet). ``None`` means "everything"
    (a full update) and absorbs the rest."""
    import torch

    if first:
        return None if new is None else dict(new)
    if acc is None or new is None:
        return None
    out = dict(acc)
    for name, flat in new.items():
        old = out.get(name, ...)
        if old is ... or flat is False:
            out[name] = flat
        elif old is None or flat is None or old is False:
            out[name] = None if old is not False else flat
        else:
            out[name] = torch.unique(torch.cat([old, flat]))  # type: ignore[list-item]
    return out


class InProcessEngine:
    """``[engine] kind = "inprocess"``: the checkpoint-coordinate truth itself serves.

    The truth's own commit is the engine's commit (under ``truth.lock``, checked
    against the target digest), so ``stage`` and ``commit`` only confirm that
    the truth holds the update's version."""

    kind = "inprocess"

    def __init__(self, truth: InProcessWeights) -> None:
        self.truth = truth

    def served_version(self) -> int | None:
        return self.truth.version

    def stage(self, update: WeightUpdate) -> None:
        if self.truth.version != update.version:
            raise EngineError(f"in-process weights are at version {self.truth.version}, "
                              f"not {update.version}")

    def commit(self, update: WeightUpdate) -> CommitStats:
        self.stage(update)
        return CommitStats(version=update.version, paused_s=0.0, commit_s=0.0, path="inprocess",
                           bytes=0)

    def close(self) -> None:
        pass
