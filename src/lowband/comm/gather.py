"""Collectives of uneven sizes: allgather (first dimensions may differ) and all-to-all (uneven
splits), each with a blocking form and a nonblocking ``i``-form returning a :class:`Handle`.

When the caller passes every rank's sizes (``sizes``, ``recv_splits``) the op needs no size exchange;
otherwise it waits for the other ranks' signatures, which also checks them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowband.comm import validate
from lowband.comm.base import (
    GLOO_LACKS,
    byte_wire,
    check_name,
    checked_tensor,
    checking,
    contiguous_flat,
    make_handle,
    one_issuer,
    resolve,
)
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group


@one_issuer("allgather")
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
    t = checked_tensor("allgather", ctx, tensor, g=g)
    name = check_name("allgather", ctx, name)
    src = t.reshape(1) if t.dim() == 0 else t
    rest = tuple(src.shape[1:])
    if sizes is not None:
        sizes = validate.ints_arg("allgather", ctx.rank, "sizes", sizes)
        if len(sizes) != g.size or any(s < 0 for s in sizes) or sizes[g.rank] != src.shape[0]:
            raise InvalidArgumentError(
                f"lowband.allgather on rank {ctx.rank}: sizes={sizes} must hold {g.size} non-negative first "
                f"dimensions, this rank's being {src.shape[0]}"
            )
    guard = None
    if g.size > 1 and (sizes is None or checking(ctx, g)):
        sig = validate.signature_row("allgather", t.dtype, src.shape, int(t.dim() == 0), (), g.size, t.device)
        given = sizes
        table, guard = validate.check(
            "allgather",
            g,
            sig,
            ctx.config.timeout,
            vary_dim0=True,
            arg_name="0-d-ness",
            needs_table=given is None,
            fits=lambda rows: [r[validate.F_DIM0] for r in rows] == given,
        )
        gathered = [int(r[validate.F_DIM0]) for r in table]
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
        return [g.pg._allgather_base(byte_wire(recv), byte_wire(send))]

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
    nb = mx * row * es * (p - 1)
    return make_handle(ctx, g, "allgather", name, issue, finish, nb, nb, guard, t.device)


def allgather(
    tensor: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> torch.Tensor:
    """Blocking allgather; see :func:`iallgather`."""
    return iallgather(tensor, sizes=sizes, name=name, group=group).wait()


@one_issuer("alltoall")
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
    t = checked_tensor("alltoall", ctx, tensor, g=g)
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
        send_splits = validate.check_splits("alltoall", ctx.rank, "splits", splits, p, n0)
    rsplits = (
        None
        if recv_splits is None
        else validate.check_splits("alltoall", ctx.rank, "recv_splits", recv_splits, p, None)
    )
    guard = None
    if p > 1 and (rsplits is None or checking(ctx, g)):
        sig = validate.signature_row("alltoall", t.dtype, t.shape, 0, send_splits, p, t.device)
        col = validate.HEADER + g.rank
        given = rsplits
        table, guard = validate.check(
            "alltoall",
            g,
            sig,
            ctx.config.timeout,
            vary_dim0=True,
            needs_table=given is None,
            fits=lambda rows: [r[col] for r in rows] == given,
        )
        got = [int(r[col]) for r in table]
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
        o, i = out, src
        if t.dtype in GLOO_LACKS:  # rows as bytes (gloo and NCCL lack the dtype): dim 0 and splits unchanged
            o, i = out.reshape(out.shape[0], -1).view(torch.uint8), src.reshape(n0, -1).view(torch.uint8)
        return [g.pg.alltoall_base(o, i, final, send_splits, dist.AllToAllOptions())]

    row = int(torch.Size(rest).numel()) * t.element_size()
    me = g.rank
    sent = (sum(send_splits) - send_splits[me]) * row
    recv = (sum(rsplits) - rsplits[me]) * row
    return make_handle(ctx, g, "alltoall", name, issue, lambda: (out, final), sent, recv, guard, t.device)


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
