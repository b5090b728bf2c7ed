"""lowband.compat.bluefog.common.topology_util against BlueFog's own formulas, rewritten here as
single-process oracles (BlueFog itself needs MPI and does not install)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import networkx as nx
import numpy as np
import numpy.typing as npt
import pytest

from lowband.compat.bluefog.common import topology_util as tu
from lowband.errors import InvalidArgumentError
from lowband.topology import Topology, inner_outer_exponential_two, inner_outer_ring

Matrix = npt.NDArray[np.float64]

# -- BlueFog's formulas: [i, j] is the weight of the edge i -> j --------------------------------


def _circulant(x: Matrix) -> Matrix:
    return np.array([np.roll(x, i) for i in range(len(x))])


def _bf_is_power(x: int, base: int) -> bool:
    return base ** int(math.log(x, base)) == x  # BlueFog's isPowerOf (exact for the sizes used here)


def bf_exponential_two(n: int) -> Matrix:
    x = np.array([1.0 if i & (i - 1) == 0 else 0 for i in range(n)])
    return _circulant(x / x.sum())


def bf_exponential(n: int, base: int) -> Matrix:
    x = np.array([1.0] + [1.0 if _bf_is_power(i, base) else 0.0 for i in range(1, n)])
    return _circulant(x / x.sum())


def bf_symmetric_exponential(n: int, base: int) -> Matrix:
    x = np.array(
        [1.0] + [1.0 if _bf_is_power(i if i <= n // 2 else n - i, base) else 0.0 for i in range(1, n)]
    )
    return _circulant(x / x.sum())


def bf_mesh(n: int, shape: tuple[int, int] | None = None) -> Matrix:
    if shape is None:
        i = int(np.sqrt(n))
        while n % i != 0:
            i -= 1
        shape = (i, n // i)
    _, ncol = shape
    topo = np.zeros((n, n))
    for i in range(n):
        topo[i][i] = 1.0
        if (i + 1) % ncol != 0:
            topo[i][i + 1] = topo[i + 1][i] = 1.0
        if i + ncol < n:
            topo[i][i + ncol] = topo[i + ncol][i] = 1.0
    nbrs = [np.nonzero(topo[i])[0] for i in range(n)]
    for i in range(n):
        for j in nbrs[i]:
            if i != j:
                topo[i][j] = 1.0 / max(len(nbrs[i]), len(nbrs[j]))
        topo[i][i] = 2.0 - topo[i].sum()
    return topo


def bf_star(n: int, c: int) -> Matrix:
    topo = np.zeros((n, n))
    for i in range(n):
        topo[i, i] = 1 - 1 / n
        topo[c, i] = 1 / n
        topo[i, c] = 1 / n
    return topo


def bf_ring(n: int, style: int) -> Matrix:
    if n == 1:
        return np.array([[1.0]])
    if n == 2:
        return np.array([[0.5, 0.5], [0.5, 0.5]])
    x = np.zeros(n)
    x[0] = 0.5
    if style == 0:
        x[0] = x[-1] = x[1] = 1 / 3.0
    elif style == 1:
        x[-1] = 0.5
    else:
        x[1] = 0.5
    return _circulant(x)


def bf_fully_connected(n: int) -> Matrix:
    return _circulant(np.array([1 / n] * n))


def bf_one_peer(topo: nx.DiGraph, self_rank: int) -> Iterator[tuple[list[int], list[int]]]:
    """BlueFog's GetDynamicOnePeerSendRecvRanks (graphs with self-loops)."""
    size = topo.number_of_nodes()
    sorted_send_ranks = []
    for rank in range(size):
        ranks = sorted(topo.successors(rank), key=lambda r, rk=rank: r - rk if r >= rk else r - rk + size)
        if ranks[0] == rank:
            ranks = ranks[1:]
        sorted_send_ranks.append(ranks)
    self_degree = topo.out_degree(self_rank) - 1
    index = 0
    while True:
        send_rank = sorted_send_ranks[self_rank][index % self_degree]
        recv_ranks = []
        for other in range(size):
            if other == self_rank:
                continue
            degree = topo.out_degree(other) - 1
            if sorted_send_ranks[other][index % degree] == self_rank:
                recv_ranks.append(other)
        yield [send_rank], recv_ranks
        index += 1


