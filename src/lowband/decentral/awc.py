"""Adapt-With-Combine (BlueFog paper §V-C, Eq. 22): ``x_i <- sum_j w_ij x_j - lr * g_i(x_i)``.

In each layer's forward pre-hook during the J-th training forward (gradients enabled) since the last
communication, ``J = num_steps_per_communication``, the nonblocking combination of the layer's current
parameters starts, out of place, so it overlaps the whole forward and backward; the gradient is
computed at the local parameters. :meth:`~AdaptWithCombineOptimizer.step` then waits for the
combinations, sets every parameter to its combined value and runs the inner torch optimizer, which
applies the local gradient there. A step before the J-th forward is a local step. As in BlueFog, both
``J x (forward, backward, step)`` (local steps, the last one combining) and ``J x (forward, backward)``
then one step (gradients accumulated over J passes, one combining step) work.

With momentum or Adam the inner optimizer's state is built from local gradients but applied to the
combined iterate: the state follows the combined iterate, as in BlueFog's AWC optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lowband.decentral.combine import CommunicationType, write_back
from lowband.decentral.optim_base import DecentralizedOptimizer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.layerwise import OptimizerFactory
from lowband.topology import DynamicTopology, Topology


class AdaptWithCombineOptimizer(DecentralizedOptimizer):
    """AWC decentralized optimizer wrapping the torch optimizer ``make_optimizer`` builds over the
    model's parameters.

    ``forward -> backward -> step()``. ``topology`` is a static :class:`Topology` or a
    :class:`DynamicTopology`; ``machine_topology`` likewise for the hierarchical type. See
    :class:`DecentralizedOptimizer` for the knobs (set them before the forward). Every rank must run
    the same layers in each forward; layers a forward did not reach are sent at ``step()``.
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
        where, layers = self.model_layers("AdaptWithCombineOptimizer", model, group)
        self.inner = self.build_inner(where, make_optimizer, layers)
        self._launched: set[int] = set()
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
        self.count_forwards()
        self.forward_pre_hooks(self._before_forward)

    def is_communicating(self) -> bool:
        return self.forwards >= self.num_steps_per_communication

    def _before_forward(self, layers: list[int]) -> None:
        if not torch.is_grad_enabled() or not self.model.training:
            return  # evaluation forwards do not communicate
        if self.is_communicating():
            self._launch(layers)

    def _launch(self, layers: list[int]) -> None:
        for i in layers:
            if i not in self._launched:
                self._launched.add(i)
                pending = self.launch_layer(i)
                if pending is not None:
                    self._pending[i] = pending

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Communicating iteration (the J-th forward happened): send the layers no forward reached, set
        every parameter to its combined value, then step the inner optimizer with the local gradients.
        Otherwise a local step."""
        if closure is not None:
            raise InvalidArgumentError(f"{self.where}: step(closure) is not supported")
        communicating = self.is_communicating()
        if communicating:
            self._launch(list(range(len(self.layers))))
        self.synchronize()
        self.inner.step()
        self._launched.clear()
        if communicating:
            self.end_iteration()
            self.forwards = 0
        else:
            self.steps += 1
        return None

    def counters(self) -> dict[str, Any]:
        return {**super().counters(), "forwards": self.forwards}

    def load_counters(self, counters: dict[str, Any]) -> None:
        super().load_counters(counters)
        self.forwards = int(counters.get("forwards", 0))

    def synchronize(self) -> None:
        """Complete every combination in flight (in layer order) and write it into the parameters.
        Between steps nothing is in flight; between a forward and its backward this would change the
        parameters the backward needs, so only :meth:`step` calls it then."""
        self._pending.wait_all(in_key_order=True)

    def finish_layer(self, i: int, result: list[Tensor] | None) -> None:
        if result is not None:  # (None: it failed under on_peer_loss="continue", the layer stays as it is)
            write_back(self.layers[i][1], result)
