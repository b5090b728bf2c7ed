"""Differentiable collectives: autograd Functions over :mod:`lowband.comm` whose backward is the
transposed collective.

==========================================  ==================================================
forward                                     backward (of the gradient)
==========================================  ==================================================
allgather, first dims ``sizes``             reduce-scatter (sum), blocks of ``sizes``
alltoall, send ``splits``, recv ``r``       alltoall, send ``r``, recv ``splits``
reduce_scatter (sum / average), ``sizes``   allgather of ``sizes`` (scaled by 1/p for average)
==========================================  ==================================================

The objective these gradients belong to is the sum of every rank's loss: each rank calls
``backward`` on its own loss, and the backward collectives deliver to every input the gradient of that
sum (divide by the group size for the average of the ranks' losses). Every rank of ``group`` must call
the same ops in the same order, forward and backward.

Each op has a nonblocking ``i``-form returning a :class:`~lowband.comm.handle.Handle` whose ``wait()``
gives a tensor in the autograd graph. When the caller passes the sizes (``sizes`` for allgather and
reduce_scatter, ``recv_splits`` for alltoall), nothing is exchanged before the data: the op is issued at
once (with the cross-rank argument check on, the check itself still runs; see ``lowband.init(check=)``).
Without them, a small exchange of the sizes runs first (blocking). Backward collectives always know
their sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from lowband.comm import collectives as comm
from lowband.comm import validate
from lowband.comm.base import host_value
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import world_group

_SUM_OPS = ("sum", "average")


class _Pending:
    """What links the two graph nodes of one op: the communication in flight and its transpose."""

    def __init__(
        self, handle: Handle[torch.Tensor], transpose: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.handle = handle
        self.transpose = transpose


class _Start(torch.autograd.Function):
    """Issues the op (done by the caller); its output is a placeholder of the result's shape, so that
    the gradient of the result flows here, where the transposed collective runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: _Pending, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.pending = pending
        return x.new_zeros(()).expand(shape)

    @staticmethod
    @once_differentiable  # type: ignore[misc]
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.pending.transpose(grad), None, None