CASES: list[tuple[str, Callable[[int], nx.DiGraph], Callable[[int], Matrix]]] = [
    ("ExponentialTwoGraph", tu.ExponentialTwoGraph, bf_exponential_two),
    ("ExponentialGraph", tu.ExponentialGraph, lambda n: bf_exponential(n, 2)),
    ("ExponentialGraph3", lambda n: tu.ExponentialGraph(n, 3), lambda n: bf_exponential(n, 3)),
    ("SymmetricExponentialGraph", tu.SymmetricExponentialGraph, lambda n: bf_symmetric_exponential(n, 4)),
    (
        "SymmetricExponentialGraph2",
        lambda n: tu.SymmetricExponentialGraph(n, 2),
        lambda n: bf_symmetric_exponential(n, 2),
    ),
    ("MeshGrid2DGraph", tu.MeshGrid2DGraph, bf_mesh),
    ("StarGraph", tu.StarGraph, lambda n: bf_star(n, 0)),
    ("StarGraphLast", lambda n: tu.StarGraph(n, n - 1), lambda n: bf_star(n, n - 1)),
    ("RingGraph", tu.RingGraph, lambda n: bf_ring(n, 0)),
    ("RingGraphLeft", lambda n: tu.RingGraph(n, 1), lambda n: bf_ring(n, 1)),
    ("RingGraphRight", lambda n: tu.RingGraph(n, 2), lambda n: bf_ring(n, 2)),
    ("FullyConnectedGraph", tu.FullyConnectedGraph, bf_fully_connected),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=IDS)
def test_static_graphs_equal_bluefog(
    name: str, ours: Callable[[int], nx.DiGraph], theirs: Callable[[int], Matrix]
) -> None:
    for n in range(1, 10):
        g, expected = ours(n), theirs(n)
        assert isinstance(g, nx.DiGraph)
        bf_graph = nx.from_numpy_array(expected, create_using=nx.DiGraph)
        assert sorted(g.edges) == sorted(bf_graph.edges), (name, n)  # self-loops included
        np.testing.assert_allclose(
            nx.to_numpy_array(g), expected, rtol=0, atol=1e-15, err_msg=f"{name} n={n}"
        )
        if name != "MeshGrid2DGraph":  # BlueFog's mesh self weight 2 - (1 + s) may differ in the last bit
            np.testing.assert_array_equal(nx.to_numpy_array(g), expected, err_msg=f"{name} n={n}")


def test_mesh_with_shape() -> None:
    for shape in [(2, 3), (3, 2), (1, 6), (6, 1)]:
        np.testing.assert_allclose(
            nx.to_numpy_array(tu.MeshGrid2DGraph(6, shape)), bf_mesh(6, shape), atol=1e-15
        )
    with pytest.raises(InvalidArgumentError, match="shape 4x2 does not match size 6"):
        tu.MeshGrid2DGraph(6, (4, 2))


def test_exponential_graph_uses_exact_powers() -> None:
    # BlueFog's float isPowerOf misses 3**5 = 243; the graph here links every power of the base
    assert not _bf_is_power(243, 3)
    assert 243 in tu.ExponentialGraph(250, 3).successors(0)


def test_recv_and_send_weights() -> None:
    for g in (tu.ExponentialTwoGraph(6), tu.StarGraph(5, 2), tu.MeshGrid2DGraph(6), tu.RingGraph(5, 2)):
        w = nx.to_numpy_array(g)
        for rank in range(g.number_of_nodes()):
            self_w, recv = tu.GetRecvWeights(g, rank)
            assert self_w == w[rank, rank]
            assert recv == {s: w[s, rank] for s in g.predecessors(rank) if s != rank}
            self_w2, send = tu.GetSendWeights(g, rank)
            assert self_w2 == self_w
            assert send == {d: w[rank, d] for d in g.successors(rank) if d != rank}
    self_w, recv = tu.GetRecvWeights(tu.RingGraph(4, 2), 0)  # rank 0 hears rank 3 on a right ring
    assert (self_w, recv) == (0.5, {3: 0.5})
    assert tu.GetSendWeights(tu.RingGraph(4, 2), 0) == (0.5, {1: 0.5})
    no_self = nx.DiGraph([(0, 1), (1, 0)])
    assert tu.GetRecvWeights(no_self, 0) == (0.0, {1: 1.0})
    with pytest.raises(InvalidArgumentError, match=r"rank must be in \[0, 2\), got 2"):
        tu.GetRecvWeights(no_self, 2)
    with pytest.raises(
        InvalidArgumentError, match=r"GetSendWeights: topo must be a networkx\.DiGraph, got Graph"
    ):
        tu.GetSendWeights(nx.path_graph(2), 0)


