"""Point-to-point send and receive.

With checking on (the default), a send is preceded by a small header (dtype and shape) that the
receiver compares with its buffer before the data is received, so a mismatch raises
:class:`CollectiveMismatchError` naming both ranks instead of aborting the process inside gloo.
``irecv`` posts the header receive at once and the data receive when the handle is waited on (or
``then``-chained), after the header matched; so with checking on, a receive's data moves at ``wait()``.
With ``check=False`` both sides are one nonblocking torch op each.

``tag`` values must be in ``[0, 2**30)``; lowband uses ``2*tag`` for data and ``2*tag+1`` for headers.
"""

from __future__ import annotations

import datetime

import torch

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
from lowband.comm.handle import Handle, comm_error
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group

_MAX_TAG = 2**30


def _check_tag(op: str, rank: int, tag: object) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < _MAX_TAG:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: tag must be an int in [0, 2**30), got {tag!r}"
        )
    return tag


def _header(t: torch.Tensor) -> torch.Tensor:
    return validate.signature("send", t.dtype, t.shape, 0, (), 1)


def isend(
    tensor: torch.Tensor, dst: int, *, tag: int = 0, name: str | None = None, group: Group | None = None
) -> Handle[None]:
    """Nonblocking send of ``tensor`` to rank ``dst`` of ``group``. Do not modify ``tensor`` until waited."""
    ctx, g = resolve("send", group)
    t = checked_tensor("send", ctx, tensor)
    name = check_name("send", ctx, name)
    dst = g.check_rank("send", "dst", dst)
    tag = _check_tag("send", ctx.rank, tag)
    if dst == g.rank:
        raise InvalidArgumentError(f"lowband.send on rank {ctx.rank}: cannot send to itself (dst={dst})")
    buf = contiguous_flat(t)
    check = checking(ctx, g)

    def issue() -> list[object]:
        works = []
        if check:
            works.append(g.pg.send([_header(t)], dst, 2 * tag + 1))
        if buf.numel():
            works.append(g.pg.send([buf], dst, 2 * tag))
        return works

    return make_handle(ctx, g, "send", name, issue, lambda: None, nbytes(t), 0)


def send(
    tensor: torch.Tensor, dst: int, *, tag: int = 0, name: str | None = None, group: Group | None = None
) -> None:
    """Blocking send; see :func:`isend`."""
    isend(tensor, dst, tag=tag, name=name, group=group).wait()


def irecv(
    tensor: torch.Tensor, src: int, *, tag: int = 0, name: str | None = None, group: Group | None = None
) -> Handle[torch.Tensor]:
    """Nonblocking receive from rank ``src`` into ``tensor`` (in place); ``wait()`` returns ``tensor``."""
    ctx, g = resolve("recv", group)
    t = checked_tensor("recv", ctx, tensor)
    name = check_name("recv", ctx, name)
    src = g.check_rank("recv", "src", src)
    tag = _check_tag("recv", ctx.rank, tag)
    if src == g.rank:
        raise InvalidArgumentError(f"lowband.recv on rank {ctx.rank}: cannot receive from itself (src={src})")
    buf = contiguous_flat(t)
    check = checking(ctx, g)
    head = torch.empty(validate.HEADER + 1, dtype=torch.int64)
    timeout = ctx.config.timeout

    def issue() -> list[object]:
        if check:
            # Only the header is posted now: the data receive is posted once the header matches, so
            # a mismatched send raises here instead of aborting the process inside gloo.
            return [g.pg.recv([head], src, 2 * tag + 1)]
        return [g.pg.recv([buf], src, 2 * tag)] if buf.numel() else []

    def finish() -> torch.Tensor:
        if check:
            mine = _header(t)
            if not torch.equal(head, mine):
                raise CollectiveMismatchError(
                    f"lowband.recv on rank {ctx.rank}: rank {g.ranks[src]} sent {validate.describe(head.tolist())[8:]} "
                    f"(tag {tag}) but this rank posted a receive for {validate.describe(mine.tolist())[8:]}"
                )
            if buf.numel():
                try:
                    g.pg.recv([buf], src, 2 * tag).wait(datetime.timedelta(seconds=timeout))
                except RuntimeError as exc:
                    raise comm_error(
                        f"lowband.recv on rank {ctx.rank} (from rank {g.ranks[src]}, tag {tag})", exc, timeout
                    ) from exc
        if buf.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(buf.view(t.shape))
        return t

    return make_handle(ctx, g, "recv", name, issue, finish, 0, nbytes(t))


def recv(
    tensor: torch.Tensor, src: int, *, tag: int = 0, name: str | None = None, group: Group | None = None
) -> torch.Tensor:
    """Blocking receive; see :func:`irecv`."""
    return irecv(tensor, src, tag=tag, name=name, group=group).wait()
