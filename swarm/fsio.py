"""Crash-safe output files for the command line: checked before work, written atomically.

Every CLI output goes through ``check_output_file`` first (so a missing or
read-only directory, or a directory where a file should go, is a one-line
error before any work is done) and is written by ``write_atomic``: a
temporary file beside the target, fsynced, then renamed over it, and removed
on any failure, so a crash or a full disk never leaves a partial or stray file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from swarm.errors import PatchswarmError


def check_output_file(path: str | Path, what: str = "output") -> Path:
    """Refuse an output path we could not write a file at; return it as a Path."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise PatchswarmError(f"{what} {path} is a directory; name a file")
    if not parent.is_dir():
        raise PatchswarmError(f"{what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PatchswarmError(f"{what} {path}: directory {parent} is not writable")
    return path


def write_atomic(path: str | Path, data: bytes | Callable[[str], None], what: str = "output") -> None:
    """Write ``data`` (bytes, or a function that writes a file at the path it is given)
    to ``path`` via a fsynced temporary file and a rename."""
    path = check_output_file(path, what)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise PatchswarmError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    try:
        if isinstance(data, bytes | bytearray | memoryview):
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            os.close(fd)
            data(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise PatchswarmError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
