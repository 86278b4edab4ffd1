"""The worker extension vLLM loads so a patchswarm node can change its weights in place.

    vllm serve MODEL --worker-extension-cls node.engines.vllm_worker.PatchswarmWorkerExtension

vLLM mixes this class into every worker; the node reaches its methods with
``collective_rpc`` (``POST /collective_rpc`` in dev mode), so each method takes
only strings and returns JSON-able values. It runs inside vLLM's own venv and
imports only torch, safetensors and vLLM (never the rest of patchswarm).

The node hands over an *update file* (safetensors, written by
``node.engines.vllm.VllmEngine``) of tensors in checkpoint coordinates; the
model's own ``load_weights`` maps them onto the engine's fused, sharded or
repacked parameters. Each tensor takes one of three paths, chosen by the node
from what ``patchswarm_layout`` reported for this engine:

- ``sparse``: changed positions and values only. Written in place through the
  loader with NaN marking unchanged elements (vLLM's
  ``load_checkpoint_weight_patches``); storage keeps its address (CUDA graphs
  stay valid). Only for modules whose loaded parameter is the one the forward
  reads (no repacking, no quantization), and only when no new value is NaN.
- ``dense``: the whole tensor through ``load_weights``, same modules as sparse.
- ``reload``: the whole tensor through the model runner's
  ``reload_weights(weights_iterator=...)``, which rebuilds the affected layers
  and runs their post-load processing again (CPU oneDNN repacking, online
  quantization). A layer is rebuilt from what is loaded, so every checkpoint
  tensor feeding a reloaded module travels with it (the node sends the whole
  group, see ``module`` in the layout).

Exactness is the invariant: the engine must end up as if cold-started on the
new checkpoint. Every path writes exact values (checkpoint values cast to the
parameter's dtype, as a cold start does); the node checks the result by
asking for nothing but the version, the tests check it by comparing tokens and
logprobs with a cold start.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

FORMAT = "patchswarm-vllm-update/1"
# Methods whose process_weights_after_loading leaves the loaded tensor as the one
# the forward reads (outside the CPU backend, which repacks; see _inplace_ok).
_PLAIN_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


def _model(worker: Any) -> torch.nn.Module:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _module_key(model: torch.nn.Module, name: str) -> tuple[str, str]:
    """Checkpoint name -> (engine module path, parameter name) via the model's mappings."""
    mapped = name
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name"):
        try:
            got = mapper._map_name(name)
        except Exception:  # a mapper that cannot map it: keep the name
            got = name
        if got:
            mapped = got
    module_path, _, param = mapped.rpartition(".")
    head, _, leaf = module_path.rpartition(".")
    for packed, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf in parts:
            module_path = f"{head}.{packed}" if head else packed
            break
    return module_path, param


def _group(model: torch.nn.Module, name: str, module: torch.nn.Module) -> list[str]:
    """Checkpoint names that load into the same engine module as ``name`` (itself included):
    the packed siblings (q/k/v -> qkv_proj) times the module's own parameter names."""
    module_path, _, _ = name.rpartition(".")
    head, _, leaf = module_path.rpartition(".")
    parts = [leaf]
    for packed_parts in (getattr(model, "packed_modules_mapping", None) or {}).values():
        if leaf in packed_parts:
            parts = list(packed_parts)
            break
    params = [n for n, p in module.named_parameters(recurse=False) if p is not None] or [
        name.rpartition(".")[2]]
    prefix = f"{head}." if head else ""
    return sorted({f"{prefix}{part}.{p}" for part in parts for p in params})


def _inplace_ok(module: torch.nn.Module, param: str) -> bool:
    """True when a write into the loaded parameter is what the forward reads next."""
    if hasattr(module, "cpu_linear"):  # CPU backend: weights repacked after loading
        return False
    qm = getattr(module, "quant_method", None)
    if qm is not None and type(qm).__name__ not in _PLAIN_METHODS:
        return False
    t = getattr(module, param, None)
    return isinstance(t, torch.Tensor) and t.numel() > 0 and t.is_floating_point()


