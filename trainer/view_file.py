"""The trainer's published view on disk, written off the publish path.

A publish needs the last published view (what the next patch is diffed against) in
memory only; the file ``published-<version>.safetensors`` in the store directory is
there so that a restarted trainer (or the next ``patchswarm publish`` call) has it
without rebuilding it from the stored chain of patches. It is the whole served
view, 50-2000x the patch: written (and fsynced) before the hand-off it held every
version's first byte back by ~0.2 s per 64 MiB on this box's disk (2.2 s for
512 MiB; a 16 GB model waits tens of seconds). So it is written after the version
is committed and handed to the swarm, by ``ViewSaver``'s thread, and only the
newest version asked for is written (a slow disk skips versions, never queues
them). Once a view file is durable the older ones are deleted.

A trainer killed before the newest view is on disk finds an older view file on its
next start and replays the stored patches after it (``Publisher._load_last``);
failing that, the chain from the base or the newest full checkpoint.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("patchswarm.trainer")

PUBLISHED_VIEW = "published.safetensors"  # before 0.2: one view file, no version in its name
VIEW_PATTERN = "published-{version}.safetensors"
_VIEW_NAME = re.compile(r"published-(\d{1,19})\.safetensors")


def view_files(store_dir: Path) -> dict[int, Path]:
    """The view files in ``store_dir`` by version (names that do not parse are ignored)."""
    out: dict[int, Path] = {}
    for p in store_dir.glob("published-*.safetensors"):
        m = _VIEW_NAME.fullmatch(p.name)
        if m is not None:
            out[int(m.group(1))] = p
    return out


def drop_views_below(store_dir: Path, version: int) -> None:
    """Delete the view files of versions below ``version``, and the pre-0.2 one."""
    for v, p in view_files(store_dir).items():
        if v < version:
            p.unlink(missing_ok=True)
    (store_dir / PUBLISHED_VIEW).unlink(missing_ok=True)


class ViewSaver:
    """Runs ``save(version, *args)`` for the newest version submitted, on a thread of
    its own that lives while there is something to write. The thread is not a daemon:
    an interpreter exiting after a publish first finishes the write in progress and
    the newest one pending, so a clean exit leaves the newest view on disk."""

    def __init__(self, save: Callable[..., None]) -> None:
        self._save = save
        self._cv = threading.Condition()
        self._pending: tuple | None = None
        self._running = False
        self.saved: int | None = None  # the newest version written
        self.skipped = 0  # versions replaced by a newer one before their turn

    def submit(self, version: int, *args: object) -> None:
        with self._cv:
            if self._pending is not None:
                self.skipped += 1
            self._pending = (version, *args)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="patchswarm-view-save").start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or being written; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._running, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                job, self._pending = self._pending, None
                if job is None:
                    self._running = False
                    self._cv.notify_all()
                    return
            version, t0 = job[0], time.monotonic()
            try:
                self._save(*job)
            except Exception as exc:  # a full disk: the next start rebuilds from the store
                log.warning("cannot write the view of version %d (%s); a restart rebuilds it "
                            "from the stored patches", version, exc)
            else:
                log.debug("view file of version %d written in %.2f s", version,
                          time.monotonic() - t0)
                with self._cv:
                    self.saved = version
