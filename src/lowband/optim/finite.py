"""The device-side reads of the non-finite check (:mod:`lowband.optim.nonfinite`): a unit's flag (and
zeroing), a host decision over a few gradients, and the NaN sentinel a carried unit's average tells by."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lowband.optim.scaling import zero_nonfinite_

Tensor = torch.Tensor


def flag_(
    grads: Sequence[Tensor], *, zero: bool, ones: dict[tuple[torch.device, torch.dtype], Tensor]
) -> Tensor:
    """1.0 where ``grads`` (one device) hold inf/NaN, else 0.0, as a 1-element float32 tensor on their
    device; with ``zero`` every one of them is zeroed when one is bad."""
    dev = grads[0].device
    if dev.type == "cpu":
        # on the CPU a host decision costs nothing: one read pass (the sums), confirmed element-wise
        # only if a sum is not finite; gradients written only when one is bad
        bad = any_nonfinite(grads)
        if bad and zero:
            for g in grads:
                (g._values() if g.is_sparse else g).zero_()
        return torch.full((1,), float(bad), dtype=torch.float32, device="cpu")
    # on an accelerator: flagged (and zeroed) on the device, no host synchronisation
    one = ones.get((dev, torch.float32))
    if one is None:
        one = ones[(dev, torch.float32)] = torch.ones(1, dtype=torch.float32, device=dev)
    if zero:
        return zero_nonfinite_(grads, one)
    flag = torch.zeros(1, dtype=torch.float32, device=dev)
    with torch.no_grad():  # multiplied by 1: torch's fused check, nothing written
        torch._amp_foreach_non_finite_check_and_unscale_(
            [g._values() if g.is_sparse else g for g in grads], flag, one
        )
    return flag


def any_nonfinite(grads: Sequence[Tensor]) -> bool:
    """True if any of ``grads`` holds inf/NaN (a host decision: one read pass, the sums, added in float64
    and read once; a non-finite sum confirmed element-wise, since large finite values can overflow it)."""
    dense = [g._values() if g.is_sparse else g for g in grads]
    sums = [g.sum(dtype=torch.float32 if g.element_size() < 4 else None) for g in dense]
    if not sums:
        return False
    dev = sums[0].device
    if dev.type == "cpu":  # added on the host as Python floats (tensor ops' overhead is the cost here)
        if math.isfinite(sum(x.item() for x in sums)):
            return False
    elif bool(torch.isfinite(torch.stack([x.to(dev, torch.float64) for x in sums]).sum())):
        return False  # one host read: the sums added on their device
    return not all(bool(torch.isfinite(g).all()) for g in dense)


def poison_(wire: Tensor, flag: Tensor) -> None:
    """Make ``wire``'s first element NaN where ``flag`` (1 element) is set, so that every rank's sum of
    it is NaN; on the CPU a host branch, elsewhere device-side with no host synchronisation."""
    if wire.numel() == 0:
        return
    head = wire.view(-1)[:1]
    if flag.device.type == "cpu" and head.device.type == "cpu":
        if flag.item() > 0:
            head.fill_(math.nan)
        return
    nan = torch.tensor(math.nan, dtype=head.dtype, device=head.device)
    head.copy_(torch.where(flag.to(head.device) > 0, nan, head))
