"""Gradient buckets overlapped with backward, the event model of DDP and of lowband's gradient stage.

Buckets are formed as DDP forms them (:func:`lowband.optim.reducer.bucket_units`), at the profile's layer
granularity: layers join the open bucket in backward order until it holds at least ``first_cap`` bytes
(the first bucket) or ``cap`` bytes (the others). A bucket's communication starts when its last layer's
backward ends and the link has finished the bucket before (one queue), which is DreamDDP's event model
(Eq. 7, :func:`lowband.localsgd.costmodel.iteration_time`) on a profile whose "layers" are the buckets:
that function computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lowband.localsgd.costmodel import CostProfile, LayerCost, iteration_time

MiB = 2**20


def layer_buckets(nbytes: Sequence[int], cap: float, first_cap: float) -> list[list[int]]:
    """Layer indices (forward order) grouped into buckets (module doc), buckets in forward order.
    ``cap == 0``: one bucket per layer."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(nbytes))):
        buckets[-1].append(i)
        size += nbytes[i]
        if cap == 0 or size >= (first_cap if len(buckets) == 1 else cap):
            buckets.append([])
            size = 0
    return [sorted(b) for b in reversed(buckets) if b]


def bucket_profile(
    cost: CostProfile, buckets: Sequence[Sequence[int]], comm: Callable[[int], float]
) -> CostProfile:
    """A profile whose layers are ``buckets`` (summed forward, backward and bytes; ``comm(k)``: seconds
    bucket ``k`` holds the link, compression included), with ``cost``'s measured interference."""
    layers = []
    for k, b in enumerate(buckets):
        ls = [cost.layers[i] for i in b]
        layers.append(
            LayerCost(
                f"bucket{k}",
                sum(lc.fwd for lc in ls),
                sum(lc.bwd for lc in ls),
                comm(k),
                sum(lc.nbytes for lc in ls),
            )
        )
    return CostProfile(tuple(layers), kappa=cost.kappa, sigma=cost.sigma)


def overlapped_exposed(
    cost: CostProfile, buckets: Sequence[Sequence[int]], comm: Callable[[int], float]
) -> float:
    """Seconds of bucket communication not hidden behind backward (>= 0); with interference (``cost.kappa``,
    ``cost.sigma``: ranks sharing cores, measured by a profile on every rank at once) the backward it
    slows is counted here too."""
    bp = bucket_profile(cost, buckets, comm)
    return max(0.0, iteration_time(bp, range(bp.L)) - bp.fwd_total - bp.bwd_total)
