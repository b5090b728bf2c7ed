"""Every compressor as a DDP communication hook, through the core's bridge
(:func:`lowband.ddp_comm_hook`)::

    ddp = DistributedDataParallel(model, process_group=pg)
    state, hook = lowband.compress.ddp_hook(model, compressor="onebit", reducer="ps")
    ddp.register_comm_hook(state, hook)

DDP hands each bucket to the compressed reducer as per-parameter views named from the model, so the
error-feedback memories are keyed by parameter name and survive DDP's bucket rebuild; ``state`` has
``state_dict`` / ``load_state_dict`` (the step counter and the reducer's state) for checkpoints, and
``state.reducer.timings`` the compression and decoding seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._C._distributed_c10d import GradBucket

from lowband.compress.base import Compressor
from lowband.compress.specs import build_reducer
from lowband.group import Group
from lowband.optim.ddp_hook import DDPHookState, ddp_comm_hook

Hook = Callable[[DDPHookState, GradBucket], torch.futures.Future[torch.Tensor]]


def ddp_hook(
    model: nn.Module,
    *,
    compressor: str | Compressor = "identity",
    reducer: str = "auto",
    memory: str = "residual",
    seed: int = 0,
    group: Group | None = None,
) -> tuple[DDPHookState, Hook]:
    """``(state, hook)`` for ``ddp.register_comm_hook(state, hook)``: ``compressor`` through the
    transport ``reducer`` (``"auto"``: allreduce for summable formats, else allgather) with ``memory``
    (options as :func:`lowband.compress.specs.build_reducer`); ``group`` must be DDP's process group's
    (default: the world)."""
    red = build_reducer(compressor, reducer, memory, seed=seed, where="lowband.compress.ddp_hook")
    return ddp_comm_hook(red, model, group)
