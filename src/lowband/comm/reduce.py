"""Reductions: allreduce and reduce_scatter, each with a blocking form and a nonblocking ``i``-form
returning a :class:`Handle`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lowband.comm import validate
from lowband.comm.base import (
    GLOO_LACKS,
    check_inplace,
    check_name,
    checked_tensor,
    checking,
    contiguous_flat,
    make_handle,
    nbytes,
    one_issuer,
    resolve,
)
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group

TORCH_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "average": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide once the data is there
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}
#: the signature's argument field of each reduce op
OP_ARG = {name: i for i, name in enumerate(validate.REDUCE_OPS)}


def ring_bytes(total: int, p: int) -> int:
    """Bytes one rank sends (and receives) in a ring allreduce of ``total`` bytes over ``p`` ranks."""
    return 2 * (p - 1) * total // p if p > 1 else 0


@one_issuer("allreduce")
def iallreduce(
    tensor: torch.Tensor,
    op: str = "average",
    *,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking allreduce. ``op``: 'average' (default), 'sum', 'min', 'max', 'product'.
    Out of place unless ``inplace``; ``wait()`` returns the reduced tensor."""
    ctx, g = resolve("allreduce", group)
    t = checked_tensor("allreduce", ctx, tensor, g=g)
    name = check_name("allreduce", ctx, name)
    rop = validate.check_reduce_op("allreduce", ctx.rank, op, t.dtype)
    if inplace:
        check_inplace("allreduce", ctx, t)
    guard = None
    if checking(ctx, g) and g.size > 1:
        sig = validate.signature_row("allreduce", t.dtype, t.shape, OP_ARG[rop], (), g.size, t.device)
        _, guard = validate.check("allreduce", g, sig, ctx.config.timeout, arg_name="op")
    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    buf = contiguous_flat(out)
    size = g.size
    # dtypes gloo lacks are reduced widened to int32: sum and product wrap modulo 2**16 as before
    wire = buf.to(torch.int32) if buf.dtype in GLOO_LACKS and size > 1 else buf

    def issue() -> list[object]:
        if size == 1 or buf.numel() == 0:
            return []
        opts = dist.AllreduceOptions()
        opts.reduceOp = TORCH_OPS[rop]
        return [g.pg.allreduce([wire], opts)]

    def finish() -> torch.Tensor:
        with torch.no_grad():
            if wire is not buf:
                buf.copy_(wire)
            if rop == "average" and size > 1:
                buf.div_(size)
            if buf.data_ptr() != out.data_ptr() or not out.is_contiguous():
                out.copy_(buf.view(out.shape))
        return out

    nb = ring_bytes(nbytes(t), size)
    return make_handle(ctx, g, "allreduce", name, issue, finish, nb, nb, guard, t.device)


def allreduce(
    tensor: torch.Tensor,
    op: str = "average",
    *,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Blocking allreduce; see :func:`iallreduce`."""
    return iallreduce(tensor, op, inplace=inplace, name=name, group=group).wait()


@one_issuer("reduce_scatter")
def ireduce_scatter(
    tensor: torch.Tensor, op: str = "average", *, name: str | None = None, group: Group | None = None
) -> Handle[torch.Tensor]:
    """Nonblocking reduce-scatter along dimension 0: rank ``r`` gets the reduction of block ``r`` of
    every rank's tensor (the first dimension must be divisible by the group size)."""
    ctx, g = resolve("reduce_scatter", group)
    t = checked_tensor("reduce_scatter", ctx, tensor, g=g)
    name = check_name("reduce_scatter", ctx, name)
    rop = validate.check_reduce_op("reduce_scatter", ctx.rank, op, t.dtype)
    p = g.size
    if t.dim() == 0 or t.shape[0] % p:
        raise InvalidArgumentError(
            f"lowband.reduce_scatter on rank {ctx.rank}: tensor of shape {tuple(t.shape)} needs a first dimension "
            f"divisible by the group size {p}"
        )
    guard = None
    if checking(ctx, g) and p > 1:
        sig = validate.signature_row("reduce_scatter", t.dtype, t.shape, OP_ARG[rop], (), p, t.device)
        _, guard = validate.check("reduce_scatter", g, sig, ctx.config.timeout, arg_name="op")
    out = torch.empty((t.shape[0] // p, *t.shape[1:]), dtype=t.dtype, device=t.device)
    src = contiguous_flat(t)
    dst = contiguous_flat(out)
    # dtypes gloo (and NCCL) lack are reduced widened to int32, as allreduce does
    wide = t.dtype in GLOO_LACKS and p > 1
    wsrc = src.to(torch.int32) if wide else src
    wdst = torch.empty(dst.shape, dtype=torch.int32, device=dst.device) if wide else dst

    def issue() -> list[object]:
        if p == 1:
            dst.copy_(src)
            return []
        if src.numel() == 0:
            return []
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = TORCH_OPS[rop]
        return [g.pg._reduce_scatter_base(wdst, wsrc, opts)]

    def finish() -> torch.Tensor:
        if wdst is not dst:
            dst.copy_(wdst)
        if rop == "average" and p > 1:
            out.div_(p)
        return out

    nb = (p - 1) * nbytes(t) // p
    return make_handle(ctx, g, "reduce_scatter", name, issue, finish, nb, nb, guard, t.device)


def reduce_scatter(
    tensor: torch.Tensor, op: str = "average", *, name: str | None = None, group: Group | None = None
) -> torch.Tensor:
    """Blocking reduce-scatter; see :func:`ireduce_scatter`."""
    return ireduce_scatter(tensor, op, name=name, group=group).wait()
