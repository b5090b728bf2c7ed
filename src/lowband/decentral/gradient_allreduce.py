"""Gradient allreduce (BlueFog's ``DistributedGradientAllreduceOptimizer``, synchronous data parallel
SGD): gradients are averaged over the group, then the inner torch optimizer steps on every rank with
the same averaged gradient.

It is the gradient stage (:class:`lowband.optim.GradientStage`) with one unit per layer and the
:class:`~lowband.optim.AllreduceReducer`: a layer's gradients leave as soon as they are complete in
backward (one fused nonblocking allreduce per layer, in place on ``.grad``, in backward order),
overlapping the backward of the layers before it; :meth:`~GradientAllreduceOptimizer.step` waits for
them and steps. Layers that got no gradient in a backward are sent when the backward ends (their
missing gradients count as zeros), so every rank sends every layer once per step, in the same order.

``num_steps_per_communication = J`` accumulates the gradients of J backward passes locally before they
are sent (BlueFog's ``backward_passes_per_step``): the allreduce starts during the J-th backward; a
``step()`` after fewer backward passes sends what has accumulated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lowband.decentral.knobs import check_period
from lowband.decentral.optim_base import WrapperBase
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.layerwise import OptimizerFactory
from lowband.optim.reducer import AllreduceReducer, layer_units, parameter_names
from lowband.optim.stage import GradientStage


class GradientAllreduceOptimizer(WrapperBase):
    """Averaged-gradient optimizer wrapping the torch optimizer ``make_optimizer`` builds.

    ``loss.backward(); opt.step()``; ``zero_grad()`` is refused while gradients are in flight.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        *,
        num_steps_per_communication: int = 1,
        group: Group | None = None,
        broadcast_init: bool = True,
    ) -> None:
        where, layers = self.model_layers("GradientAllreduceOptimizer", model, group)
        self.inner = self.build_inner(where, make_optimizer, layers)
        super().__init__(
            model, layers, group, broadcast_init=broadcast_init
        )  # checks the layout on every rank
        self.stage = GradientStage(
            layer_units(layers, parameter_names(model)),
            AllreduceReducer(),
            group=self.group,
            check_layout=False,
            where="GradientAllreduceOptimizer",
        )
        self.num_steps_per_communication = num_steps_per_communication

    @property
    def num_steps_per_communication(self) -> int:
        """J: backward passes accumulated per allreduce (a knob, settable before every step)."""
        return self.stage.accumulate

    @num_steps_per_communication.setter
    def num_steps_per_communication(self, value: int) -> None:
        self.stage.accumulate = check_period(self, "num_steps_per_communication", value)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Send the layers not yet sent, wait for every average, step the inner optimizer."""
        if closure is not None:
            raise InvalidArgumentError(f"{self.where}: step(closure) is not supported")
        self.synchronize()
        self.inner.step()
        self.steps += 1
        return None

    def synchronize(self) -> None:
        """Complete the gradient averages (sending what has accumulated; the gradients are then
        averaged in place)."""
        self.stage.wait()

    def in_flight(self) -> list[int]:
        return self.stage.in_flight()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage.in_flight():
            raise InvalidArgumentError(
                f"{self.where}: zero_grad() while gradients are being averaged (after backward, before step)"
            )
        self.inner.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self.stage.remove_hooks()

    def counters(self) -> dict[str, Any]:
        return {**super().counters(), "rounds": self.stage.rounds}

    def load_counters(self, counters: dict[str, Any]) -> None:
        super().load_counters(counters)
        self.stage.rounds = int(counters.get("rounds", self.steps))
