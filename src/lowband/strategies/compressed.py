"""The ``compressed`` strategy: any registered compressor through any registered transport, with or
without error feedback, on lowband's gradient stage (the ``stage`` strategy with a
:class:`~lowband.compress.reducer.CompressedReducer` as its reducer), then the torch optimizer.

Spec: ``compressed:compressor=NAME[:opt=v;opt=v],reducer=TRANSPORT|auto,memory=residual|none|dgc[:opt=v;...],
bucket_mb=MB,seed=S`` (a nested spec separates its options with ``;``), e.g.
``compressed:compressor=qsgd:levels=16;bucket=512,reducer=ps``. ``reducer=auto`` (the default) is the
allreduce transport for formats that sum on the wire (casts) and the allgather transport for all others
(:mod:`lowband.compress.specs`). ``bucket_mb`` defaults to DDP's 25 MB, so that the strategy compares
with ``ddp`` and ``stage`` on the same units; ``bucket_mb=0`` compresses per layer. Every name, option
and value is checked before the first collective (one clear error).

State: the stage's reduction counter (the step random compressors are seeded with) and the reducer's
state (error-feedback memories keyed by parameter name, the compressor's and the transport's state) go
into ``state_dict``; a checkpoint resumes bit-identically at the same world size, and
:func:`~lowband.strategies.compressed_state.reshard_checkpoints` maps every rank's checkpoint onto
another world size where the state allows.

Precision: with bf16/fp16 autocast the parameters and gradients stay float32, so the error-feedback
memories (built from the gradients) are float32 too; with fp16 loss scaling the stage unscales each
unit before the compressor and memory see it (:class:`~lowband.strategies.stage.StageStrategy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from lowband.compress.dgc import DGCMemory, check_optimizer
from lowband.compress.reducer import CompressedReducer
from lowband.compress.specs import REDUCER_OPTIONS, build_reducer, describe_reducer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.units import BUCKET_OPTIONS
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.registry import modelled_as, register_strategy
from lowband.strategies.stage import StageStrategy

if TYPE_CHECKING:
    from lowband.plan.links import Links
    from lowband.plan.prediction import Prediction
    from lowband.plan.profile import PlanProfile


class CompressedStrategy(StageStrategy):
    """A compressed reducer on the gradient stage (module docstring)."""

    name = "compressed"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        reducer: CompressedReducer,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
    ) -> None:
        if not isinstance(reducer, CompressedReducer):
            raise InvalidArgumentError(
                f"CompressedStrategy: reducer must be a lowband.compress.CompressedReducer, got "
                f"{type(reducer).__name__}"
            )
        self.reducer = reducer
        super().__init__(
            model, make_optimizer, group, reducer, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
        )
        if isinstance(reducer.memory, DGCMemory):  # the same on every rank: no rank is left waiting
            check_optimizer(self.optimizer)

    plan_grid = (
        "compressor=topk:ratio=0.01",
        "compressor=topk:ratio=0.1",
        "compressor=fp16",
        "compressor=qsgd",
    )

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models

        return models.compressed(profile, links, options)

    def hparams(self) -> dict[str, Any]:
        d = describe_reducer(self.reducer)
        opts = ";".join(f"{k}={v}" for k, v in d["compressor_options"].items())
        return {
            "compressor": d["compressor"] + (f":{opts}" if opts else ""),
            "reducer": d["transport"],
            "memory": d["memory"],
            "bucket_mb": self.bucket_mb,
        }

    def report(self) -> dict[str, Any]:
        t = self.reducer.timings
        return {
            **super().report(),
            **describe_reducer(self.reducer),
            "timings": {
                "compress_s": t.compress_s,
                "decompress_s": t.decompress_s,
                "decompress_inline_s": t.decompress_inline_s,
                "units": t.units,
            },
        }

    def extra_state(self) -> dict[str, Any]:
        d = describe_reducer(self.reducer)
        return {
            **super().extra_state(),
            "world_size": self.group.size,
            "compressor": d["compressor"],
            "transport": d["transport"],
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        where = f"CompressedStrategy.load_state_dict on rank {self.group.rank}"
        d = describe_reducer(self.reducer)
        saved = {k: state.get(k) for k in ("compressor", "transport")}
        if saved != {"compressor": d["compressor"], "transport": d["transport"]}:
            raise InvalidArgumentError(
                f"{where}: the checkpoint is of compressor {saved['compressor']!r} through "
                f"{saved['transport']!r}, this strategy runs {d['compressor']!r} through {d['transport']!r}"
            )
        n = state.get("world_size", self.group.size)
        if n != self.group.size:
            raise InvalidArgumentError(
                f"{where}: the checkpoint was taken at {n} ranks, this group has {self.group.size}: its "
                "per-rank state (error-feedback memories) must be re-sharded first with "
                "lowband.strategies.reshard_checkpoints(every rank's checkpoint, world_size)"
            )
        super().load_extra_state(state)


@register_strategy(
    "compressed",
    "any registered compressor through any registered transport on the gradient stage "
    "(compressor=SPEC, reducer=auto|TRANSPORT, memory=residual|none|dgc, bucket_mb, seed)",
    REDUCER_OPTIONS | BUCKET_OPTIONS,
)
@modelled_as(CompressedStrategy)
def compressed(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    compressor: str = "identity",
    reducer: str = "auto",
    memory: str = "residual",
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    seed: int = 0,
) -> CompressedStrategy:
    where = f"strategy 'compressed' on rank {group.rank}"
    red = build_reducer(compressor, reducer, memory, seed=seed, where=where)
    return CompressedStrategy(
        model, make_optimizer, group, red, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
    )
