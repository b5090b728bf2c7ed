"""Model divergence of local SGD (the paper's Gamma, Section 2.4 and Fig. 5).

``Gamma = 1/K sum_k ||w_bar - w_k||^2`` with ``w_bar = 1/K sum_k w_k``, over the trainable parameters of
the K replicas of ``group``. Computed layer by layer (a layer-sized float64 copy at a time, never a
model-sized one): one averaging allreduce per layer, then one scalar allreduce. Every rank gets the
same value. Gamma is 0 when the replicas are identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lowband.comm.base import host_value
from lowband.comm.collectives import allreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.layerwise import parameter_layers
from lowband.runtime import world_group


def model_divergence(
    model: nn.Module | Sequence[Sequence[torch.Tensor]], *, group: Group | None = None
) -> float:
    """Gamma of ``model`` (an ``nn.Module``, or its parameters grouped by layer) across ``group``; every
    rank calls it with the same layout."""
    ctx, g = world_group(group, "model_divergence")
    if isinstance(model, nn.Module):
        layers: list[Sequence[torch.Tensor]] = [ps for _, ps in parameter_layers(model)]
    elif isinstance(model, Sequence) and all(isinstance(ps, Sequence) for ps in model):
        layers = list(model)
    else:
        raise InvalidArgumentError(
            f"lowband.model_divergence on rank {ctx.rank}: model must be an nn.Module or a sequence of "
            f"parameter lists, got {type(model).__name__}"
        )
    sq = 0.0
    for ps in layers:
        if not ps:
            continue
        flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in ps])
        mean = allreduce(flat, "average", group=g)
        sq += float(((flat - mean) ** 2).sum())
    sq_t = host_value(torch.tensor([sq], dtype=torch.float64, device="cpu"), g)
    return float(allreduce(sq_t, "average", group=g)[0])
