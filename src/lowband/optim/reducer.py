"""Reducers and the units they reduce: what the gradient stage hands over, and what comes back.

A *unit* is a set of parameters whose gradients are reduced together: a layer (a module owning
parameters) or a fused bucket of parameters (about ``bucket_mb`` megabytes, in backward order, as DDP
fuses them). A unit carries the names of its parameters (``model.named_parameters()``), so state a
reducer keeps per gradient (error-feedback memory, warm-start factors) can be keyed by parameter name:
it survives a new bucketing, a restart and a different unit layout. Its :attr:`Unit.key` names the unit
in traces and errors; it is derived from the names, never from a bucket index.

The protocol. A :class:`Reducer` gets one unit's gradients (in the unit's order) with a
:class:`ReduceContext` (the group and the step counter, a seed for randomised compressors) and returns
a :class:`~lowband.comm.handle.Handle` whose result is the reduced gradients, same shapes and order (it
may reduce in place and return the same tensors). That handle is the only way results come back: no
reducer has a side channel, and whoever holds the handles decides when to wait (the gradient stage at
the step, or a step later: :meth:`GradientStage.hand_off <lowband.optim.stage.GradientStage.hand_off>`).
Besides ``reduce``, every reducer answers, so that no caller probes its type:

- :meth:`Reducer.prepare` ``(units, group)``: called once by the gradient stage when it is built, on
  every rank, before the first reduction; a reducer may build and agree on per-unit state there
  (sketching reducers build their hash tables; collectives on ``group`` are allowed). No-op by default.
- :attr:`Reducer.timings`: a :class:`Timings` of the seconds the reducer spends coding on the thread
  that calls ``reduce`` and waits (the training thread), which the step clock reports as compression
  (:mod:`lowband.strategies.breakdown`), or None when it spends none there.
- ``state_dict`` / ``load_state_dict`` (keyed by parameter name) and :attr:`Reducer.carries_nonfinite`.

Phases. A reducer may issue several dependent collectives for one unit (gs-SGD's second round on the
coordinates its first round found, PowerSGD's P then Q, SlimGC's fused rounds); the handle it returns
stands for all of them. The collectives must be issued in the same order on every rank, so a later
phase is issued from a place whose order is fixed: (a) by the thread that waits, chained with
:meth:`Handle.map <lowband.comm.handle.Handle.map>` (gs-SGD, Sketched-SGD, gTop-k: the stage waits in
launch order, the same on every rank); (b) on the calling thread, waiting for the first phase inside
``reduce`` (PowerSGD: P's allreduce waited, Q's returned); (c) as tasks of an issue-order
:class:`~lowband.comm.lane.Lane` of the group's communication engine, in submission order, the handle a
lane task's (a task may return a handle) or a :class:`~lowband.comm.lane.Promise` the lane's later
task settles (SlimGC: every unit's handle completes when its round's last operation is done). Never
issue a later phase from torch's callback thread (``Handle.then``): its timing differs per rank.

:class:`AllreduceReducer` is the plain reducer: an average by one fused allreduce.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.comm.fusion import igrouped_allreduce
from lowband.comm.handle import Handle
from lowband.comm.priority import NegotiatedQueue
from lowband.comm.reduce import iallreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.finite import poison_
from lowband.optim.scaling import check_scaled_, exact_scale

Tensor = torch.Tensor


@dataclass
class Timings:
    """Seconds a reducer spends in compression (memory included) and decompression, and the units
    processed (:attr:`Reducer.timings`).

    ``decompress_inline_s`` is the part of ``decompress_s`` spent on the thread that called
    ``reduce`` (the training thread: on the critical path); the rest ran elsewhere (torch's callback
    threads, with :meth:`~lowband.comm.handle.Handle.then`), overlapped."""

    compress_s: float = 0.0
    decompress_s: float = 0.0
    decompress_inline_s: float = 0.0
    units: int = 0

    def reset(self) -> None:
        self.compress_s = self.decompress_s = self.decompress_inline_s = 0.0
        self.units = 0


@dataclass(frozen=True, eq=False)
class Unit:
    """Parameters whose gradients are reduced together; ``names[k]`` is the name of ``params[k]``."""

    key: str
    names: tuple[str, ...]
    params: tuple[Tensor, ...]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


@dataclass(frozen=True)
class ReduceContext:
    """What a reducer is told besides the gradients: the group to reduce over (its layout was checked
    when the stage was built; per-op checks are off) and ``step``, the number of reductions the stage
    completed before this one (the same on every rank: a seed for random projections or sketches)."""

    group: Group
    step: int
    #: the unit's non-finite flag (1 element, 1.0: this rank's gradients held inf/NaN and were zeroed) for
    #: a reducer that carries it in its payload (``carries_nonfinite == "poison"``), else None
    nonfinite: Tensor | None = None


class Reducer(abc.ABC):
    """Reduces one unit's gradients over a group; see the module docstring."""

    #: how a rank's inf/NaN may reach every rank with the data (lowband.optim.nonfinite): "" (it may not:
    #: the unit is zeroed and the flags exchanged), "raw" (a stateless average carries it as it is) or
    #: "poison" (the unit is zeroed before any state sees it, and the payload made NaN on the wire)
    carries_nonfinite = ""

    #: the seconds spent coding on the thread that calls :meth:`reduce` (module docstring), or None
    timings: Timings | None = None

    def prepare(self, units: Sequence[Unit], group: Group) -> None:
        """Called once, on every rank, with every unit this reducer will see and the group it reduces
        over (per-op checks off), before the first reduction: build and agree on per-unit state here.
        Nothing by default."""
        return None

    @abc.abstractmethod
    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        """Start reducing ``grads`` (the gradients of ``unit.params``, in order); never blocks."""

    def reduce_checked(
        self, unit: Unit, grads: list[Tensor], ctx: ReduceContext
    ) -> tuple[Handle[list[Tensor]], Tensor, Tensor] | None:
        """:meth:`reduce` with the non-finite check fused into a pass the reduction makes anyway, for a
        reducer whose average carries inf/NaN (``carries_nonfinite == "raw"``): the handle, this rank's
        flag (1 element, on the device) and a 1-element view of where the average's first element lands,
        NaN there on every rank when any rank's unit held inf/NaN (:meth:`NonFiniteGuard.ride_
        <lowband.optim.nonfinite.NonFiniteGuard.ride_>`). None (the default): the stage checks the unit
        itself before :meth:`reduce`."""
        return None

    def average_tells(self, size: int) -> bool:
        """True if, reducing over ``size`` ranks, the first element of every average this reducer
        returns is NaN whenever any of its elements is not finite (so that the non-finite guard reads one
        element of it, not all); False by default."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """State needed to resume (keyed by parameter name); none by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        if state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: this reducer holds no state, got keys {sorted(state)}"
            )


