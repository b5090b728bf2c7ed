"""Optimizer plumbing shared by strategies (never re-implemented optimizers: wrappers of torch's) and
the gradient stage (gradients handed to a reducer from backward hooks)."""

from lowband.optim.ddp_hook import DDPHookState, ddp_comm_hook
from lowband.optim.layerwise import LayerwiseOptimizer, parameter_layers
from lowband.optim.reducer import (
    AllreduceReducer,
    ReduceContext,
    Reducer,
    Unit,
    bucket_units,
    layer_units,
    parameter_names,
)
from lowband.optim.stage import GradientStage
from lowband.optim.units import model_units

__all__ = [
    "AllreduceReducer", "DDPHookState", "GradientStage", "LayerwiseOptimizer", "ReduceContext", "Reducer", "Unit",
    "bucket_units", "ddp_comm_hook", "layer_units", "model_units", "parameter_layers", "parameter_names",
]  # fmt: skip
