"""Any lowband reducer as a DDP communication hook: ``ddp.register_comm_hook(*ddp_comm_hook(r, model))``.

DDP hands its hook a ``GradBucket`` (a flat buffer of some parameters' gradients, in an order DDP may
rebuild after the first iteration) and expects a torch Future of the reduced buffer. The adapter cuts
the buffer into per-parameter views, names them from the model (``model.named_parameters()``), calls
the reducer with a :class:`~lowband.optim.reducer.Unit` whose key is derived from those names, and
bridges the handle to a Future (:meth:`lowband.comm.handle.Handle.future`). State a reducer keys by
parameter name therefore survives DDP's bucket rebuild. The step counter given to the reducer counts
DDP iterations (it advances after the last bucket of each backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._C._distributed_c10d import GradBucket

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import ReduceContext, Reducer, Unit, parameter_names
from lowband.runtime import world_group

Tensor = torch.Tensor


@dataclass
class DDPHookState:
    """What the hook needs between calls: the reducer, the group, parameter names, the step counter."""

    reducer: Reducer
    group: Group
    names: dict[int, str] = field(repr=False)
    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "step" not in state or "reducer" not in state:
            raise InvalidArgumentError(
                "DDPHookState.load_state_dict: expects a dict with 'step' and 'reducer'"
            )
        self.step = int(state["step"])
        self.reducer.load_state_dict(dict(state["reducer"]))


def reducer_hook(state: DDPHookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """The DDP comm hook running ``state.reducer`` on one bucket."""
    buf = bucket.buffer()
    params = bucket.parameters()
    grads: list[Tensor] = []
    names: list[str] = []
    pos = 0
    for p in params:
        n = p.numel()
        grads.append(buf[pos : pos + n].view(p.shape))
        names.append(state.names.get(id(p), f"bucket{bucket.index()}.{len(names)}"))
        pos += n
    key = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    unit = Unit(key, tuple(names), tuple(params))
    h = state.reducer.reduce(unit, grads, ReduceContext(state.group, state.step))
    if bucket.is_last():
        state.step += 1

    def flat(out: list[Tensor]) -> Tensor:
        if len(out) == len(grads) and all(o is g for o, g in zip(out, grads)):
            return buf  # reduced in place, in the bucket's own buffer
        return torch.cat([o.reshape(-1) for o in out])

    return h.then(flat).future()


# DDP compares the hook's annotations with the classes themselves; postponed (string) annotations
# would fail that check, so the evaluated ones are set here.
reducer_hook.__annotations__ = {
    "state": DDPHookState,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def ddp_comm_hook(
    reducer: Reducer, model: nn.Module, group: Group | None = None
) -> tuple[DDPHookState, Callable[[DDPHookState, GradBucket], torch.futures.Future[Tensor]]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``: ``reducer`` reduces every
    bucket of the DDP model wrapping ``model`` over ``group`` (default: the world; it must be the
    process group DDP was given). DDP checks the model's layout across ranks at construction, so the
    reducer runs with per-op checks off."""
    ctx, g = world_group(group, "ddp_comm_hook")
    if not isinstance(reducer, Reducer):
        raise InvalidArgumentError(
            f"lowband.ddp_comm_hook on rank {ctx.rank}: reducer must be a lowband.optim.Reducer, "
            f"got {type(reducer).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"lowband.ddp_comm_hook on rank {ctx.rank}: model must be the torch.nn.Module DDP wraps, "
            f"got {type(model).__name__}"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    names = {id(p): n for p, n in parameter_names(model).items()}
    return DDPHookState(reducer, g.unchecked(), names), reducer_hook
