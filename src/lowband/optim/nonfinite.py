"""One non-finite policy for every strategy: a NaN or an infinity in a gradient is caught before it is
communicated or stored in any residual, and every rank learns it in the same step.

Where the check runs (always device-side, fused with work already done, no host synchronisation):

- on a gradient stage (:class:`~lowband.optim.stage.GradientStage`: every reducer, compressor, sketch,
  SlimGC, the layer-stepping strategies), per unit, right before the unit is handed to its reducer (or
  stepped; a plain average's unit inside its reduction, below): :func:`lowband.optim.scaling.zero_nonfinite_`,
  the fused kernel fp16 unscaling already runs, with a scale of 1 (on the CPU, where a host decision is
  free, one sum per gradient, confirmed element-wise only when not finite). A unit holding inf/NaN on this rank is zeroed there, so no reducer, compressor,
  error-feedback residual or layer step ever sees the value, and its flag is remembered (one 1-element
  tensor per unit, on the device);
- the gradients the stages do not cover (torch DDP's, local SGD's, the decentralized strategies' local
  steps, embedding tables), once, when the strategy is about to step (:meth:`NonFiniteGuard.decide`).

Then, once per step, before the optimizer step, :meth:`NonFiniteGuard.decide` makes the ranks agree: one
allreduce-max of a vector of ``world`` floats (this rank's slot: the position + 1 of its first non-finite
unit, 0 when clean) and one host read of it, the decision every policy needs on the host anyway.

The flag rides the data where the data is an average. A unit reduced by a plain allreduce of the
gradients (``AllreduceReducer`` on a stage that steps after the whole backward; torch DDP's buckets,
checked in lowband's allreduce comm hook) holds no state a NaN could poison, and the sum carries any
rank's NaN or infinity to every rank: such a unit is checked (``carried=True``) but not zeroed, and its
averaged gradients, identical on every rank, are checked again in :meth:`NonFiniteGuard.decide`. Where
the group size is a power of two both reads are (almost) free: the unit is divided by the group size
*before* the sum (bit for bit the same average) by torch's fused check-and-scale kernel
(:func:`~lowband.optim.scaling.check_scaled_`, which takes what ``div_`` alone takes), so this rank's
check rides a pass the reduction makes anyway; a sum of values divided first cannot overflow, so a
flagged unit's first element, made NaN before the sum is issued (:func:`poison_`), tells every rank by
one element of its average (:meth:`NonFiniteGuard.ride_`). Other group sizes read the unit before and
its average after. When
everything a strategy checks is carried (:attr:`NonFiniteGuard.rides_data`, set by the strategy), the
exchange above is skipped on the clean steps; a non-finite average, seen alike by every rank, then runs
the exchange once to name the ranks whose own gradients held it (none: the sum overflowed).

By the policy (the ``on_nonfinite`` option of every strategy):

- ``"raise"`` (the default): :class:`~lowband.errors.NonFiniteError` on every rank, naming each rank that
  held a non-finite value, its unit and the step;
- ``"skip"``: the step is skipped on every rank, as torch's ``GradScaler`` does: no parameter is updated
  and the optimizer state is untouched (the gradients are set to ``None``, which every torch optimizer
  skips), and the reducers' state (error-feedback residuals, counters) is put back as it was when the
  step began (a copy taken at the start of each reduction: ``skip`` costs one copy of the reducers'
  state per step; ``raise`` costs nothing of the kind). Strategies that step layers during backward
  cannot skip (their layers are stepped before the whole gradient is known) and refuse ``skip``.

Local steps (``localsgd``, ``diloco`` with ``inner=local``: each rank steps its own replica between
exchanges, and no gradient stage is attached; :attr:`NonFiniteGuard.deferred`): a rank's gradients are
checked on the host as above, and when non-finite they are dropped, so its local step updates nothing
(its parameters stay finite, and any averaging inside the step runs on every rank alike). ``dreamddp``
(and ``plsgd-enp``, ``flsgd-overlap``) steps each layer during backward and averages some layers inside
every step, so the step as a whole cannot be dropped (layers stepped earlier in that backward keep
their update); each unit is checked on its layerwise stage before its layer is stepped, and a flagged
unit is zeroed there, so its layer step sees a zero gradient (momentum and weight decay, if any, still
apply: finite) and no averaging or optimizer state ever sees the value. No step waits
for the others: under ``raise`` the flags are allreduced asynchronously and read ``MAX_PENDING`` steps
later (on a WAN an allreduce of a few bytes takes several round trips, longer than a step), or in
``synchronize`` or ``state_dict`` if those come first; every rank reads them at the same step and
raises there, naming the rank, the unit or parameter, and the step (so no rank enters an exchange that
another, having raised, will not join; an exchange never waits for them). Under ``skip`` nothing is
exchanged and only the rank that held the value drops it (``skipped`` counts this rank's steps).

With an fp16 ``GradScaler`` (:mod:`lowband.optim.scaling`) overflows are the scaler's to handle (it
skips the step everywhere and backs the scale off): the guard steps aside. ``LOWBAND_CHECK_FINITE=off``
(:mod:`lowband.compress.finite`) turns the guard off too.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lowband.comm.collectives import allreduce, iallreduce
from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError, NonFiniteError
from lowband.group import Group
from lowband.optim.finite import any_nonfinite, flag_, poison_

if TYPE_CHECKING:
    from lowband.optim.stage import GradientStage

Tensor = torch.Tensor

#: local steps: agreements in flight before a step waits for the oldest (bounds memory and the delay)
MAX_PENDING = 16

#: the values of every strategy's ``on_nonfinite`` option
POLICIES = ("raise", "skip", "off")  # off: no check (what the overhead benchmark compares with)


def check_policy(where: str, policy: object) -> str:
    if policy not in POLICIES:
        raise InvalidArgumentError(f"{where}: on_nonfinite must be one of {list(POLICIES)}, got {policy!r}")
    assert isinstance(policy, str)
    return policy


class NonFiniteGuard:
    """The per-rank state of the policy (module docstring) for one strategy.

    ``step`` gives the step number named in errors. Stages attached with :meth:`attach` check their
    units; :meth:`decide` covers ``params`` (the gradients no stage checks) and makes the ranks agree.
    """

    def __init__(
        self, policy: str, group: Group, *, where: str, step: Callable[[], int], channel: Group | None = None
    ) -> None:
        self.policy = check_policy(where, policy)
        self.group = group
        #: where the flags are agreed: the data group, or (``channel``) a private gloo group over its ranks
        #: for strategies whose data group is also used by another thread at step time (host values)
        self._fast = group.unchecked() if channel is None else channel
        self._host = channel is not None
        self.where = where
        self._step = step
        # (imported here: lowband.compress imports the optim package, which imports this module)
        from lowband.compress.finite import mode

        self.enabled = mode() != "off" and self.policy != "off"
        #: steps skipped on every rank (policy ``skip``)
        self.skipped = 0
        self.stages: list[GradientStage] = []
        self._flags: list[Tensor] = []  # this round's unit flags (device, 1 element), in check order
        self._labels: list[str] = []
        #: this round's carried units (module docstring): label, gradients (averaged in place), own flag,
        #: and whether their first element alone tells (a sentinel: see :meth:`check_`)
        self._carried: list[tuple[str, list[Tensor], Tensor, bool]] = []
        #: every check is carried by the data (set by the strategy): no exchange on a clean step
        self.rides_data = False
        #: the gradients :meth:`decide` is given were averaged already (torch DDP's): a value found there
        #: is on every rank alike and its source is not known (set by the strategy)
        self.params_averaged = False
        self._ones: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        #: state put back on a skipped step besides the stages' reducers (e.g. PowerSGD's comm hook)
        self.restorers: list[Callable[[], None]] = []
        #: the ranks step apart between exchanges (set by local-step strategies without gradient stages):
        #: agreed asynchronously, a few steps late (module docstring, "Local steps")
        self.deferred = False
        #: local steps' agreements in flight, oldest first: handle, step, this rank's bad parameter
        #: outside the stages, the stages' unit labels in check order
        self._pending: collections.deque[tuple[Handle[Tensor], int, str, list[str]]] = collections.deque()
        #: how :meth:`settle` waits for an agreement in flight (None: ``handle.wait()``); a strategy with
        #: a heartbeat beats meanwhile (:mod:`lowband.strategies.peer_loss`)
        self.waiter: Callable[[Handle[Tensor]], Tensor] | None = None

    def attach(self, stage: GradientStage) -> None:
        """``stage`` checks each unit through this guard (and keeps its reducer's state for ``skip``)."""
        if stage not in self.stages:
            self.stages.append(stage)
            stage.guard = self

    def moved(self, group: Group, *, step: Callable[[], int]) -> NonFiniteGuard:
        """A guard of the same policy over ``group`` (a survivor's own, once it noticed a lost peer),
        taking over the gradient stages (which flag into the guard that reads them: left on this one, a
        non-finite gradient would be zeroed and never raised) and this step's flags so far."""
        guard = NonFiniteGuard(self.policy, group, where=self.where, step=step)
        guard.deferred, guard.skipped = self.deferred, self.skipped
        for stage in self.stages:
            guard.attach(stage)
        guard._flags, guard._labels = self._flags, self._labels
        self.stages, self._flags, self._labels = [], [], []
        return guard

    def covered(self) -> set[int]:
        """ids of the parameters the attached stages check (stages with their hooks on)."""
        return {id(p) for s in self.stages if s.enabled for u in s.units for p in u.params}

    def check_(
        self,
        grads: Sequence[Tensor],
        label: str,
        *,
        carried: bool = False,
        zero: bool = True,
        sentinel: bool = False,
        tells: bool = False,
    ) -> Tensor | None:
        """One unit: flag (and zero) inf/NaN on the device, no host synchronisation; returns the flag.
        ``carried``: the unit's average, about to be computed, carries the value to every rank (module
        docstring); ``zero=False`` leaves the gradients as they are (a stateless average).
        ``sentinel`` (one carried tensor, averaged as a sum of terms already divided by the group size,
        which cannot overflow): a flagged tensor's first element is made NaN too, so that the average's
        first element alone tells whether any rank's tensor held inf/NaN. ``tells``: the reducer makes
        the average's first element so itself (:meth:`Reducer.average_tells
        <lowband.optim.reducer.Reducer.average_tells>`)."""
        if not self.enabled or not grads:
            return None
        if carried and len({g.device for g in grads}) == 1:
            flag = flag_(grads, zero=zero, ones=self._ones)
            sentinel = sentinel and len(grads) == 1 and grads[0].numel() > 0
            if sentinel:
                poison_(grads[0], flag)
            tells = tells and grads[0].numel() > 0
            self._carried.append((label, list(grads), flag, sentinel or tells))
            return flag
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for gs in by_device.values():
            self._flags.append(flag_(gs, zero=True, ones=self._ones))
            self._labels.append(label)
        return None

    def ride_(self, label: str, head: Tensor, flag: Tensor) -> None:
        """A carried unit checked where its reducer divides it by the group size before the sum
        (:func:`~lowband.optim.scaling.check_scaled_`: no read of its own) and made a sentinel with
        :func:`poison_` before the sum was issued: ``head`` (1 element, where the average's first element
        lands) tells whether any rank's unit held inf/NaN; ``flag`` is this rank's."""
        if self.enabled:
            self._carried.append((label, [head], flag, True))

    def discard(self) -> None:
        """Forget this round's flags (a pass that is not stepped)."""
        self._flags, self._labels, self._carried = [], [], []

    def decide(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> bool:
        """Collective over the strategy's group, once per step before stepping: True to step; False
        (``skip``, on every rank alike) after gradients set to None and reducer states put back; raises
        :class:`NonFiniteError` on every rank (``raise``). ``params``: named parameters whose gradients no
        stage checked (checked here, not zeroed; under :attr:`rides_data` they are the strategy's own
        averages, checked as the carried units' are)."""
        if not self.enabled:
            return True
        if self.deferred:
            return self._decide_local(params)
        grads = [(n, p.grad) for n, p in params if p.grad is not None]
        if grads and not self.rides_data:
            self.check_([g for _, g in grads], "")  # label filled in on the failure path
        for stage in self.stages:  # the carried units' averages are read below: complete them
            if stage.carries_nonfinite() and stage.pending():
                stage.wait()
        carried = self._carried
        flags = self._flags + [f for _, _, f, _ in carried]
        labels = self._labels + [label for label, _, _, _ in carried]
        exchange = bool(self._flags) or not self.rides_data
        self.discard()
        # the carried units' averages: identical on every rank, so is this check's outcome
        averaged = [gs[0].view(-1)[:1] if sentinel else g for _, gs, _, sentinel in carried for g in gs]
        spread = bool(averaged) and any_nonfinite(averaged)
        if not exchange and not spread:
            return True  # every rank's flag rode its data, and the averages are finite
        dev = flags[0].device if flags else torch.device("cpu")
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        if flags:
            bad = torch.cat([f.reshape(1).to(dev) for f in flags]) > 0
            # position + 1 of the first flagged unit, 0 when none (device-side)
            pos = torch.arange(1, len(flags) + 1, dtype=torch.float32, device=dev)
            local = torch.where(bad, pos, float(len(flags) + 1)).min().reshape(1)
            local = torch.where(local > len(flags), float(len(flags) + 1) if spread else 0.0, local)
        elif spread:
            local.fill_(1.0)
        vec = torch.zeros(self.group.size, dtype=torch.float32, device=dev)
        vec[self.group.rank : self.group.rank + 1] = local
        if self.group.size > 1:
            wire = vec.to("cpu") if self._host else vec
            if self.waiter is None:
                vec = allreduce(wire, op="max", group=self._fast)
            else:  # a strategy that beats, or watches for a lost peer, while it waits (on_peer_loss)
                vec = self.waiter(iallreduce(wire, op="max", group=self._fast))
        found = [int(v) for v in vec.tolist()]  # the one host read of the step
        if not any(found):
            return True
        if self.policy == "skip":
            self._skip(params)
            return False
        raise self._error(found, labels, grads)

    def _decide_local(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> bool:
        """:meth:`decide` for local steps: settle the agreements that have arrived, check this rank's
        gradients outside the stages (one host read) and drop them when non-finite (its local step
        updates nothing), take this step's stage flags (units zeroed before their layers were stepped or
        averaged), and, under ``raise``, start this step's agreement without waiting for it. Always
        True: the step goes on (a strategy's averaging inside it runs on every rank alike)."""
        self.settle(keep=MAX_PENDING - 1)
        flags, labels = self._flags, self._labels
        self.discard()
        grads = [(n, p.grad) for n, p in params if p.grad is not None]
        if not grads and not flags:
            return True
        bad = bool(grads) and any_nonfinite([g for _, g in grads])
        names = [n for n, g in grads if bad and not bool(torch.isfinite(g).all())]
        dev = flags[0].device if flags else grads[0][1].device
        # position + 1 of this rank's first flagged unit, len(labels) + 1 for a gradient outside the
        # stages, 0 when clean: device-side, no host read under raise
        local = torch.full((1,), float(len(labels) + 1) if bad else 0.0, dtype=torch.float32, device=dev)
        if flags:
            hit = torch.cat([f.reshape(1).to(dev) for f in flags]) > 0
            pos = torch.arange(1, len(flags) + 1, dtype=torch.float32, device=dev)
            first = torch.where(hit, pos, float(len(flags) + 1)).min().reshape(1)
            local = torch.where(first <= len(flags), first, local)
        own = names[0] if names else ""
        if self.policy == "raise" and self.group.size > 1:
            vec = torch.zeros(self.group.size, dtype=torch.float32, device=dev)
            vec[self.group.rank : self.group.rank + 1] = local
            handle = iallreduce(vec.to("cpu") if self._host else vec, op="max", group=self._fast)
            self._pending.append((handle, self._step(), own, labels))
        if bad:
            for _, p in params:
                p.grad = None
        # this rank's count: under raise among several ranks only what is known without a host read
        if bad or ((self.policy == "skip" or self.group.size == 1) and float(local.item()) > 0):
            self.skipped += 1
            if self.policy == "raise" and self.group.size == 1:
                self.settle_now(local, self._step(), own, labels)
        return True

    def settle(self, *, keep: int = 0) -> None:
        """Local steps: read the agreements started at earlier steps, oldest first, until ``keep`` are
        left in flight, and raise :class:`NonFiniteError` if one shows a rank's non-finite gradients.
        Where they are read is the same on every rank, so every rank raises at the same step: each step
        reads those beyond ``MAX_PENDING`` (issued that many steps ago: arrived, on any link), and the
        strategies read all of them in ``synchronize`` and in ``state_dict`` (no checkpoint is taken
        after a non-finite gradient went unreported). No rank enters an exchange that another, having
        raised, will not join, since all raise at the same step."""
        while len(self._pending) > keep:
            handle, step, own, labels = self._pending.popleft()
            found = handle.wait() if self.waiter is None else self.waiter(handle)
            self.settle_now(found, step, own, labels)

    def settle_now(self, found: Tensor, step: int, own: str, labels: Sequence[str] = ()) -> None:
        """Raise if ``found`` (one value per rank, :meth:`_decide_local`) names a rank; ``own``: this
        rank's bad parameter outside the stages, ``labels``: the stages' units in check order."""
        parts = []
        for r, v in enumerate(found.tolist()):
            k = int(v)
            if k <= 0:
                continue
            if k <= len(labels):
                what = f"unit {labels[k - 1]!r}"
            else:
                what = f"parameter {own!r}" if r == self.group.rank and own else "its gradients"
            parts.append(f"rank {self.group.ranks[r]} ({what})")
        if not parts:
            return
        raise NonFiniteError(
            f"{self.where}: a non-finite gradient (NaN or Inf) at step {step} on {', '.join(parts)}; "
            "dropped on that rank before anything stepped, averaged or stored it (its parameters stay "
            f"finite) and raised on every rank (at step {self._step()} here: local steps agree "
            "asynchronously, so no step waits for the check). Fix its cause (learning rate, loss, "
            "inputs), or pass on_nonfinite='skip' to drop such gradients"
        )

    def _skip(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        self.skipped += 1
        for s in self.stages:
            s.restore_reducer()
        for restore in self.restorers:
            restore()
        for p in [p for s in self.stages for u in s.units for p in u.params] + [p for _, p in params]:
            p.grad = None

    def _error(
        self, found: list[int], labels: list[str], grads: Sequence[tuple[str, Tensor]]
    ) -> NonFiniteError:
        parts = []
        if self.params_averaged and all(0 < k <= len(labels) and not labels[k - 1] for k in found):
            names = [n for n, g in grads if not bool(torch.isfinite(g).all())]
            what = f"parameter {names[0]!r}" if names else "a parameter"
            return NonFiniteError(
                f"{self.where}: the averaged gradient of {what} was non-finite (NaN or Inf) at step "
                f"{self._step()} on every rank alike: torch DDP averaged it during backward, so the rank "
                "it came from is not known; raised on every rank. Fix its cause (learning rate, loss, "
                "inputs), or pass on_nonfinite='skip' to skip such steps on every rank"
            )
        if all(k > len(labels) for k in found):  # every rank's own gradients were finite
            return NonFiniteError(
                f"{self.where}: the averaged gradient was non-finite (Inf or NaN) at step {self._step()} "
                "although every rank's own gradients were finite: their sum overflowed; raised on every "
                "rank. Lower the learning rate or the loss's scale, or pass on_nonfinite='skip' to skip "
                "such steps on every rank"
            )
        for r, k in enumerate(found):
            if not k or k > len(labels):
                continue
            label = labels[k - 1] if k <= len(labels) else ""
            if not label:  # outside the stages: this rank knows which parameter
                names = [n for n, g in grads if r == self.group.rank and not bool(torch.isfinite(g).all())]
                label = f"parameter {names[0]!r}" if names else "a gradient outside the gradient stage"
            else:
                label = f"unit {label!r}"
            parts.append(f"rank {self.group.ranks[r]} ({label})")
        return NonFiniteError(
            f"{self.where}: a non-finite gradient (NaN or Inf) at step {self._step()} on "
            f"{', '.join(parts)}; caught before it was communicated or stored, raised on every rank. Fix "
            "its cause (learning rate, loss, inputs), or pass on_nonfinite='skip' to skip such steps on "
            "every rank"
        )


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a reducer's state (its tensors cloned), to put back after a skipped step."""
    return copy.deepcopy(state)
