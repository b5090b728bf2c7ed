"""Globally sparse training strategies on the gradient stage: ``gs-sgd`` (global CountSketch over the
halving/doubling tree), and its baselines ``sketched-sgd`` (sketches summed on rank 0), ``gtopk`` (global
top-k by merging pairs up the tree) and ``topk-allgather`` (every rank's top-k pairs allgathered: the
compression framework's allgather transport with its top-k compressor). Momentum stays with the
wrapped torch optimizer unless a strategy's ``momentum`` option moves it into the workers (Sketched-SGD).

Each is the reducer on :class:`~lowband.strategies.stage.StageStrategy` (buckets of ``bucket_mb``, as
DDP fuses them; ``k`` or ``density`` applies per bucket); residuals and worker momentum are in the
checkpoint (``extra_state``), with the stage's reduction counter that seeds HEAVYMIX's random fill, and
the world size it was taken at: a checkpoint of another world size is refused (before anything loads)
unless every rank's was re-sharded first by :func:`~lowband.strategies.compressed_state.reshard_checkpoints` (residuals and
worker momentum keep their sum over ranks). The options that change what the state means (density,
``k``, sketch size, ...) are compared when it is loaded (:mod:`lowband.strategies.digest`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from lowband.compress.gssgd import (
    FEEDBACK_OPTIONS,
    REDUCE_OPTIONS,
    SKETCH_OPTIONS,
    GsSGDReducer,
    GTopKReducer,
    SketchedSGDReducer,
)
from lowband.compress.sparse_update import SPARSE_OPTIONS, SparseUpdateReducer
from lowband.group import Group
from lowband.optim.units import BUCKET_OPTIONS
from lowband.options import Opt, Options
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.compressed import CompressedStrategy, compressed
from lowband.strategies.registry import modelled_as, register_strategy
from lowband.strategies.stage import StageStrategy

if TYPE_CHECKING:
    from lowband.plan import Links, PlanProfile, Prediction


class SparseStageStrategy(StageStrategy):
    """A globally sparse reducer on the gradient stage, named after its scheme."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        reducer: SparseUpdateReducer,
        *,
        bucket_mb: float,
        first_bucket_mb: float,
    ) -> None:
        self.name = name
        self.sparse = reducer  # (the stage prepares it: a sketching reducer's tables built and agreed)
        super().__init__(
            model, make_optimizer, group, reducer, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
        )

    def hparams(self) -> dict[str, Any]:
        return {**super().hparams(), **self.sparse.options()}

    def extra_state(self) -> dict[str, Any]:
        # a checkpoint of another world size is refused before anything loads (digest.check_checkpoint)
        return {**super().extra_state(), "world_size": self.group.size}

    def report(self) -> dict[str, Any]:
        out = super().report()
        t = self.sparse.timings
        out["timings"] = {"compress_s": t.compress_s, "decompress_s": t.decompress_s, "units": t.units}
        return out


class _GsSGDModel(SparseStageStrategy):
    """gs-SGD's cost model (:func:`lowband.plan.models_sparse.gs_sgd`), carried by its factory.
    Sketched-SGD, gTop-k and top-k allgather have none yet (their star, pair-merging tree and uneven
    pair counts are priced by :mod:`lowband.plan.collectives` but not modelled per step)."""

    plan_grid = ("density=0.01",)

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models_sparse

        return models_sparse.gs_sgd(profile, links, options)


@register_strategy(
    "gs-sgd",
    "gs-SGD: CountSketches summed over a halving/doubling tree, top-k recovery (or HEAVYMIX), exact values",
    SKETCH_OPTIONS | SPARSE_OPTIONS | REDUCE_OPTIONS | BUCKET_OPTIONS,
)
@modelled_as(_GsSGDModel)
def gs_sgd(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    rows: int = 5,
    cols: int = 0,
    density: float = 0.01,
    k: int = 0,
    recovery: str = "topk",
    oversample: float = 1.0,
    reduce: str = "tree",
    momentum: float = 0.0,
    masking: bool = False,
    seed: int = 0,
    warmup: str = "",
    warmup_steps: int = 0,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> SparseStageStrategy:
    r = GsSGDReducer(
        rows=rows, cols=cols, density=density, k=k, recovery=recovery, oversample=oversample,
        reduce=reduce, momentum=momentum, masking=masking, seed=seed, warmup=warmup, warmup_steps=warmup_steps,
    )  # fmt: skip
    return SparseStageStrategy(
        "gs-sgd", model, make_optimizer, group, r, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
    )


@register_strategy(
    "sketched-sgd",
    "Sketched-SGD: CountSketches summed on rank 0, indices broadcast",
    SKETCH_OPTIONS | SPARSE_OPTIONS | BUCKET_OPTIONS,
)
def sketched_sgd(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    rows: int = 5,
    cols: int = 0,
    density: float = 0.01,
    k: int = 0,
    recovery: str = "topk",
    oversample: float = 1.0,
    momentum: float = 0.0,
    masking: bool = False,
    seed: int = 0,
    warmup: str = "",
    warmup_steps: int = 0,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> SparseStageStrategy:
    """No cost model yet (``lowband plan``): rank 0's link takes ``P - 1`` sketches
    (:func:`lowband.plan.collectives.star_time` prices it), but rank 0's recovery and the values' round
    trip are not modelled per step."""
    r = SketchedSGDReducer(
        rows=rows, cols=cols, density=density, k=k, recovery=recovery, oversample=oversample,
        momentum=momentum, masking=masking, seed=seed, warmup=warmup, warmup_steps=warmup_steps,
    )  # fmt: skip
    return SparseStageStrategy(
        "sketched-sgd", model, make_optimizer, group, r, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
    )


@register_strategy(
    "gtopk",
    "gTop-k S-SGD: global top-k by merging (index, value) pairs up a tree, any P",
    SPARSE_OPTIONS | FEEDBACK_OPTIONS | BUCKET_OPTIONS,
)
def gtopk(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    density: float = 0.01,
    k: int = 0,
    feedback: str = "exact",
    momentum: float = 0.0,
    masking: bool = False,
    seed: int = 0,
    warmup: str = "",
    warmup_steps: int = 0,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> SparseStageStrategy:
    """No cost model yet (``lowband plan``): the tree is priced (:mod:`lowband.plan.collectives`), the
    merge of two sparse vectors in every round (measured work on the critical path) is not."""
    r = GTopKReducer(
        density=density, k=k, feedback=feedback, momentum=momentum, masking=masking, seed=seed,
        warmup=warmup, warmup_steps=warmup_steps,
    )  # fmt: skip
    return SparseStageStrategy(
        "gtopk", model, make_optimizer, group, r, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb
    )


@register_strategy(
    "topk-allgather",
    "top-k S-SGD: every rank's top-k pairs allgathered, error feedback",
    Options(
        {
            "density": Opt(float, gt=0, max=1, doc="the fraction of each unit each rank sends"),
            "seed": Opt(int, doc="seeds the compressor's context"),
        }
    )
    | BUCKET_OPTIONS,
)
def topk_allgather(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    density: float = 0.01,
    seed: int = 0,
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> CompressedStrategy:
    """``compressed:compressor=topk:ratio=DENSITY,reducer=allgather`` under its own name."""
    s = compressed(
        model, make_optimizer, group, compressor=f"topk:ratio={density}", reducer="allgather",
        memory="residual", bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, seed=seed,
    )  # fmt: skip
    assert isinstance(s, CompressedStrategy)
    s.name = "topk-allgather"
    return s
