"""Block-level horizontal scheduling of the dense layers (EmbRace, "Accelerating Sparse Communication for
Distributed Training of Deep Neural Networks", section 4.2.1), for the ``embrace`` strategy.

Each dense layer (a module owning parameters: a block, whose parameters travel together) is reduced by
the gradient stage as soon as its gradients are complete in backward, through a
:class:`~lowband.optim.reducer.PriorityReducer`: one communication thread runs the reductions in
forward order as far as readiness allows, in an order negotiated with every rank
(:class:`~lowband.comm.priority.NegotiatedQueue`). Nothing waits for them at ``step()``: layer ``i`` is
completed and stepped (its own torch optimizer, :class:`~lowband.optim.LayerwiseOptimizer`'s inner ones)
in the forward pre-hook of its module, just before the next forward reads it, so the reductions of
the later layers overlap the forward of the earlier ones (and the next step's embedding lookups, which
the strategy issues ahead of the forward). A layer the next forward does not read is stepped before
the next backward, and :meth:`BlockSchedule.finish_all` steps every layer still due (before
evaluation, checkpoints and clipping).

The updates are the ones a synchronous step would make, each applied before its layer is next read.
"""

from __future__ import annotations

from torch import nn

from lowband.comm.priority import NegotiatedQueue
from lowband.group import Group
from lowband.optim.layerwise import LayerwiseOptimizer, layer_pre_hooks
from lowband.optim.reducer import AllreduceReducer, PriorityReducer, layer_units, parameter_names
from lowband.optim.stage import GradientStage
from lowband.strategies.base import OptimizerFactory


class BlockSchedule:
    """The dense ``layers`` of ``model`` (forward order) reduced in priority order and stepped lazily;
    see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[tuple[str, list[nn.Parameter]]],
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        timeout: float,
        where: str,
    ) -> None:
        self.layers = layers
        self.optimizer = LayerwiseOptimizer(layers, make_optimizer)
        self.optimizer.enabled = False  # stepped here, not from its own backward hooks
        self.optimizer.remove_hooks()
        units = layer_units(layers, parameter_names(model))
        self.queue = NegotiatedQueue(
            len(units), group=group.unchecked(), timeout=timeout, where=f"{where} blocks"
        )
        self.stage = GradientStage(
            units, PriorityReducer(AllreduceReducer(), self.queue, units), group=group, where=where
        )
        self.due: set[int] = set()  # layers reduced (or in flight) and not stepped yet
        self._hooks = layer_pre_hooks(model, layers, self, BlockSchedule.finish)

    def end_step(self) -> None:
        """The step of the dense layers: each is now due, stepped when its reduction is needed."""
        self.due = set(range(len(self.layers)))

    def finish(self, i: int) -> None:
        """Complete layer ``i``'s reduction and step it, if it is due."""
        if i not in self.due:
            return
        self.due.discard(i)
        self.stage.complete(i)
        opt = self.optimizer.optimizers[i]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def finish_all(self) -> None:
        """Step every layer still due (forward order); completes the stage's reduction."""
        for i in sorted(self.due):
            self.finish(i)
        self.stage.wait()

    def zero_grad(self) -> None:
        """Clear the gradients of the layers not due (a due layer's are its reduced gradients)."""
        for i, opt in enumerate(self.optimizer.optimizers):
            if i not in self.due:
                opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.stage.remove_hooks()
        self.queue.close()
