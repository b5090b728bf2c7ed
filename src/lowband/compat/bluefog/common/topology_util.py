"""BlueFog's ``bluefog.common.topology_util`` on :mod:`lowband.topology`.

Same function names, arguments, defaults and return types as BlueFog 0.3: static builders return a
``networkx.DiGraph`` in BlueFog's convention (``nx.to_numpy_array(G)[i, j]`` is the weight of the
edge ``i -> j``, the weight receiver ``j`` applies to ``i``'s value; self-loops carry self weights);
dynamic generators yield ``(send_ranks, recv_ranks)`` lists per step, in BlueFog's sequences.

Differences from BlueFog:

- Bad arguments raise :class:`lowband.errors.InvalidArgumentError` (a ``ValueError``) with a message
  naming the argument, where BlueFog fails an ``assert`` or crashes (``ZeroDivisionError``,
  ``OverflowError``). ``ExponentialGraph(0)`` raises instead of returning an empty graph.
- Graphs passed in must have the nodes ``0..n-1`` and finite non-negative weights; an edge of
  weight 0 is no edge.
- ``ExponentialGraph`` and ``SymmetricExponentialGraph`` test powers in exact integer arithmetic;
  BlueFog's floating-point ``isPowerOf`` misses some (``3**5 = 243`` for base 3), so for such sizes
  the graphs here have the edges BlueFog's docstrings describe.
- ``MeshGrid2DGraph``'s self weights are computed as ``1 - sum`` of the neighbour weights, which can
  differ from BlueFog's ``2 - (1 + sum)`` in the last bit.
- ``IsTopologyEquivalent`` compares weight matrices without ``nx.to_numpy_matrix`` (gone in
  networkx 3); it still returns False for ``None`` and for different node or edge counts.
- ``IsRegularGraph`` requires equal in-degrees and equal out-degrees, self-loops not counted;
  BlueFog compares total degrees (in + out, a self-loop counting twice). They agree on all the
  builders' graphs.
- ``GetRecvWeights`` / ``GetSendWeights`` return plain floats, neighbours in ascending rank order.
- ``GetDynamicOnePeerSendRecvRanks``: a rank without out-neighbours (every rank when the size is 1)
  sends to nobody (``[]``), where BlueFog divides by zero; graphs need no self-loops.
- ``GetInnerOuterRingDynamicSendRecvRanks`` / ``GetInnerOuterExpo2DynamicSendRecvRanks`` require at
  least two machines; with one, BlueFog's ring schedule sends to the rank itself and its exp-2
  schedule raises ``OverflowError``.
- ``InferSourceFromDestinationRanks`` / ``InferDestinationFromSourceRanks`` live in BlueFog's
  ``bluefog.torch.topology_util`` (re-exported here, in
  :mod:`lowband.compat.bluefog.torch.topology_util` and in ``bf``). Given this rank's list (any
  sequence of ints or a 1-D array) they are collective, as in BlueFog (two allgathers). Given one list
  per rank they are pure (lowband's extension: every rank's result, or rank ``rank``'s). The adjacency
  matrix is normalised as BlueFog documents it (each receiver's weights, self included, sum to 1:
  columns of ``[i, j] = i -> j``); BlueFog's code divides by the senders' row sums instead, which
  agrees only when every rank has as many sources as destinations.
- Only BlueFog 0.3's public functions are provided (not the older ``PowerGraph`` names, the static
  ``InnerOuter*Graph`` builders or ``isPowerOf``).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import networkx as nx
import numpy as np
import numpy.typing as npt
import torch

import lowband
from lowband.comm.base import host_value
from lowband.errors import InvalidArgumentError
from lowband.runtime import current
from lowband.topology import (
    Topology,
    exponential,
    exponential_two,
    fully_connected,
    infer_destinations,
    infer_sources,
    inner_outer_exponential_two,
    inner_outer_ring,
    mesh_grid_2d,
    one_peer,
    one_peer_exponential_two,
    ring,
    star,
    symmetric_exponential,
    uniform_pull_weights,
)
from lowband.topology._args import as_int, check_rank, check_rank_list, check_size

SendRecv = tuple[list[int], list[int]]

_MOD = "lowband.compat.bluefog.common.topology_util"
_RING_STYLES: dict[int, Literal["bidirectional", "left", "right"]] = {
    0: "bidirectional",
    1: "left",
    2: "right",
}


def _topo(where: str, topo: Any) -> Topology:
    if not isinstance(topo, nx.DiGraph):
        raise InvalidArgumentError(
            f"{_MOD}.{where}: topo must be a networkx.DiGraph, got {type(topo).__name__}"
        )
    return Topology.from_networkx(topo)


# -- static graphs ------------------------------------------------------------------------------


def ExponentialTwoGraph(size: int) -> nx.DiGraph:
    """Each rank sends to ``rank + 2**k`` (mod ``size``) for every ``2**k < size``; uniform weights."""
    return exponential_two(size).to_networkx()


def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:
    """Each rank sends to ``rank + base**k`` (mod ``size``) for every ``base**k < size``; uniform
    weights."""
    return exponential(size, base).to_networkx()


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:
    """Ranks ``i`` and ``i + d`` are linked iff ``min(d, size - d)`` is a power of ``base``; uniform
    weights."""
    return symmetric_exponential(size, base).to_networkx()


def MeshGrid2DGraph(size: int, shape: tuple[int, int] | None = None) -> nx.DiGraph:
    """2-D mesh grid of ``shape = (nrow, ncol)`` (by default the most square factorisation of
    ``size``, ``nrow <= ncol``) with Metropolis-Hastings weights."""
    return mesh_grid_2d(size, shape).to_networkx()


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """Every rank linked both ways to ``center_rank``; weights ``1/size`` on every edge and at the
    centre, ``1 - 1/size`` self weight elsewhere."""
    return star(size, center_rank).to_networkx()


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """Ring: ``connect_style`` 0 links both neighbours, 1 sends to the left (``rank - 1``), 2 to the
    right (``rank + 1``); uniform weights."""
    style = as_int(f"{_MOD}.RingGraph", "connect_style", connect_style)
    if style not in _RING_STYLES:
        raise InvalidArgumentError(
            f"{_MOD}.RingGraph: connect_style must be 0 (both), 1 (left) or 2 (right), got {style}"
        )
    return ring(size, style=_RING_STYLES[style]).to_networkx()


def FullyConnectedGraph(size: int) -> nx.DiGraph:
    """Every rank linked to every rank; all weights ``1/size``."""
    return fully_connected(size).to_networkx()


# -- queries ------------------------------------------------------------------------------------


def IsTopologyEquivalent(topo1: nx.DiGraph | None, topo2: nx.DiGraph | None) -> bool:
    """True iff both graphs are given, have as many nodes and edges, and equal weight matrices (not
    an isomorphism test)."""
    if topo1 is None or topo2 is None:
        return False
    if topo1.number_of_nodes() != topo2.number_of_nodes():
        return False
    if topo1.number_of_edges() != topo2.number_of_edges():
        return False
    return _topo("IsTopologyEquivalent", topo1) == _topo("IsTopologyEquivalent", topo2)


def IsRegularGraph(topo: nx.DiGraph) -> bool:
    """True iff every rank has the same in-degree and the same out-degree (self-loops not counted)."""
    return _topo("IsRegularGraph", topo).is_regular()


def GetRecvWeights(topo: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """``(self_weight, {src: weight})``: the weights ``rank`` applies to itself and to what each
    in-neighbour sends (self weight 0.0 without a self-loop)."""
    t = _topo("GetRecvWeights", topo)
    return t.self_weight(rank), t.src_weights(rank)


def GetSendWeights(topo: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """``(self_weight, {dst: weight})``: ``rank``'s self weight and the weight each out-neighbour
    applies to what ``rank`` sends."""
    t = _topo("GetSendWeights", topo)
    return t.self_weight(rank), t.dst_weights(rank)


# -- dynamic topologies -------------------------------------------------------------------------


def GetDynamicOnePeerSendRecvRanks(topo: nx.DiGraph, self_rank: int) -> Iterator[SendRecv]:
    """One-peer variant of ``topo`` seen from ``self_rank``: at step ``k`` each rank sends to its
    ``k``-th out-neighbour (cyclically, ordered clockwise from the rank); yields
    ``([send_rank], recv_ranks)``."""
    return one_peer(_topo("GetDynamicOnePeerSendRecvRanks", topo), self_rank)


def GetExp2DynamicSendRecvMachineRanks(
    world_size: int, local_size: int, self_rank: int, local_rank: int
) -> Iterator[SendRecv]:
    """One-peer exponential-2 schedule between machines, seen from ``self_rank``'s machine: at step
    ``k`` machine ``m`` sends to ``m + 2**j`` and receives from ``m - 2**j``; yields
    ``([send_machine_id], [recv_machine_id])``. Needs equal machines and at least two of them."""
    where = f"{_MOD}.GetExp2DynamicSendRecvMachineRanks"
    ws = check_size(where, world_size, what="world_size")
    ls = check_size(where, local_size, what="local_size")
    r = check_rank(where, self_rank, ws, what="self_rank")
    lr = as_int(where, "local_rank", local_rank)
    if ws % ls != 0 or r % ls != lr:
        raise InvalidArgumentError(
            f"{where}: needs equal machines: world_size {ws}, local_size {ls}, self_rank {r}, local_rank {lr}"
        )
    if ws <= ls:
        raise InvalidArgumentError(
            f"{where}: needs at least two machines, got world_size {ws}, local_size {ls}"
        )
    return one_peer_exponential_two(ws // ls, r // ls)


def GetInnerOuterRingDynamicSendRecvRanks(
    world_size: int, local_size: int, self_rank: int
) -> Iterator[SendRecv]:
    """Inner-ring / outer-ring schedule seen from ``self_rank``: at step ``k`` local rank
    ``k mod local_size`` of each machine sends to its peer on the next machine, the others pass
    along a ring inside the machine; yields ``([send_rank], [recv_rank])``."""
    return inner_outer_ring(world_size, local_size, self_rank)


def GetInnerOuterExpo2DynamicSendRecvRanks(
    world_size: int, local_size: int, self_rank: int
) -> Iterator[SendRecv]:
    """Inner-exp2 / outer-exp2 schedule seen from ``self_rank``: at step ``k`` local rank
    ``k mod local_size`` of each machine exchanges with its peer ``2**j`` machines away, the others
    with a rank ``2**i`` (+1) away inside the machine; yields ``([send_rank], [recv_rank])``."""
    return inner_outer_exponential_two(world_size, local_size, self_rank)


# -- inferring the other side -------------------------------------------------------------------

Lists = list[list[int]]
Matrix = npt.NDArray[np.float64]


def _own_list(ranks: object) -> list[int] | None:
    """This rank's list when ``ranks`` is one (ints, a tuple, a 1-D array, possibly empty), else None
    (a list with one list per rank: the pure form)."""
    if isinstance(ranks, np.ndarray):
        return [int(r) for r in ranks.tolist()] if ranks.ndim == 1 else None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        return None
    if all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in ranks):
        return [int(r) for r in ranks]
    return None


def _gather_lists(where: str, mine: list[int]) -> Lists:
    """Every rank's list, by two allgathers (the lengths, then the ranks), as BlueFog does."""
    ctx = current(where)
    at = f"{_MOD}.{where} on rank {ctx.rank}"
    check_rank_list(at, "ranks", mine, ctx.rank, ctx.size)
    lens = lowband.allgather(
        host_value(torch.tensor([len(mine)], dtype=torch.int64, device="cpu")), name=f"{where}.degrees"
    )
    flat = lowband.allgather(
        host_value(torch.tensor(mine, dtype=torch.int64, device="cpu")), name=f"{where}.ranks"
    ).tolist()
    out: Lists = []
    pos = 0
    for k in lens.tolist():
        out.append(sorted(flat[pos : pos + k]))
        pos += k
    return out


