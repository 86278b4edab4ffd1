"""The error types every layer raises for bad input.

Each is a ``PatchswarmError``: the CLI prints its message on one line and exits
non-zero, without a traceback. Raise them with a message that names what was
wrong (which tensor, which chunk, which field) so an operator can act on it.
"""


class PatchswarmError(Exception):
    """Base class for every expected, user-facing failure."""


class PatchFormatError(PatchswarmError):
    """A patch is malformed, truncated, corrupt or of an unknown format version."""


class PatchApplyError(PatchswarmError):
    """A well-formed patch does not fit the weights it is applied to.

    Raised after the weights were restored to their state before the apply.
    """


class ManifestError(PatchswarmError):
    """A manifest is malformed, badly signed, untrusted or not applicable."""


class ChunkError(PatchswarmError):
    """A chunk is missing or does not match the hash its manifest lists."""


class StoreError(PatchswarmError):
    """The on-disk store cannot complete an operation (disk full, quota, corruption)."""


class ConfigError(PatchswarmError):
    """A TOML configuration file is missing, malformed or fails validation."""


class ProtocolError(PatchswarmError):
    """A peer sent a malformed, oversized or out-of-order frame."""
