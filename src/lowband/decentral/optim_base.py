"""What every decentralized optimizer wrapper shares: the wrapped torch optimizer, the model's layers,
the knobs settable before every step (as in BlueFog), the layout check, and the plan of an iteration.

A wrapper is a :class:`torch.optim.Optimizer` in the style of torch's ``PostLocalSGDOptimizer``: it
holds the inner optimizer(s) built by the caller's factory (any torch optimizer, never re-implemented),
shares their ``param_groups`` (LR schedulers work) and forwards ``state_dict``/``load_state_dict``,
adding its own counters.

Communication is per *layer* (a module owning parameters, :func:`lowband.optim.parameter_layers`): the
tensors of one layer travel in one fused operation (:mod:`lowband.decentral.combine`). Which operation
is decided once per iteration, when its first layer is sent, from the knobs
(:class:`CommunicationType` and the weights/topologies); set them before the forward pass.
``num_steps_per_communication = J`` makes communication happen once per J passes, as in BlueFog:
adapt-with-combine and win-put count training forwards, adapt-then-combine backward passes; a ``step()``
before the J-th pass is a local step, one after it communicates (so J steps, or J passes accumulated
into one step, both work).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lowband.comm.agree import agree, crc
from lowband.comm.initial import broadcast_initial_state
from lowband.decentral.combine import CommunicationType, Guarded, Pending, Plan, launch
from lowband.decentral.knobs import (
    Knob,
    check_bool,
    check_comm_type,
    check_dst_knob,
    check_dynamic_knob,
    check_period,
    check_self_weight,
    check_src,
    check_topology_knob,
)
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim import parameter_layers
from lowband.optim.factory import as_optimizer_factory
from lowband.optim.pending import PendingWork, Survival, forward_pre_hooks, module_layers
from lowband.runtime import Context, world_group
from lowband.topology import DynamicTopology, Topology
from lowband.topology.names import MACHINE_TOPOLOGIES, TOPOLOGIES, build_topology

Tensor = torch.Tensor
Layers = list[tuple[str, list[nn.Parameter]]]

__all__ = [
    "CommunicationType",
    "DecentralizedOptimizer",
    "Knob",
    "Layers",
    "Pending",
    "WrapperBase",
    "module_layers",
]


def _layout_signature(layers: Layers) -> list[int]:
    desc = [[(tuple(p.shape), str(p.dtype)) for p in ps] for _, ps in layers]
    return [len(layers), sum(p.numel() for _, ps in layers for p in ps), crc(desc)]


class WrapperBase(torch.optim.Optimizer):
    """Common plumbing of the wrappers. Subclasses set :attr:`inner` (the wrapped optimizer) before
    calling ``__init__`` and implement ``step`` and ``synchronize``.

    torch.optim.Optimizer's own ``__init__`` is not called (as in torch's ``PostLocalSGDOptimizer``):
    the state lives in the inner optimizer.
    """

    inner: torch.optim.Optimizer
    #: completed :meth:`step` calls (the index of the current iteration)
    steps: int

    def __init__(
        self, model: nn.Module, layers: Layers, group: Group | None, *, broadcast_init: bool = True
    ) -> None:
        kind = type(self).__name__
        ctx, g = world_group(group, kind)
        self.ctx: Context = ctx
        self.group: Group = g
        self.where = f"lowband.{kind} on rank {ctx.rank}"
        if not layers:
            raise InvalidArgumentError(f"{self.where}: the model has no trainable parameters")
        self.model = model
        self.layers = layers
        self.param_groups = self.inner.param_groups
        self.defaults = dict(self.inner.defaults)
        self.steps = 0
        self._hooks: list[Any] = []
        #: each layer's combination in flight; waiting writes its result with :meth:`finish_layer` (None:
        #: a combination that failed under ``on_peer_loss="continue"``, nothing to write)
        self._pending: PendingWork[list[Tensor] | None] = PendingWork(self.finish_layer)
        self._check_layout()
        # start every replica from rank 0's parameters and buffers, as DDP does (after the layout check)
        broadcast_initial_state(model, group=self.group, enabled=broadcast_init, where=self.where)

    @staticmethod
    def model_layers(kind: str, model: object, group: Group | None) -> tuple[str, Layers]:
        """``(where, layers)``: how errors name this wrapper on this rank, and the layers of ``model``
        (:func:`lowband.optim.parameter_layers`; at least one)."""
        ctx, _ = world_group(group, kind)
        where = f"lowband.{kind} on rank {ctx.rank}"
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"{where}: model must be a torch.nn.Module, got {model!r}")
        layers = parameter_layers(model)
        if not layers:
            raise InvalidArgumentError(f"{where}: the model has no trainable parameters")
        return where, layers

    @staticmethod
    def build_inner(
        where: str, make_optimizer: Callable[[Iterable[nn.Parameter]], Any], layers: Layers
    ) -> Any:
        """One torch optimizer over every layer's parameters, built by the caller's factory (or rebuilt
        from the caller's optimizer instance, :func:`lowband.optim.factory.as_optimizer_factory`)."""
        params = [p for _, ps in layers for p in ps]
        opt = as_optimizer_factory(make_optimizer, where, params)(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"{where}: make_optimizer returned {type(opt).__name__}, not a torch.optim.Optimizer"
            )
        return opt

    def _check_layout(self) -> None:
        """Every rank of the group must wrap the same layers (count, elements, shapes and dtypes)."""
        agree(
            self.group,
            "the wrapped model's layer layout",
            _layout_signature(self.layers),
            fields=("the number of layers", "the number of elements", "the hash of shapes and dtypes"),
            where=self.where,
        )

    def machine_layout(self) -> tuple[int, int]:
        """``(machine_size, machine_rank)`` of this rank."""
        return self.ctx.machine_size, self.ctx.machine_rank

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return self.inner.state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def layer_name(self, i: int) -> str:
        return f"{type(self).__name__}.{self.layers[i][0]}"

    def forward_pre_hooks(self, fn: Callable[[list[int]], None]) -> None:
        """Call ``fn(layer indices)`` before the forward of every module holding parameters."""
        self._hooks.extend(forward_pre_hooks(self.model, self.layers, fn))

    def count_forwards(self) -> None:
        """Count the model's training forwards (gradients enabled) in :attr:`forwards`, before any
        layer's forward pre-hook runs: BlueFog's optimizers communicate at the J-th forward since the
        last communication (``num_steps_per_communication = J``)."""
        self.forwards = 0

        def count(module: nn.Module, _args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self.forwards += 1

        self._hooks.append(self.model.register_forward_pre_hook(count, prepend=True))

    def finish_layer(self, i: int, result: list[Tensor] | None) -> None:
        """What waiting for layer ``i``'s operation ends with (nothing here; combiners write back; None: it
        failed and was survived)."""

    def remove_hooks(self) -> None:
        """Detach from the model (finishing what is in flight first)."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def synchronize(self) -> None:
        """Complete every operation in flight (every concrete optimizer defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must define synchronize()")

    def in_flight(self) -> list[int]:
        """The layers (indices into :attr:`layers`) whose communication is in flight."""
        return sorted(self._pending.keys())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InvalidArgumentError(f"{self.where}: add_param_group: the layers are fixed at construction")

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state and this wrapper's counters."""
        return {"inner": self.inner.state_dict(), "counters": self.counters()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (completes what is in flight first)."""
        if not isinstance(state_dict, Mapping) or "inner" not in state_dict or "counters" not in state_dict:
            raise InvalidArgumentError(
                f"{self.where}: load_state_dict expects a dict with 'inner' and 'counters', got "
                f"{sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__}"
            )
        self.synchronize()
        self.inner.load_state_dict(state_dict["inner"])
        self.load_counters(dict(state_dict["counters"]))

    def counters(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_counters(self, counters: dict[str, Any]) -> None:
        self.steps = int(counters["steps"])

    def communicates(self, period: int) -> bool:
        """Whether the current iteration is a communicating one: every ``period``-th."""
        return (self.steps + 1) % period == 0


class DecentralizedOptimizer(WrapperBase):
    """Base of the parameter-combining wrappers (ATC, AWC): BlueFog's knobs and the per-iteration plan.

    Knobs (settable before every step): ``communication_type``; ``num_steps_per_communication``;
    ``self_weight`` with ``src_weights`` / ``dst_weights`` (neighbor averaging) or
    ``src_machine_weights`` / ``dst_machine_weights`` (hierarchical); else ``dynamic_topology`` (a
    :class:`DynamicTopology`, at the index of the neighbor-averaging round), else ``topology`` (static),
    else the group's topology (:func:`lowband.decentral.state.load_topology`); likewise
    ``dynamic_machine_topology`` / ``machine_topology`` for the hierarchical type. Explicit weights win
    over topologies. ``enable_topo_check`` (default False: the layout was checked at construction) runs
    the topology check and the per-op argument check of that iteration's operations.
    """

    communication_type = Knob(check_comm_type)
    num_steps_per_communication = Knob(check_period)
    enable_topo_check = Knob(check_bool)
    self_weight = Knob(check_self_weight)
    src_weights = Knob(check_src)
    dst_weights = Knob(check_dst_knob)
    src_machine_weights = Knob(check_src)
    dst_machine_weights = Knob(check_dst_knob)
    topology = Knob(check_topology_knob)
    dynamic_topology = Knob(check_dynamic_knob)
    machine_topology = Knob(check_topology_knob)
    dynamic_machine_topology = Knob(check_dynamic_knob)

    def __init__(
        self,
        model: nn.Module,
        layers: Layers,
        group: Group | None,
        *,
        communication_type: CommunicationType | str,
        topology: Topology | DynamicTopology | str | None,
        machine_topology: Topology | DynamicTopology | str | None,
        num_steps_per_communication: int,
        broadcast_init: bool = True,
    ) -> None:
        super().__init__(model, layers, group, broadcast_init=broadcast_init)
        # names, Topology and DynamicTopology objects: the same parser as the strategies' option
        if topology is not None:
            topology = build_topology(
                self.where, topology, tuple(TOPOLOGIES), self.group.size, self.ctx.local_size
            )
        if machine_topology is not None:
            machine_topology = build_topology(
                self.where, machine_topology, MACHINE_TOPOLOGIES, self.ctx.machine_size, 1
            )
        self.communication_type = communication_type
        self.num_steps_per_communication = num_steps_per_communication
        self.enable_topo_check = False
        self.self_weight = self.src_weights = self.dst_weights = None
        self.src_machine_weights = self.dst_machine_weights = None
        dyn = isinstance(topology, DynamicTopology)
        self.topology = None if dyn else topology
        self.dynamic_topology = topology if dyn else None
        mdyn = isinstance(machine_topology, DynamicTopology)
        self.machine_topology = None if mdyn else machine_topology
        self.dynamic_machine_topology = machine_topology if mdyn else None
        #: neighbor-averaging rounds done (the index given to ``dynamic_topology.at``)
        self.neighbor_rounds = 0
        self._plan: Plan | None = None
        #: under ``on_peer_loss="continue"``: how a failed combination is survived (None: it raises)
        self.survival: Survival | None = None

    def counters(self) -> dict[str, Any]:
        return {"steps": self.steps, "neighbor_rounds": self.neighbor_rounds}

    def load_counters(self, counters: dict[str, Any]) -> None:
        super().load_counters(counters)
        self.neighbor_rounds = int(counters["neighbor_rounds"])

    def plan(self) -> Plan:
        """The current iteration's plan (made from the knobs the first time it is asked for)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> Plan:
        kind = self.communication_type
        if not self.is_communicating():
            kind = CommunicationType.empty
        kwargs: dict[str, Any] = {}
        if kind is CommunicationType.neighbor_allreduce:
            if self.self_weight is not None or self.src_weights is not None or self.dst_weights is not None:
                kwargs = {"self_weight": self.self_weight, "src_weights": self.src_weights,
                          "dst_weights": self.dst_weights}  # fmt: skip
            elif self.dynamic_topology is not None:
                kwargs = {"topology": self.dynamic_topology.at(self.neighbor_rounds)}
            elif self.topology is not None:
                kwargs = {"topology": self.topology}
        elif kind is CommunicationType.hierarchical_neighbor_allreduce:
            if self.group.pg is not self.ctx.world.pg:
                raise InvalidArgumentError(
                    f"{self.where}: hierarchical_neighbor_allreduce runs over the world; this optimizer's "
                    f"group is {self.group.name!r}"
                )
            m_src, m_dst = self.src_machine_weights, self.dst_machine_weights
            if self.self_weight is not None or m_src is not None or m_dst is not None:
                kwargs = {"self_weight": self.self_weight, "src_machine_weights": m_src,
                          "dst_machine_weights": m_dst}  # fmt: skip
            elif self.dynamic_machine_topology is not None:
                kwargs = {"machine_topology": self.dynamic_machine_topology.at(self.neighbor_rounds)}
            elif self.machine_topology is not None:
                kwargs = {"machine_topology": self.machine_topology}
        check = self.enable_topo_check
        # always the checked group: the argument check costs no message while the ranks agree, and an
        # op on the unchecked view would share the process group with checked ones unseen (a rank's extra
        # op would pair with another rank's next collective inside gloo); enable_topo_check adds the
        # topology check
        return Plan(kind, kwargs, self.group, check)

    def is_communicating(self) -> bool:
        """Whether the current iteration communicates (every J-th step unless a subclass counts passes)."""
        return self.communicates(self.num_steps_per_communication)

    def end_iteration(self) -> None:
        """Advance the counters; the next iteration makes a new plan from the knobs."""
        plan = self.plan()
        if plan.kind in (
            CommunicationType.neighbor_allreduce,
            CommunicationType.hierarchical_neighbor_allreduce,
        ):
            self.neighbor_rounds += 1
        self.steps += 1
        self._plan = None

    def launch_layer(self, i: int) -> Pending | Guarded | None:
        """Start combining layer ``i``'s parameters as the current plan says (None: nothing to send)."""
        pending = launch(self.plan(), self.layers[i][1], self.layer_name(i))
        if pending is None or self.survival is None:
            return pending
        return Guarded(pending, i, self.survival)

    # -- a lost peer (on_peer_loss="continue", lowband.decentral.strategies) ------------------------
    def abandon(self) -> None:
        """A lost peer was noticed: drop every combination in flight without writing it (each drained
        first: the strategy broke the group, so they end at once) and send nothing more this iteration."""
        for i in self._pending:
            work = self._pending.pop(i)
            if isinstance(work, Guarded):  # (only under on_peer_loss="continue" is a loss noticed)
                work.drain()
        self._plan = Plan(CommunicationType.empty, {}, self.group, False)

    def regroup(self, group: Group, topology: Topology | DynamicTopology) -> None:
        """Combine over ``group`` (the members after a membership change) with ``topology`` (over its
        ranks) from the next iteration on."""
        self.group = group
        dyn = isinstance(topology, DynamicTopology)
        self.topology = None if dyn else topology
        self.dynamic_topology = topology if dyn else None
        self._plan = None
