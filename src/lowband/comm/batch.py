"""Batched point-to-point: many sends and receives on one group, posted at once, as one traced op.

This is the transport of lowband's own message patterns (the neighbor ops and the one-sided windows of
:mod:`lowband.decentral`). The caller lists the messages in posting order (receives first, then sends:
posting never blocks, so no rank waits for a peer that has not posted yet) and gets one
:class:`~lowband.comm.handle.Handle` whose ``wait()`` waits every message (bounded) and then runs the
op's finishing step. Like every other op, the batch is traced and counted under the op's name (data
bytes; control messages such as headers and status words are moved but not counted, as with
:func:`lowband.send`'s header), and torch's errors when posting or waiting become
:class:`CommTimeoutError` / :class:`CommFailedError` naming the op and the rank.

Tags are the process group's own tags: a batch on a group that also carries :func:`lowband.send` /
:func:`lowband.recv` (which use ``2*tag`` and ``2*tag+1``) must keep to tags those never use, or run on a
group of its own.

:class:`Channel` is the same for threads without a runtime context (the receiver threads of a window
service answer other ranks from threads of their own): it holds the group, the rank, the timeout and the
tracer, captured on the rank's own thread.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from lowband.comm import contract
from lowband.comm.base import GLOO_LACKS, byte_wire, nbytes, resolve
from lowband.comm.contract import host_staged
from lowband.comm.handle import Handle, comm_error
from lowband.comm.trace import Tracer
from lowband.errors import InvalidArgumentError
from lowband.group import Group

T = TypeVar("T")

SEND, RECV = "send", "recv"


class P2POp(NamedTuple):
    """One message of a batch: ``kind`` is ``"send"`` or ``"recv"``, ``peer`` a rank of the group,
    ``tensor`` a contiguous buffer (sent as is, or received into in place)."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int
    #: a control message (a header, a status word): moved, not counted as data bytes
    control: bool = False
    #: a message its peer may refuse (a payload, an answer): checked when the batch is waited, after the
    #: messages listed before it completed; once it returns True the message is no longer waited for
    #: (it stays posted on the process group)
    abandon_if: Callable[[], bool] | None = None


def send_op(
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    *,
    control: bool = False,
    abandon_if: Callable[[], bool] | None = None,
) -> P2POp:
    return P2POp(SEND, tensor, peer, tag, control, abandon_if)


def recv_op(
    tensor: torch.Tensor,
    peer: int,
    tag: int,
    *,
    control: bool = False,
    abandon_if: Callable[[], bool] | None = None,
) -> P2POp:
    return P2POp(RECV, tensor, peer, tag, control, abandon_if)


class _Abandonable:
    """A torch work that counts as complete once ``cond()`` says its peer refused the message."""

    def __init__(self, work: Any, cond: Callable[[], bool]) -> None:
        self.work = work
        self.cond = cond

    def wait(self, timeout: datetime.timedelta) -> bool:
        return True if self.cond() else bool(self.work.wait(timeout))

    def is_completed(self) -> bool:
        return self.cond() or bool(self.work.is_completed())

    def get_future(self) -> Any:
        raise RuntimeError("an abandonable send has no future")