class AllreduceReducer(Reducer):
    """The average over the group, in place, in one fused allreduce per unit."""

    #: stateless, identical result on every rank: a rank's inf/NaN reaches every rank's average
    carries_nonfinite = "raw"

    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        one_buffer = sum(g.numel() * g.element_size() for g in grads) + 1
        return igrouped_allreduce(
            grads, "average", inplace=True, name=unit.key, group=ctx.group, fusion_threshold=one_buffer
        )

    def reduce_checked(
        self, unit: Unit, grads: list[Tensor], ctx: ReduceContext
    ) -> tuple[Handle[list[Tensor]], Tensor, Tensor] | None:
        """The unit flattened into one buffer, divided by the group size *before* the sum (the same
        average bit for bit when the size is a power of two, and a sum that cannot overflow) with the
        check fused into that division (:func:`~lowband.optim.scaling.check_scaled_`), its first element
        made NaN when flagged, then summed; None for other group sizes, sparse gradients or several
        devices."""
        p = ctx.group.size
        if (
            not exact_scale(p)
            or not grads
            or any(g.is_sparse for g in grads)
            or len({g.device for g in grads}) > 1
        ):
            return None
        single = len(grads) == 1 and grads[0].is_contiguous()
        flat = grads[0].view(-1) if single else torch.cat([g.reshape(-1) for g in grads])
        flag = check_scaled_([flat], 1.0 / p)
        poison_(flat, flag)
        h = iallreduce(flat, "sum", inplace=True, name=unit.key, group=ctx.group)

        def finish(avg: Tensor) -> list[Tensor]:
            if not single:
                with torch.no_grad():
                    parts = torch.split(avg, [g.numel() for g in grads])
                    torch._foreach_copy_(grads, [a.view(g.shape) for a, g in zip(parts, grads)])
            return grads

        return h.map(finish), flag, flat[:1]

    def __repr__(self) -> str:
        return "AllreduceReducer()"


