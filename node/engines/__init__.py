"""Inference engines a node feeds: the port (``base``) and one module per adapter.

``make_engine`` builds the adapter ``[engine] kind`` names. The node's
checkpoint-coordinate truth (``inprocess.InProcessWeights``) is built by the
daemon either way; with ``kind = "inprocess"`` it also serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.errors import ConfigError

if TYPE_CHECKING:
    from node.engines.base import Engine
    from node.engines.config import EngineConfig
    from node.engines.inprocess import InProcessWeights


def make_engine(cfg: EngineConfig, truth: InProcessWeights) -> Engine:
    """The adapter for ``cfg.kind`` (``ConfigError`` naming ``engine.kind`` if unavailable)."""
    if cfg.kind == "inprocess":
        from node.engines.inprocess import InProcessEngine

        return InProcessEngine(truth)
    if cfg.kind == "sglang":
        from node.engines.sglang import SGLangEngine

        return SGLangEngine(cfg)
    if cfg.kind == "vllm":
        try:
            from node.engines import vllm
        except ImportError as exc:
            raise ConfigError(f"engine.kind: the vllm adapter is not available here: {exc}") from None
        factory = getattr(vllm, "VLLMEngine", None)
        if factory is None:
            raise ConfigError("engine.kind: node.engines.vllm has no VLLMEngine adapter")
        return factory(cfg, truth=truth)  # it reads unchanged siblings of fused modules
    raise ConfigError(f"engine.kind: unknown engine {cfg.kind!r}")
