"""fp16 loss scaling for data-parallel strategies: gradients unscaled before anything reads them,
inf/NaN agreed over the ranks, the step skipped on every rank together.

torch's :class:`torch.amp.GradScaler` assumes one process reads the gradients once, at ``step``. A
strategy that compresses (or otherwise transforms) gradients inside backward hooks sees them *scaled*:
an error-feedback memory would hold scaled values (wrong after every change of the scale) and an
overflowed gradient would poison it with inf/NaN for good. :class:`GradUnscaler` is the scaler's
companion that fixes this, in one of two modes:

- ``per_unit=True`` (the gradient stage, a DDP comm hook): :meth:`GradUnscaler.unscale_` divides each
  unit's gradients by the scale with torch's own fused kernel
  (``torch._amp_foreach_non_finite_check_and_unscale_``, the one ``GradScaler.unscale_`` uses: the inf
  check stays on the device, no host synchronisation), *before* the unit is handed to a reducer; a unit
  holding inf/NaN on this rank is zeroed (``masked_fill_`` on the device flag), so no inf/NaN reaches a
  compressor or an error-feedback memory, and the flag is remembered;
- ``per_unit=False`` (gradients read only at ``step``: DDP's allreduce, local SGD, no communication):
  torch's ``GradScaler.unscale_`` unscales ``.grad`` as usual.

Then :meth:`GradUnscaler.finish` (before clipping or the optimizer step) makes the ranks agree on the
flag when asked (one allreduce-max of a 1-element tensor: a data value, no host synchronisation on
NCCL) and records it for the optimizer as ``GradScaler.unscale_`` records its own, so
``scaler.step(optimizer)`` skips the step on every rank when any rank overflowed, and
``scaler.update()`` backs the scale off, exactly as documented for torch's scaler.

This is the one place lowband touches a ``GradScaler``'s private state (``_scale`` and
``_per_optimizer_states``, torch 2.13): :func:`record_found_inf` writes what ``unscale_`` would have
written; ``tests/test_precision.py`` checks it against torch's own ``unscale_`` so a change in torch
fails a test rather than training.

A step skipped for an overflow still consumed the units' error-feedback memories (the zeroed gradient
plus the memory was compressed and exchanged, its result discarded by the skipped step): rare, finite,
and the price of never blocking the backward for the flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.amp.grad_scaler import GradScaler, OptState

from lowband.comm.collectives import allreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group

Tensor = torch.Tensor


def scale_of(scaler: GradScaler, where: str) -> Tensor:
    """The scaler's current scale tensor (on its device); an error before the first ``scaler.scale``."""
    scale: Tensor | None = getattr(scaler, "_scale", None)
    if scale is None:
        raise InvalidArgumentError(
            f"{where}: the GradScaler has no scale yet: scale the loss (scaler.scale(loss)) before backward"
        )
    return scale


