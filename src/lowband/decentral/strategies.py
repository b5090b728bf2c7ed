"""The decentralized optimizers as lowband strategies (so ``lowband bench`` and ``lowband demo`` run them):
``atc``, ``awc``, ``hierarchical-atc``, ``winput`` and ``gradient-allreduce``.

Options (keyword-only, declared in :data:`NEIGHBOR_OPTIONS` and checked before construction):

- ``topology``: a :class:`Topology`, a :class:`DynamicTopology` (as the decentralized optimizers
  take; :func:`lowband.topology.names.build_topology` parses both) or a name from :data:`TOPOLOGIES` — ``ring``, ``exp2`` (static exponential-2),
  ``dynamic-exp2`` (one peer of the exponential-2 graph per round), ``inner-outer-exp2`` (BlueFog's
  dynamic inner/outer exponential-2 over machines of ``local_size`` ranks), ``full``. For
  ``hierarchical-atc`` it is the topology between machines; ``winput`` takes static ones only.
  Default (:data:`DEFAULT_TOPOLOGY`) for ``atc``, ``awc`` and ``hierarchical-atc``: ``dynamic-exp2``,
  sparse at every world size: each rank sends one model copy per communication to one peer and
  receives one, whatever the number of ranks (a ring allreduce sends ``2 (n-1)/n`` copies: 1.33 at 3
  ranks, 1.5 at 4). The static ``exp2`` sends ``ceil(log2 n)`` copies, and at 3 ranks it is the full
  graph (2 copies, 1.5x DDP's bytes). ``winput`` (static topologies only) keeps ``exp2``.
- ``allreduce_every = k`` (> 0): every k-th communication is a global allreduce of the parameters
  instead of a neighbor averaging (0: never). :meth:`in_sync` is True right after such a step.
- ``period = H``: communicate every H-th step; the steps in between are local.

The topology check runs on a strategy's first step only; the layer layout is checked at construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from lowband.decentral.atc import AdaptThenCombineOptimizer
from lowband.decentral.awc import AdaptWithCombineOptimizer
from lowband.decentral.gradient_allreduce import GradientAllreduceOptimizer
from lowband.decentral.optim_base import CommunicationType, DecentralizedOptimizer
from lowband.decentral.winput import WinPutOptimizer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.options import Opt, Options
from lowband.runtime import current
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.registry import register_strategy
from lowband.topology import DynamicTopology, Topology
from lowband.topology.names import (
    MACHINE_TOPOLOGIES,
    STATIC_TOPOLOGIES,
    TOPOLOGIES,
    build_topology,
    topology_label,
    topology_option,
)

#: a topology option: a registered name, a :class:`Topology` or a :class:`DynamicTopology`
TopologyArg = str | Topology | DynamicTopology

#: the neighbor-averaging strategies' default: one peer per round at every world size (module docstring)
DEFAULT_TOPOLOGY = "dynamic-exp2"


_PERIOD = Opt(int, min=1, unit="steps", doc="communicate every period-th step (local steps between)")
#: the options of ``atc`` and ``awc`` (module docstring); ``hierarchical-atc`` takes machine topologies
NEIGHBOR_OPTIONS = Options(
    {
        "topology": topology_option(tuple(TOPOLOGIES)),
        "allreduce_every": Opt(int, min=0, doc="every k-th communication a global allreduce (0: never)"),
        "period": _PERIOD,
    }
)


class DecentralStrategy(Strategy):
    """A strategy around a :class:`DecentralizedOptimizer`: before each step's forward (at construction,
    after each step and after a load, so whichever loop steps) it sets the communication type (neighbor
    averaging, or a global allreduce every ``allreduce_every``-th communication) and the topology check
    (first step only). ``accumulate=J``: the optimizer communicates once per ``period * J`` passes
    (BlueFog's ``num_steps_per_communication`` counts passes), the strategy steps every J."""

    optimizer: DecentralizedOptimizer
    base_type = CommunicationType.neighbor_allreduce

    def __init__(
        self, model: nn.Module, optimizer: DecentralizedOptimizer, group: Group, *, topology: object,
        allreduce_every: int, period: int,
    ) -> None:  # fmt: skip
        super().__init__(model, optimizer, group)
        self.topology_name = topology_label(topology)
        self.allreduce_every = allreduce_every
        self.period = period
        self._checked = False
        #: whether a neighbor-averaging step leaves every replica identical (one machine, hierarchical)
        self.neighbor_is_global = False
        self._global = group.size == 1
        self._prepare()

    def _prepare(self) -> None:
        """The next step's knobs (its communication type, whether it checks the topology)."""
        opt = self.optimizer
        opt.enable_topo_check = not self._checked
        t = opt.steps + 1
        self._rounds = t // self.period if t % self.period == 0 else 0
        every = self.allreduce_every
        self._allreduce = self._rounds > 0 and every > 0 and self._rounds % every == 0
        opt.communication_type = CommunicationType.allreduce if self._allreduce else self.base_type

    def after_step(self) -> None:
        self._global = (
            self.group.size == 1 or self._allreduce or (self.neighbor_is_global and self._rounds > 0)
        )
        self._checked = True
        self._prepare()

    def configure_accumulation(self, passes: int) -> None:
        opt = self.optimizer
        opt.num_steps_per_communication = self.period * passes
        layerwise = getattr(opt, "layerwise", None)
        if layerwise is not None:  # ATC counts backward passes on its layers' stage
            layerwise.stage.accumulate = opt.num_steps_per_communication

    @contextlib.contextmanager
    def local_pass(self) -> Iterator[None]:
        yield  # the optimizer counts passes itself (configure_accumulation)

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def in_sync(self) -> bool:
        """True after a step that averaged the parameters globally (allreduce; or hierarchical averaging
        on a single machine), once synchronized. Always True on one rank."""
        return self._global

    def hparams(self) -> dict[str, Any]:
        return {
            "topology": self.topology_name,
            "allreduce_every": self.allreduce_every,
            "period": self.period,
        }

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.synchronize()
        super().load_state_dict(state)
        self._prepare()

    def close(self) -> None:
        self.optimizer.remove_hooks()


class _NeighborStrategy(DecentralStrategy):
    """ATC or AWC (``optimizer_class``) over a named topology: the one constructor both share."""

    optimizer_class: type[AdaptThenCombineOptimizer] | type[AdaptWithCombineOptimizer]

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, topology: TopologyArg = DEFAULT_TOPOLOGY,
        allreduce_every: int = 0, period: int = 1,
    ) -> None:  # fmt: skip
        where = f"{type(self).__name__}"
        ae, h = allreduce_every, period
        topo = build_topology(where, topology, tuple(TOPOLOGIES), group.size, current(where).local_size)
        opt = self.optimizer_class(
            model, make_optimizer, topology=topo, num_steps_per_communication=h, group=group
        )
        super().__init__(model, opt, group, topology=topology, allreduce_every=ae, period=h)


