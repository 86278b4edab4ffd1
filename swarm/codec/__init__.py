"""The lossless patch codec for served weights (no network code here).

- ``encode_patch(old, new)``: diff two versions (name -> tensor) into a patch.
- ``apply_patch(weights, patch)`` / ``PatchApplier``: apply in place on the
  tensors' device, streaming, all or nothing.
- ``stage_patch(weights, patch)``: decode while the weights are still served;
  ``.finish()`` then applies it (only the scatter and checks are in the pause).
- ``state_digest(weights)``: the 32-byte name of a whole served version.
- ``read_patch_info(patch)``: header and per-record sizes, for ``inspect``.
- ``entropy_bound(old, new)``: the i.i.d. entropy bound the codec is held to.

Format: docs/patch-format.md.
"""

from swarm.codec.apply import ApplyReport, PatchApplier, apply_patch, stage_patch
from swarm.codec.bound import entropy_bound
from swarm.codec.digest import state_digest, tensor_digest
from swarm.codec.encode import EncodeResult, encode_patch
from swarm.codec.inspect import read_patch_info

__all__ = [
    "ApplyReport",
    "EncodeResult",
    "PatchApplier",
    "apply_patch",
    "encode_patch",
    "entropy_bound",
    "read_patch_info",
    "stage_patch",
    "state_digest",
    "tensor_digest",
]