class PriorityReducer(Reducer):
    """``inner``'s reductions run on a :class:`~lowband.comm.priority.NegotiatedQueue` in priority
    order: ``units[k]`` has priority ``k`` (the stage's forward order: the first layer's gradients go
    first once ready on every rank), so a reduction launched later in backward overtakes those not
    started yet. The queue negotiates on the reduction's group; its ``n`` must be ``len(units)``."""

    def __init__(self, inner: Reducer, queue: NegotiatedQueue, units: Sequence[Unit]) -> None:
        if queue.n != len(units):
            raise InvalidArgumentError(
                f"PriorityReducer: the queue has {queue.n} keys for {len(units)} units"
            )
        self.inner, self.queue = inner, queue
        self._key = {id(u): k for k, u in enumerate(units)}

    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        k = self._key.get(id(unit))
        if k is None:
            raise InvalidArgumentError(f"PriorityReducer: unit {unit.key!r} is not one of the queue's units")
        return self.queue.submit(k, lambda: self.inner.reduce(unit, grads, ctx), name=unit.key)

    def prepare(self, units: Sequence[Unit], group: Group) -> None:
        self.inner.prepare(units, group)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __repr__(self) -> str:
        return f"PriorityReducer({self.inner!r})"


def parameter_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Every parameter of ``model`` with its name (the first, for a shared parameter)."""
    return {p: n for n, p in model.named_parameters()}


def _key(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def layer_units(
    layers: Sequence[tuple[str, Sequence[nn.Parameter]]], names: dict[nn.Parameter, str] | None = None
) -> list[Unit]:
    """One unit per layer, keyed by the layer's name; parameter names from ``names`` (default
    ``"layer.k"``)."""
    out = []
    for lname, ps in layers:
        pn = tuple(names[p] if names is not None and p in names else f"{lname}.{k}" for k, p in enumerate(ps))
        out.append(Unit(lname, pn, tuple(ps)))
    return out


def bucket_units(model: nn.Module, bucket_mb: float, first_bucket_mb: float = 1.0) -> list[Unit]:
    """The model's trainable parameters fused into buckets in backward order (reverse registration),
    as DDP fuses them: parameters join the open bucket (one dtype per bucket) until it holds at least
    ``first_bucket_mb`` megabytes for the first bucket (so communication starts early), ``bucket_mb``
    for the others, and then it closes (a parameter larger than the cap closes the bucket it joins).
    Returned in forward order (the last bucket is the first one ready in backward)."""
    for what, v in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise InvalidArgumentError(f"bucket_units: {what} must be a number > 0, got {v!r}")
    names = parameter_names(model)
    params = [p for p in names if p.requires_grad]  # registration order, shared ones once
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if buckets[-1] and buckets[-1][-1].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= (first_bucket_mb if len(buckets) == 1 else bucket_mb) * 2**20:
            buckets.append([])
            size = 0
    units = []
    for b in reversed([b for b in buckets if b]):
        b = b[::-1]  # parameters in forward order inside a bucket
        pn = tuple(names[p] for p in b)
        units.append(Unit(_key(pn), pn, tuple(b)))
    return units
