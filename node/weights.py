"""Compatibility: the checkpoint-coordinate holder moved to ``node.engines.inprocess``."""

from node.engines.inprocess import EngineAdapter, InProcessWeights, pick_device

__all__ = ["EngineAdapter", "InProcessWeights", "pick_device"]
