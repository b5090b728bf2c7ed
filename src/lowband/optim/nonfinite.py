"""One non-finite policy for every strategy: a NaN or an infinity in a gradient is caught before it is
communicated or stored in any residual, and every rank learns it in the same step.

Where the check runs (always device-side, fused with work already done, no host synchronisation):

- on a gradient stage (:class:`~lowband.optim.stage.GradientStage`: every reducer, compressor, sketch,
  SlimGC, the layer-stepping strategies), per unit, right before the unit is handed to its reducer (or
  stepped): :func:`lowband.optim.scaling.zero_nonfinite_`, the fused kernel fp16 unscaling already runs,
  with a scale of 1. A unit holding inf/NaN on this rank is zeroed there, so no reducer, compressor,
  error-feedback residual or layer step ever sees the value, and its flag is remembered (one 1-element
  tensor per unit, on the device);
- the gradients the stages do not cover (torch DDP's, local SGD's, the decentralized strategies' local
  steps, embedding tables), once, when the strategy is about to step (:meth:`NonFiniteGuard.decide`).

Then, once per step, before the optimizer step, :meth:`NonFiniteGuard.decide` makes the ranks agree: one
allreduce-max of a vector of ``world`` floats (this rank's slot: the position + 1 of its first non-finite
unit, 0 when clean) and one host read of it, the decision every policy needs on the host anyway. By the
policy (the ``on_nonfinite`` option of every strategy):

- ``"raise"`` (the default): :class:`~lowband.errors.NonFiniteError` on every rank, naming each rank that
  held a non-finite value, its unit and the step;
- ``"skip"``: the step is skipped on every rank, as torch's ``GradScaler`` does: no parameter is updated
  and the optimizer state is untouched (the gradients are set to ``None``, which every torch optimizer
  skips), and the reducers' state (error-feedback residuals, counters) is put back as it was when the
  step began (a copy taken at the start of each reduction: ``skip`` costs one copy of the reducers'
  state per step; ``raise`` costs nothing of the kind). Strategies that step layers during backward
  cannot skip (their layers are stepped before the whole gradient is known) and refuse ``skip``.

With an fp16 ``GradScaler`` (:mod:`lowband.optim.scaling`) overflows are the scaler's to handle (it
skips the step everywhere and backs the scale off): the guard steps aside. ``LOWBAND_CHECK_FINITE=off``
(:mod:`lowband.compress.finite`) turns the guard off too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lowband.comm.collectives import allreduce
from lowband.errors import InvalidArgumentError, NonFiniteError
from lowband.group import Group
from lowband.optim.scaling import zero_nonfinite_

if TYPE_CHECKING:
    from lowband.optim.stage import GradientStage

Tensor = torch.Tensor

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
        self._ones: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        #: state put back on a skipped step besides the stages' reducers (e.g. PowerSGD's comm hook)
        self.restorers: list[Callable[[], None]] = []

    def attach(self, stage: GradientStage) -> None:
        """``stage`` checks each unit through this guard (and keeps its reducer's state for ``skip``)."""
        if stage not in self.stages:
            self.stages.append(stage)
            stage.guard = self

    def covered(self) -> set[int]:
        """ids of the parameters the attached stages check (stages with their hooks on)."""
        return {id(p) for s in self.stages if s.enabled for u in s.units for p in u.params}

    def check_(self, grads: Sequence[Tensor], label: str) -> None:
        """One unit: flag (and zero) inf/NaN on the device, no host synchronisation."""
        if not self.enabled or not grads:
            return
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for dev, gs in by_device.items():
            if dev.type == "cpu":
                # on the CPU a host decision costs nothing: one read pass (the sums: inf/NaN anywhere
                # makes them non-finite), confirmed element-wise only if a sum is not finite (large
                # finite values can overflow a sum); gradients written only when one is bad
                dense = [g._values() if g.is_sparse else g for g in gs]
                sums = [g.sum(dtype=torch.float32 if g.element_size() < 4 else None) for g in dense]
                bad = bool(sums) and not bool(torch.isfinite(torch.stack([x.double() for x in sums]).sum()))
                if bad:
                    bad = not all(bool(torch.isfinite(g).all()) for g in dense)
                if bad:
                    for g in gs:
                        (g._values() if g.is_sparse else g).zero_()
                self._flags.append(torch.full((1,), float(bad), dtype=torch.float32, device="cpu"))
            else:  # on an accelerator: flagged and zeroed on the device, no host synchronisation
                one = self._ones.get((dev, torch.float32))
                if one is None:
                    one = self._ones[(dev, torch.float32)] = torch.ones(1, dtype=torch.float32, device=dev)
                self._flags.append(zero_nonfinite_(gs, one))
            self._labels.append(label)

    def discard(self) -> None:
        """Forget this round's flags (a pass that is not stepped)."""
        self._flags, self._labels = [], []

    def decide(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> bool:
        """Collective over the strategy's group, once per step before stepping: True to step; False
        (``skip``, on every rank alike) after gradients set to None and reducer states put back; raises
        :class:`NonFiniteError` on every rank (``raise``). ``params``: named parameters whose gradients no
        stage checked (checked here, not zeroed)."""
        if not self.enabled:
            return True
        grads = [(n, p.grad) for n, p in params if p.grad is not None]
        if grads:
            self.check_([g for _, g in grads], "")  # label filled in on the failure path
        flags, labels = self._flags, self._labels
        self.discard()
        dev = flags[0].device if flags else torch.device("cpu")
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        if flags:
            bad = torch.cat([f.reshape(1).to(dev) for f in flags]) > 0
            # position + 1 of the first flagged unit, 0 when none (device-side)
            pos = torch.arange(1, len(flags) + 1, dtype=torch.float32, device=dev)
            local = torch.where(bad, pos, float(len(flags) + 1)).min().reshape(1)
            local = torch.where(local > len(flags), 0.0, local)
        vec = torch.zeros(self.group.size, dtype=torch.float32, device=dev)
        vec[self.group.rank : self.group.rank + 1] = local
        if self.group.size > 1:
            vec = allreduce(vec.to("cpu") if self._host else vec, op="max", group=self._fast)
        found = [int(v) for v in vec.tolist()]  # the one host read of the step
        if not any(found):
            return True
        if self.policy == "skip":
            self._skip(params)
            return False
        raise self._error(found, labels, grads)

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
        for r, k in enumerate(found):
            if not k:
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
