"""Shared plumbing of every op: resolving the group, tracing, wrapping torch works in a handle."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from lowband.comm import contract, validate
from lowband.comm.control import Prediction
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import Context, world_group

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

_ISSUING = "lowband.comm.issuing"


def resolve(op: str, group: Group | None) -> tuple[Context, Group]:
    return world_group(group, op)


def one_issuer(op: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator of a collective's entry point: one thread at a time issues a group's collectives.

    Two threads of one rank inside collectives of the same group at once would let each rank's thread
    timing decide the order of the group's collectives (NCCL and gloo match collectives by issue order:
    the ranks would mismatch or deadlock). The second thread is refused with
    :class:`~lowband.errors.InvalidArgumentError` naming both threads, before its argument check or any
    data is sent. Asynchronous communication belongs on the group's engine
    (:func:`lowband.comm.engine.issue_lane`), or on a group of its own. A call nested in another of the
    same thread (a grouped allreduce's inner ops) passes. Under the NCCL emulator
    (:mod:`lowband.comm.nccl_emulator`) the stricter rule holds: no thread issues while another
    thread's op on the group is still in flight."""

    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            group = kwargs.get("group")
            ctx, g = resolve(op, group if isinstance(group, Group) else None)
            marks: dict[int, tuple[int, str, str]] = ctx.state.setdefault(_ISSUING, {})
            me = threading.current_thread()
            mine = (me.ident or 0, me.name, op)
            held = marks.setdefault(id(g.pg), mine)  # atomic: the first thread in holds the group
            if held is not mine:
                if held[0] == mine[0]:
                    return fn(*args, **kwargs)  # nested in this thread's own op
                raise InvalidArgumentError(
                    f"lowband.{op} on rank {ctx.rank}: thread {me.name!r} issued a collective on group "
                    f"{g.name!r} while thread {held[1]!r} is inside {held[2]} on it; collectives of a group "
                    "are matched by issue order, so two threads issuing at once would let thread timing "
                    "order them differently on each rank. Issue them from one thread, through the "
                    "group's engine (lowband.comm.engine.issue_lane), or on a group of their own"
                )
            try:
                return fn(*args, **kwargs)
            finally:
                marks.pop(id(g.pg), None)

        return wrapper

    return deco


def checking(ctx: Context, g: Group) -> bool:
    """Whether ops on ``g`` run the cross-rank argument check: the group's own setting
    (:meth:`Group.unchecked`), else the runtime's."""
    return ctx.config.check if g.check is None else g.check


def checked_tensor(
    op: str, ctx: Context, t: object, what: str = "tensor", g: Group | None = None
) -> torch.Tensor:
    """A tensor lowband can send (:func:`validate.check_tensor`) on a device ``g``'s backend moves."""
    out = validate.check_tensor(op, ctx.rank, t, what)
    if g is not None:
        validate.check_device(op, ctx.rank, g, out, what)
    return out


def host_value(t: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """``t``, a small host value of lowband's own (timings, sizes, flags), on a device ``group``'s data
    backend moves: ``t`` itself where that backend moves CPU tensors (lowband's own groups on a GPU are
    ``cpu:gloo,cuda:nccl``), else a copy on this rank's device. The latter is an NCCL-only group: one that
    torch, Lightning or Accelerate made with backend ``nccl`` and :func:`lowband.init` adopted. An op on
    the result returns it on that device; read it with ``.tolist()``, ``.item()`` or ``.cpu()``.
    A user's CPU tensor on such a group is still refused (:func:`checked_tensor`): only lowband's own
    host values are moved."""
    ctx, g = resolve("host_value", group)
    served = validate.served_devices(g.pg)
    if t.device.type in served or ctx.device.type not in served:
        return t
    return t.to(ctx.device)


def check_inplace(op: str, ctx: Context, t: torch.Tensor) -> None:
    """An ``inplace=True`` target must be writable as one buffer, before anything is sent."""
    if t.requires_grad and torch.is_grad_enabled():
        raise InvalidArgumentError(
            f"lowband.{op} on rank {ctx.rank}: inplace=True on a tensor that requires grad would write "
            "past autograd; pass tensor.detach() (same memory) or call it under torch.no_grad()"
        )
    if validate.overlapping(t):
        raise InvalidArgumentError(
            f"lowband.{op} on rank {ctx.rank}: inplace=True on a tensor whose elements share memory "
            f"(shape {tuple(t.shape)}, strides {t.stride()}, e.g. from expand()); pass a contiguous copy"
        )


def check_name(op: str, ctx: Context, name: object) -> str | None:
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(
            f"lowband.{op} on rank {ctx.rank}: name must be a str or None, got {type(name).__name__}"
        )
    return name


def make_handle(
    ctx: Context,
    g: Group,
    op: str,
    name: str | None,
    issue: Callable[[], Sequence[Any]],
    finish: Callable[[], T],
    sent: int = 0,
    received: int = 0,
    guard: Prediction | None = None,
    device: torch.device | None = None,
    polled: bool = True,
) -> Handle[T]:
    """Issue the torch works (in program order, on the caller's thread) and wrap them in a handle.
    ``guard``: the argument check's prediction (:func:`validate.check`), which watches the works.
    ``device``: where the op's tensors live (default: the rank's device); under NCCL's contract the
    works are polled, never waited with a timeout (:mod:`lowband.comm.contract`); ``polled=False``: the
    op's works already follow the contract (point-to-point, whose headers ride the control group)."""
    tracer = ctx.tracer
    ev = tracer.start(op, name, int(sent), int(received), g.name) if tracer.enabled else None
    works = issue()
    if polled:
        works = contract.polled(works, g.pg, ctx.device if device is None else device)
    if guard is not None:
        works = guard.watch(list(works))
    return Handle(
        works, finish, op=op, name=name, rank=ctx.rank, timeout=ctx.config.timeout, tracer=tracer, event=ev
    )


def contiguous_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view (0-d tensors become one element)."""
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


#: dtypes gloo's broadcast/allgather/allreduce reject ("Invalid scalar type"): moved as bytes (or widened)
GLOO_LACKS: frozenset[torch.dtype] = frozenset({torch.int16})


def byte_wire(flat: torch.Tensor) -> torch.Tensor:
    """What a data-moving collective (broadcast, allgather) sends of the 1-D contiguous ``flat``: a
    ``uint8`` view of the same memory for the dtypes gloo lacks, else ``flat`` itself."""
    return flat.view(torch.uint8) if flat.dtype in GLOO_LACKS else flat


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
