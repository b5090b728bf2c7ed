"""One round of the gradient stage handed over without waiting: every unit's handle, for whoever
consumes the round later (:meth:`GradientStage.hand_off <lowband.optim.stage.GradientStage.hand_off>`).

The gradient stage usually completes a round itself (:meth:`GradientStage.wait
<lowband.optim.stage.GradientStage.wait>`: the reduced gradients written into ``.grad`` before the
optimizer steps). A strategy that consumes a round later (SlimGC's model backup applies the round
launched at step ``i`` at step ``i + 1``, while ``.grad`` keeps this rank's own gradient) takes the
round's handles instead: a :class:`Reduction`, waited when its results are needed, in launch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.optim.reducer import Unit

Tensor = torch.Tensor


def settle(
    where: str, unit: Unit, handle: Handle[list[Tensor]], grads: list[Tensor], *, into_grads: bool
) -> list[Tensor]:
    """Wait for one unit's reduction and check its result (one tensor per gradient); with
    ``into_grads``, copy each reduced tensor into the gradient it came from (unless it is that tensor:
    a reducer that reduced in place)."""
    out = handle.wait()
    if len(out) != len(grads):
        raise InvalidArgumentError(
            f"{where}: the reducer returned {len(out)} tensors for unit {unit.key!r} of {len(grads)} gradients"
        )
    if into_grads:
        for g, r in zip(grads, out):
            if r is not g:
                g.copy_(r)
    return out


@dataclass(eq=False)
class Reduction:
    """A round of the gradient stage, launched and handed over: ``launched`` holds ``(unit index,
    handle, gradients given to the reducer)`` in launch order; ``step`` is the round's
    :attr:`ReduceContext.step <lowband.optim.reducer.ReduceContext.step>`."""

    where: str
    step: int
    units: Sequence[Unit]
    launched: list[tuple[int, Handle[list[Tensor]], list[Tensor]]]

    def done(self) -> bool:
        """True once every unit's reduction has finished; never blocks."""
        return all(h.done() for _, h, _ in self.launched)

    def wait(self, *, into_grads: bool = False) -> list[list[Tensor]]:
        """Every unit's reduced gradients, indexed like :attr:`units` (waited in launch order, each
        bounded by the runtime's timeout). ``into_grads`` also writes them into the gradients they were
        reduced from (``.grad``, if it still holds them), as :meth:`GradientStage.wait` does."""
        out: list[list[Tensor]] = [[] for _ in self.units]
        for i, h, grads in self.launched:
            out[i] = settle(self.where, self.units[i], h, grads, into_grads=into_grads)
        return out
