"""BlueFog's basics: init/shutdown, ranks and sizes, the virtual topologies, timeline activities.

Topologies are networkx DiGraphs in BlueFog's convention (``nx.to_numpy_array(G)[i, j]`` is the weight of
the edge ``i -> j``). ``set_topology(G, is_weighted=False)`` averages uniformly over the in-neighbors (each
rank ``1 / (1 + in_degree)``), as BlueFog does; ``is_weighted=True`` uses the graph's edge weights and
self-loops. The graph becomes the world's :func:`lowband.decentral.state.set_topology`, so lowband's own
neighbor ops see it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import networkx as nx
import torch.distributed as dist

import lowband
from lowband.compat.bluefog.common import topology_util
from lowband.compat.bluefog.torch import _timeline as timeline
from lowband.compat.bluefog.torch._errors import TopologyTypeError
from lowband.compat.bluefog.torch._state import MOD, compat_state
from lowband.decentral import state as dstate
from lowband.decentral import window as dwindow
from lowband.errors import InvalidArgumentError
from lowband.runtime import current
from lowband.topology import Topology, uniform_pull_weights
from lowband.topology.weights import as_adjacency

logger = logging.getLogger("lowband.compat.bluefog")

#: BlueFog's number of ranks per machine (it overrides what the launcher says)
NODES_PER_MACHINE_ENV = "BLUEFOG_NODES_PER_MACHINE"


def init(topology_fn: Callable[[int], nx.DiGraph] | None = None, is_weighted: bool = False) -> None:
    """Initialise lowband (env:// under torchrun, else a world of one; an existing lowband context, as in
    the test harness, is reused) and set the topology ``topology_fn(size())``, by default
    ``ExponentialTwoGraph(size())``, and the machine topology ``ExponentialTwoGraph(machine_size())``.
    ``$BLUEFOG_NODES_PER_MACHINE`` sets the number of ranks per machine (before torchrun's
    ``LOCAL_WORLD_SIZE``), as in BlueFog. With ``$BLUEFOG_TIMELINE`` set, the timeline is traced and
    written while the program runs (see :mod:`lowband.compat.bluefog.torch._timeline`)."""
    per_machine = os.environ.get(NODES_PER_MACHINE_ENV)
    if not lowband.is_initialized() and per_machine:
        try:
            local = int(per_machine)
        except ValueError:
            raise InvalidArgumentError(
                f"{MOD}.init: ${NODES_PER_MACHINE_ENV}={per_machine!r} is not an integer"
            ) from None
        lowband.init(local_size=local)
    else:
        lowband.init()
        if per_machine and per_machine.strip() != str(lowband.local_size()):
            logger.warning(
                "%s.init on rank %d: $%s=%s ignored: lowband was initialised before with %d ranks per machine",
                MOD,
                lowband.rank(),
                NODES_PER_MACHINE_ENV,
                per_machine,
                lowband.local_size(),
            )
    timeline.start()
    n = size()
    graph = topology_fn(n) if topology_fn is not None else topology_util.ExponentialTwoGraph(n)
    set_topology(graph, is_weighted)
    set_machine_topology(topology_util.ExponentialTwoGraph(machine_size()))


def shutdown() -> None:
    """Shut lowband down on this rank (writing the timeline file a last time when one is written)."""
    if not lowband.is_initialized():
        return
    timeline.flush(force=True)
    lowband.shutdown()


def size() -> int:
    """Number of ranks."""
    return lowband.size()


def rank() -> int:
    """This rank."""
    return lowband.rank()


def local_size() -> int:
    """Number of ranks on this machine."""
    return lowband.local_size()


def local_rank() -> int:
    """This rank's index on its machine."""
    return lowband.local_rank()


def machine_size() -> int:
    """Number of machines (``size() // local_size()``)."""
    return lowband.machine_size()


def machine_rank() -> int:
    """This rank's machine (``rank() // local_size()``)."""
    return lowband.machine_rank()


def is_homogeneous() -> bool:
    """Always True: lowband lays ranks out with the same number on every machine."""
    current("is_homogeneous")
    return True


def nccl_built() -> bool:
    """Whether torch was built with NCCL (lowband then runs CUDA tensors on it)."""
    return bool(dist.is_nccl_available())


def mpi_threads_supported() -> bool:
    """Always False: there is no MPI under lowband (mixing with ``mpi4py`` is not supported)."""
    current("mpi_threads_supported")
    return False


def unified_mpi_window_model_supported() -> bool:
    """Always True: lowband's windows need no MPI window model, so the window ops are always usable."""
    current("unified_mpi_window_model_supported")
    return True


def set_skip_negotiate_stage(value: bool) -> None:
    """BlueFog's switch for its negotiation stage maps to lowband's cross-rank argument check:
    ``True`` turns the check off (:func:`lowband.set_check`). Call it on every rank."""
    lowband.set_check(not value)


def get_skip_negotiate_stage() -> bool:
    """True when lowband's cross-rank argument check is off."""
    return not current("get_skip_negotiate_stage").config.check


# ---------------------------------------------------------------- topologies


