"""Executing a reduce/broadcast schedule (:mod:`lowband.compress.tree`) on batched point-to-point ops.

:func:`itree` runs a :class:`~lowband.compress.tree.TreeSchedule`'s rounds over a message made of a
fixed list of tensors (the same shapes and dtypes on every rank, so a receiver allocates its buffers with
no size exchange). In a reduce round the receiver combines what it receives into its own message
(``combine(mine, received, src)``; default: elementwise sum, so the tree computes the sum over ranks,
bit-identical to the single-process sum for integer-valued inputs); in a broadcast round it takes what it
receives. The handle's result is the root's final message, on every rank (with ``broadcast=False``: the
root's result on the root, and this rank's partial message elsewhere).

Nonblocking: the first round this rank takes part in is posted at once; every later round depends on
the one before and is posted and waited (each bounded by the runtime's timeout) by the thread that
waits on the handle, so ``done()`` turns True once the first round is complete. Each round is its own
traced, byte-counted op (``tree_reduce`` / ``tree_broadcast``). Tags: one per call, from a counter per
process group kept in the rank's runtime state (every rank calls the tree ops of a group in the same
order), in ``[2**30, 3 * 2**29)``, a range apart from the neighbor ops'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lowband.comm.base import resolve
from lowband.comm.batch import Channel, P2POp, recv_op, send_op
from lowband.comm.handle import Handle, completed
from lowband.compress.tree import TreeSchedule
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import Context

Tensor = torch.Tensor
#: ``combine(mine, received, src) -> new mine`` (same shapes and dtypes)
Combine = Callable[[list[Tensor], list[Tensor], int], list[Tensor]]

_TAG_BASE = 2 << 29
_TAG_SPAN = 1 << 29
_STATE_KEY = "lowband.comm.tree"


def _next_tag(ctx: Context, g: Group) -> int:
    seqs: dict[int, tuple[object, int]] = ctx.state.setdefault(_STATE_KEY, {})
    _, seq = seqs.get(id(g.pg), (g.pg, 0))
    seqs[id(g.pg)] = (g.pg, seq + 1)
    return int(_TAG_BASE + seq % _TAG_SPAN)


def add(mine: list[Tensor], received: list[Tensor], src: int) -> list[Tensor]:
    """The default combine: elementwise sum (a new list)."""
    return [a + b for a, b in zip(mine, received)]


class _Run:
    """One call's rounds on this rank."""

    def __init__(
        self,
        ch: Channel,
        steps: list[tuple[str, tuple[tuple[int, int], ...]]],
        state: list[Tensor],
        combine: Combine,
        tag: int,
        name: str | None,
    ) -> None:
        self.ch, self.steps, self.state, self.combine, self.tag, self.name = (
            ch,
            steps,
            state,
            combine,
            tag,
            name,
        )

    def post(self, i: int) -> Handle[None]:
        kind, pairs = self.steps[i]
        me = self.ch.group.rank
        srcs = [s for s, d in pairs if d == me]
        dsts = [d for s, d in pairs if s == me]
        bufs = [[torch.empty_like(t) for t in self.state] for _ in srcs]
        ops: list[P2POp] = [recv_op(b, s, self.tag) for s, bs in zip(srcs, bufs) for b in bs]
        ops += [send_op(t, d, self.tag) for d in dsts for t in self.state]

        def finish() -> None:
            for s, bs in zip(srcs, bufs):
                self.state = self.combine(self.state, bs, s) if kind == "reduce" else bs
                if [(t.shape, t.dtype) for t in self.state] != [(b.shape, b.dtype) for b in bs]:
                    raise InvalidArgumentError(
                        f"{self.ch.where('tree', self.name)}: combine changed the message's layout"
                    )

        return self.ch.ibatch(f"tree_{kind}", ops, finish, name=self.name)

    def rest(self) -> list[Tensor]:
        for i in range(1, len(self.steps)):
            self.post(i).wait()
        return self.state


def itree(
    tensors: Sequence[Tensor],
    schedule: TreeSchedule,
    combine: Combine = add,
    *,
    broadcast: bool = True,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[list[Tensor]]:
    """Run ``schedule`` over the message ``tensors`` (contiguous; not modified; do not modify them before
    ``wait()``); see the module docstring. Collective over ``group`` (default: the world)."""
    ctx, g = resolve("tree", group)
    where = f"lowband.tree{f' {name!r}' if name else ''} on rank {ctx.rank}"
    if not isinstance(schedule, TreeSchedule) or schedule.size != g.size:
        raise InvalidArgumentError(
            f"{where}: schedule must be a TreeSchedule of {g.size} ranks (the group's size), got {schedule!r}"
        )
    state = list(tensors)
    if any(not isinstance(t, Tensor) or not t.is_contiguous() for t in state):
        raise InvalidArgumentError(f"{where}: the message must be a list of contiguous tensors")
    rounds = [("reduce", r) for r in schedule.reduce]
    if broadcast:
        rounds += [("broadcast", r) for r in schedule.broadcast]
    me = g.rank
    steps = [(k, r) for k, r in rounds if any(me in pair for pair in r)]
    if not steps:
        return completed(state, op="tree", name=name, rank=ctx.rank)
    ch = Channel(g, ctx.rank, ctx.config.timeout, ctx.tracer)
    run = _Run(ch, steps, state, combine, _next_tag(ctx, g), name)
    return run.post(0).map(lambda _: run.rest())