def InferSourceFromDestinationRanks(
    dst_ranks: Sequence[int] | Sequence[Sequence[int]],
    construct_adjacency_matrix: bool = False,
    *,
    rank: int | None = None,
) -> Any:
    """Sources from destinations. As in BlueFog, a collective call: ``dst_ranks`` is this rank's list of
    destinations (any sequence of ints or a 1-D array), every rank calls it, and this rank's sources
    (ascending) are returned; with ``construct_adjacency_matrix`` the pair ``(sources, W)`` where
    ``W[i, j]`` is the weight of the edge ``i -> j`` and each receiver averages itself and its sources
    uniformly (columns sum to 1). lowband's pure form: pass every rank's list (``dst_ranks[r]`` is rank
    ``r``'s); every rank's sources are returned, or ``rank``'s alone."""
    mine = _own_list(dst_ranks)
    if mine is not None:
        lists = _gather_lists("InferSourceFromDestinationRanks", mine)
        sources = infer_sources(lists)
        return _result("InferSourceFromDestinationRanks", sources, sources, construct_adjacency_matrix, _me())
    sources = infer_sources(dst_ranks)  # type: ignore[arg-type]
    return _result("InferSourceFromDestinationRanks", sources, sources, construct_adjacency_matrix, rank)


def InferDestinationFromSourceRanks(
    src_ranks: Sequence[int] | Sequence[Sequence[int]],
    construct_adjacency_matrix: bool = False,
    *,
    rank: int | None = None,
) -> Any:
    """Destinations from sources: the collective call (this rank's sources in, its destinations out) or
    the pure form, as :func:`InferSourceFromDestinationRanks`; the matrix is the same graph's."""
    mine = _own_list(src_ranks)
    if mine is not None:
        lists = _gather_lists("InferDestinationFromSourceRanks", mine)
        destinations = infer_destinations(lists)
        return _result(
            "InferDestinationFromSourceRanks", destinations, lists, construct_adjacency_matrix, _me()
        )
    destinations = infer_destinations(src_ranks)  # type: ignore[arg-type]
    sources = infer_sources(destinations)
    return _result("InferDestinationFromSourceRanks", destinations, sources, construct_adjacency_matrix, rank)


def _me() -> int:
    return current("topology_util").rank


def _result(name: str, lists: Lists, sources: Lists, with_matrix: bool, rank: int | None) -> Any:
    n = len(lists)
    out: Any = lists if rank is None else lists[check_rank(f"{_MOD}.{name}", rank, n)]
    if not with_matrix:
        return out
    a = np.zeros((n, n), dtype=np.bool_)
    for i, srcs in enumerate(sources):
        a[i, srcs] = True  # a[i, j]: j sends to i (lowband's receiver-row convention)
    w: Matrix = uniform_pull_weights(a).T  # BlueFog's [sender, receiver] convention
    return out, w


__all__ = [
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "FullyConnectedGraph",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetRecvWeights",
    "GetSendWeights",
    "InferDestinationFromSourceRanks",
    "InferSourceFromDestinationRanks",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "MeshGrid2DGraph",
    "RingGraph",
    "StarGraph",
    "SymmetricExponentialGraph",
]
