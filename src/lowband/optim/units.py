"""A whole model's units for the gradient stage: fused buckets (``bucket_mb`` > 0, DDP's rule) or one
unit per layer (``bucket_mb = 0``). The one rule every whole-model stepper shares (the ``stage`` and
``compressed`` strategies, :class:`lowband.compress.CompressedOptimizer`)."""

from __future__ import annotations

from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.optim.layerwise import parameter_layers
from lowband.optim.reducer import Unit, bucket_units, layer_units, parameter_names


def check_bucket_mb(where: str, bucket_mb: object, first_bucket_mb: object) -> tuple[float, float]:
    """Both sizes as floats (numbers >= 0), else :class:`InvalidArgumentError` naming ``where``."""
    for what, v in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise InvalidArgumentError(f"{where}: {what} must be a number >= 0, got {v!r}")
    return float(bucket_mb), float(first_bucket_mb)  # type: ignore[arg-type]


def model_units(model: nn.Module, bucket_mb: float, first_bucket_mb: float = 1.0) -> list[Unit]:
    """Units of ``model``'s trainable parameters: per layer when ``bucket_mb == 0``, else buckets of
    about ``bucket_mb`` megabytes (the first, in backward order, ``first_bucket_mb`` or, when 0,
    ``bucket_mb``); see :func:`~lowband.optim.reducer.bucket_units`."""
    bucket_mb, first_bucket_mb = check_bucket_mb("model_units", bucket_mb, first_bucket_mb)
    if bucket_mb == 0:
        return layer_units(parameter_layers(model), parameter_names(model))
    return bucket_units(model, bucket_mb, first_bucket_mb or bucket_mb)
