"""Collective operations: allreduce, broadcast, allgather (uneven), alltoall (uneven), reduce_scatter,
barrier. Each has a blocking form and a nonblocking ``i``-form returning a :class:`Handle`.

Every op takes an explicit ``group`` (default: the world) and an optional ``name`` (shown in traces).
Ranks given to an op (``root``) are ranks within the group. Reductions live in
:mod:`lowband.comm.reduce`, the ops of uneven sizes in :mod:`lowband.comm.gather`; broadcast and
barrier here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowband.comm import validate
from lowband.comm.base import (
    byte_wire,
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
from lowband.comm.gather import allgather, alltoall, iallgather, ialltoall
from lowband.comm.handle import Handle
from lowband.comm.reduce import allreduce, iallreduce, ireduce_scatter, reduce_scatter
from lowband.group import Group

__all__ = [
    "allgather", "allreduce", "alltoall", "barrier", "broadcast", "iallgather", "iallreduce",
    "ialltoall", "ibarrier", "ibroadcast", "ireduce_scatter", "reduce_scatter",
]  # fmt: skip


# ---------------------------------------------------------------- broadcast


@one_issuer("broadcast")
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
    t = checked_tensor("broadcast", ctx, tensor, g=g)
    name = check_name("broadcast", ctx, name)
    root = g.check_rank("broadcast", "root", root)
    if inplace:
        check_inplace("broadcast", ctx, t)
    guard = None
    if checking(ctx, g) and g.size > 1:
        sig = validate.signature_row("broadcast", t.dtype, t.shape, root, (), g.size, t.device)
        _, guard = validate.check("broadcast", g, sig, ctx.config.timeout, arg_name="root")
    out = t if inplace else t.clone(memory_format=torch.contiguous_format)
    buf = contiguous_flat(out)

    def issue() -> list[object]:
        if g.size == 1 or buf.numel() == 0:
            return []
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return [g.pg.broadcast([byte_wire(buf)], opts)]

    def finish() -> torch.Tensor:
        if buf.data_ptr() != out.data_ptr() or not out.is_contiguous():
            with torch.no_grad():
                out.copy_(buf.view(out.shape))
        return out

    m = nbytes(t)
    sent = m * (g.size - 1) if g.rank == root else 0
    recv = 0 if g.rank == root else m
    return make_handle(ctx, g, "broadcast", name, issue, finish, sent, recv, guard, t.device)


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


# ---------------------------------------------------------------- barrier


@one_issuer("barrier")
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
