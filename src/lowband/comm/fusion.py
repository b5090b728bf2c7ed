"""Tensor fusion: many tensors reduced through a few flat buffers instead of one op each.

Tensors are packed in order, by dtype and device, into buffers of at most ``fusion_threshold`` bytes
(a tensor larger than the threshold travels alone, without a copy). Each buffer is one allreduce; the
handle's ``wait()`` unpacks the results. The element-wise result is the one the unfused ops would
produce: sums of the same operands. (With floats on 3 or more ranks gloo's reduction order depends on
an element's offset in the buffer, so float results agree to rounding; integer-valued data is exact.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowband.comm import validate
from lowband.comm.base import (
    check_inplace,
    check_name,
    checked_tensor,
    checking,
    make_handle,
    nbytes,
    one_issuer,
    resolve,
)
from lowband.comm.handle import Handle
from lowband.comm.reduce import OP_ARG, TORCH_OPS, ring_bytes
from lowband.errors import InvalidArgumentError
from lowband.group import Group


def plan_buckets(tensors: Sequence[torch.Tensor], threshold: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into fusion buckets (pure; same plan on every rank)."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nb = nbytes(t)
        if threshold == 0 or nb >= threshold:
            buckets.append([i])
            continue
        cur = open_.get(key)
        if cur is not None and cur[1] + nb <= threshold:
            cur[0].append(i)
            open_[key] = (cur[0], cur[1] + nb)
        else:
            b = [i]
            buckets.append(b)
            open_[key] = (b, nb)
    return buckets


@one_issuer("grouped_allreduce")
def igrouped_allreduce(
    tensors: Sequence[torch.Tensor],
    op: str = "average",
    *,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
    fusion_threshold: int | None = None,
) -> Handle[list[torch.Tensor]]:
    """Nonblocking allreduce of many tensors with tensor fusion; ``wait()`` returns the list of results."""
    ctx, g = resolve("grouped_allreduce", group)
    name = check_name("grouped_allreduce", ctx, name)
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise InvalidArgumentError(
            f"lowband.grouped_allreduce on rank {ctx.rank}: tensors must be a list of tensors, got {type(tensors).__name__}"
        )
    ts = [checked_tensor("grouped_allreduce", ctx, t, f"tensors[{i}]", g=g) for i, t in enumerate(tensors)]
    devs = sorted({str(t.device) for t in ts})
    if len(devs) > 1:
        raise InvalidArgumentError(
            f"lowband.grouped_allreduce on rank {ctx.rank}: tensors are on several devices {devs}; "
            "fusion needs them on one"
        )
    validate.check_reduce_op("grouped_allreduce", ctx.rank, op, torch.float32)  # the op name, even for []
    for t in ts:
        validate.check_reduce_op("grouped_allreduce", ctx.rank, op, t.dtype)
    threshold = ctx.config.fusion_threshold if fusion_threshold is None else fusion_threshold
    if threshold < 0:
        raise InvalidArgumentError(
            f"lowband.grouped_allreduce on rank {ctx.rank}: fusion_threshold must be >= 0"
        )
    p = g.size
    if inplace:
        for t in ts:
            check_inplace("grouped_allreduce", ctx, t)
    guard = None
    if checking(ctx, g) and p > 1:
        # One signature for the whole list: count, and a hash of every dtype and shape.
        desc = [d for t in ts for d in (validate.dtype_code(t.dtype, t.device), t.dim(), *t.shape)]
        sig = validate.signature_row("grouped_allreduce", torch.int64, [len(ts), *desc], OP_ARG[op], (), p)
        _, guard = validate.check("grouped_allreduce", g, sig, ctx.config.timeout, arg_name="op")
    outs = ts if inplace else [t.clone(memory_format=torch.contiguous_format) for t in ts]
    buckets = plan_buckets(outs, threshold)
    buffers: list[torch.Tensor] = []
    for b in buckets:
        if len(b) == 1 and outs[b[0]].is_contiguous():
            buffers.append(outs[b[0]].reshape(-1))
        else:
            buffers.append(torch.cat([outs[i].reshape(-1) for i in b]))

    def issue() -> list[object]:
        if p == 1:
            return []
        opts = dist.AllreduceOptions()
        opts.reduceOp = TORCH_OPS[op]
        return [g.pg.allreduce([buf], opts) for buf in buffers if buf.numel()]

    @torch.no_grad()
    def finish() -> list[torch.Tensor]:
        for b, buf in zip(buckets, buffers):
            if op == "average" and p > 1:
                buf.div_(p)
            if len(b) == 1 and buf.data_ptr() == outs[b[0]].data_ptr():
                continue
            pos = 0
            for i in b:
                n = outs[i].numel()
                outs[i].copy_(buf[pos : pos + n].view(outs[i].shape))
                pos += n
        return list(outs)

    nb = sum(ring_bytes(nbytes(t), p) for t in ts)
    return make_handle(
        ctx, g, "grouped_allreduce", name, issue, finish, nb, nb, guard, ts[0].device if ts else None
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    op: str = "average",
    *,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
    fusion_threshold: int | None = None,
) -> list[torch.Tensor]:
    """Blocking grouped allreduce; see :func:`igrouped_allreduce`."""
    return igrouped_allreduce(
        tensors, op, inplace=inplace, name=name, group=group, fusion_threshold=fusion_threshold
    ).wait()