def test_is_topology_equivalent() -> None:
    a = tu.RingGraph(5)
    assert tu.IsTopologyEquivalent(a, tu.RingGraph(5))
    assert not tu.IsTopologyEquivalent(a, None) and not tu.IsTopologyEquivalent(None, a)
    assert not tu.IsTopologyEquivalent(a, tu.RingGraph(6))  # node count
    assert not tu.IsTopologyEquivalent(a, tu.FullyConnectedGraph(5))  # edge count
    assert not tu.IsTopologyEquivalent(tu.RingGraph(5, 1), tu.RingGraph(5, 2))  # same counts, other edges
    b = tu.RingGraph(5)
    b[0][1]["weight"] = 0.5  # same edges, another weight
    assert not tu.IsTopologyEquivalent(a, b)
    assert tu.IsTopologyEquivalent(tu.ExponentialGraph(8), tu.ExponentialTwoGraph(8))


def test_is_regular_graph() -> None:
    for n in range(1, 9):
        for g in (
            tu.RingGraph(n),
            tu.ExponentialTwoGraph(n),
            tu.FullyConnectedGraph(n),
            tu.SymmetricExponentialGraph(n),
        ):
            assert tu.IsRegularGraph(g)
    assert not tu.IsRegularGraph(tu.StarGraph(4))
    assert not tu.IsRegularGraph(tu.MeshGrid2DGraph(6))
    assert tu.IsRegularGraph(tu.MeshGrid2DGraph(4))  # a 2x2 grid is a 4-cycle


def test_ring_graph_styles() -> None:
    assert sorted(tu.RingGraph(5, 1).successors(2)) == [1, 2]  # 1: each rank sends to its left
    assert sorted(tu.RingGraph(5, 2).successors(2)) == [2, 3]
    for bad in (3, -1):
        with pytest.raises(
            InvalidArgumentError,
            match=rf"connect_style must be 0 \(both\), 1 \(left\) or 2 \(right\), got {bad}",
        ):
            tu.RingGraph(5, bad)
    with pytest.raises(InvalidArgumentError, match="connect_style must be an int"):
        tu.RingGraph(5, True)


@pytest.mark.parametrize("size", [0, -1])
def test_static_size_errors(size: int) -> None:
    builders: list[Callable[[int], nx.DiGraph]] = [
        tu.ExponentialTwoGraph, tu.ExponentialGraph, tu.SymmetricExponentialGraph, tu.MeshGrid2DGraph,
        tu.StarGraph, tu.RingGraph, tu.FullyConnectedGraph,
    ]  # fmt: skip
    for build in builders:
        with pytest.raises(InvalidArgumentError, match=f"size must be >= 1, got {size}"):
            build(size)
    with pytest.raises(InvalidArgumentError, match="base must be an int >= 2, got 1"):
        tu.ExponentialGraph(4, 1)
    with pytest.raises(InvalidArgumentError, match=r"center must be in \[0, 4\), got 7"):
        tu.StarGraph(4, 7)


# -- dynamic ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "ours", "theirs"), CASES, ids=IDS)
def test_one_peer_equals_bluefog(
    name: str, ours: Callable[[int], nx.DiGraph], theirs: Callable[[int], Matrix]
) -> None:
    for n in range(2, 10):
        g = ours(n)
        for rank in range(n):
            got = list(itertools.islice(tu.GetDynamicOnePeerSendRecvRanks(g, rank), 2 * n))
            want = list(itertools.islice(bf_one_peer(g, rank), 2 * n))
            assert got == want, (name, n, rank)


def test_one_peer_size_one_and_errors() -> None:
    assert next(tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialTwoGraph(1), 0)) == ([], [])
    no_self = nx.DiGraph([(0, 1), (1, 2), (2, 0)])  # BlueFog needs self-loops; not here
    assert list(itertools.islice(tu.GetDynamicOnePeerSendRecvRanks(no_self, 0), 2)) == [
        ([1], [2]),
        ([1], [2]),
    ]
    with pytest.raises(InvalidArgumentError, match=r"rank must be in \[0, 3\), got 3"):
        tu.GetDynamicOnePeerSendRecvRanks(no_self, 3)


def test_exp2_machine_ranks() -> None:
    for machines in range(2, 10):
        for local_size in (1, 2, 3):
            ws = machines * local_size
            e = int(np.log2(machines - 1))
            for rank in range(ws):
                m = rank // local_size
                gen = tu.GetExp2DynamicSendRecvMachineRanks(ws, local_size, rank, rank % local_size)
                for k, step in enumerate(itertools.islice(gen, 2 * machines)):
                    d = 2 ** (k % (e + 1))
                    assert step == ([(m + d) % machines], [(m - d) % machines])
    with pytest.raises(InvalidArgumentError, match="needs equal machines"):
        tu.GetExp2DynamicSendRecvMachineRanks(8, 4, 1, 2)
    with pytest.raises(InvalidArgumentError, match="needs equal machines"):
        tu.GetExp2DynamicSendRecvMachineRanks(6, 4, 1, 1)
    with pytest.raises(InvalidArgumentError, match="at least two machines"):
        tu.GetExp2DynamicSendRecvMachineRanks(4, 4, 1, 1)
    with pytest.raises(InvalidArgumentError, match=r"self_rank must be in \[0, 8\), got 8"):
        tu.GetExp2DynamicSendRecvMachineRanks(8, 4, 8, 0)


