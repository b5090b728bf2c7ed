"""Optimizer plumbing shared by strategies (never re-implemented optimizers: wrappers of torch's)."""

from lowband.optim.layerwise import LayerwiseOptimizer, parameter_layers

__all__ = ["LayerwiseOptimizer", "parameter_layers"]
