"""Collective operations: allreduce, broadcast, allgather (uneven), alltoall (uneven), reduce_scatter,
barrier. Each has a blocking form and a nonblocking ``i``-form returning a :class:`Handle`.

Every op takes an explicit ``group`` (default: the world) and an optional ``name`` (shown in traces).
Ranks given to an op (``root``) are ranks within the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lowband.comm import validate
from lowband.comm.base import (
    check_name,
    checked_tensor,
    checking,
    contiguous_flat,
    make_handle,
    nbytes,
    resolve,
)
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group

_TORCH_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "average": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide once the data is there
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}
_OP_ARG = {name: i for i, name in enumerate(validate.REDUCE_OPS)}


def _ring_bytes(total: int, p: int) -> int:
    return 2 * (p - 1) * total // p if p > 1 else 0


# ---------------------------------------------------------------- allreduce


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
    t = checked_tensor("allreduce", ctx, tensor)
    name = check_name("allreduce", ctx, name)
    rop = validate.check_reduce_op("allreduce", ctx.rank, op, t.dtype)
    if checking(ctx, g) and g.size > 1:
        sig = validate.signature("allreduce", t.dtype, t.shape, _OP_ARG[rop], (), g.size)
        validate.check_rows("allreduce", g, validate.exchange(g, sig, ctx.config.timeout), arg_name="op")
    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    buf = contiguous_flat(out)
    size = g.size

    def issue() -> list[object]:
        if size == 1 or buf.numel() == 0:
            return []
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OPS[rop]
        return [g.pg.allreduce([buf], opts)]

    def finish() -> torch.Tensor:
        if rop == "average" and size > 1:
            buf.div_(size)
        if buf.data_ptr() != out.data_ptr() or not out.is_contiguous():
            out.copy_(buf.view(out.shape))
        return out

    nb = _ring_bytes(nbytes(t), size)
    return make_handle(ctx, g, "allreduce", name, issue, finish, nb, nb)


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


# ---------------------------------------------------------------- broadcast


def ibroadcast(
    tensor: torch.Tensor,
    root: int = 0,
    *,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking broadcast of the root's ``tensor`` (root is a rank of ``group``)."""
    ctx, g = resolve("broadcast", group)
    t = checked_tensor("broadcast", ctx, tensor)
    name = check_name("broadcast", ctx, name)
    root = g.check_rank("broadcast", "root", root)
    if checking(ctx, g) and g.size > 1:
        sig = validate.signature("broadcast", t.dtype, t.shape, root, (), g.size)
        validate.check_rows("broadcast", g, validate.exchange(g, sig, ctx.config.timeout), arg_name="root")
    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    buf = contiguous_flat(out)

    def issue() -> list[object]:
        if g.size == 1 or buf.numel() == 0:
            return []
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return [g.pg.broadcast([buf], opts)]

    def finish() -> torch.Tensor:
        if buf.data_ptr() != out.data_ptr() or not out.is_contiguous():
            out.copy_(buf.view(out.shape))
        return out

    m = nbytes(t)
    sent = m * (g.size - 1) if g.rank == root else 0
    recv = 0 if g.rank == root else m
    return make_handle(ctx, g, "broadcast", name, issue, finish, sent, recv)


