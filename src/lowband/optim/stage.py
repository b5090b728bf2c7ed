"""The gradient stage: each unit's gradients handed to a reducer the moment they are complete in
backward, before any optimizer step.

A :class:`GradientStage` watches a model's parameters with ``register_post_accumulate_grad_hook``.
When every parameter of a unit (a layer or a fused bucket, :mod:`lowband.optim.reducer`) has its
gradient, the unit's gradients go to the reducer, which returns a handle; the reduction overlaps the
backward of the units before it. Whoever steps then waits only for what it steps:

- whole-model stepping: :meth:`GradientStage.wait` completes every unit (the reduced gradients are in
  ``.grad``), then the wrapped torch optimizer steps (:class:`~lowband.decentral.gradient_allreduce.
  GradientAllreduceOptimizer`, the ``stage`` strategy);
- stepping a round later: :meth:`GradientStage.hand_off` launches what is left and hands the round's
  handles over (a :class:`~lowband.optim.reduction.Reduction`) without waiting; ``.grad`` keeps this
  rank's gradients and the next backward may start (SlimGC's model backup consumes the round one step
  later);
- per-layer stepping: ``on_reduced(i)`` runs for each unit, on the thread running the backward, as
  soon as its reduction is complete (polled at every later gradient hook, the rest waited when the
  backward ends): :class:`~lowband.optim.LayerwiseOptimizer` steps layer ``i`` there. Without a
  reducer (local stepping) a unit is reported the moment its gradients are complete.

Collective order. With a reducer, units are launched in one fixed order on every rank (backward
order: the last unit first), a unit only after the ones before it, as DDP does with its buckets, so
data-dependent completion orders never mismatch the collectives; ``on_reduced`` is called in that
order too. Units whose parameters got no gradient are launched when the backward ends, their missing
gradients as zeros. Communicate in ``on_reduced`` on another group than the reducer's: its timing
relative to the reducer's launches is not the same on every rank.

Loss scaling (fp16). With :attr:`GradientStage.unscaler` set (a per-unit
:class:`~lowband.optim.scaling.GradUnscaler`), each unit's gradients are unscaled (a unit holding inf/NaN
zeroed and flagged) right before they are handed to the reducer, so reducers, compressors and their
error-feedback memories only ever see true, finite gradients.

Non-finite gradients. With :attr:`GradientStage.guard` set (a
:class:`~lowband.optim.nonfinite.NonFiniteGuard`, and no unscaler), each unit's gradients are checked on
the device right before the reducer (or, without one, the layer's step) sees them: a unit holding inf/NaN
is zeroed and flagged, and the strategy decides once per step on every rank. A unit whose reducer
averages it plainly (:meth:`Reducer.reduce_checked <lowband.optim.reducer.Reducer.reduce_checked>`) is
checked inside the reduction instead, fused with its division by the group size. Under ``skip`` the reducer's
state is copied at the start of each reduction and put back by :meth:`restore_reducer`.

Accumulation. With ``accumulate = J`` the gradients of J backward passes are summed locally (in
``.grad``, as torch does) and reduced during the J-th backward; passes inside :meth:`no_sync` are
never reduced and do not count. :meth:`wait` after fewer passes reduces what has accumulated.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from lowband.comm.agree import agree, crc
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.nonfinite import NonFiniteGuard, snapshot
from lowband.optim.reducer import ReduceContext, Reducer, Unit
from lowband.optim.reduction import Reduction, settle
from lowband.optim.scaling import GradUnscaler
from lowband.runtime import world_group

Tensor = torch.Tensor
UnitCallback = Callable[[int], None]


def check_accumulate(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{where}: accumulate must be an int >= 1, got {value!r}")
    return value


def _layout(units: Sequence[Unit]) -> list[int]:
    desc = [[(tuple(p.shape), str(p.dtype)) for p in u.params] for u in units]
    return [len(units), sum(p.numel() for u in units for p in u.params), crc(desc)]


class GradientStage:
    """Hands each unit's gradients to ``reducer`` from backward hooks; see the module docstring.

    ``units`` are in forward (registration) order; unit ``i`` is what ``on_reduced(i)`` and
    :meth:`in_flight` refer to. ``reducer=None`` reduces nothing (local stepping). ``check_layout``
    (default True) allgathers the units' layout once, then the reducer runs on ``group.unchecked()``.
    """

    def __init__(
        self,
        units: Sequence[Unit],
        reducer: Reducer | None,
        *,
        group: Group | None = None,
        accumulate: int = 1,
        on_reduced: UnitCallback | None = None,
        check_layout: bool = True,
        where: str = "GradientStage",
    ) -> None:
        self.where = where
        if not units or any(not u.params for u in units):
            raise InvalidArgumentError(f"{where}: needs at least one unit, each with parameters")
        ids = [id(p) for u in units for p in u.params]
        if len(ids) != len(set(ids)):
            raise InvalidArgumentError(f"{where}: a parameter appears in more than one unit")
        if reducer is not None and not isinstance(reducer, Reducer):
            raise InvalidArgumentError(
                f"{where}: reducer must be a lowband.optim.Reducer, got {type(reducer).__name__}"
            )
        self.units = list(units)
        self.reducer = reducer
        self.group: Group | None = None
        if reducer is not None:
            ctx, g = world_group(group, where)
            self.where = where = f"lowband.{where} on rank {ctx.rank}"
            self.group = g
            if check_layout:
                self._check_layout(g)
            self._fast = g.unchecked()
            reducer.prepare(self.units, self._fast)  # per-unit state built (and agreed) once, now
        self.accumulate = check_accumulate(where, accumulate)
        self.on_reduced = on_reduced
        #: reductions completed (the ``step`` a reducer is given)
        self.rounds = 0
        #: seconds spent inside ``reducer.reduce`` calls (launching: compression, issuing ops), on the
        #: threads running backward or :meth:`wait`
        self.reduce_s = 0.0
        self.enabled = True
        #: fp16 loss scaling: unscales each unit before the reducer sees it (module docstring)
        self.unscaler: GradUnscaler | None = None
        #: the non-finite policy's per-unit check (module docstring; set by NonFiniteGuard.attach)
        self.guard: NonFiniteGuard | None = None
        self._saved: dict[str, Any] | None = None  # the reducer's state at the round's start (skip)
        n = len(self.units)
        self._unit_of = {id(p): i for i, u in enumerate(self.units) for p in u.params}
        self._order = list(reversed(range(n)))  # launch order: backward order
        self._ready = [0] * n
        self._launched = [False] * n
        self._next = 0  # position in _order of the next unit to launch (with a reducer)
        self._handles: dict[int, tuple[Handle[list[Tensor]], list[Tensor]]] = {}
        self._reported = [False] * n
        self._open = False  # a reduction has started and is not complete
        self._passes = 0  # backward passes accumulated since the last reduction
        self._no_sync = 0
        self._in_backward = False
        self._reducing = False  # the current backward reduces
        # The hooks hold the stage weakly: a strong reference would make a cycle through the
        # parameters' hooks that Python's collector cannot see (see LayerwiseOptimizer).
        ref = weakref.ref(self)

        def hook(p: Tensor) -> None:
            me = ref()
            if me is not None:
                me._on_grad(p)

        self._hooks = [
            p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
            for u in self.units
            for p in u.params
        ]

    def _check_layout(self, g: Group) -> None:
        """Every rank must hand the same units (count, elements, shapes and dtypes) to the reducer."""
        agree(
            g,
            "the gradient stage's units",
            _layout(self.units),
            fields=("the number of units", "the number of elements", "the hash of shapes and dtypes"),
            where=self.where,
        )

    def __repr__(self) -> str:
        return f"GradientStage({len(self.units)} units, {self.reducer!r}, accumulate={self.accumulate})"

    # -- backward hooks ---------------------------------------------------------------------------
    def _on_grad(self, p: Tensor) -> None:
        if not self.enabled:
            return
        if not self._in_backward:
            self._begin_backward()
        i = self._unit_of[id(p)]
        self._ready[i] += 1
        if not self._reducing or self._ready[i] != len(self.units[i].params):
            return
        if self.reducer is None:
            self._launch(i)
            self._report(i)
            return
        while self._next < len(self._order) and self._complete(self._order[self._next]):
            self._launch(self._order[self._next])
            self._next += 1
        if self.on_reduced is not None:
            self._report_done(block=False)

    def _complete(self, i: int) -> bool:
        return self._ready[i] == len(self.units[i].params)

    def _begin_backward(self) -> None:
        if self._open:
            raise InvalidArgumentError(
                f"{self.where}: a backward pass while the previous gradient reduction is not complete "
                "(step() or wait() first)"
            )
        self._in_backward = True
        self._reducing = self._no_sync == 0 and self._passes + 1 >= self.accumulate
        if self._reducing:
            self._new_round()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)  # type: ignore[attr-defined]

    def _end_backward(self) -> None:
        """Runs once when the backward finishes: launch (and, with ``on_reduced``, complete) the units
        that did not get all their gradients."""
        try:
            if self._reducing:
                self._launch_rest()
                if self.on_reduced is not None:
                    self._report_done(block=True)
            elif self._no_sync == 0:
                self._passes += 1
        finally:
            self._ready = [0] * len(self.units)
            self._in_backward = False

    # -- launching and completing -----------------------------------------------------------------
    def _launch(self, i: int) -> None:
        self._open = True
        self._launched[i] = True
        unit = self.units[i]
        if self.reducer is None:
            if self.guard is not None:  # checked before the layer is stepped
                self.guard.check_([p.grad for p in unit.params if p.grad is not None], unit.key)
            return
        grads = []
        for p in unit.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.unscaler is not None:
            self.unscaler.unscale_(grads)
        flag = None
        t0 = time.perf_counter()
        ctx = ReduceContext(self._fast, self.rounds, None)
        if self.unscaler is None and self.guard is not None and self.guard.enabled:
            carry = self.carries_nonfinite()
            if carry == "raw":  # checked inside the reduction where it can be (fused, a sentinel)
                fused = self.reducer.reduce_checked(unit, grads, ctx)
                if fused is not None:
                    h, own, head = fused
                    self.guard.ride_(unit.key, head, own)
                    self.reduce_s += time.perf_counter() - t0
                    self._handles[i] = (h, grads)
                    return
            tells = carry == "poison" and self.reducer.average_tells(self._fast.size)
            flag = self.guard.check_(grads, unit.key, carried=bool(carry), zero=carry != "raw", tells=tells)
            flag = flag if carry == "poison" else None
            t0 = time.perf_counter()
        h = self.reducer.reduce(unit, grads, ReduceContext(self._fast, self.rounds, flag))
        self.reduce_s += time.perf_counter() - t0
        self._handles[i] = (h, grads)

    def _launch_rest(self) -> None:
        if self.reducer is None:
            for i in self._order:
                if not self._launched[i]:
                    self._launch(i)
                    self._report(i)
            return
        while self._next < len(self._order):
            self._launch(self._order[self._next])
            self._next += 1

    def _finish(self, i: int) -> None:
        h, grads = self._handles.pop(i)
        settle(self.where, self.units[i], h, grads, into_grads=True)

    def _report(self, i: int) -> None:
        self._reported[i] = True
        if self.on_reduced is not None:
            self.on_reduced(i)
        if all(self._reported):
            self._end_round()

    def _report_done(self, *, block: bool) -> None:
        """Complete and report launched units in launch order: those already done, or all (block)."""
        for i in self._order[: self._next]:
            if self._reported[i]:
                continue
            if not block and not self._handles[i][0].done():
                return
            self._finish(i)
            self._report(i)

    def _new_round(self) -> None:
        if self.guard is not None and self.guard.policy == "skip" and self.reducer is not None:
            self._saved = snapshot(self.reducer.state_dict())
        self._next = 0
        self._launched = [False] * len(self.units)
        self._reported = [False] * len(self.units)

    def _end_round(self) -> None:
        # the flags stay as they are (all launched and reported) until the next round begins
        self.rounds += 1
        self._passes = 0
        self._open = False

    def carries_nonfinite(self) -> str:
        """How a unit's inf/NaN rides its reduction to every rank (:attr:`Reducer.carries_nonfinite`,
        :mod:`lowband.optim.nonfinite`); "" when it cannot (no reducer, or units stepped during backward,
        before the whole step is decided)."""
        if self.reducer is None or self.on_reduced is not None:
            return ""
        return self.reducer.carries_nonfinite

    # -- what the stepping side calls ------------------------------------------------------------
    def pending(self) -> bool:
        """True while gradients wait to be reduced or stepped: a reduction in flight, or backward
        passes accumulated and not reduced yet."""
        return self._open or self._passes > 0

    def wait(self) -> None:
        """Complete the current reduction: launch the units not launched yet (after fewer than
        ``accumulate`` passes: what has accumulated), wait for every unit in launch order, write the
        results into ``.grad`` and report the units not reported yet. Nothing happens when no backward
        pass ran since the last reduction."""
        if self._in_backward:
            raise InvalidArgumentError(f"{self.where}: wait() inside a backward pass")
        if not self.pending():
            return
        if not self._open:  # passes accumulated, nothing launched yet
            self._new_round()
            self._open = True
        self._launch_rest()
        if self.reducer is not None:
            self._report_done(block=True)

    def hand_off(self) -> Reduction:
        """Launch the units not launched yet (as :meth:`wait` does) and hand the round over without
        waiting, as a :class:`~lowband.optim.reduction.Reduction` of every unit's handle (its results are
        not written into ``.grad`` unless the reducer reduced in place); the next backward may start a
        new round. Needs a reducer, no ``on_reduced``, and a backward pass since the last reduction."""
        if self._in_backward or self.reducer is None or self.on_reduced is not None or not self.pending():
            raise InvalidArgumentError(
                f"{self.where}: hand_off() needs a reducer, no on_reduced, and a backward pass since the "
                "last reduction, outside backward"
            )
        if not self._open:  # passes accumulated, nothing launched yet
            self._new_round()
            self._open = True
        self._launch_rest()
        launched = [(i, *self._handles.pop(i)) for i in self._order if i in self._handles]
        reduction = Reduction(self.where, self.rounds, self.units, launched)
        self._reported = [True] * len(self.units)
        self._end_round()
        return reduction

    def complete(self, i: int) -> None:
        """Complete unit ``i`` alone (its reduced gradients in ``.grad``) and report it, if it is launched
        and not completed yet: for stepping a unit when it is needed (e.g. just before its module's next
        forward) rather than every unit at once (:meth:`wait`)."""
        if self._in_backward:
            raise InvalidArgumentError(f"{self.where}: complete() inside a backward pass")
        if i in self._handles:
            self._finish(i)
            self._report(i)

    def in_flight(self) -> list[int]:
        """Units whose reduction is launched and not waited yet."""
        return sorted(self._handles)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and are not reduced (DDP's ``no_sync``)."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def restore_reducer(self) -> None:
        """Put the reducer's state back as it was when the last reduction began (a skipped step)."""
        if self._saved is not None and self.reducer is not None:
            self.reducer.load_state_dict(self._saved)
        self._saved = None

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The reduction counter, the reducer's state (complete the reduction first) and, when any, the
        backward passes counted since the last reduction (``passes``: e.g. ATC's local steps towards its
        next combination)."""
        state: dict[str, Any] = {
            "rounds": self.rounds,
            "reducer": {} if self.reducer is None else self.reducer.state_dict(),
        }
        if self._passes:
            state["passes"] = self._passes
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "rounds" not in state or "reducer" not in state:
            raise InvalidArgumentError(
                f"{self.where}: load_state_dict expects a dict with 'rounds' and 'reducer', got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        if self.pending():
            raise InvalidArgumentError(f"{self.where}: load_state_dict while gradients are pending")
        self.rounds = int(state["rounds"])
        self._passes = int(state.get("passes", 0))  # checkpoints written before it was saved: 0
        if self.reducer is not None:
            self.reducer.load_state_dict(dict(state["reducer"]))

    def remove_hooks(self) -> None:
        """Detach from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