class _Wait(torch.autograd.Function):
    """Waits for the op and returns its result in place of the placeholder (identity for gradients)."""

    @staticmethod
    def forward(ctx: FunctionCtx, placeholder: torch.Tensor, pending: _Pending) -> torch.Tensor:
        return pending.handle.wait()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _graph_handle(
    x: torch.Tensor,
    handle: Handle[torch.Tensor],
    shape: tuple[int, ...],
    transpose: Callable[[torch.Tensor], torch.Tensor],
) -> Handle[torch.Tensor]:
    pending = _Pending(handle, transpose)
    placeholder: torch.Tensor = _Start.apply(x, pending, shape)  # type: ignore[no-untyped-call]

    def wait(_result: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Wait.apply(placeholder, pending)  # type: ignore[no-untyped-call]
        return out

    return handle.map(wait)


def _tensor(op: str, rank: int, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise InvalidArgumentError(
            f"lowband.nn.{op} on rank {rank}: tensor must be a torch.Tensor with at least one dimension"
        )
    return x


def _exchange_dim0(n: int, group: Group) -> list[int]:
    return [
        int(v)
        for v in comm.allgather(
            host_value(torch.tensor([n], dtype=torch.int64, device="cpu"), group), group=group
        ).tolist()
    ]


# ---------------------------------------------------------------- reduce-scatter (also allgather's transpose)


def _issue_reduce_scatter(
    x: torch.Tensor, op: str, sizes: list[int], name: str | None, group: Group
) -> Handle[torch.Tensor]:
    """reduce-scatter of blocks of ``sizes`` rows (uneven blocks padded to the largest)."""
    p, me = group.size, group.rank
    mx = max(sizes) if sizes else 0
    if all(s == mx for s in sizes):
        return comm.ireduce_scatter(x, op, name=name, group=group)
    padded = x.new_zeros((p * mx, *x.shape[1:]))
    pos = 0
    for r, s in enumerate(sizes):
        padded[r * mx : r * mx + s] = x[pos : pos + s]
        pos += s
    mine = sizes[me]
    return comm.ireduce_scatter(padded, op, name=name, group=group).map(lambda t: t[:mine])


def _issue_allgather(
    x: torch.Tensor, sizes: list[int], name: str | None, group: Group
) -> Handle[torch.Tensor]:
    return comm.iallgather(x, sizes=sizes, name=name, group=group)


def iallgather(
    tensor: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking differentiable allgather along dimension 0 (first dimensions may differ across ranks).

    ``wait()`` returns the ranks' tensors concatenated in rank order. ``sizes``: every rank's first
    dimension, if known (no exchange). Backward: reduce-scatter (sum) of the gradient.
    """
    ctx, g = world_group(group, "nn.allgather")
    x = _tensor("allgather", ctx.rank, tensor)
    s = (
        _exchange_dim0(x.shape[0], g)
        if sizes is None
        else validate.check_splits("nn.allgather", ctx.rank, "sizes", sizes, g.size, None)
    )
    if s[g.rank] != x.shape[0]:
        raise InvalidArgumentError(
            f"lowband.nn.allgather on rank {ctx.rank}: sizes={s} but this rank's first dimension is {x.shape[0]}"
        )
    h = _issue_allgather(x.detach(), s, name, g)
    shape = (sum(s), *x.shape[1:])
    return _graph_handle(x, h, shape, lambda grad: _issue_reduce_scatter(grad, "sum", s, name, g).wait())


def allgather(
    tensor: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Differentiable allgather; see :func:`iallgather`."""
    return iallgather(tensor, sizes=sizes, name=name, group=group).wait()


def ireduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking differentiable reduce-scatter along dimension 0: rank ``r`` gets the ``op``
    ('sum' or 'average') of block ``r`` of every rank's tensor. ``sizes``: the blocks' first dimensions
    (the same on every rank, summing to the tensor's; default: equal blocks). Backward: allgather."""
    ctx, g = world_group(group, "nn.reduce_scatter")
    x = _tensor("reduce_scatter", ctx.rank, tensor)
    if op not in _SUM_OPS:
        raise InvalidArgumentError(
            f"lowband.nn.reduce_scatter on rank {ctx.rank}: op must be 'sum' or 'average' to be differentiable, got {op!r}"
        )
    p, n0 = g.size, x.shape[0]
    if sizes is None:
        if n0 % p:
            raise InvalidArgumentError(
                f"lowband.nn.reduce_scatter on rank {ctx.rank}: first dimension {n0} is not divisible by the "
                f"group size {p}; pass sizes"
            )
        s = [n0 // p] * p
    else:
        s = validate.check_splits("nn.reduce_scatter", ctx.rank, "sizes", sizes, p, n0)
    h = _issue_reduce_scatter(x.detach(), op, s, name, g)
    scale = 1.0 / p if op == "average" else 1.0

    def transpose(grad: torch.Tensor) -> torch.Tensor:
        full = _issue_allgather(grad.contiguous(), s, name, g).wait()
        return full if scale == 1.0 else full.mul_(scale)

    return _graph_handle(x, h, (s[g.rank], *x.shape[1:]), transpose)


def reduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Differentiable reduce-scatter; see :func:`ireduce_scatter`."""
    return ireduce_scatter(tensor, op, sizes=sizes, name=name, group=group).wait()


# ---------------------------------------------------------------- alltoall


def ialltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | None = None,
    *,
    recv_splits: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking differentiable all-to-all along dimension 0: rows ``splits[j]`` go to rank ``j``
    (default: equal parts); ``wait()`` returns the rows received, in source-rank order.
    ``recv_splits``: how many rows come from each rank, if known (no exchange). Backward: the
    all-to-all of the gradient with the splits swapped."""
    ctx, g = world_group(group, "nn.alltoall")
    x = _tensor("alltoall", ctx.rank, tensor)
    p, n0 = g.size, x.shape[0]
    if splits is None:
        if n0 % p:
            raise InvalidArgumentError(
                f"lowband.nn.alltoall on rank {ctx.rank}: first dimension {n0} is not divisible by the group "
                f"size {p}; pass splits"
            )
        send = [n0 // p] * p
    else:
        send = validate.check_splits("nn.alltoall", ctx.rank, "splits", splits, p, n0)
    if recv_splits is None:
        got = comm.alltoall(
            host_value(torch.tensor(send, dtype=torch.int64, device="cpu"), group), group=group
        )[0]
        recv = [int(v) for v in got.tolist()]
    else:
        recv = validate.check_splits("nn.alltoall", ctx.rank, "recv_splits", recv_splits, p, None)
    h = comm.ialltoall(x.detach(), send, recv_splits=recv, name=name, group=g).map(lambda r: r[0])

    def transpose(grad: torch.Tensor) -> torch.Tensor:
        return comm.alltoall(grad.contiguous(), recv, recv_splits=send, name=name, group=g)[0]

    return _graph_handle(x, h, (sum(recv), *x.shape[1:]), transpose)


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | None = None,
    *,
    recv_splits: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Differentiable all-to-all; see :func:`ialltoall`."""
    return ialltoall(tensor, splits, recv_splits=recv_splits, name=name, group=group).wait()