def test_inner_outer_generators() -> None:
    for ws, ls in [(6, 3), (12, 3), (16, 4), (10, 5)]:
        for rank in range(ws):
            for ours, lowband_gen in (
                (tu.GetInnerOuterRingDynamicSendRecvRanks, inner_outer_ring),
                (tu.GetInnerOuterExpo2DynamicSendRecvRanks, inner_outer_exponential_two),
            ):
                got = list(itertools.islice(ours(ws, ls, rank), 2 * ws))
                assert got == list(itertools.islice(lowband_gen(ws, ls, rank), 2 * ws))
    assert next(tu.GetInnerOuterRingDynamicSendRecvRanks(9, 3, 4)) == ([5], [5])
    for gen in (tu.GetInnerOuterRingDynamicSendRecvRanks, tu.GetInnerOuterExpo2DynamicSendRecvRanks):
        with pytest.raises(InvalidArgumentError, match="local_size must be > 2"):
            gen(4, 2, 0)
        with pytest.raises(InvalidArgumentError, match="does not divide"):
            gen(8, 3, 0)
        with pytest.raises(InvalidArgumentError, match="at least 2 machines"):
            gen(3, 3, 0)


# -- infer --------------------------------------------------------------------------------------------


def _bf_matrix(dst_ranks: list[list[int]]) -> Matrix:
    """BlueFog's adjacency matrix of InferSourceFromDestinationRanks (W[i, j] = edge i -> j)."""
    w = np.eye(len(dst_ranks))
    for k, adj in enumerate(dst_ranks):
        w[k, adj] = 1
    return w / w.sum(axis=1)


def test_infer_ranks() -> None:
    dst = [[1, 2], [2], [0], [0]]
    assert tu.InferSourceFromDestinationRanks(dst) == [[2, 3], [0], [0, 1], []]
    assert tu.InferSourceFromDestinationRanks(dst, rank=2) == [0, 1]
    assert tu.InferSourceFromDestinationRanks(dst, rank=3) == []
    src, w = tu.InferSourceFromDestinationRanks(dst, True)
    assert src == [[2, 3], [0], [0, 1], []]
    expected = np.array(
        [[1 / 3, 1 / 2, 1 / 3, 0], [0, 1 / 2, 1 / 3, 0], [1 / 3, 0, 1 / 3, 0], [1 / 3, 0, 0, 1]]
    )
    np.testing.assert_allclose(w, expected, atol=1e-15)
    np.testing.assert_allclose(w.sum(axis=0), 1.0)  # each receiver's weights sum to 1
    assert tu.InferDestinationFromSourceRanks(src) == dst
    assert tu.InferDestinationFromSourceRanks(src, rank=0) == [1, 2]
    dst2, w2 = tu.InferDestinationFromSourceRanks(src, construct_adjacency_matrix=True, rank=1)
    assert dst2 == [2]
    np.testing.assert_array_equal(w2, w)
    # where every rank has as many sources as destinations, BlueFog's normalisation agrees
    ring_dst = [[(r + 1) % 5, (r + 2) % 5] for r in range(5)]
    np.testing.assert_allclose(tu.InferSourceFromDestinationRanks(ring_dst, True)[1], _bf_matrix(ring_dst))
    # and the matrix is the topology of those lists in BlueFog's convention
    topo = Topology.from_networkx(nx.from_numpy_array(w, create_using=nx.DiGraph))
    assert [topo.out_neighbors(r) for r in range(4)] == [[1, 2], [2], [0], [0]]
    assert topo.is_row_stochastic()


def test_infer_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="dst_ranks of rank 1 contains the rank itself"):
        tu.InferSourceFromDestinationRanks([[1], [1]])
    with pytest.raises(InvalidArgumentError, match="src_ranks of rank 0 contains 1 twice"):
        tu.InferDestinationFromSourceRanks([[1, 1], []])
    with pytest.raises(InvalidArgumentError, match=r"entry must be in \[0, 2\), got 5"):
        tu.InferSourceFromDestinationRanks([[5], []])
    with pytest.raises(
        InvalidArgumentError, match=r"InferSourceFromDestinationRanks: rank must be in \[0, 2\), got 2"
    ):
        tu.InferSourceFromDestinationRanks([[1], [0]], rank=2)
