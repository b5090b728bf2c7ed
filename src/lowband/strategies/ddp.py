"""Synchronous data parallelism with torch DDP (the S-SGD / WFBP baseline) and DDP + PowerSGD.

Used exactly as PyTorch ships them: DDP buckets gradients and launches each bucket's allreduce from the
autograd engine as soon as the bucket is ready, overlapping communication with the rest of backward;
PowerSGD replaces the bucket allreduce with torch's ``powerSGD_hook`` (low-rank compression with error
feedback and warm start).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.registry import register_strategy


def _check_positive(cls: str, what: str, v: object, minimum: float = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < minimum:
        raise InvalidArgumentError(f"{cls}: {what} must be a number >= {minimum}, got {v!r}")


@register_strategy("ddp", "S-SGD: torch DDP, bucketed allreduce overlapped with backward (WFBP)")
class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        _check_positive("DDPStrategy", "bucket_cap_mb", bucket_cap_mb, 0.001)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.ddp = DistributedDataParallel(model, process_group=group.pg, bucket_cap_mb=self.bucket_cap_mb)
        super().__init__(model, make_optimizer(model.parameters()), group)

    @property
    def module(self) -> nn.Module:
        return self.ddp

    def hparams(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb}


@register_strategy("powersgd", "torch DDP with the PowerSGD comm hook (rank-r compression + error feedback)")
class PowerSGDStrategy(DDPStrategy):
    name = "powersgd"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        rank: int = 2,
        start_iter: int = 10,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        _check_positive("PowerSGDStrategy", "rank", rank)
        # torch requires start_powerSGD_iter > 1 with error feedback / warm start
        _check_positive("PowerSGDStrategy", "start_iter", start_iter, 2)
        super().__init__(model, make_optimizer, group, bucket_cap_mb=bucket_cap_mb)
        self.rank, self.start_iter = int(rank), int(start_iter)
        self.state = psgd.PowerSGDState(
            process_group=group.pg,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        self.ddp.register_comm_hook(self.state, psgd.powerSGD_hook)

    def hparams(self) -> dict[str, Any]:
        return {"rank": self.rank, "start_iter": self.start_iter}

    def extra_state(self) -> dict[str, Any]:
        # error-feedback memory, warm-start factors and the iteration counter (PowerSGDState pickles
        # without its process group)
        slots = [s for s in psgd.PowerSGDState.__slots__ if s != "process_group"]
        return {"powersgd": {s: getattr(self.state, s) for s in slots}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "powersgd" not in state:
            raise InvalidArgumentError("PowerSGDStrategy.load_state_dict: checkpoint has no PowerSGD state")
        for slot, value in state["powersgd"].items():
            setattr(self.state, slot, value)
