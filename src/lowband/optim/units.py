"""A whole model's units for the gradient stage: fused buckets (``bucket_mb`` > 0, DDP's rule) or one
unit per layer (``bucket_mb = 0``). The one rule every whole-model stepper shares (the ``stage`` and
``compressed`` strategies, :class:`lowband.compress.CompressedOptimizer`)."""

from __future__ import annotations

from torch import nn

from lowband.optim.layerwise import parameter_layers
from lowband.optim.reducer import Unit, bucket_units, layer_units, parameter_names
from lowband.options import Opt, Options

#: the options of every strategy that steps the whole model through these units (defaults: its own)
BUCKET_OPTIONS = Options(
    {
        "bucket_mb": Opt(float, min=0, unit="MB", doc="gradient bucket size (0: one unit per layer)"),
        "first_bucket_mb": Opt(
            float, min=0, unit="MB", doc="the first bucket in backward order (0: bucket_mb), as DDP's"
        ),
    }
)


def check_bucket_mb(where: str, bucket_mb: object, first_bucket_mb: object) -> tuple[float, float]:
    """Both sizes as floats (numbers >= 0, :data:`BUCKET_OPTIONS`), else :class:`InvalidArgumentError`
    naming ``where``."""
    got = BUCKET_OPTIONS.check(where, {"bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb})
    return got["bucket_mb"], got["first_bucket_mb"]


def model_units(model: nn.Module, bucket_mb: float, first_bucket_mb: float = 1.0) -> list[Unit]:
    """Units of ``model``'s trainable parameters: per layer when ``bucket_mb == 0``, else buckets of
    about ``bucket_mb`` megabytes (the first, in backward order, ``first_bucket_mb`` or, when 0,
    ``bucket_mb``); see :func:`~lowband.optim.reducer.bucket_units`."""
    bucket_mb, first_bucket_mb = check_bucket_mb("model_units", bucket_mb, first_bucket_mb)
    if bucket_mb == 0:
        return layer_units(parameter_layers(model), parameter_names(model))
    return bucket_units(model, bucket_mb, first_bucket_mb or bucket_mb)
