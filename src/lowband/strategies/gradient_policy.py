"""What a strategy does with the gradients it is handed, apart from the loop: fp16 loss scaling
(:meth:`GradientPolicies.set_grad_scaler`, :mod:`lowband.optim.scaling`) and the non-finite policy
(:meth:`GradientPolicies.set_nonfinite`, :mod:`lowband.optim.nonfinite`). A base of
:class:`~lowband.strategies.Strategy` (the precision paragraph of :mod:`lowband.strategies.base`).
"""

from __future__ import annotations

import torch
from torch import nn

from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.optim.nonfinite import NonFiniteGuard
from lowband.optim.scaling import GradUnscaler
from lowband.optim.stage import GradientStage


class GradientPolicies:
    """fp16 loss scaling and the non-finite policy of a strategy (its :class:`Strategy` attributes)."""

    name: str
    steps_in_backward: bool
    group: Group
    steps: int
    optimizer: torch.optim.Optimizer
    local_module: nn.Module
    #: why fp16 loss scaling (:meth:`set_grad_scaler`) is refused (None: supported). Refused unless a
    #: strategy says how its gradients are unscaled before they are communicated or stepped.
    no_grad_scaler_reason: str | None = (
        "it has not been made safe for loss scaling (its gradients could be communicated or applied while "
        "still scaled)"
    )
    #: with a scaler: unscale each unit before communicating it (True; the strategy wires
    #: :attr:`unscaler` in :meth:`_attach_unscaler`) or ``.grad`` once before the step (False)
    unscale_per_unit: bool = False
    #: with a scaler: the ranks agree on inf/NaN before stepping (one 1-element allreduce per step);
    #: False only where the gradients are identical on every rank already (DDP's allreduce) or the
    #: ranks never communicate
    agree_found_inf: bool = True
    grad_scaler: torch.amp.GradScaler | None = None
    unscaler: GradUnscaler | None = None
    _grads_unscaled: bool = False

    def finish_gradients(self) -> None:
        """Complete the gradient communication of the last backward (the gradients in ``.grad`` are the
        ones :meth:`step` will apply once this returns)."""

    # -- fp16 loss scaling ------------------------------------------------------------------------
    def set_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Train with fp16 loss scaling by ``scaler`` (see the module docstring); every rank, before the
        first step. Raises :class:`InvalidArgumentError` where the strategy cannot do it correctly."""
        where = f"{type(self).__name__}.set_grad_scaler on rank {self.group.world_rank}"
        reason = self.no_grad_scaler_reason
        if reason is None and self.steps_in_backward and not self.local_steps:
            reason = "it steps each layer during backward, before the whole gradient is known to be finite"
        if reason is not None:
            raise InvalidArgumentError(
                f"{where}: strategy {self.name!r} cannot train with fp16 loss scaling: {reason}; use bf16 "
                "(--precision bf16: no scaler needed) or fp32"
            )
        if self.grad_scaler is not None or self.steps:
            raise InvalidArgumentError(f"{where}: set the grad scaler once, before the first step")
        self.unscaler = GradUnscaler(
            scaler, per_unit=self.unscale_per_unit, agree=self.agree_found_inf, where=where
        )
        self.grad_scaler = scaler
        self._attach_unscaler(self.unscaler)

    def _attach_unscaler(self, unscaler: GradUnscaler) -> None:
        """Strategies with :attr:`unscale_per_unit` hand ``unscaler`` to where units are communicated."""

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the grad scaler's scale (``loss`` itself without a scaler)."""
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    def unscale_gradients(self) -> None:
        """With a grad scaler: the gradients in ``.grad`` unscaled (once per step) and the ranks' inf/NaN
        flags agreed and recorded for the optimizer; nothing without one. Call after
        :meth:`finish_gradients`."""
        if self.unscaler is None or self._grads_unscaled:
            return
        self.unscaler.finish(self.optimizer, self.group)
        self._grads_unscaled = True

    def optimizer_step(self) -> None:
        """The wrapped optimizer's step; with a grad scaler, after :meth:`unscale_gradients`, skipped on
        every rank when any rank's gradients held inf/NaN, then the scale updated."""
        if not self.check_nonfinite():
            return  # skipped on every rank: no optimizer step (nor a model averager's count or average)
        if self.grad_scaler is None:
            self.optimizer.step()
            return
        self.unscale_gradients()
        # GradScaler.step decides on the host whether to skip: it reads the agreed flag (a host
        # synchronisation on accelerators, unavoidable: skipping is host control flow)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._grads_unscaled = False

    # -- the non-finite policy (lowband.optim.nonfinite) ------------------------------------------
    nonfinite: NonFiniteGuard | None = None
    #: why on_nonfinite="skip" is refused (None: supported, unless the strategy steps in backward)
    no_skip_reason: str | None = None
    #: each rank steps its own replica between exchanges: the non-finite flags are agreed asynchronously
    #: (:mod:`lowband.optim.nonfinite`, "Local steps"), not at every step
    local_steps = False

    def set_nonfinite(self, policy: str) -> None:
        """Catch non-finite gradients by ``policy`` ("raise", "skip" or "off", :mod:`lowband.optim.nonfinite`);
        :func:`~lowband.strategies.make_strategy` calls it (option ``on_nonfinite``, default "raise").
        Every rank alike, before the first step."""
        where = f"{type(self).__name__} (on_nonfinite={policy!r}) on rank {self.group.world_rank}"
        reason = self.no_skip_reason
        if reason is None and self.steps_in_backward and not self.local_steps:
            reason = "it steps each layer during backward, before the whole gradient is known to be finite"
        if policy == "skip" and reason is not None:
            raise InvalidArgumentError(
                f"{where}: strategy {self.name!r} cannot skip a step: {reason}; use on_nonfinite='raise'"
            )
        self.nonfinite = NonFiniteGuard(
            policy,
            self.nonfinite_group(),
            where=where,
            step=lambda: self.steps,
            channel=self.nonfinite_channel(),
        )
        for stage in self.gradient_stages():
            self.nonfinite.attach(stage)
        self.nonfinite.rides_data = self.nonfinite_rides_data()
        # local steps agree late: without stages, or with layers stepped in backward (dreamddp: every
        # unit zeroed before its layer is stepped or averaged); a stage that reduces agrees every step
        self.nonfinite.deferred = self.local_steps and (not self.nonfinite.stages or self.steps_in_backward)

    def nonfinite_rides_data(self) -> bool:
        """True if every gradient the non-finite guard sees is averaged by a plain allreduce before the
        step is decided (:mod:`lowband.optim.nonfinite`: no exchange on clean steps): by default, when
        the gradient stages cover every trainable parameter and each carries its inf/NaN."""
        guard = self.nonfinite
        if guard is None or not guard.stages or not all(s.carries_nonfinite() for s in guard.stages):
            return False
        trainable = {id(p) for p in self.local_module.parameters() if p.requires_grad}
        return trainable <= guard.covered()

    def nonfinite_group(self) -> Group:
        """The ranks that step together and so agree on their gradients' finiteness every step: the
        strategy's group (a strategy whose ranks take different numbers of steps narrows it)."""
        return self.group

    def nonfinite_channel(self) -> Group | None:
        """A private group to agree the non-finite flags on, for strategies whose data group another
        thread uses at step time (None: the data group)."""
        return None

    def gradient_stages(self) -> list[GradientStage]:
        """The gradient stages whose units the non-finite guard checks before they are communicated or
        stepped: by default those held as ``stage`` by the strategy, its optimizer, or the optimizer's
        ``layerwise`` part; strategies keeping stages elsewhere override it."""
        owners = (self, self.optimizer, getattr(self.optimizer, "layerwise", None))
        found = [getattr(o, "stage", None) for o in owners]
        return [s for i, s in enumerate(found) if isinstance(s, GradientStage) and s not in found[:i]]

    def settle_nonfinite(self, where: str) -> None:
        """Local steps: read every non-finite agreement still in flight (:meth:`NonFiniteGuard.settle`),
        before ``where`` (an exchange, ``synchronize``, ``state_dict``); a dead peer met there is named
        as the step's check names it."""
        if self.nonfinite is None:
            return
        try:
            self.nonfinite.settle()
        except (CommFailedError, CommTimeoutError) as exc:
            raise type(exc)(
                f"strategy {self.name!r}: the non-finite agreements read before {where} at step {self.steps} "
                f"on rank {self.group.world_rank}: {exc}"
            ) from exc

    def check_nonfinite(self) -> bool:
        """Before stepping, once per step, on every rank: the gradients' finiteness agreed (one tiny
        allreduce and one host read); raises :class:`~lowband.errors.NonFiniteError` on every rank
        (policy "raise") or returns False with every gradient set to None (policy "skip": the optimizer
        step that follows updates nothing); True to step. With a grad scaler the scaler decides."""
        guard = self.nonfinite
        if guard is None or self.grad_scaler is not None:
            return True
        self.finish_gradients()
        covered = guard.covered()
        try:
            return guard.decide(
                [(n, p) for n, p in self.local_module.named_parameters() if id(p) not in covered]
            )
        except (CommFailedError, CommTimeoutError) as exc:  # a dead or stopped peer, met at the agreement
            raise type(exc)(
                f"strategy {self.name!r}: the non-finite check at step {self.steps} on rank "
                f"{self.group.world_rank}: {exc}"
            ) from exc