@register_strategy(
    "atc", "BlueFog Adapt-Then-Combine: layer steps in backward, then neighbor averaging", NEIGHBOR_OPTIONS
)
class ATCStrategy(_NeighborStrategy):
    name = "atc"
    steps_in_backward = True
    optimizer_class = AdaptThenCombineOptimizer


@register_strategy(
    "awc", "BlueFog Adapt-With-Combine: neighbor averaging from forward hooks, overlapped", NEIGHBOR_OPTIONS
)
class AWCStrategy(_NeighborStrategy):
    name = "awc"
    optimizer_class = AdaptWithCombineOptimizer


@register_strategy(
    "hierarchical-atc",
    "BlueFog ATC with hierarchical neighbor averaging (machine average, then machines)",
    NEIGHBOR_OPTIONS | Options({"topology": topology_option(MACHINE_TOPOLOGIES)}),
)
class HierarchicalATCStrategy(DecentralStrategy):
    name = "hierarchical-atc"
    steps_in_backward = True
    base_type = CommunicationType.hierarchical_neighbor_allreduce

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, topology: TopologyArg = DEFAULT_TOPOLOGY,
        allreduce_every: int = 0, period: int = 1,
    ) -> None:  # fmt: skip
        where = f"{type(self).__name__}"
        ae, h = allreduce_every, period
        ctx = current(where)
        if group.pg is not ctx.world.pg:
            raise InvalidArgumentError(
                f"{where}: hierarchical averaging runs over the world, not group {group.name!r}"
            )
        topo = build_topology(where, topology, MACHINE_TOPOLOGIES, ctx.machine_size, 1)
        opt = AdaptThenCombineOptimizer(
            model, make_optimizer, communication_type=self.base_type, machine_topology=topo,
            num_steps_per_communication=h, group=group,
        )  # fmt: skip
        super().__init__(model, opt, group, topology=topology, allreduce_every=ae, period=h)
        # one machine: the machine average, broadcast to its ranks, is a global average
        self.neighbor_is_global = ctx.machine_size == 1


class _WrapperStrategy(Strategy):
    """A strategy around a wrapper whose communication needs no per-step settings. ``accumulate=J``: the
    wrapper communicates once per ``period * J`` passes (it counts them), the strategy steps every J."""

    optimizer: GradientAllreduceOptimizer | WinPutOptimizer
    period = 1

    def configure_accumulation(self, passes: int) -> None:
        self.optimizer.num_steps_per_communication = self.period * passes

    @contextlib.contextmanager
    def local_pass(self) -> Iterator[None]:
        yield  # the wrapper counts passes itself (configure_accumulation)

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.synchronize()
        super().load_state_dict(state)

    def close(self) -> None:
        self.optimizer.remove_hooks()


@register_strategy("gradient-allreduce", "Gradients averaged by per-layer allreduce from backward hooks")
class GradientAllreduceStrategy(_WrapperStrategy):
    name = "gradient-allreduce"

    def finish_gradients(self) -> None:
        self.optimizer.synchronize()  # the gradients are averaged in place

    def __init__(self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group) -> None:
        # the optimizer starts every replica from rank 0's parameters and buffers, as DDP does
        super().__init__(model, GradientAllreduceOptimizer(model, make_optimizer, group=group), group)


@register_strategy(
    "winput",
    "BlueFog asynchronous win_put: put to neighbors in forward, combine arrivals, local step",
    Options({"topology": topology_option(STATIC_TOPOLOGIES, dynamic=False), "period": _PERIOD}),
)
class WinPutStrategy(_WrapperStrategy):
    name = "winput"

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, topology: TopologyArg = "exp2",
        period: int = 1,
    ) -> None:  # fmt: skip
        where = f"{type(self).__name__}"
        h = period
        topo = build_topology(where, topology, STATIC_TOPOLOGIES, group.size, 1, dynamic=False)
        assert isinstance(topo, Topology)
        opt = WinPutOptimizer(
            model, make_optimizer, topology=topo, num_steps_per_communication=h, group=group
        )
        super().__init__(model, opt, group)
        self.topology_name, self.period = topology_label(topology), h

        self.winput = opt

    def in_sync(self) -> bool:
        return self.group.size == 1

    def hparams(self) -> dict[str, Any]:
        return {"topology": self.topology_name, "period": self.period}

    def close(self) -> None:
        """Free the windows (collective)."""
        self.winput.close()
