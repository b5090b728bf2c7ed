"""BlueFog's utilities: broadcast or average a model's parameters, broadcast an optimizer's state."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

import lowband
from lowband.comm.base import host_value
from lowband.comm.initial import broadcast_tensors
from lowband.errors import InvalidArgumentError
from lowband.runtime import current

_MOD = "lowband.compat.bluefog.torch"


def _named_tensors(op: str, params: object) -> list[tuple[str | None, torch.Tensor]]:
    """``(name, tensor)`` pairs of a dict (sorted by name, as BlueFog does), or of a list of tensors or of
    ``(name, tensor)`` pairs (``model.parameters()`` / ``model.named_parameters()``)."""
    if isinstance(params, Mapping):
        items: list[tuple[str | None, Any]] = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise InvalidArgumentError(
            f"{_MOD}.{op} on rank {current(op).rank}: params must be a dict or a list, got {type(params).__name__}"
        )
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"{_MOD}.{op} on rank {current(op).rank}: params entry {name!r} is {type(t).__name__}, not a tensor"
            )
    return items


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every tensor of ``params`` (``model.state_dict()``, ``model.parameters()`` or
    ``model.named_parameters()``) with ``root_rank``'s, in place (nonblocking broadcasts, then waited)."""
    broadcast_tensors(_named_tensors("broadcast_parameters", params), root_rank, group=None)


def allreduce_parameters(params: Any) -> None:
    """Replace every tensor of ``params`` by its average over the ranks, in place."""
    items = _named_tensors("allreduce_parameters", params)
    handles = [lowband.iallreduce(t.detach(), inplace=True, name=name) for name, t in items]
    lowband.wait_all(handles)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters: the root's ``state_dict()`` is
    serialised (``torch.save``), broadcast as bytes and loaded, so the other ranks' state need not be
    initialised (BlueFog instead broadcasts tensor by tensor after a dummy step)."""
    op = "broadcast_optimizer_state"
    ctx = current(op)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"{_MOD}.{op} on rank {ctx.rank}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError(
            f"{_MOD}.{op} on rank {ctx.rank}: cannot broadcast torch.optim.LBFGS state"
        )
    payload = torch.empty(0, dtype=torch.uint8, device="cpu")
    if ctx.rank == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    n = lowband.broadcast(
        host_value(torch.tensor([payload.numel()], dtype=torch.int64, device="cpu")),
        root_rank,
        name=f"{op}.size",
    )
    if ctx.rank != root_rank:
        payload = torch.empty(int(n.item()), dtype=torch.uint8, device="cpu")
    payload = lowband.broadcast(host_value(payload), root_rank, name=op).cpu()
    if ctx.rank != root_rank:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        optimizer.load_state_dict(state)