class PatchswarmWorkerExtension:
    """Mixed into vLLM's worker class; see the module docstring."""

    # --------------------------------------------------------------- version

    def patchswarm_set_version(self, version: str) -> str:
        self._patchswarm_version = str(version)
        return self._patchswarm_version

    def patchswarm_version(self) -> str | None:
        return getattr(self, "_patchswarm_version", None)

    # ---------------------------------------------------------------- layout

    def patchswarm_layout(self, names_json: str) -> dict:
        """For each checkpoint name: the engine module it loads into and whether a
        sparse in-place write is exact there. Names the model does not know get
        ``module: null`` (they can only be reloaded, alone)."""
        model = _model(self)
        out: dict[str, dict] = {}
        for name in json.loads(names_json):
            path, param = _module_key(model, name)
            try:
                module = model.get_submodule(path)
            except AttributeError:
                out[name] = {"module": None, "inplace": False}
                continue
            out[name] = {"module": path, "inplace": _inplace_ok(module, param),
                         "group": _group(model, name, module)}
        return {"layout": out, "device": str(self._patchswarm_device(model)),
                "dtype": str(next(model.parameters()).dtype)}

    @staticmethod
    def _patchswarm_device(model: torch.nn.Module) -> torch.device:
        for p in model.parameters():
            if p.numel():
                return p.device
        return torch.device("cpu")

    # ----------------------------------------------------------------- apply

    def patchswarm_apply(self, path: str) -> dict:
        """Apply one update file; returns per-path counts, bytes and seconds.

        Everything is checked before the first write; a failure after it leaves
        the worker uncertain (the node then rebuilds it with a full update)."""
        t0 = time.perf_counter()
        try:
            plan = self._patchswarm_plan(path)
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            # nothing was written: the node may resume serving the old version
            return {"ok": False, "wrote": False, "error": f"{type(exc).__name__}: {exc}"}
        return self._patchswarm_write(plan, t0)

    def _patchswarm_plan(self, path: str) -> dict:
        from safetensors import safe_open
        from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

        t0 = time.perf_counter()
        model = _model(self)
        device = self._patchswarm_device(model)
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} file")
            entries = json.loads(meta["entries"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        t_read = time.perf_counter()

        sparse: list = []
        dense: list[tuple[str, torch.Tensor]] = []
        reload: list[tuple[str, torch.Tensor]] = []
        nbytes = {"sparse": 0, "dense": 0, "reload": 0}
        counts = {"sparse": 0, "dense": 0, "reload": 0}
        for e in entries:
            name, how = e["name"], e["path"]
            if how in ("sparse", "dense"):  # both write into the live parameter
                mod_path, param = _module_key(model, name)
                try:
                    module = model.get_submodule(mod_path)
                except AttributeError:
                    raise ValueError(f"{name}: no engine module {mod_path}") from None
                if not _inplace_ok(module, param):
                    raise ValueError(f"{name}: the engine layout does not allow an in-place write")
            if how == "sparse":
                idx, val = tensors[f"i/{name}"], tensors[f"v/{name}"]
                if torch.isnan(val).any():
                    raise ValueError(f"{name}: a sparse value is NaN (send it dense)")
                numel = 1
                for d in e["shape"]:
                    numel *= int(d)
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
                    raise ValueError(f"{name}: index out of range")
                sparse.append(CheckpointWeightPatch(
                    name, tuple(e["shape"]), val.dtype, val.to(device), idx.to(device)))
                nbytes["sparse"] += idx.numel() * idx.element_size() + val.numel() * val.element_size()
            elif how in ("dense", "reload"):
                w = tensors[f"w/{name}"]
                if list(w.shape) != list(e["shape"]):
                    raise ValueError(f"{name}: shape {list(w.shape)} != {e['shape']}")
                (dense if how == "dense" else reload).append((name, w))
                nbytes[how] += w.numel() * w.element_size()
            else:
                raise ValueError(f"{name}: unknown path {how!r}")
            counts[how] += 1
        return {"meta": meta, "sparse": sparse, "dense": dense, "reload": reload, "device": device,
                "counts": counts, "bytes": nbytes, "read_s": t_read - t0,
                "check_s": time.perf_counter() - t_read}

    def _patchswarm_write(self, plan: dict, t0: float) -> dict:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            load_checkpoint_weight_patches,
        )

        model = _model(self)
        sparse, dense, reload = plan["sparse"], plan["dense"], plan["reload"]
        device, meta = plan["device"], plan["meta"]
        t_check = time.perf_counter()
        with torch.no_grad():
            if sparse:
                load_checkpoint_weight_patches(model, sparse, validate_unique_indices=False)
            if dense:
                model.load_weights([(n, w.to(device)) for n, w in dense])
            if reload:
                self.model_runner.reload_weights(weights_iterator=iter(reload))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_done = time.perf_counter()
        if "version" in meta:
            self._patchswarm_version = meta["version"]
        return {"ok": True, "wrote": True, "counts": plan["counts"], "bytes": plan["bytes"],
                "read_s": plan["read_s"], "check_s": plan["check_s"],
                "write_s": t_done - t_check, "total_s": t_done - t0,
                "version": getattr(self, "_patchswarm_version", None)}

    # ----------------------------------------------------------------- probe

    def patchswarm_digest(self) -> dict:
        """sha256 of every non-empty engine parameter (engine layout), for tests."""
        import hashlib

        model = _model(self)
        out = {}
        for n, p in model.named_parameters():
            if p.numel():
                t = p.detach().contiguous().cpu()
                out[n] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        return out