class Channel:
    """Batched point-to-point on ``group`` as world rank ``rank``, bounded by ``timeout`` seconds and
    traced by ``tracer``; usable from any thread (see the module docstring)."""

    __slots__ = ("group", "rank", "timeout", "tracer")

    def __init__(self, group: Group, rank: int, timeout: float, tracer: Tracer) -> None:
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.tracer = tracer

    @staticmethod
    def of(group: Group | None, op: str = "batch_p2p") -> Channel:
        """The calling rank's channel on ``group`` (default: the world)."""
        ctx, g = resolve(op, group)
        return Channel(g, ctx.rank, ctx.config.timeout, ctx.tracer)

    def where(self, op: str, name: str | None = None) -> str:
        label = f" {name!r}" if name else ""
        return f"lowband.{op}{label} on rank {self.rank}"

    def _check(self, op: str, ops: Sequence[P2POp]) -> None:
        g = self.group
        n, me = g.size, g.rank
        for m in ops:
            p = m.peer
            if (
                type(p) is not int  # bool is not a rank
                or not 0 <= p < n
                or p == me
                or m.kind not in (SEND, RECV)
                or not m.tensor.is_contiguous()
            ):
                raise InvalidArgumentError(
                    f"{self.where(op)}: a batched message must be a send or a receive of a contiguous "
                    f"tensor to another rank of group {g.name!r} (size {n}), got {m.kind} to rank {p!r}"
                )

    def post(self, op: str, ops: Sequence[P2POp], name: str | None = None) -> list[Any]:
        """Post every message in order; returns torch's works (raw; prefer :meth:`ibatch`)."""
        self._check(op, ops)
        pg = self.group.pg
        devs = list(dict.fromkeys(m.tensor.device for m in ops))
        nccl = [d for d in devs if contract.nccl_semantics(pg, d)]
        try:
            if not nccl:
                return [self._post_one(pg, m) for m in ops]
            # NCCL's contract: a pair's sends and receives share one stream and tags are ignored, so
            # the round's messages on each such device go as one coalesced batch (matched by order)
            works: list[Any] = []
            for d in devs:
                ms = [m for m in ops if m.tensor.device == d]
                if d in nccl:
                    if any(m.abandon_if is not None for m in ms):
                        raise InvalidArgumentError(
                            f"{self.where(op, name)}: a refusable message cannot ride an NCCL batch "
                            "(windows use a gloo channel of their own)"
                        )
                    works += contract.coalesced(pg, d, functools.partial(self._post_all, pg, ms))
                else:
                    works += [self._post_one(pg, m) for m in ms]
            return works
        except RuntimeError as exc:  # a pair closed by an earlier timeout, a dead peer
            raise comm_error(self.where(op, name), exc, self.timeout) from exc

    @classmethod
    def _post_all(cls, pg: Any, ms: list[P2POp]) -> list[Any]:
        return [cls._post_one(pg, m) for m in ms]

    @staticmethod
    def _post_one(pg: Any, m: P2POp) -> Any:
        t = m.tensor
        if t.dtype in GLOO_LACKS and t.is_contiguous():  # as bytes: gloo's and NCCL's p2p alike
            t = byte_wire(t.reshape(-1))
        w = pg.send([t], m.peer, m.tag) if m.kind == SEND else pg.recv([t], m.peer, m.tag)
        return w if m.abandon_if is None else _Abandonable(w, m.abandon_if)

    def ibatch(
        self,
        op: str,
        ops: Sequence[P2POp],
        finish: Callable[[], T],
        *,
        name: str | None = None,
        after_post: Callable[[], None] | None = None,
        trace: bool = True,
    ) -> Handle[T]:
        """Post ``ops`` in order as one op named ``op``; ``after_post`` runs once they are posted (local
        work overlapping the transfer); ``wait()`` waits them all and returns ``finish()``."""
        tracer = self.tracer
        ev = None
        if trace and tracer.enabled:
            sent = sum(nbytes(m.tensor) for m in ops if m.kind == SEND and not m.control)
            received = sum(nbytes(m.tensor) for m in ops if m.kind == RECV and not m.control)
            ev = tracer.start(op, name, sent, received, self.group.name)
        staged: list[tuple[P2POp, torch.Tensor]] = []
        if any(m.tensor.device.type == "cuda" for m in ops) and host_staged(self.group.pg):
            ops = [_stage(m, staged) for m in ops]
        works = self.post(op, ops, name)
        if after_post is not None:
            after_post()
        done = finish
        if staged:

            def done() -> T:  # the received host copies into the caller's GPU buffers, then finish
                for m, host in staged:
                    if m.abandon_if is None or not m.abandon_if():
                        m.tensor.copy_(host)
                return finish()

        return Handle(
            works, done, op=op, name=name, rank=self.rank, timeout=self.timeout, tracer=tracer, event=ev
        )

    def batch(
        self,
        op: str,
        ops: Sequence[P2POp],
        *,
        timeout: float | None = None,
        name: str | None = None,
        trace: bool = True,
    ) -> None:
        """Post ``ops`` and wait for them (at most ``timeout`` seconds, default the channel's)."""
        self.ibatch(op, ops, lambda: None, name=name, trace=trace).wait(timeout)


def _stage(m: P2POp, staged: list[tuple[P2POp, torch.Tensor]]) -> P2POp:
    """``m`` with a host copy of its GPU tensor (a send's copy taken now; a receive's copied back by
    the batch's finishing step)."""
    if m.tensor.device.type != "cuda":
        return m
    if m.kind == SEND:
        return m._replace(tensor=m.tensor.to("cpu"))
    host = torch.empty_like(m.tensor, device="cpu")
    staged.append((m, host))
    return m._replace(tensor=host)


def ibatch_p2p(
    op: str,
    ops: Sequence[P2POp],
    finish: Callable[[], T],
    *,
    name: str | None = None,
    group: Group | None = None,
    after_post: Callable[[], None] | None = None,
) -> Handle[T]:
    """Nonblocking batch of sends and receives on ``group`` (default: the world), traced as ``op``;
    see :meth:`Channel.ibatch`."""
    return Channel.of(group, op).ibatch(op, ops, finish, name=name, after_post=after_post)
