"""Per-rank state of the decentralized ops: the static topology of each group, the machine topology,
and the tag counters of the neighbor ops.

Everything lives in ``ctx.state["lowband.decentral"]`` (one record per rank; the test harness runs ranks
as threads of one process, so nothing here may be a module global). Setting a topology is local: it does
not communicate. Every rank of a group should set the same topology; a rank whose send and receive sets
disagree with its neighbors' is caught by the topology check of the next neighbor op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import Context, current, world_group
from lowband.topology import Topology, exponential_two

STATE_KEY = "lowband.decentral"

#: neighbor-op messages use tags in [_TAG_BASE, 2**31) (gloo tags are non-negative int32); user
#: point-to-point tags (``lowband.send``) below 3 * 2**28 can never collide with them
_TAG_BASE = 3 << 29
_TAG_SPAN = 1 << 29


@dataclass
class DecentralState:
    """One rank's decentralized state. Groups are keyed by their torch process group (``Group.unchecked()``
    copies share it); the process group is held so that its ``id`` cannot be reused."""

    topologies: dict[int, tuple[Any, Topology]] = field(default_factory=dict)
    machine_topology: Topology | None = None
    seqs: dict[int, tuple[Any, int]] = field(default_factory=dict)


def decentral_state(ctx: Context) -> DecentralState:
    """This rank's :class:`DecentralState` (created on first use)."""
    st = ctx.state.get(STATE_KEY)
    if st is None:
        st = DecentralState()
        ctx.state[STATE_KEY] = st
    assert isinstance(st, DecentralState)
    return st


def next_tag(ctx: Context, g: Group) -> int:
    """The tag of the next neighbor-op message batch on ``g``. Neighbor ops are collective (every rank of
    the group calls them in the same order), so the counter, and the tag, is the same on every rank; two
    nonblocking calls in flight therefore never exchange each other's messages."""
    st = decentral_state(ctx)
    _, seq = st.seqs.get(id(g.pg), (g.pg, 0))
    st.seqs[id(g.pg)] = (g.pg, seq + 1)
    return _TAG_BASE + seq % _TAG_SPAN


def check_topology_arg(where: str, ctx: Context, topology: object, size: int, what: str) -> Topology:
    """``topology`` as a :class:`Topology` of ``size`` ranks, or an :class:`InvalidArgumentError`."""
    if not isinstance(topology, Topology):
        hint = " (for a time-varying topology pass topology.at(step))" if hasattr(topology, "at") else ""
        raise InvalidArgumentError(
            f"lowband.{where} on rank {ctx.rank}: {what} must be a lowband.topology.Topology, "
            f"got {type(topology).__name__}{hint}"
        )
    if topology.size != size:
        raise InvalidArgumentError(
            f"lowband.{where} on rank {ctx.rank}: {what} has {topology.size} ranks but must have {size}"
        )
    return topology


def set_topology(topology: Topology | None = None, *, group: Group | None = None) -> bool:
    """Set the static topology of ``group`` (default: the world) on this rank; returns True.

    ``None`` sets BlueFog's default, ``exponential_two(group.size)``. The topology's size must equal the
    group's size. Neighbor ops given no weights use it: rank ``i`` keeps ``W[i, i]`` of its own value,
    receives from its in-neighbors with weights ``W[i, j]`` and sends to its out-neighbors unscaled.
    """
    ctx, g = world_group(group, "set_topology")
    topo = exponential_two(g.size) if topology is None else topology
    topo = check_topology_arg("set_topology", ctx, topo, g.size, "topology")
    decentral_state(ctx).topologies[id(g.pg)] = (g.pg, topo)
    return True


def load_topology(group: Group | None = None) -> Topology:
    """The static topology of ``group`` (default: the world): the one set last by :func:`set_topology`,
    else ``exponential_two(group.size)``."""
    ctx, g = world_group(group, "load_topology")
    st = decentral_state(ctx)
    entry = st.topologies.get(id(g.pg))
    if entry is None:
        entry = (g.pg, exponential_two(g.size))
        st.topologies[id(g.pg)] = entry
    return entry[1]


def set_machine_topology(topology: Topology | None) -> bool:
    """Set the topology between machines used by :func:`hierarchical_neighbor_allreduce`; returns True.

    A machine topology is an ordinary :class:`Topology` over the ``machine_size`` machines (machine ``m``
    holds world ranks ``m * local_size ... (m + 1) * local_size - 1``). ``None`` sets
    ``exponential_two(machine_size)``.
    """
    ctx = current("set_machine_topology")
    topo = exponential_two(ctx.machine_size) if topology is None else topology
    topo = check_topology_arg("set_machine_topology", ctx, topo, ctx.machine_size, "topology")
    decentral_state(ctx).machine_topology = topo
    return True


def load_machine_topology() -> Topology:
    """The machine topology: the one set by :func:`set_machine_topology`, else
    ``exponential_two(machine_size)``."""
    ctx = current("load_machine_topology")
    st = decentral_state(ctx)
    if st.machine_topology is None:
        st.machine_topology = exponential_two(ctx.machine_size)
    return st.machine_topology


def in_neighbor_ranks(group: Group | None = None) -> list[int]:
    """Ranks (in ``group``) this rank receives from under the group's static topology, ascending."""
    _, g = world_group(group, "in_neighbor_ranks")
    return [int(r) for r in load_topology(g).in_neighbors(g.rank)]


def out_neighbor_ranks(group: Group | None = None) -> list[int]:
    """Ranks (in ``group``) this rank sends to under the group's static topology, ascending."""
    _, g = world_group(group, "out_neighbor_ranks")
    return [int(r) for r in load_topology(g).out_neighbors(g.rank)]


def in_neighbor_machine_ranks() -> list[int]:
    """Machines this rank's machine receives from under the machine topology, ascending."""
    ctx = current("in_neighbor_machine_ranks")
    return [int(r) for r in load_machine_topology().in_neighbors(ctx.machine_rank)]


def out_neighbor_machine_ranks() -> list[int]:
    """Machines this rank's machine sends to under the machine topology, ascending."""
    ctx = current("out_neighbor_machine_ranks")
    return [int(r) for r in load_machine_topology().out_neighbors(ctx.machine_rank)]
