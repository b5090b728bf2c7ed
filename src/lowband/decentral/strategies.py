"""The decentralized optimizers as lowband strategies (so ``lowband bench`` and ``lowband demo`` run them):
``atc``, ``awc``, ``hierarchical-atc`` and ``gradient-allreduce`` (``winput``:
:mod:`lowband.decentral.winput_strategy`).

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
  instead of a neighbor averaging (0: never). :meth:`in_sync` is True right after such a step (not for
  ``awc``, which applies each rank's own gradient after the combination).
- ``period = H``: communicate every H-th step; the steps in between are local.

The topology check runs on a strategy's first step only; the layer layout is checked at construction.

``on_peer_loss="continue"`` (``atc``, ``awc``; options :data:`~lowband.strategies.peer_loss.PEER_LOSS_OPTIONS`):
the survivors of a lost rank train on without it, as the strategies that average at every step do
(:mod:`lowband.strategies.peer_steps`):

- *Noticed*: a combination that fails (its wait polls: the heartbeat beats, another member's notice is
  seen), the per-step non-finite agreement (usually first: it follows every backward), the heartbeat.
  The combination is out of place, so a failed one writes nothing (:class:`~lowband.decentral.combine.Guarded`);
  and from the notice on, every combination of this rank not yet written into the parameters is dropped
  (:meth:`~lowband.decentral.optim_base.DecentralizedOptimizer.abandon`: drained, then forgotten) and
  this rank combines nothing until the members meet: its steps are local steps (atc: adapt only; awc:
  the local gradient step on the uncombined parameters). Nothing raises into the forward or the step.
- What is dropped: a rank killed between two steps is noticed by every survivor at the non-finite
  agreement of the next step, before that step's combinations are written (atc writes them at the next
  forward, awc in the step, after the agreement): that step is a local step on every survivor. With the
  non-finite check off (``on_nonfinite="off"``) a survivor whose combination did not involve the lost rank
  may complete it and keep it while another drops its own: what each survivor combined before it noticed
  stays, as in :mod:`lowband.strategies.peer_steps`.
- *Agreed and met* after the step (a member behind the latest step count catches up alone): the topology
  is rebuilt from its name (``topology`` option) over the members, in the order of their world ranks,
  from its round 0 on every member; the members check their step counts, rounds and topology. So ``continue`` needs a topology name: a :class:`Topology` or :class:`DynamicTopology`
  object is over a fixed number of ranks and is refused, and so is ``inner-outer-exp2`` (its machines
  lose ranks unevenly).
- Replacements (:mod:`lowband.strategies.peer_join`) are proposed before the global allreduce steps
  (``allreduce_every > 0``) and admitted when the next step begins, taking a member's state (a neighbor
  averaging completes without every member: it cannot carry the proposal's agreement). A replacement of
  a strategy with ``allreduce_every=0`` is refused at construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from lowband.comm.agree import agree, crc
from lowband.decentral.atc import AdaptThenCombineOptimizer
from lowband.decentral.awc import AdaptWithCombineOptimizer
from lowband.decentral.gradient_allreduce import GradientAllreduceOptimizer
from lowband.decentral.optim_base import CommunicationType, DecentralizedOptimizer
from lowband.decentral.winput import WinPutOptimizer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.pending import Survival
from lowband.options import Opt, Options
from lowband.runtime import current
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.peer_loss import PEER_LOSS_OPTIONS
from lowband.strategies.peer_steps import StepwisePeerLoss
from lowband.strategies.registry import register_strategy
from lowband.topology import DynamicTopology, Topology
from lowband.topology.names import (
    MACHINE_TOPOLOGIES,
    TOPOLOGIES,
    build_topology,
    topology_label,
    topology_option,
)

if TYPE_CHECKING:
    from lowband.plan import Links, PlanProfile, Prediction

#: a topology option: a registered name, a :class:`Topology` or a :class:`DynamicTopology`
TopologyArg = str | Topology | DynamicTopology

#: the neighbor-averaging strategies' default: one peer per round at every world size (module docstring)
DEFAULT_TOPOLOGY = "dynamic-exp2"


PERIOD = Opt(int, min=1, unit="steps", doc="communicate every period-th step (local steps between)")
#: the options of ``atc`` and ``awc`` (module docstring; they add :data:`PEER_LOSS_OPTIONS`);
#: ``hierarchical-atc`` takes machine topologies
NEIGHBOR_OPTIONS = Options(
    {
        "topology": topology_option(tuple(TOPOLOGIES)),
        "allreduce_every": Opt(int, min=0, doc="every k-th communication a global allreduce (0: never)"),
        "period": PERIOD,
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
        if not self.membership_settled():  # a lost peer noticed (on_peer_loss=continue): train alone
            self._allreduce = False
            opt.communication_type = CommunicationType.empty

    def after_step(self) -> None:
        super().after_step()  # (the heartbeat, where the strategy has one)
        self._global = self.group.size == 1 or (
            self.membership_settled() and (self._allreduce or (self.neighbor_is_global and self._rounds > 0))
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
        super().close()  # (atc, awc: marks this rank done for the heartbeat)


class _NeighborStrategy(DecentralStrategy, StepwisePeerLoss):
    """ATC or AWC (``optimizer_class``) over a named topology: the one constructor both share, and
    ``on_peer_loss="continue"`` (module docstring)."""

    optimizer_class: type[AdaptThenCombineOptimizer] | type[AdaptWithCombineOptimizer]

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, topology: TopologyArg = DEFAULT_TOPOLOGY,
        allreduce_every: int = 0, period: int = 1, on_peer_loss: str = "raise", min_ranks: int | None = None,
        peer_settle: float = 1.0, heartbeat: float | None = None,
    ) -> None:  # fmt: skip
        where = f"{type(self).__name__} on rank {group.world_rank}"
        ae, h = allreduce_every, period
        ctx = current(where)
        if on_peer_loss == "continue":
            _check_survivable(where, topology, allreduce_every, ctx.joining)
        topo = build_topology(where, topology, tuple(TOPOLOGIES), group.size, ctx.local_size)
        opt = self.optimizer_class(
            model, make_optimizer, topology=topo, num_steps_per_communication=h, group=group
        )
        super().__init__(model, opt, group, topology=topology, allreduce_every=ae, period=h)
        self.init_peer_loss(on_peer_loss, min_ranks, peer_settle, heartbeat)
        if on_peer_loss == "continue":
            opt.survival = Survival(self.wait_beating, self._combination_lost, ctx.config.timeout)

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models_peers

        return models_peers.neighbor(cls.name, profile, links, options)

    # -- a lost peer (on_peer_loss="continue": module docstring, lowband.strategies.peer_steps) -----
    def begin_step(self) -> None:
        super().begin_step()  # (admits the replacements proposed at the last global allreduce)
        if self._allreduce and self.peer_loss == "continue":
            self.propose_joins(self._rounds)  # before this step's allreduce is launched

    def after_step(self) -> None:
        super().after_step()
        if self.peer_loss == "continue" and not self.membership_settled():
            self.recover()  # the members agree (and, once caught up, meet on their group)
            self._prepare()  # the next step's knobs, on the new group once met

    def notice(
        self, exc: BaseException, what: str, began: float, silent: dict[int, float] | None = None
    ) -> None:
        super().notice(exc, what, began, silent)
        self.optimizer.abandon()  # every combination not written yet is dropped

    def _combination_lost(self, exc: BaseException, layer: int, launched: float) -> None:
        self.notice(exc, f"the combination of {self.optimizer.layer_name(layer)!r}", launched)

    def regroup(self, group: Group) -> None:
        where = f"{type(self).__name__} on rank {group.world_rank}"
        topo = build_topology(
            where, self.topology_name, tuple(TOPOLOGIES), group.size, current(where).local_size
        )
        self.optimizer.regroup(group, topo)
        # the members checked the topology at their first step; a replacement's first step is not theirs
        self._checked, self.optimizer.enable_topo_check = True, False

    def after_meeting(self) -> None:
        # members that trained alone for different numbers of steps counted different rounds: the
        # topology rebuilt over the members starts at its first round on every one of them
        opt = self.optimizer
        opt.neighbor_rounds = 0
        agree(
            self.group, "the step counts and the topology after a membership change",
            [self.steps, opt.steps, opt.neighbor_rounds, crc(self.topology_name), self.group.size],
            fields=("the strategy's steps", "the optimizer's steps", "the neighbor rounds", "the topology hash",
                    "the group size"),
            where=f"{type(self).__name__} on rank {self.group.world_rank}",
        )  # fmt: skip


def check_survivable_topology(where: str, topology: object, names: Iterable[str]) -> None:
    """Under ``on_peer_loss="continue"`` the topology is rebuilt over the survivors from its name: option
    ``topology`` must be one of ``names``, not a topology object over a fixed number of ranks."""
    if not isinstance(topology, str):
        raise InvalidArgumentError(
            f"{where}: on_peer_loss='continue' rebuilds the topology over the survivors from its name: option "
            f"'topology' must be a name ({', '.join(names)}), not a {type(topology).__name__} over a fixed "
            "number of ranks"
        )


def _check_survivable(where: str, topology: object, allreduce_every: int, joining: bool) -> None:
    """What ``on_peer_loss="continue"`` needs of the options (module docstring)."""
    check_survivable_topology(where, topology, (n for n in TOPOLOGIES if n != "inner-outer-exp2"))
    if topology == "inner-outer-exp2":
        raise InvalidArgumentError(
            f"{where}: on_peer_loss='continue' cannot rebuild option 'topology'={topology!r} over the "
            "survivors (its machines lose ranks unevenly): give another topology"
        )
    if joining and allreduce_every == 0:
        raise InvalidArgumentError(
            f"{where}: this process replaces a lost rank, but replacements join at the global allreduce "
            "steps and option 'allreduce_every' is 0: give the members allreduce_every > 0"
        )


@register_strategy(
    "atc",
    "BlueFog Adapt-Then-Combine: layer steps in backward, then neighbor averaging",
    NEIGHBOR_OPTIONS | PEER_LOSS_OPTIONS,
)
class ATCStrategy(_NeighborStrategy):
    name = "atc"
    steps_in_backward = True
    optimizer_class = AdaptThenCombineOptimizer


@register_strategy(
    "awc",
    "BlueFog Adapt-With-Combine: neighbor averaging from forward hooks, overlapped",
    NEIGHBOR_OPTIONS | PEER_LOSS_OPTIONS,
)
class AWCStrategy(_NeighborStrategy):
    name = "awc"
    optimizer_class = AdaptWithCombineOptimizer

    def in_sync(self) -> bool:
        # the combination (a global allreduce included) is followed by each rank's own gradient step
        return self.group.size == 1


@register_strategy(
    "hierarchical-atc",
    "BlueFog ATC with hierarchical neighbor averaging (machine average, then machines)",
    NEIGHBOR_OPTIONS | Options({"topology": topology_option(MACHINE_TOPOLOGIES)}),
)
class HierarchicalATCStrategy(DecentralStrategy):
    """No cost model (``lowband plan``): a machine average over the links inside a machine, then
    machines; the planner's one-ring link model has no second tier."""

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


class WrapperStrategy(Strategy):
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
class GradientAllreduceStrategy(WrapperStrategy):
    name = "gradient-allreduce"

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models_peers

        return models_peers.gradient_allreduce(profile, links, options)

    def finish_gradients(self) -> None:
        self.optimizer.synchronize()  # the gradients are averaged in place

    def __init__(self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group) -> None:
        # the optimizer starts every replica from rank 0's parameters and buffers, as DDP does
        super().__init__(model, GradientAllreduceOptimizer(model, make_optimizer, group=group), group)


# winput's strategy builds on the wrapper above and registers itself in its own module; imported here, at
# the end, so that importing this module (or lowband.strategies, which imports it) registers it too
from lowband.decentral import winput_strategy as _winput  # noqa: E402, F401
