"""Gradient allreduce (BlueFog's ``DistributedGradientAllreduceOptimizer``, synchronous data parallel
SGD): gradients are averaged over the group, then the inner torch optimizer steps on every rank with
the same averaged gradient.

A layer's gradients leave as soon as they are complete in backward (post-accumulate-grad hooks, one
fused nonblocking allreduce per layer, in place on ``.grad``), overlapping the backward of the layers
before it; :meth:`~GradientAllreduceOptimizer.step` waits for them and steps. Layers that got no
gradient in a backward are sent when the backward ends (their missing gradients count as zeros), so
every rank sends every layer once per step, in the same order provided every rank uses the same layers.

``num_steps_per_communication = J`` accumulates the gradients of J backward passes locally before they
are sent (BlueFog's ``backward_passes_per_step``): the allreduce starts during the J-th backward; a
``step()`` after fewer backward passes sends what has accumulated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lowband.comm.fusion import igrouped_allreduce
from lowband.decentral.combine import Pending
from lowband.decentral.knobs import Knob, check_period
from lowband.decentral.optim_base import WrapperBase
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.layerwise import OptimizerFactory


class GradientAllreduceOptimizer(WrapperBase):
    """Averaged-gradient optimizer wrapping the torch optimizer ``make_optimizer`` builds.

    ``loss.backward(); opt.step()``; ``zero_grad()`` is refused while gradients are in flight.
    """

    num_steps_per_communication = Knob(check_period)

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        *,
        num_steps_per_communication: int = 1,
        group: Group | None = None,
    ) -> None:
        where, layers = self.model_layers("GradientAllreduceOptimizer", model, group)
        self.inner = self.build_inner(where, make_optimizer, layers)
        super().__init__(model, layers, group)
        self.num_steps_per_communication = num_steps_per_communication
        self._fast = self.group.unchecked()
        self._layer_of = {id(p): i for i, (_, ps) in enumerate(layers) for p in ps}
        self._ready = [0] * len(layers)
        self._sent: set[int] = set()  # layers sent since the last step
        self._passes = 0  # backward passes since the last step
        self._in_backward = False
        for _, ps in layers:
            for p in ps:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))  # type: ignore[no-untyped-call]

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._in_backward:
            if self._passes >= self.num_steps_per_communication:
                raise InvalidArgumentError(
                    f"{self.where}: more than num_steps_per_communication={self.num_steps_per_communication} "
                    "backward passes before step()"
                )
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)  # type: ignore[attr-defined]
        i = self._layer_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.layers[i][1]) and self._last_pass():
            self._send(i)

    def _last_pass(self) -> bool:
        return self._passes + 1 == self.num_steps_per_communication

    def _end_backward(self) -> None:
        try:
            if self._last_pass():
                for i in reversed(range(len(self.layers))):
                    self._send(i)
        finally:
            self._ready = [0] * len(self.layers)
            self._passes += 1
            self._in_backward = False

    def _send(self, i: int) -> None:
        if i in self._sent:
            return
        self._sent.add(i)
        grads = []
        for p in self.layers[i][1]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        h = igrouped_allreduce(grads, "average", inplace=True, name=self.layer_name(i), group=self._fast)
        self._pending[i] = Pending([h], lambda r: list(r[0]))

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Send the layers not yet sent (in layer order), wait for every average, step the inner optimizer."""
        if closure is not None:
            raise InvalidArgumentError(f"{self.where}: step(closure) is not supported")
        for i in range(len(self.layers)):
            self._send(i)
        self.synchronize()
        self.inner.step()
        self._sent.clear()
        self._passes = 0
        self.steps += 1
        return None

    def synchronize(self) -> None:
        """Wait for every gradient average in flight (the gradients are then averaged in place)."""
        for i in sorted(self._pending):
            self._pending.pop(i).wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise InvalidArgumentError(
                f"{self.where}: zero_grad() while gradients are being averaged (after backward, before step)"
            )
        self.inner.zero_grad(set_to_none=set_to_none)
