"""Point-to-point send and receive.

With checking on (the default), a send is preceded by a small header (dtype and full shape) that the
receiver compares with its buffer before the data is received, and the receiver answers it: an
acknowledgement on the group's control process group. On a match the data follows; on a mismatch the
receiver drains the data (so the pair's stream stays in step and both ranks can go on) and both sides
raise :class:`CollectiveMismatchError` showing both dtypes and shapes: the receiver at once, the sender
as soon as the answer arrives, instead of waiting its full timeout for a receive that never comes.
``irecv`` posts the header receive at once and the data receive when the handle is waited on (or
``then``-chained), after the header matched; so with checking on, a receive's data moves at ``wait()``.
With ``check=False`` both sides are one nonblocking torch op each.

The header and its answer travel on the group's control process group (CPU gloo), so the data group
carries only the data: under NCCL (which ignores tags and matches a pair's messages by order) the data
group sees one message per send. A GPU tensor on a gloo data group is staged through host memory.

``tag`` values must be in ``[0, 2**30)``; lowband uses ``2*tag`` for data, and on the control group
``2*tag+1`` for headers and ``2*tag`` for answers.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import torch

from lowband.comm import contract, validate
from lowband.comm.base import (
    byte_wire,
    check_name,
    checked_tensor,
    checking,
    contiguous_flat,
    make_handle,
    nbytes,
    resolve,
)
from lowband.comm.contract import host_staged
from lowband.comm.handle import Handle, comm_error
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group

_MAX_TAG = 2**30
_MAGIC = 0x5E4D
_DIMS = 8
#: magic, dtype code, ndim, numel, crc of the full shape, then the first ``_DIMS`` dims (-1 padded)
_HEAD = 5 + _DIMS
_OK, _MISMATCH = 0, 1


def _check_tag(op: str, rank: int, tag: object) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < _MAX_TAG:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: tag must be an int in [0, 2**30), got {tag!r}"
        )
    return tag


def _header(t: torch.Tensor) -> torch.Tensor:
    dims = list(t.shape)
    crc = zlib.crc32(repr(tuple(dims)).encode()) & 0x7FFFFFFF
    head = [_MAGIC, validate.DTYPE_CODES[t.dtype], len(dims), t.numel(), crc]
    head += [dims[i] if i < len(dims) else -1 for i in range(_DIMS)]
    return torch.tensor(head, dtype=torch.int64, device="cpu")


def _describe(head: list[int]) -> str:
    if len(head) != _HEAD or head[0] != _MAGIC:
        return "a message that is not a lowband send header (is the other rank running with check off?)"
    nd = head[2]
    dims = [str(d) for d in head[5 : 5 + min(nd, _DIMS)]] + (["..."] if nd > _DIMS else [])
    shape = "(" + ", ".join(dims) + ("," if nd == 1 else "") + ")"
    dt = str(validate.CODE_DTYPES.get(head[1], "?")).replace("torch.", "")
    return f"a {dt} tensor of shape {shape}"


class _AnsweredSend:
    """The torch works of a checked send, waited as one: the header, the receiver's answer, then the
    data. A refusal raises as soon as the answer arrives (the data, drained by the receiver, completes
    on its own)."""

    def __init__(
        self, header: Any, answer: Any, reply: torch.Tensor, data: Any, where: str, sent: str
    ) -> None:
        self.parts = [w for w in (header, answer, data) if w is not None]
        self.answer, self.reply, self.data = answer, reply, data
        self.where, self.sent = where, sent

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self.parts:
            w.wait() if timeout is None else w.wait(timeout)
            if w is self.answer and int(self.reply[0]) != _OK:
                raise CollectiveMismatchError(
                    f"{self.where}: the receiver posted a receive for {_describe(self.reply[1:].tolist())} "
                    f"but this rank sent {self.sent}"
                )
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.parts)

    def get_future(self) -> Any:
        raise RuntimeError("Work::getFuture not implemented")  # waited by Handle's watcher instead


def _wire(flat: torch.Tensor, g: Group, *, send: bool) -> torch.Tensor:
    """What goes on the data group for ``flat``: itself, or a host copy of a GPU tensor where gloo
    serves the group (gloo's send/recv move host buffers only); a receive's host copy is copied back
    into the caller's tensor when the handle completes."""
    if flat.device.type != "cuda" or not host_staged(g.pg):
        return flat
    return flat.to("cpu") if send else torch.empty_like(flat, device="cpu")


def isend(
    tensor: torch.Tensor, dst: int, *, tag: int = 0, name: str | None = None, group: Group | None = None
) -> Handle[None]:
    """Nonblocking send of ``tensor`` to rank ``dst`` of ``group``. Do not modify ``tensor`` until waited."""
    ctx, g = resolve("send", group)
    t = checked_tensor("send", ctx, tensor, g=g)
    name = check_name("send", ctx, name)
    dst = g.check_rank("send", "dst", dst)
    tag = _check_tag("send", ctx.rank, tag)
    if dst == g.rank:
        raise InvalidArgumentError(f"lowband.send on rank {ctx.rank}: cannot send to itself (dst={dst})")
    buf = _wire(contiguous_flat(t), g, send=True)
    check = checking(ctx, g)
    where = f"lowband.send on rank {ctx.rank} (to rank {g.ranks[dst]}, tag {tag})"

    def issue() -> list[object]:
        if not check:
            return (
                contract.polled([g.pg.send([byte_wire(buf)], dst, 2 * tag)], g.pg, buf.device)
                if buf.numel()
                else []
            )
        head = _header(t)
        if g.ctl is None:  # no control process group: no answer (a mismatch times out here)
            works = [g.pg.send([head], dst, 2 * tag + 1)]
            sends = [g.pg.send([byte_wire(buf)], dst, 2 * tag)] if buf.numel() else []
            return works + contract.polled(sends, g.pg, buf.device)
        # the header (tag 2*tag+1) and its answer (tag 2*tag, the other way) go on the control group:
        # the data group carries only data
        reply = torch.empty(1 + _HEAD, dtype=torch.int64, device="cpu")
        answer = g.ctl.recv([reply], dst, 2 * tag)
        header = g.ctl.send([head], dst, 2 * tag + 1)
        data: Any = None
        if buf.numel():
            data = contract.polled([g.pg.send([byte_wire(buf)], dst, 2 * tag)], g.pg, buf.device)[0]
        return [_AnsweredSend(header, answer, reply, data, where, _describe(head.tolist()))]

    return make_handle(ctx, g, "send", name, issue, lambda: None, nbytes(t), 0, polled=False)


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
    t = checked_tensor("recv", ctx, tensor, g=g)
    name = check_name("recv", ctx, name)
    src = g.check_rank("recv", "src", src)
    tag = _check_tag("recv", ctx.rank, tag)
    if src == g.rank:
        raise InvalidArgumentError(f"lowband.recv on rank {ctx.rank}: cannot receive from itself (src={src})")
    buf = _wire(contiguous_flat(t), g, send=False)
    check = checking(ctx, g)
    head = torch.empty(_HEAD, dtype=torch.int64, device="cpu")
    timeout = ctx.config.timeout
    td = datetime.timedelta(seconds=timeout)
    where = f"lowband.recv on rank {ctx.rank} (from rank {g.ranks[src]}, tag {tag})"

    def issue() -> list[object]:
        if check:
            # Only the header is posted now: the data receive is posted once the header matches, so
            # a mismatched send raises here instead of aborting the process inside gloo.
            return [(g.pg if g.ctl is None else g.ctl).recv([head], src, 2 * tag + 1)]
        return (
            contract.polled([g.pg.recv([byte_wire(buf)], src, 2 * tag)], g.pg, buf.device)
            if buf.numel()
            else []
        )

    def answer(status: int, mine: torch.Tensor) -> Any:
        if g.ctl is None:
            return None
        return g.ctl.send([torch.cat([torch.tensor([status], device="cpu"), mine])], src, 2 * tag)

    def finish() -> torch.Tensor:
        if check:
            mine = _header(t)
            if not torch.equal(head, mine):
                _refuse(mine)
            try:
                sent = answer(_OK, mine)
                if buf.numel():
                    contract.polled([g.pg.recv([byte_wire(buf)], src, 2 * tag)], g.pg, buf.device)[0].wait(td)
                if sent is not None:
                    sent.wait(td)
            except RuntimeError as exc:
                raise comm_error(where, exc, timeout) from exc
        if buf.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(buf.view(t.shape))
        return t

    def _refuse(mine: torch.Tensor) -> None:
        theirs = head.tolist()
        error = CollectiveMismatchError(
            f"lowband.recv on rank {ctx.rank}: rank {g.ranks[src]} sent {_describe(theirs)} (tag {tag}) "
            f"but this rank posted a receive for {_describe(mine.tolist())}"
        )
        dtype = validate.CODE_DTYPES.get(theirs[1]) if theirs[0] == _MAGIC else None
        try:
            sent = answer(_MISMATCH, mine)
            if dtype is not None and theirs[3] > 0:  # drain the data the sender has posted
                drain = torch.empty(theirs[3], dtype=dtype, device=buf.device)
                contract.polled([g.pg.recv([byte_wire(drain)], src, 2 * tag)], g.pg, buf.device)[0].wait(td)
            if sent is not None:
                sent.wait(td)
        except RuntimeError:
            pass  # the mismatch is the error to report
        raise error

    return make_handle(ctx, g, "recv", name, issue, finish, 0, nbytes(t), polled=False)


def recv(
    tensor: torch.Tensor, src: int, *, tag: int = 0, name: str | None = None, group: Group | None = None
) -> torch.Tensor:
    """Blocking receive; see :func:`irecv`."""
    return irecv(tensor, src, tag=tag, name=name, group=group).wait()