def _as_topology(op: str, graph: object, n: int, is_weighted: bool) -> Topology:
    """The lowband topology of a BlueFog graph: its edge weights, or uniform pull weights."""
    ctx = current(op)
    if not isinstance(graph, nx.DiGraph):
        raise TopologyTypeError(
            f"{MOD}.{op} on rank {ctx.rank}: topology must be a networkx.DiGraph, got {type(graph).__name__}"
        )
    if graph.number_of_nodes() != n:
        raise InvalidArgumentError(
            f"{MOD}.{op} on rank {ctx.rank}: topology has {graph.number_of_nodes()} nodes but there are {n} "
            f"{'machines' if 'machine' in op else 'ranks'}"
        )
    name = graph.graph.get("name") or "networkx"
    if is_weighted:
        return Topology.from_networkx(graph, name=str(name))
    adjacency = as_adjacency(f"{MOD}.{op}", graph, symmetric=False)
    return Topology(uniform_pull_weights(adjacency), name=str(name))


def set_topology(topology: nx.DiGraph | None = None, is_weighted: bool = False) -> bool:
    """Set the virtual topology (default ``ExponentialTwoGraph(size())``); returns True. Neighbor ops and
    window updates given no weights average over the in-neighbors: uniformly, or with the graph's weights
    (self-loops are self weights) when ``is_weighted``. Setting a graph equivalent to the current one (and
    the same ``is_weighted``) is a no-op; while windows exist the topology cannot change and False is
    returned, as in BlueFog."""
    st = compat_state(op="set_topology")
    graph = topology_util.ExponentialTwoGraph(size()) if topology is None else topology
    if (
        st.graph is not None
        and st.topology is dstate.load_topology()
        and st.is_weighted == bool(is_weighted)
        and isinstance(graph, nx.DiGraph)
        and topology_util.IsTopologyEquivalent(graph, st.graph)
    ):
        return True
    topo = _as_topology("set_topology", graph, size(), bool(is_weighted))
    if dwindow.window_names():
        logger.error(
            "%s.set_topology on rank %d: windows %s exist; free them (win_free) before changing the topology",
            MOD,
            rank(),
            dwindow.window_names(),
        )
        return False
    dstate.set_topology(topo)
    st.graph, st.is_weighted, st.topology = graph, bool(is_weighted), topo
    return True


def load_topology() -> nx.DiGraph:
    """The graph last given to :func:`set_topology` (the same object), or, if lowband's topology was set
    otherwise, that topology as a networkx graph."""
    st = compat_state(op="load_topology")
    topo = dstate.load_topology()
    if st.graph is not None and st.topology is topo:
        return st.graph
    return topo.to_networkx()


def is_topo_weighted() -> bool:
    """Whether the topology was set with ``is_weighted=True``."""
    return compat_state(op="is_topo_weighted").is_weighted


def in_neighbor_ranks() -> list[int]:
    """Ranks this rank receives from under the topology (ascending; never itself)."""
    return dstate.in_neighbor_ranks()


def out_neighbor_ranks() -> list[int]:
    """Ranks this rank sends to under the topology (ascending; never itself)."""
    return dstate.out_neighbor_ranks()


def set_machine_topology(topology: nx.DiGraph | None, is_weighted: bool = False) -> bool:
    """Set the topology between machines of :func:`hierarchical_neighbor_allreduce` (default
    ``ExponentialTwoGraph(machine_size())``); returns True. Weights as for :func:`set_topology`."""
    st = compat_state(op="set_machine_topology")
    graph = topology_util.ExponentialTwoGraph(machine_size()) if topology is None else topology
    topo = _as_topology("set_machine_topology", graph, machine_size(), bool(is_weighted))
    dstate.set_machine_topology(topo)
    st.machine_graph, st.machine_is_weighted, st.machine_topology = graph, bool(is_weighted), topo
    return True


def load_machine_topology() -> nx.DiGraph:
    """The graph last given to :func:`set_machine_topology` (or lowband's machine topology as a graph)."""
    st = compat_state(op="load_machine_topology")
    topo = dstate.load_machine_topology()
    if st.machine_graph is not None and st.machine_topology is topo:
        return st.machine_graph
    return topo.to_networkx()


def is_machine_topo_weighted() -> bool:
    """Whether the machine topology was set with ``is_weighted=True``."""
    return compat_state(op="is_machine_topo_weighted").machine_is_weighted


def in_neighbor_machine_ranks() -> list[int]:
    """Machines this rank's machine receives from (ascending)."""
    return dstate.in_neighbor_machine_ranks()


def out_neighbor_machine_ranks() -> list[int]:
    """Machines this rank's machine sends to (ascending)."""
    return dstate.out_neighbor_machine_ranks()


# ---------------------------------------------------------------- timeline


def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    """Open an activity on lowband's timeline (op ``"timeline"``, name ``"<tensor>:<activity>"``). Returns
    False, recording nothing, when tracing is off (BlueFog: when its timeline is off)."""
    ctx = current("timeline_start_activity")
    if not ctx.tracer.enabled:
        return False
    st = compat_state(ctx)
    st.timeline[tensor_name] = ctx.tracer.start(
        "timeline", f"{tensor_name}:{activity_name}", 0, 0, "timeline"
    )
    return True


def timeline_end_activity(tensor_name: str) -> bool:
    """Close the open activity of ``tensor_name``; False if tracing is off or none is open."""
    ctx = current("timeline_end_activity")
    ev: Any = compat_state(ctx).timeline.pop(tensor_name, None)
    if ev is None or not ctx.tracer.enabled:
        return False
    ctx.tracer.end(ev)
    timeline.flush()
    return True


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str) -> Iterator[None]:
    """An activity around the body of a ``with`` block."""
    timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        timeline_end_activity(tensor_name)