def record_found_inf(
    scaler: GradScaler, optimizer: torch.optim.Optimizer, found_inf: Tensor, where: str
) -> None:
    """Record ``found_inf`` (1 element, float32, > 0: skip) for ``optimizer`` as ``scaler.unscale_``
    does, so that ``scaler.step(optimizer)`` and ``scaler.update()`` act on it."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.READY:
        raise InvalidArgumentError(
            f"{where}: the gradients were already unscaled or stepped since the last scaler.update()"
        )
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.UNSCALED


def zero_nonfinite_(grads: Sequence[Tensor], inv_scale: Tensor) -> Tensor:
    """The one fused check of a unit's gradients (all on ``inv_scale``'s device): multiplied by
    ``inv_scale`` in place with torch's own kernel (``torch._amp_foreach_non_finite_check_and_unscale_``,
    the one ``GradScaler.unscale_`` uses), then, if any held inf/NaN, every one of them zeroed
    (``masked_fill_`` on the device flag). Returns the flag (1 element, float32, 1.0: non-finite found) on
    the device, without a host synchronisation. ``inv_scale`` = 1 checks without unscaling (the non-finite
    policy, :mod:`lowband.optim.nonfinite`)."""
    with torch.no_grad():
        # a sparse gradient (an embedding table's) is checked through its values, as GradScaler does
        dense = [g._values() if g.is_sparse else g for g in grads]
        flag = torch.zeros(1, dtype=torch.float32, device=inv_scale.device)
        torch._amp_foreach_non_finite_check_and_unscale_(dense, flag, inv_scale)
        bad = flag.bool()
        for g in dense:
            g.masked_fill_(bad, 0.0)
    return flag


def exact_scale(n: int) -> bool:
    """True if multiplying by ``1/n`` is exact (``n`` a power of two): then dividing each rank's
    gradients by ``n`` before the sum, instead of the sum by ``n`` after it, gives the same average
    bit for bit, and that division can carry the non-finite check (:func:`check_scaled_`)."""
    return n >= 1 and n & (n - 1) == 0


def check_scaled_(tensors: Sequence[Tensor], scale: float) -> Tensor:
    """Flag inf/NaN in ``tensors`` (dense, one device) and multiply them by ``scale`` in place, in one
    pass of torch's fused kernel (``torch._amp_foreach_non_finite_check_and_unscale_``): where the
    gradients are divided by the group size anyway, the check costs nothing beyond that division
    (measured on the CPU: the kernel takes what ``div_`` alone takes). The flag is the values' as given
    (1 element, float32, 1.0: found), on their device, with no host synchronisation."""
    dev = tensors[0].device
    flag = torch.zeros(1, dtype=torch.float32, device=dev)
    with torch.no_grad():
        torch._amp_foreach_non_finite_check_and_unscale_(
            list(tensors), flag, torch.full((1,), scale, dtype=torch.float32, device=dev)
        )
    return flag


class GradUnscaler:
    """Unscales gradients for a strategy trained with a :class:`torch.amp.GradScaler` (module docstring)."""

    def __init__(self, scaler: GradScaler, *, per_unit: bool, agree: bool, where: str) -> None:
        if not isinstance(scaler, GradScaler):
            raise InvalidArgumentError(
                f"{where}: expected a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        if not scaler.is_enabled():
            raise InvalidArgumentError(
                f"{where}: the GradScaler is disabled (it would scale nothing); pass none"
            )
        self.scaler = scaler
        self.per_unit = per_unit
        self.agree = agree
        self.where = where
        self._inv: dict[torch.device, Tensor] = {}
        self._found: dict[torch.device, Tensor] = {}

    def _inv_scale(self, device: torch.device) -> Tensor:
        inv = self._inv.get(device)
        if inv is None:
            # as GradScaler.unscale_: the reciprocal in float64 (float32 division can be imprecise)
            inv = scale_of(self.scaler, self.where).double().reciprocal().float().to(device)
            self._inv[device] = inv
        return inv

    def unscale_(self, grads: Sequence[Tensor]) -> None:
        """Unscale one unit's gradients in place (on their devices, no host synchronisation); a unit
        holding inf/NaN is zeroed and flagged (see the module docstring)."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            if g.dtype == torch.float16:
                raise InvalidArgumentError(
                    f"{self.where}: float16 gradients cannot be unscaled (their parameters are float16); keep "
                    "the parameters in float32 and run forward under torch.autocast"
                )
            by_device.setdefault(g.device, []).append(g)
        for dev, gs in by_device.items():
            flag = zero_nonfinite_(gs, self._inv_scale(dev))
            found = self._found.get(dev)
            if found is None:
                self._found[dev] = flag
            else:
                found.add_(flag)

    def discard(self) -> None:
        """Forget the flags of units unscaled since the last :meth:`finish` (a pass that is not stepped)."""
        self._found = {}

    def finish(self, optimizer: torch.optim.Optimizer, group: Group | None) -> None:
        """Before clipping or stepping: unscale ``.grad`` (torch's way, unless done per unit), agree on
        the flag over ``group`` (when :attr:`agree`), and record it for ``optimizer``."""
        if not self.per_unit:
            self.scaler.unscale_(optimizer)
            state = self.scaler._per_optimizer_states[id(optimizer)]
            if not self.agree or group is None or group.size == 1:
                return
            self._found = dict(state["found_inf_per_device"])
            state["found_inf_per_device"] = {}
            state["stage"] = OptState.READY
        scale = scale_of(self.scaler, self.where)
        found = torch.zeros(1, dtype=torch.float32, device=scale.device)
        for flag in self._found.values():
            found.add_(flag.reshape(1).to(scale.device))
        if self.agree and group is not None and group.size > 1:
            found = allreduce(found, op="max", group=group)
        self._found = {}
        self._inv = {}  # the scale may change at scaler.update()
        record_found_inf(self.scaler, optimizer, found, self.where)
