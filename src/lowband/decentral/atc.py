"""Adapt-Then-Combine (BlueFog paper §V-C, Eq. 23): ``x_i <- sum_j w_ij (x_j - lr * g_j(x_j))``.

Each layer is stepped by its own torch optimizer as soon as its gradients are complete in backward
(:class:`lowband.optim.LayerwiseOptimizer`), and right then the nonblocking combination of that layer's
updated parameters starts (one fused operation per layer), so it overlaps the backward of the layers
before it and everything up to that layer's next forward. It is completed, and the combined values
written into the parameters, in the layer's forward pre-hook of the next iteration, before the layer's
next optimizer step, or at :meth:`~AdaptThenCombineOptimizer.synchronize` (call it before reading the
parameters otherwise: evaluation, checkpoints).

With momentum or Adam the inner optimizer adapts from the combined iterate of the previous iteration;
its state (momentum buffers, moments) stays local.

``num_steps_per_communication = J`` counts backward passes, as BlueFog does: the layers are stepped
(on the gradients accumulated since the last step) and combined during the J-th backward since the last
communication; a :meth:`~AdaptThenCombineOptimizer.step` before it is a local step of what has
accumulated. So both ``J x (forward, backward, step)`` (local steps, the last one combining) and
``J x (forward, backward)`` then one step (one step on J accumulated gradients, combined) work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lowband.decentral.combine import CommunicationType, write_back
from lowband.decentral.optim_base import DecentralizedOptimizer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim import LayerwiseOptimizer
from lowband.optim.layerwise import OptimizerFactory
from lowband.topology import DynamicTopology, Topology


class AdaptThenCombineOptimizer(DecentralizedOptimizer):
    """ATC decentralized optimizer wrapping the torch optimizer ``make_optimizer`` builds (one per layer).

    Use it like any optimizer: ``loss.backward(); opt.step()`` (the layers are already stepped in
    backward; ``step()`` closes the iteration). ``topology`` is a static :class:`Topology` or a
    :class:`DynamicTopology`; ``machine_topology`` likewise, for
    ``CommunicationType.hierarchical_neighbor_allreduce``. See :class:`DecentralizedOptimizer` for the
    knobs. Every rank must use the same layers in each backward.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        *,
        communication_type: CommunicationType | str = CommunicationType.neighbor_allreduce,
        topology: Topology | DynamicTopology | str | None = None,
        machine_topology: Topology | DynamicTopology | str | None = None,
        num_steps_per_communication: int = 1,
        group: Group | None = None,
        broadcast_init: bool = True,
    ) -> None:
        _, layers = self.model_layers("AdaptThenCombineOptimizer", model, group)
        self.layerwise = LayerwiseOptimizer(
            layers, make_optimizer, on_layer=self._adapted, accumulate=num_steps_per_communication
        )
        self.layerwise.refuse_restep = True  # step() closes every iteration
        self.inner = self.layerwise
        self._launched: set[int] = set()
        #: whether the J-th backward of this iteration stepped (and so combines) the layers
        self._combining = False
        try:
            super().__init__(
                model,
                layers,
                group,
                communication_type=communication_type,
                topology=topology,
                machine_topology=machine_topology,
                num_steps_per_communication=num_steps_per_communication,
                broadcast_init=broadcast_init,
            )
        except BaseException:
            self.layerwise.remove_hooks()  # leave the model as it was
            raise
        for i, opt in enumerate(self.layerwise.optimizers):
            self._hooks.append(opt.register_step_pre_hook(functools.partial(self._before_layer_step, i)))
        self.forward_pre_hooks(self._complete)

    # -- hooks ------------------------------------------------------------------------------------
    def is_communicating(self) -> bool:
        return self._combining

    def _adapted(self, i: int) -> None:
        """Layer ``i`` was just stepped in the J-th backward: start combining it."""
        self._combining = True
        pending = self.launch_layer(i)
        self._launched.add(i)
        if pending is not None:
            self._pending[i] = pending

    def _before_layer_step(self, i: int, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self._complete([i])

    def _complete(self, layers: list[int]) -> None:
        """Wait for the combination of ``layers`` (if in flight) and write it into their parameters."""
        self._pending.wait_keys(layers)

    def finish_layer(self, i: int, result: list[Tensor] | None) -> None:
        if result is not None:  # (None: it failed under on_peer_loss="continue", the layer stays as it is)
            write_back(self.layers[i][1], result)

    # -- the Optimizer interface ------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Close the iteration: step any layer that still holds gradients (a local step before the J-th
        backward), start combining any layer the J-th backward did not send (in layer order), advance
        the counters."""
        if closure is not None:
            raise InvalidArgumentError(f"{self.where}: step(closure) is not supported")
        if self._combining or self.num_steps_per_communication == 1:
            self.layerwise.step()
        else:
            self._local_step()
        if self._combining:
            for i in range(len(self.layers)):
                if i not in self._launched:
                    self._adapted(i)
            self.end_iteration()
        else:
            self.steps += 1
        self._launched.clear()
        self._combining = False
        self.layerwise.stage.accumulate = self.num_steps_per_communication
        return None

    def _local_step(self) -> None:
        """Step every layer holding gradients, leaving the backward-pass count as it is (the J-th
        backward still combines)."""
        for opt in self.layerwise.optimizers:
            if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
                opt.step()
                opt.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        """Complete every combination in flight (in layer order) and write it into the parameters."""
        self._pending.wait_all(in_key_order=True)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self.layerwise.remove_hooks()