def broadcast(
    tensor: torch.Tensor,
    root: int = 0,
    *,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Blocking broadcast; see :func:`ibroadcast`."""
    return ibroadcast(tensor, root, inplace=inplace, name=name, group=group).wait()


# ---------------------------------------------------------------- allgather


def iallgather(
    tensor: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking allgather along dimension 0; first dimensions may differ across ranks.

    ``wait()`` returns the ranks' tensors concatenated in rank order (0-d tensors are gathered into a
    1-D tensor of length ``group.size``). If every rank already knows every rank's first dimension,
    pass them as ``sizes`` to skip the size exchange (with check=False the op is then one collective).
    """
    ctx, g = resolve("allgather", group)
    t = checked_tensor("allgather", ctx, tensor)
    name = check_name("allgather", ctx, name)
    src = t.reshape(1) if t.dim() == 0 else t
    rest = tuple(src.shape[1:])
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != g.size or any(s < 0 for s in sizes) or sizes[g.rank] != src.shape[0]:
            raise InvalidArgumentError(
                f"lowband.allgather on rank {ctx.rank}: sizes={sizes} must hold {g.size} non-negative first "
                f"dimensions, this rank's being {src.shape[0]}"
            )
    if g.size > 1 and (sizes is None or checking(ctx, g)):
        sig = validate.signature("allgather", t.dtype, src.shape, int(t.dim() == 0), (), g.size)
        table = validate.exchange(g, sig, ctx.config.timeout)
        validate.check_rows("allgather", g, table, vary_dim0=True, arg_name="0-d-ness")
        gathered = [int(x) for x in table[:, validate.F_DIM0].tolist()]
        if sizes is not None and gathered != sizes:
            raise InvalidArgumentError(
                f"lowband.allgather on rank {ctx.rank}: sizes={sizes} but the ranks passed first dimensions {gathered}"
            )
        sizes = gathered
    if sizes is None:
        sizes = [src.shape[0]]
    p = g.size
    mx = max(sizes)
    total = sum(sizes)
    out = torch.empty((total, *rest), dtype=t.dtype, device=t.device)
    row = int(torch.Size(rest).numel())
    even = all(s == mx for s in sizes)
    send = contiguous_flat(src)
    if not even:
        padded = torch.zeros(mx * row, dtype=t.dtype, device=t.device)
        padded[: send.numel()] = send
        send = padded
    recv = contiguous_flat(out) if even else torch.empty(p * mx * row, dtype=t.dtype, device=t.device)

    def issue() -> list[object]:
        if p == 1:
            recv.copy_(send)
            return []
        if mx * row == 0:
            return []
        return [g.pg._allgather_base(recv, send)]

    def finish() -> torch.Tensor:
        if not even:
            flat = contiguous_flat(out)
            pos = 0
            for r, s in enumerate(sizes):
                n = s * row
                flat[pos : pos + n] = recv[r * mx * row : r * mx * row + n]
                pos += n
        return out

    es = t.element_size()
    return make_handle(
        ctx, g, "allgather", name, issue, finish, mx * row * es * (p - 1), (p - 1) * mx * row * es
    )


def allgather(
    tensor: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Blocking allgather; see :func:`iallgather`."""
    return iallgather(tensor, sizes=sizes, name=name, group=group).wait()


# ---------------------------------------------------------------- alltoall


def _check_splits(
    op: str, rank: int, what: str, splits: Sequence[int], p: int, total: int | None
) -> list[int]:
    s = [int(x) for x in splits]
    if len(s) != p or any(x < 0 for x in s) or (total is not None and sum(s) != total):
        need = f" summing to {total}" if total is not None else ""
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what}={s} must be {p} non-negative ints{need}"
        )
    return s


def ialltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | None = None,
    *,
    recv_splits: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[tuple[torch.Tensor, list[int]]]:
    """Nonblocking all-to-all along dimension 0: rows ``splits[j]`` go to rank ``j``.

    ``splits`` defaults to equal parts. ``wait()`` returns ``(output, recv_splits)``: the rows received,
    in source-rank order, and how many came from each rank. Pass ``recv_splits`` if known to skip the
    split exchange (when check=False).
    """
    ctx, g = resolve("alltoall", group)
    t = checked_tensor("alltoall", ctx, tensor)
    name = check_name("alltoall", ctx, name)
    p = g.size
    if t.dim() == 0:
        raise InvalidArgumentError(
            f"lowband.alltoall on rank {ctx.rank}: tensor must have at least one dimension"
        )
    n0 = t.shape[0]
    if splits is None:
        if n0 % p:
            raise InvalidArgumentError(
                f"lowband.alltoall on rank {ctx.rank}: first dimension {n0} is not divisible by the group size {p}; pass splits"
            )
        send_splits = [n0 // p] * p
    else:
        send_splits = _check_splits("alltoall", ctx.rank, "splits", splits, p, n0)
    rsplits = (
        None
        if recv_splits is None
        else _check_splits("alltoall", ctx.rank, "recv_splits", recv_splits, p, None)
    )
    if p > 1 and (rsplits is None or checking(ctx, g)):
        sig = validate.signature("alltoall", t.dtype, t.shape, 0, send_splits, p)
        table = validate.exchange(g, sig, ctx.config.timeout)
        validate.check_rows("alltoall", g, table, vary_dim0=True)
        got = [int(x) for x in table[:, validate.HEADER + g.rank].tolist()]
        if rsplits is not None and got != rsplits:
            raise InvalidArgumentError(
                f"lowband.alltoall on rank {ctx.rank}: recv_splits={rsplits} but the ranks send {got}"
            )
        rsplits = got
    if rsplits is None:
        rsplits = list(send_splits)
    rest = tuple(t.shape[1:])
    out = torch.empty((sum(rsplits), *rest), dtype=t.dtype, device=t.device)
    src = t if t.is_contiguous() else t.contiguous()
    final = list(rsplits)

    def issue() -> list[object]:
        if p == 1:
            out.copy_(src)
            return []
        if src.numel() == 0 and out.numel() == 0:
            return []
        return [g.pg.alltoall_base(out, src, final, send_splits, dist.AllToAllOptions())]

    row = int(torch.Size(rest).numel()) * t.element_size()
    me = g.rank
    sent = (sum(send_splits) - send_splits[me]) * row
    recv = (sum(rsplits) - rsplits[me]) * row
    return make_handle(ctx, g, "alltoall", name, issue, lambda: (out, final), sent, recv)


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | None = None,
    *,
    recv_splits: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Blocking all-to-all; see :func:`ialltoall`."""
    return ialltoall(tensor, splits, recv_splits=recv_splits, name=name, group=group).wait()


# ---------------------------------------------------------------- reduce_scatter


def ireduce_scatter(
    tensor: torch.Tensor, op: str = "average", *, name: str | None = None, group: Group | None = None
) -> Handle[torch.Tensor]:
    """Nonblocking reduce-scatter along dimension 0: rank ``r`` gets the reduction of block ``r`` of
    every rank's tensor (the first dimension must be divisible by the group size)."""
    ctx, g = resolve("reduce_scatter", group)
    t = checked_tensor("reduce_scatter", ctx, tensor)
    name = check_name("reduce_scatter", ctx, name)
    rop = validate.check_reduce_op("reduce_scatter", ctx.rank, op, t.dtype)
    p = g.size
    if t.dim() == 0 or t.shape[0] % p:
        raise InvalidArgumentError(
            f"lowband.reduce_scatter on rank {ctx.rank}: tensor of shape {tuple(t.shape)} needs a first dimension "
            f"divisible by the group size {p}"
        )
    if checking(ctx, g) and p > 1:
        sig = validate.signature("reduce_scatter", t.dtype, t.shape, _OP_ARG[rop], (), p)
        validate.check_rows("reduce_scatter", g, validate.exchange(g, sig, ctx.config.timeout), arg_name="op")
    out = torch.empty((t.shape[0] // p, *t.shape[1:]), dtype=t.dtype, device=t.device)
    src = contiguous_flat(t)
    dst = contiguous_flat(out)

    def issue() -> list[object]:
        if p == 1:
            dst.copy_(src)
            return []
        if src.numel() == 0:
            return []
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[rop]
        return [g.pg._reduce_scatter_base(dst, src, opts)]

    def finish() -> torch.Tensor:
        if rop == "average" and p > 1:
            out.div_(p)
        return out

    nb = (p - 1) * nbytes(t) // p
    return make_handle(ctx, g, "reduce_scatter", name, issue, finish, nb, nb)


def reduce_scatter(
    tensor: torch.Tensor, op: str = "average", *, name: str | None = None, group: Group | None = None
) -> torch.Tensor:
    """Blocking reduce-scatter; see :func:`ireduce_scatter`."""
    return ireduce_scatter(tensor, op, name=name, group=group).wait()


# ---------------------------------------------------------------- barrier


def ibarrier(*, name: str | None = None, group: Group | None = None) -> Handle[None]:
    """Nonblocking barrier."""
    ctx, g = resolve("barrier", group)
    name = check_name("barrier", ctx, name)

    def issue() -> list[object]:
        return [] if g.size == 1 else [g.pg.barrier(dist.BarrierOptions())]

    return make_handle(ctx, g, "barrier", name, issue, lambda: None)


def barrier(*, name: str | None = None, group: Group | None = None) -> None:
    """Blocking barrier (bounded by the runtime's timeout)."""
    ibarrier(name=name, group=group).wait()
