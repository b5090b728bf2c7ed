"""Topologies by name: the one list that strategies, the bench and the command line choose from."""

from __future__ import annotations

from collections.abc import Callable

from lowband.errors import InvalidArgumentError
from lowband.options import Opt
from lowband.registry import Registry
from lowband.topology.builders import exponential_two, fully_connected, ring
from lowband.topology.dynamic import (
    DynamicTopology,
    dynamic_inner_outer_exponential_two,
    dynamic_one_peer_exponential_two,
)
from lowband.topology.graph import Topology

#: ``builder(size, local_size)``: a topology over ``size`` ranks on machines of ``local_size`` ranks
TopologyBuilder = Callable[[int, int], Topology | DynamicTopology]

TOPOLOGIES: Registry[TopologyBuilder] = Registry("topology")
TOPOLOGIES.register("ring", lambda n, _ls: ring(n), "bidirectional ring")
TOPOLOGIES.register("exp2", lambda n, _ls: exponential_two(n), "static exponential-2 graph")
TOPOLOGIES.register(
    "dynamic-exp2", lambda n, _ls: dynamic_one_peer_exponential_two(n), "one exponential-2 peer per round"
)
TOPOLOGIES.register(
    "inner-outer-exp2", dynamic_inner_outer_exponential_two, "dynamic, within and across machines"
)
TOPOLOGIES.register("full", lambda n, _ls: fully_connected(n), "every rank with every other")

#: the names that make sense over machines (hierarchical averaging), and the static ones
MACHINE_TOPOLOGIES = ("ring", "exp2", "dynamic-exp2", "full")
STATIC_TOPOLOGIES = ("ring", "exp2", "full")


def topology_option(allowed: tuple[str, ...], *, dynamic: bool = True) -> Opt:
    """The option a topology argument is: a name of ``allowed``, a :class:`Topology` or (``dynamic``) a
    :class:`DynamicTopology`; the strategies declare it (:mod:`lowband.options`), :func:`build_topology`
    checks with it."""
    kinds = (Topology, DynamicTopology) if dynamic else (Topology,)
    return Opt(str, choices=allowed, objects=kinds, doc="the graph of the neighbor averaging")


def build_topology(
    where: str,
    name: object,
    allowed: tuple[str, ...],
    size: int,
    local_size: int,
    *,
    dynamic: bool = True,
) -> Topology | DynamicTopology:
    """The one parser of topology arguments: a name registered as one of ``allowed`` (built over
    ``size`` ranks on machines of ``local_size`` ranks), or a :class:`Topology` over ``size`` ranks, or
    (when ``dynamic``) a :class:`DynamicTopology` over ``size`` ranks, returned as is."""
    if isinstance(name, (Topology, DynamicTopology)):
        if isinstance(name, DynamicTopology) and not dynamic:
            raise InvalidArgumentError(f"{where}: topology must be static here, got a DynamicTopology")
        if name.size != size:
            raise InvalidArgumentError(
                f"{where}: the topology given is over {name.size} ranks, the group has {size}"
            )
        return name
    topology_option(allowed, dynamic=dynamic).convert(where, "topology", name)
    return TOPOLOGIES.get(name, where)(size, local_size)


def topology_label(topology: object) -> str:
    """How reports name a topology argument: its name, or its class for an object."""
    return topology if isinstance(topology, str) else type(topology).__name__
