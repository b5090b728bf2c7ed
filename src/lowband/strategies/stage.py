"""Synchronous data parallelism through lowband's gradient stage: the plain allreduce reducer on fused
buckets (about ``bucket_mb`` megabytes, in backward order, launched as each bucket is ready, as DDP
does), or per layer (``bucket_mb=0``). The baseline every reducer of the stage (compression,
sketches) is measured against, next to torch DDP: ``lowband bench -s "ddp+stage"``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lowband.comm.initial import broadcast_initial_state
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import AllreduceReducer, Reducer
from lowband.optim.scaling import GradUnscaler
from lowband.optim.stage import GradientStage
from lowband.optim.units import BUCKET_OPTIONS, model_units
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.breakdown import ClockedStrategy, StepClock
from lowband.strategies.registry import register_strategy


class StageStrategy(ClockedStrategy):
    """A reducer on the gradient stage, then the torch optimizer on the whole model.

    Its :meth:`report` holds the per-step breakdown of the training thread's time (computation,
    compression, communication not overlapped; :mod:`lowband.strategies.breakdown`)."""

    name = "stage"
    # fp16: each unit is unscaled by the stage before its reducer (compressor, memory) sees it
    no_grad_scaler_reason = None
    unscale_per_unit = True

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        reducer: Reducer,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
    ) -> None:
        where = type(self).__name__
        self.bucket_mb, self.first_bucket_mb = float(bucket_mb), float(first_bucket_mb)
        # start every replica from rank 0's parameters and buffers, as DDP does
        broadcast_initial_state(model, group=group)
        units = model_units(model, self.bucket_mb, self.first_bucket_mb)
        self.stage = GradientStage(units, reducer, group=group, where=where)
        self.clock = StepClock(self.stage, reducer.timings)
        super().__init__(model, make_optimizer(model.parameters()), group)

    def apply_step(self) -> None:
        self.stage.wait()
        self.clock.wait_done()
        self.optimizer_step()

    def _attach_unscaler(self, unscaler: GradUnscaler) -> None:
        self.stage.unscaler = unscaler

    def synchronize(self) -> None:
        self.stage.wait()

    def finish_gradients(self) -> None:
        self.stage.wait()

    def hparams(self) -> dict[str, Any]:
        return {"bucket_mb": self.bucket_mb}

    def report(self) -> dict[str, Any]:
        return {"breakdown": self.clock.report()}

    def extra_state(self) -> dict[str, Any]:
        return {"stage": self.stage.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "stage" not in state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: checkpoint has no stage state"
            )
        self.stage.load_state_dict(state["stage"])

    def close(self) -> None:
        self.stage.remove_hooks()


@register_strategy(
    "stage", "S-SGD: the allreduce reducer on lowband's gradient stage (buckets, from hooks)", BUCKET_OPTIONS
)
def allreduce_stage(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> StageStrategy:
    return StageStrategy(
        model, make_optimizer, group, AllreduceReducer(), bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
    )
