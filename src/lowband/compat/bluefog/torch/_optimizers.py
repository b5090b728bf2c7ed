"""BlueFog's distributed-optimizer factories on lowband's decentralized optimizers.

BlueFog's factories take an already built torch optimizer and return a new optimizer (an instance of a
class made at run time that inherits from the given optimizer's class and re-implements its step).
lowband's wrappers (:mod:`lowband.decentral.optimizers`) take an optimizer *factory* instead and wrap real
torch optimizers. The factories here adapt: :func:`optimizer_factory` makes, from the given optimizer, a
factory building a new optimizer of the same class over any subset of its parameters, each parameter in a
group with its original group's hyperparameters (``lr``, ``momentum``, ...). As in BlueFog, the returned
optimizer starts with a fresh state (momentum buffers, moments) and is the one to step, to set the learning
rate on and to attach LR schedulers to; unlike BlueFog, its ``param_groups`` are new dicts, not the given
optimizer's. The returned object is the lowband wrapper itself (a :class:`torch.optim.Optimizer`, not an
instance of the given optimizer's class) with BlueFog's knobs: ``communication_type``, ``self_weight``,
``src_weights``, ``dst_weights``, ``src_machine_weights``, ``dst_machine_weights``, ``enable_topo_check``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

import lowband
from lowband.decentral.optimizers import (
    AdaptThenCombineOptimizer,
    AdaptWithCombineOptimizer,
    CommunicationType,
    GradientAllreduceOptimizer,
    WinPutOptimizer,
)
from lowband.errors import InvalidArgumentError
from lowband.optim.factory import OptimizerFactory, instance_factory

_MOD = "lowband.compat.bluefog.torch"


def optimizer_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory building, for any of ``optimizer``'s parameters, a new optimizer of its class whose
    groups carry the hyperparameters of the groups those parameters came from (parameters it does not
    hold get its ``defaults``). The given optimizer itself is left untouched."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"{_MOD}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    return instance_factory(optimizer)


def _model(where: str, model: object) -> nn.Module:
    """BlueFog takes a module or a list of modules; lowband one module (a list becomes a ModuleList)."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return nn.ModuleList(model)
    raise InvalidArgumentError(
        f"{_MOD}.{where}: model must be a torch.nn.Module or a list of them, got {type(model).__name__}"
    )


def DistributedAdaptThenCombineOptimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | list[nn.Module],
    communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
    num_steps_per_communication: int = 1,
) -> AdaptThenCombineOptimizer:
    """Adapt-then-combine: each layer is stepped as soon as its gradients are ready in backward and its
    updated parameters are combined with the neighbors' (or allreduced), overlapped with computation.
    Returns :class:`lowband.decentral.optimizers.AdaptThenCombineOptimizer` (one optimizer of
    ``optimizer``'s class per layer)."""
    return AdaptThenCombineOptimizer(
        _model("DistributedAdaptThenCombineOptimizer", model),
        optimizer_factory(optimizer),
        communication_type=communication_type,
        num_steps_per_communication=num_steps_per_communication,
        broadcast_init=False,  # BlueFog leaves it to bf.broadcast_parameters
    )


def DistributedAdaptWithCombineOptimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | list[nn.Module],
    communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
    num_steps_per_communication: int = 1,
) -> AdaptWithCombineOptimizer:
    """Adapt-with-combine: the parameters are combined with the neighbors' (or allreduced) while forward
    and backward run, and the step applies the local gradient to the combined value. Returns
    :class:`lowband.decentral.optimizers.AdaptWithCombineOptimizer`."""
    return AdaptWithCombineOptimizer(
        _model("DistributedAdaptWithCombineOptimizer", model),
        optimizer_factory(optimizer),
        communication_type=communication_type,
        num_steps_per_communication=num_steps_per_communication,
        broadcast_init=False,  # BlueFog leaves it to bf.broadcast_parameters
    )


def DistributedGradientAllreduceOptimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | list[nn.Module],
    num_steps_per_communication: int = 1,
) -> GradientAllreduceOptimizer:
    """Gradients averaged by allreduce launched from backward hooks (Horovod-style), then the step.
    Returns :class:`lowband.decentral.optimizers.GradientAllreduceOptimizer`."""
    return GradientAllreduceOptimizer(
        _model("DistributedGradientAllreduceOptimizer", model),
        optimizer_factory(optimizer),
        num_steps_per_communication=num_steps_per_communication,
        broadcast_init=False,  # BlueFog leaves it to bf.broadcast_parameters
    )


class BlueFogWinPutOptimizer(WinPutOptimizer):
    """:class:`lowband.decentral.optimizers.WinPutOptimizer` with BlueFog's ``force_barrier`` knob: when
    True, :meth:`step` starts with a barrier over the group (synchronising the ranks)."""

    force_barrier: bool = False

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self.force_barrier:
            lowband.barrier(group=self.group)
        return super().step(closure)

    def unregister_window(self) -> None:
        """Free the optimizer's windows (collective), as BlueFog's method of the same name."""
        self.close()


def DistributedWinPutOptimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | list[nn.Module],
    num_steps_per_communication: int = 1,
    window_prefix: str | None = None,
) -> BlueFogWinPutOptimizer:
    """Asynchronous, in BlueFog's order: the J-th forward (``num_steps_per_communication``) puts every
    parameter into the out-neighbors' windows; ``step()`` waits for those puts, combines each parameter
    with what has arrived (``win_update`` under the mutex), then takes the local step; it never waits for
    a neighbor to reach a step. Knobs ``dst_weights`` (and lowband's
    ``self_weight``/``src_weights``, ``require_mutex``) and ``force_barrier``. ``window_prefix`` is accepted
    for compatibility: lowband names each optimizer's windows uniquely itself. Call ``close()`` (on every
    rank) to free the windows."""
    del window_prefix
    return BlueFogWinPutOptimizer(
        _model("DistributedWinPutOptimizer", model),
        optimizer_factory(optimizer),
        num_steps_per_communication=num_steps_per_communication,
        broadcast_init=False,  # BlueFog leaves it to bf.broadcast_parameters
    )


def _deprecated(old: str, kind: CommunicationType) -> None:
    warnings.warn(
        f"{old} will be deprecated (as in BlueFog); use DistributedAdaptWithCombineOptimizer(opt, model, "
        f"CommunicationType.{kind.name})",
        PendingDeprecationWarning,
        stacklevel=3,
    )


def DistributedAllreduceOptimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module | list[nn.Module], num_steps_per_communication: int = 1
) -> AdaptWithCombineOptimizer:
    """Deprecated in BlueFog: ``DistributedAdaptWithCombineOptimizer(.., CommunicationType.allreduce)``."""
    _deprecated("DistributedAllreduceOptimizer", CommunicationType.allreduce)
    return DistributedAdaptWithCombineOptimizer(
        optimizer, model, CommunicationType.allreduce, num_steps_per_communication
    )


def DistributedNeighborAllreduceOptimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module | list[nn.Module], num_steps_per_communication: int = 1
) -> AdaptWithCombineOptimizer:
    """Deprecated in BlueFog: ``DistributedAdaptWithCombineOptimizer(.., CommunicationType.neighbor_allreduce)``."""
    _deprecated("DistributedNeighborAllreduceOptimizer", CommunicationType.neighbor_allreduce)
    return DistributedAdaptWithCombineOptimizer(
        optimizer, model, CommunicationType.neighbor_allreduce, num_steps_per_communication
    )


def DistributedHierarchicalNeighborAllreduceOptimizer(
    optimizer: torch.optim.Optimizer, model: nn.Module | list[nn.Module], num_steps_per_communication: int = 1
) -> AdaptWithCombineOptimizer:
    """Deprecated in BlueFog: ``DistributedAdaptWithCombineOptimizer(.., hierarchical_neighbor_allreduce)``."""
    kind = CommunicationType.hierarchical_neighbor_allreduce
    _deprecated("DistributedHierarchicalNeighborAllreduceOptimizer", kind)
    return DistributedAdaptWithCombineOptimizer(optimizer, model, kind, num_steps_per_communication)


__all__: list[str] = [
    "BlueFogWinPutOptimizer",
    "CommunicationType",
    "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer",
    "DistributedAllreduceOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "DistributedWinPutOptimizer",
    "optimizer_factory",
]
