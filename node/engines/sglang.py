"""SGLang adapter: feeds a running SGLang server through its HTTP API.

The contract coded to is written down, with its sources, in docs/engines.md
("SGLang's HTTP contract"). In short:

- the update crosses as a directory with one ``model.safetensors`` of the
  changed tensors (checkpoint names, whole tensors) in ``[engine] exchange_dir``;
  ``POST /update_weights_from_disk {"model_path": dir, "load_format": "auto",
  "weight_version": "<N>", "abort_all_requests": false, "flush_cache": true}``
  makes SGLang's own loader map them onto its fused/sharded parameters
  (``model.load_weights`` over the files in ``dir``): 200 ``{"success": true,
  "message", "num_paused_requests"}``, 400 ``{"success": false, "message"}``;
- the served version is ``GET /get_weight_version`` -> ``{"weight_version": str}``
  (``"default"`` until someone sets one; we set the decimal version number);
- pause modes (``[engine] pause_mode``):

  * ``wait`` (default): no pause call. SGLang's update takes its model-update
    writer lock, which waits for in-flight requests to finish and holds new
    ones until the load is done; every request runs on one version.
  * ``keep``: ``POST /pause_generation {"mode": "retract"}`` (in-flight requests
    go back to the waiting queue, KV cache flushable), load, then
    ``POST /continue_generation {}``; they resume on the new weights. Needs an
    SGLang whose ``/pause_generation`` reads ``mode`` (>= 0.5.6): older ones
    abort every request on that call, so the adapter checks
    ``GET /get_server_info`` ``version`` first and refuses older servers.
  * ``abort``: ``abort_all_requests: true`` on the update (only when configured).

  ``/pause_generation`` is never called without an explicit ``mode`` (its
  default is ``abort``).

Failure classes: a call that fails before the load request was sent leaves
the engine as it was (``uncertain=False``); a failed, timed-out or cut-off load
request, or a load that "succeeds" while the engine then reports another
version, is ``uncertain=True`` (SGLang may have loaded part of the tensors: its
own "rollback" re-reads the same directory), and the node rebuilds the engine
with a full update.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from node.engines import exchange
from node.engines.base import CommitStats, EngineError, WeightUpdate
from node.engines.config import EngineConfig
from node.engines.http import EngineHTTP

log = logging.getLogger("patchswarm.engine")

MIN_PAUSE_MODE_VERSION = (0, 5, 6)


def parse_version(text: object) -> int | None:
    """SGLang's ``weight_version`` string -> our version number (``None``: not ours)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if isinstance(text, str) and text.isdigit() and len(text) < 19:
        return int(text)
    return None


def _release(text: object) -> tuple[int, ...] | None:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", text) if isinstance(text, str) else None
    return tuple(int(x) for x in m.groups()) if m else None


class SGLangEngine:
    """``[engine] kind = "sglang"``; see the module docstring."""

    kind = "sglang"

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.url is None or cfg.exchange_dir is None:
            raise EngineError("sglang engine needs engine.url and an exchange directory")
        self.cfg = cfg
        self.http = EngineHTTP(cfg.url, timeout_s=cfg.timeout_s, api_key=cfg.api_key)
        self.exchange_dir: Path = cfg.exchange_dir
        self._staged: dict[int, Path] = {}
        self._paused = False  # we paused it and have not resumed it yet
        self._pause_modes_ok = False
        exchange.sweep(self.exchange_dir)

    # ------------------------------------------------------------------ port

    def served_version(self) -> int | None:
        self._resume_if_paused()
        r = self.http.get("/get_weight_version")
        if not isinstance(r.body, dict) or "weight_version" not in r.body:
            raise EngineError(f"GET {self.http.base_url}/get_weight_version: unexpected answer "
                              f"{r.text[:200]!r}")
        return parse_version(r.body["weight_version"])

    def stage(self, update: WeightUpdate) -> None:
        """Write the update directory (the engine keeps serving meanwhile)."""
        old = self._staged.pop(update.version, None)
        exchange.remove(old)
        self._staged[update.version] = exchange.write_update(self.exchange_dir, update)

    def commit(self, update: WeightUpdate) -> CommitStats:
        t0 = time.perf_counter()
        path = self._staged.pop(update.version, None)
        if path is None:
            path = exchange.write_update(self.exchange_dir, update)
        mode = self.cfg.pause_mode
        paused_s = 0.0
        try:
            self._resume_if_paused()
            if mode == "keep":
                self._check_pause_modes()
                tp = time.perf_counter()
                self._paused = True  # set first: a pause that times out may still have landed
                self.http.post("/pause_generation", {"mode": "retract"})
            else:
                tp = time.perf_counter()
            try:
                self._load(path, update, abort=(mode == "abort"))
            finally:
                if mode == "keep":
                    self._resume_if_paused(uncertain=True)
                paused_s = time.perf_counter() - tp
        finally:
            exchange.remove(path)
        got = self.served_version()
        if got != update.version:
            raise EngineError(f"sglang accepted version {update.version} but serves "
                              f"{'no version' if got is None else f'version {got}'}", uncertain=True)
        return CommitStats(version=update.version, paused_s=paused_s,
                           commit_s=time.perf_counter() - t0,
                           path="disk-full" if update.full else "disk-subset",
                           bytes=update.changed_bytes)

    def close(self) -> None:
        for p in self._staged.values():
            exchange.remove(p)
        self._staged.clear()

    # ------------------------------------------------------------- internals

    def _load(self, path: Path, update: WeightUpdate, *, abort: bool) -> None:
        body = {
            "model_path": str(path),
            "load_format": "auto",
            "abort_all_requests": abort,
            "weight_version": str(update.version),
            "flush_cache": True,
        }
        r = self.http.post("/update_weights_from_disk", body, timeout_s=self.cfg.commit_timeout_s,
                           uncertain=True, ok_statuses=(400,))
        ok = isinstance(r.body, dict) and r.body.get("success") is True
        if r.status == 400 or not ok:
            msg = r.body.get("message") if isinstance(r.body, dict) else r.text
            # a 400 without "success" is request validation: nothing was loaded
            tried = isinstance(r.body, dict) and "success" in r.body
            raise EngineError(f"sglang refused version {update.version} "
                              f"(HTTP {r.status}): {str(msg)[:300]}", uncertain=tried)

    def _resume_if_paused(self, uncertain: bool = False) -> None:
        if self._paused:
            self.http.post("/continue_generation", {}, uncertain=uncertain)
            self._paused = False

    def _check_pause_modes(self) -> None:
        if self._pause_modes_ok:
            return
        r = self.http.get("/get_server_info")
        version = r.body.get("version") if isinstance(r.body, dict) else None
        release = _release(version)
        if release is None or release < MIN_PAUSE_MODE_VERSION:
            raise EngineError(
                f"engine.pause_mode = \"keep\" needs SGLang >= "
                f"{'.'.join(map(str, MIN_PAUSE_MODE_VERSION))} (older /pause_generation aborts every "
                f"request); this server reports version {version!r}: use pause_mode = \"wait\"")
        self._pause_modes_ok = True
