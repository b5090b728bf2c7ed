"""lowband.topology: builders against hand-written matrices, checks, networkx round trips, dynamic
topologies (rank-local generators == global view) and every error path. Pure maths: one process."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterator

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.errors import InvalidArgumentError
from lowband.topology import (
    DynamicTopology,
    SendRecv,
    Topology,
    dynamic_inner_outer_exponential_two,
    dynamic_inner_outer_ring,
    dynamic_one_peer,
    dynamic_one_peer_exponential_two,
    exponential,
    exponential_two,
    fully_connected,
    grid_shape,
    infer_destinations,
    infer_sources,
    inner_outer_exponential_two,
    inner_outer_ring,
    mesh_grid_2d,
    metropolis_hastings,
    one_peer,
    one_peer_exponential_two,
    ring,
    star,
    symmetric_exponential,
)

T, H, Q = 1 / 3, 1 / 2, 1 / 4

BUILDERS: dict[str, Callable[[int], Topology]] = {
    "ring": ring,
    "ring_left": lambda n: ring(n, style="left"),
    "ring_right": lambda n: ring(n, style="right"),
    "exponential_two": exponential_two,
    "exponential3": lambda n: exponential(n, 3),
    "symmetric_exponential": symmetric_exponential,
    "symmetric_exponential4": lambda n: symmetric_exponential(n, 4),
    "mesh_grid_2d": mesh_grid_2d,
    "star": star,
    "star_last": lambda n: star(n, n - 1),
    "fully_connected": fully_connected,
}
UNDIRECTED = {"ring", "symmetric_exponential", "symmetric_exponential4", "mesh_grid_2d", "star", "star_last"}
UNDIRECTED |= {"fully_connected"}


def _eq(t: Topology, expected: list[list[float]]) -> None:
    np.testing.assert_allclose(t.weights, np.array(expected), rtol=0, atol=1e-15)


# -- builders against hand-written matrices ----------------------------------------------------


def test_ring_4() -> None:
    _eq(ring(4), [[T, T, 0, T], [T, T, T, 0], [0, T, T, T], [T, 0, T, T]])
    # "left": each rank sends to rank - 1, so rank i receives from i + 1
    _eq(ring(4, style="left"), [[H, H, 0, 0], [0, H, H, 0], [0, 0, H, H], [H, 0, 0, H]])
    _eq(ring(4, style="right"), [[H, 0, 0, H], [H, H, 0, 0], [0, H, H, 0], [0, 0, H, H]])
    assert ring(4, style="right").out_neighbors(1) == [2]
    assert ring(4, style="left").out_neighbors(1) == [0]


def test_ring_small() -> None:
    _eq(ring(1), [[1.0]])
    for style in ("bidirectional", "left", "right"):
        _eq(ring(2, style=style), [[H, H], [H, H]])  # type: ignore[arg-type]
    _eq(ring(3), [[T, T, T]] * 3)


def test_exponential_two_5() -> None:
    # each rank sends to rank + 1, + 2, + 4 (mod 5): rank i hears i - 1, i - 2, i - 4
    _eq(
        exponential_two(5),
        [[Q, Q, 0, Q, Q], [Q, Q, Q, 0, Q], [Q, Q, Q, Q, 0], [0, Q, Q, Q, Q], [Q, 0, Q, Q, Q]],
    )
    assert exponential_two(5) == exponential(5, 2)
    assert exponential_two(5).out_neighbors(0) == [1, 2, 4]
    assert exponential_two(5).in_neighbors(0) == [1, 3, 4]


def test_exponential_base3_and_symmetric() -> None:
    t = exponential(10, 3)  # offsets 1, 3, 9
    assert t.out_neighbors(0) == [1, 3, 9]
    assert t.in_neighbors(0) == [1, 7, 9]
    assert t.self_weight(0) == Q
    s = symmetric_exponential(8)  # min(d, 8 - d) in {1, 2, 4}: d = 1, 2, 4, 6, 7
    assert s.out_neighbors(0) == [1, 2, 4, 6, 7]
    assert s.src_weights(3) == {j: 1 / 6 for j in (1, 2, 4, 5, 7)}
    assert symmetric_exponential(12, 4).out_neighbors(0) == [1, 4, 8, 11]


def test_mesh_grid_2x3() -> None:
    # 0 1 2 / 3 4 5; degrees 2 3 2 / 2 3 2; w_ij = 1 / (1 + max(d_i, d_j))
    f = 5 / 12
    expected = [
        [f, Q, 0, T, 0, 0],
        [Q, Q, Q, 0, Q, 0],
        [0, Q, f, 0, 0, T],
        [T, 0, 0, f, Q, 0],
        [0, Q, 0, Q, Q, Q],
        [0, 0, T, 0, Q, f],
    ]
    _eq(mesh_grid_2d(6), expected)
    _eq(mesh_grid_2d(6, (2, 3)), expected)
    assert mesh_grid_2d(6).name == "mesh_grid_2d(2x3)"
    assert mesh_grid_2d(6, (3, 2)).out_neighbors(0) == [1, 2]
    assert mesh_grid_2d(5) == metropolis_hastings(nx.path_graph(5))  # a prime size is a path
    assert grid_shape(24) == (4, 6) and grid_shape(7) == (1, 7) and grid_shape(1) == (1, 1)


def test_star_4() -> None:
    _eq(star(4), [[Q, Q, Q, Q], [Q, 3 * Q, 0, 0], [Q, 0, 3 * Q, 0], [Q, 0, 0, 3 * Q]])
    _eq(star(3, center=2), [[2 * T, 0, T], [0, 2 * T, T], [T, T, T]])
    _eq(star(1), [[1.0]])
    assert star(4) == metropolis_hastings(nx.star_graph(3))


def test_metropolis_hastings_path() -> None:
    expected = [[2 * T, T, 0], [T, T, T], [0, T, 2 * T]]
    _eq(metropolis_hastings([[0, 1, 0], [1, 0, 1], [0, 1, 0]]), expected)
    _eq(metropolis_hastings(nx.path_graph(3)), expected)
    _eq(metropolis_hastings(nx.path_graph(3).to_directed()), expected)
    _eq(metropolis_hastings(np.eye(3) + np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]])), expected)
    _eq(metropolis_hastings([[1]]), [[1.0]])
    _eq(metropolis_hastings(np.zeros((2, 2), dtype=bool)), [[1, 0], [0, 1]])


def test_fully_connected() -> None:
    _eq(fully_connected(3), [[T] * 3] * 3)
    assert fully_connected(5).is_regular() and fully_connected(5).num_edges == 20


# -- the Topology class ---------------------------------------------------------------------------

# a directed 4-rank graph: 0 -> 1, 0 -> 2, 1 -> 2, 2 -> 0, 3 -> 0 (pull weights, rows sum to 1)
DIRECTED = [
    [0.5, 0.0, 0.25, 0.25],
    [0.5, 0.5, 0.0, 0.0],
    [0.2, 0.3, 0.5, 0.0],
    [0.0, 0.0, 0.0, 1.0],
]


def test_neighbors_and_weights() -> None:
    t = Topology.from_matrix(DIRECTED, name="d", require="pull")
    assert t.size == 4 and t.name == "d" and t.num_edges == 5
    assert [t.in_neighbors(r) for r in range(4)] == [[2, 3], [0], [0, 1], []]
    assert [t.out_neighbors(r) for r in range(4)] == [[1, 2], [2], [0], [0]]
    assert t.self_weight(2) == 0.5 and isinstance(t.self_weight(2), float)
    assert t.src_weights(2) == {0: 0.2, 1: 0.3}
    assert t.src_weights(3) == {}
    assert t.dst_weights(0) == {1: 0.5, 2: 0.2}
    assert t.dst_weights(3) == {0: 0.25}
    assert t.in_neighbors(np.int64(0)) == [2, 3]  # NumPy ints are ranks too
    assert not t.is_symmetric() and not t.is_regular() and not t.is_strongly_connected()
    assert t.is_row_stochastic() and not t.is_column_stochastic() and not t.is_doubly_stochastic()


def test_stochasticity_checks() -> None:
    push = Topology.from_matrix([[0.5, 0.0], [0.5, 1.0]], require="push")
    assert push.is_column_stochastic() and not push.is_row_stochastic()
    with pytest.raises(InvalidArgumentError, match=r"row 0 .* sums to 0\.5"):
        push.check("pull")
    with pytest.raises(InvalidArgumentError, match=r"row 0"):
        push.check("doubly")
    pull = Topology.from_matrix([[0.5, 0.5], [0.0, 1.0]], require="pull")
    with pytest.raises(InvalidArgumentError, match=r"column 0 .* rank 0 sends.* sums to 0\.5"):
        pull.check("push")
    with pytest.raises(InvalidArgumentError, match=r"column 0 .* sums to 0\.5"):
        Topology.from_matrix([[0.5, 0.5], [0.0, 1.0]], require="doubly")
    ok = Topology.from_matrix([[0.5 + 1e-12, 0.5], [0.5, 0.5]])
    assert ok.is_doubly_stochastic() and not ok.is_doubly_stochastic(tol=1e-13)
    assert not Topology([[0.0]]).is_row_stochastic()  # unnormalised weights are allowed unchecked


def test_graph_properties() -> None:
    assert ring(5, style="right").is_strongly_connected() and not ring(5, style="right").is_symmetric()
    assert ring(5).is_symmetric() and ring(5).is_regular()
    assert not star(4).is_regular() and star(4).is_strongly_connected()
    path = Topology([[1, 0, 0], [1, 1, 0], [0, 1, 1]])  # 0 -> 1 -> 2 only
    assert not path.is_strongly_connected()
    assert not Topology(np.eye(2)).is_strongly_connected()
    one = Topology([[1.0]])
    assert one.is_strongly_connected() and one.is_regular() and one.is_symmetric()
    assert one.in_neighbors(0) == [] and one.out_neighbors(0) == []
    assert Topology([[0.5, 0.5], [0.5 + 1e-12, 0.5]]).is_symmetric()
    assert not Topology([[0.5, 0.5], [0.5 + 1e-12, 0.5]]).is_symmetric(tol=0.0)


def test_immutable_and_value_semantics() -> None:
    w = np.array(DIRECTED)
    t = Topology(w, name="a")
    w[0, 0] = 9.0  # the topology copied its input
    assert t.weights[0, 0] == 0.5
    assert not t.weights.flags.writeable
    with pytest.raises(ValueError):
        t.weights[0, 0] = 1.0
    with pytest.raises(AttributeError):
        t.name = "b"  # type: ignore[misc]
    assert t.weights.dtype == np.float64 and t.weights.shape == (4, 4)
    same = Topology(DIRECTED, name="other name")
    assert t == same and hash(t) == hash(same)  # equality is on the weights
    assert t != ring(4) and t != "a" and ring(3) != ring(4)
    assert repr(ring(4)) == "Topology(name='ring', size=4, edges=8)"
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.name == "a"


# -- networkx (BlueFog's convention) --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_networkx_round_trip(name: str, n: int) -> None:
    t = BUILDERS[name](n)
    g = t.to_networkx()
    assert isinstance(g, nx.DiGraph) and sorted(g.nodes) == list(range(n))
    np.testing.assert_array_equal(nx.to_numpy_array(g), t.weights.T)  # [i, j]: edge i -> j
    for j, i, data in g.edges(data=True):  # j -> i: receiver i applies weights[i, j]
        assert data["weight"] == t.weights[i, j]
    assert g.number_of_edges() == t.num_edges + int(np.count_nonzero(np.diag(t.weights)))
    back = Topology.from_networkx(g)
    assert back == t and back.name == t.name


def test_from_networkx_conventions() -> None:
    g = nx.DiGraph()
    g.add_nodes_from(range(3))
    g.add_edge(0, 1, weight=0.5)  # 0 -> 1: rank 1 applies 0.5 to rank 0's value
    g.add_edge(1, 1, weight=0.5)
    g.add_edge(2, 2)  # no weight attribute: 1.0
    g.add_edge(1, 0)
    t = Topology.from_networkx(g)
    assert t.name == "networkx"
    assert t.src_weights(1) == {0: 0.5} and t.self_weight(1) == 0.5
    assert t.self_weight(2) == 1.0 and t.self_weight(0) == 0.0
    assert t.out_neighbors(1) == [0] and t.src_weights(0) == {1: 1.0}
    u = Topology.from_networkx(nx.path_graph(3), name="p")  # undirected: both directions
    assert u.name == "p" and u.in_neighbors(1) == [0, 2] and u.out_neighbors(1) == [0, 2]
    named = nx.cycle_graph(3)
    named.graph["name"] = "cycle"
    assert Topology.from_networkx(named).name == "cycle"
    rev = nx.DiGraph()
    rev.add_nodes_from([2, 1, 0])  # node order does not matter, labels do
    rev.add_edge(2, 0, weight=1.0)
    assert Topology.from_networkx(rev).in_neighbors(0) == [2]


def test_from_networkx_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="must be a networkx graph"):
        Topology.from_networkx(np.eye(2))
    with pytest.raises(InvalidArgumentError, match="no nodes"):
        Topology.from_networkx(nx.DiGraph())
    with pytest.raises(InvalidArgumentError, match=r"nodes must be the ints 0\.\.1; unexpected nodes: 'a'"):
        Topology.from_networkx(nx.relabel_nodes(nx.path_graph(2), {1: "a"}))
    with pytest.raises(InvalidArgumentError, match="unexpected nodes: 5"):
        Topology.from_networkx(nx.relabel_nodes(nx.path_graph(2), {1: 5}))
    with pytest.raises(InvalidArgumentError, match="multigraph"):
        Topology.from_networkx(nx.MultiDiGraph([(0, 1)]))
    g = nx.DiGraph()
    g.add_edge(0, 1, weight=-1.0)
    with pytest.raises(InvalidArgumentError, match=r"weights\[1, 0\] is -1\.0"):
        Topology.from_networkx(g)
    with pytest.raises(InvalidArgumentError, match=r"row 1 .* sums to 2\.0"):
        Topology.from_networkx(nx.path_graph(3), require="pull")


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[0.5, 0.5]], r"square matrix, got shape \(1, 2\)"),
        ([1.0, 2.0], r"square matrix, got shape \(2,\)"),
        (np.zeros((2, 2, 2)), "square matrix"),
        (np.zeros((0, 0)), "at least 1x1"),
        ([[1.0, float("nan")], [0.0, 1.0]], r"weights\[0, 1\] is nan; weights must be finite"),
        ([[1.0, 0.0], [float("inf"), 1.0]], r"weights\[1, 0\] is inf"),
        ([[1.0, 0.0], [-0.5, 1.5]], r"weights\[1, 0\] is -0\.5; weights must be >= 0 \(rank 1 from rank 0\)"),
        ([["a", "b"], ["c", "d"]], "square matrix of numbers"),
        ("weights", "square matrix"),
    ],
)
def test_matrix_errors(matrix: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Topology.from_matrix(matrix)


def test_argument_errors() -> None:
    t = ring(4)
    for method in (t.in_neighbors, t.out_neighbors, t.self_weight, t.src_weights, t.dst_weights):
        with pytest.raises(InvalidArgumentError, match=r"Topology\.\w+: rank must be in \[0, 4\), got 4"):
            method(4)
        with pytest.raises(InvalidArgumentError, match=r"rank must be in \[0, 4\), got -1"):
            method(-1)
        with pytest.raises(InvalidArgumentError, match="rank must be an int, got True"):
            method(True)
        with pytest.raises(InvalidArgumentError, match=r"rank must be an int, got float 1\.0"):
            method(1.0)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgumentError, match=r"kind must be one of \('pull', 'push', 'doubly'\), got 'row'"
    ):
        t.check("row")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="kind must be one of"):
        Topology.from_matrix(np.eye(2), require="rows")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="name must be a str"):
        Topology(np.eye(2), name=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize(("size", "message"), [(0, "size must be >= 1, got 0"), (-3, "got -3"), (2.0, "int")])
def test_builder_size_errors(name: str, size: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        BUILDERS[name](size)  # type: ignore[arg-type]


def test_builder_argument_errors() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"lowband\.topology\.exponential: base must be an int >= 2, got 1"
    ):
        exponential(4, 1)
    with pytest.raises(InvalidArgumentError, match="base must be an int >= 2, got 0"):
        symmetric_exponential(4, 0)
    with pytest.raises(InvalidArgumentError, match="base must be an int, got float"):
        exponential(4, 2.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="style must be one of"):
        ring(4, style="up")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"center must be in \[0, 4\), got 4"):
        star(4, 4)
    with pytest.raises(InvalidArgumentError, match=r"mesh_grid_2d: shape 2x2 does not match size 6"):
        mesh_grid_2d(6, (2, 2))
    with pytest.raises(InvalidArgumentError, match=r"shape\[0\] \(nrow\) must be >= 1, got 0"):
        mesh_grid_2d(6, (0, 6))
    with pytest.raises(InvalidArgumentError, match=r"shape\[1\] \(ncol\) must be an int"):
        mesh_grid_2d(6, (2, 3.0))  # type: ignore[arg-type]
    for bad in ((6,), (1, 2, 3), "23", 6):
        with pytest.raises(InvalidArgumentError, match="shape must be a pair"):
            mesh_grid_2d(6, bad)  # type: ignore[arg-type]


def test_metropolis_hastings_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"must be symmetric .* adjacency\[0, 1\] is False"):
        metropolis_hastings([[0, 0], [1, 0]])
    with pytest.raises(InvalidArgumentError, match=r"adjacency\[0, 1\] is 0\.5; entries must be 0 or 1"):
        metropolis_hastings([[0, 0.5], [0.5, 0]])
    with pytest.raises(InvalidArgumentError, match="entries must be 0 or 1"):
        metropolis_hastings([[0, float("nan")], [float("nan"), 0]])
    with pytest.raises(InvalidArgumentError, match="non-empty square matrix"):
        metropolis_hastings([[0, 1, 0]])
    with pytest.raises(InvalidArgumentError, match="non-empty square matrix"):
        metropolis_hastings(np.zeros((0, 0)))
    with pytest.raises(InvalidArgumentError, match="must be symmetric"):
        metropolis_hastings(nx.DiGraph([(0, 1)]))
    with pytest.raises(InvalidArgumentError, match=r"nodes must be the ints 0\.\.n-1"):
        metropolis_hastings(nx.Graph([(1, 2)]))
    with pytest.raises(InvalidArgumentError, match="0/1 matrix or a networkx graph"):
        metropolis_hastings([["x"]])


# -- property tests -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40))
def test_every_builder_is_row_stochastic(n: int) -> None:
    for name, build in BUILDERS.items():
        t = build(n)
        assert t.size == n
        assert t.is_row_stochastic(tol=1e-12), name
        assert bool(np.all(t.weights >= 0)), name
        assert t.is_doubly_stochastic(tol=1e-12), name  # all of them: circulant or symmetric
        assert t.is_strongly_connected(), name
        if name in UNDIRECTED:
            assert t.is_symmetric(tol=0.0), name


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.lists(st.booleans(), min_size=n * n, max_size=n * n)))
def test_metropolis_hastings_property(bits: list[bool]) -> None:
    n = round(len(bits) ** 0.5)
    upper = np.triu(np.array(bits, dtype=bool).reshape(n, n), 1)
    t = metropolis_hastings(upper | upper.T)
    assert t.is_doubly_stochastic(tol=1e-12) and t.is_symmetric(tol=0.0)
    assert bool(np.all(t.weights >= 0)) and bool(np.all(np.diag(t.weights) > 0))
    for i, j in itertools.product(range(n), repeat=2):
        if i != j and upper[min(i, j), max(i, j)]:
            d = max(len(t.in_neighbors(i)), len(t.in_neighbors(j)))
            assert t.weights[i, j] == 1.0 / (1 + d)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6))
def test_mesh_grid_any_shape(nrow: int, ncol: int) -> None:
    t = mesh_grid_2d(nrow * ncol, (nrow, ncol))
    assert t.is_doubly_stochastic(tol=1e-12) and t.is_symmetric(tol=0.0)
    assert t.num_edges == 2 * (nrow * (ncol - 1) + ncol * (nrow - 1))


# -- infer ------------------------------------------------------------------------------------------


def test_infer_sources_and_destinations() -> None:
    dst = [[1, 2], [2], [0], [0]]
    src = infer_sources(dst)
    assert src == [[2, 3], [0], [0, 1], []]
    assert infer_destinations(src) == [[1, 2], [2], [0], [0]]
    assert infer_sources([[]]) == [[]]
    assert infer_sources([(2, 1), [], []]) == [[], [0], [0]]
    assert infer_sources(np.array([[1], [0]])) == [[1], [0]]  # type: ignore[arg-type]
    t = Topology.from_matrix(DIRECTED)
    assert infer_sources([t.out_neighbors(r) for r in range(4)]) == [t.in_neighbors(r) for r in range(4)]


@pytest.mark.parametrize(
    ("lists", "message"),
    [
        ([[1], [1]], r"dst_ranks of rank 1 contains the rank itself"),
        ([[1, 1], []], r"dst_ranks of rank 0 contains 1 twice"),
        ([[2], []], r"dst_ranks of rank 0: entry must be in \[0, 2\), got 2"),
        ([[-1], []], r"got -1"),
        ([[0.5], []], r"must be an int"),
        ([3, []], r"dst_ranks of rank 0 must be a list of ranks, got int"),
        (["1", []], r"must be a list of ranks, got str"),
        ([], r"got an empty sequence"),
        ({0: [1]}, r"must be a sequence"),
    ],
)
def test_infer_errors(lists: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        infer_sources(lists)  # type: ignore[arg-type]


def test_infer_destinations_error_names_src() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"infer_destinations: src_ranks of rank 0 contains the rank"
    ):
        infer_destinations([[0]])


# -- dynamic topologies ---------------------------------------------------------------------------


def _check_views(dyn: DynamicTopology, gens: list[Iterator[SendRecv]], steps: int) -> None:
    """Rank-local generators == the global view, step by step, and ``at(k)`` is consistent."""
    for k in range(steps):
        local = [next(g) for g in gens]
        sends, recvs = dyn.send_ranks(k), dyn.recv_ranks(k)
        assert [s for s, _ in local] == sends, k
        assert [r for _, r in local] == recvs, k
        assert infer_sources(sends) == recvs
        pull, push = dyn.at(k), dyn.at(k, kind="push")
        assert pull.is_row_stochastic() and push.is_column_stochastic()
        for r in range(dyn.size):
            assert pull.in_neighbors(r) == recvs[r] and pull.out_neighbors(r) == sorted(sends[r])
            assert pull.self_weight(r) == 1 / (1 + len(recvs[r]))
            assert pull.src_weights(r) == {j: 1 / (1 + len(recvs[r])) for j in recvs[r]}
            assert push.dst_weights(r) == {i: 1 / (1 + len(sends[r])) for i in sends[r]}
    assert [list(x) for x in itertools.islice(dyn.rank_view(0), steps)] == [
        [dyn.send_ranks(k)[0], dyn.recv_ranks(k)[0]] for k in range(steps)
    ]


@pytest.mark.parametrize("n", range(1, 10))
def test_one_peer_exponential_two(n: int) -> None:
    dyn = dynamic_one_peer_exponential_two(n)
    _check_views(dyn, [one_peer_exponential_two(n, r) for r in range(n)], 2 * n)
    m = max(1, (n - 1).bit_length())  # number of powers of 2 below n
    for k in range(2 * n):
        t = dyn.at(k)
        if n > 1:  # rank r sends to r + 2**(k mod m), receives from r - 2**(k mod m)
            d = 2 ** (k % m)
            assert dyn.send_ranks(k) == [[(r + d) % n] for r in range(n)]
            assert dyn.recv_ranks(k) == [[(r - d) % n] for r in range(n)]
            assert t.is_doubly_stochastic()
        else:
            assert dyn.send_ranks(k) == [[]] and t == Topology([[1.0]])


def test_one_peer_exponential_two_sequence() -> None:
    g = one_peer_exponential_two(5, 0)
    assert list(itertools.islice(g, 4)) == [([1], [4]), ([2], [3]), ([4], [1]), ([1], [4])]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 9])
def test_one_peer_of_any_graph(name: str, n: int) -> None:
    topo = BUILDERS[name](n)
    _check_views(dynamic_one_peer(topo), [one_peer(topo, r) for r in range(n)], 2 * n)


def test_one_peer_cycles_clockwise() -> None:
    t = mesh_grid_2d(6)  # rank 4's neighbours 1, 3, 5: clockwise from 4 they are 5, 1, 3
    assert [s for s, _ in itertools.islice(one_peer(t, 4), 4)] == [[5], [1], [3], [5]]
    # a rank without out-neighbours sends to nobody; the others still cycle
    t2 = Topology.from_matrix(DIRECTED)
    dyn = dynamic_one_peer(t2)
    assert [dyn.send_ranks(k) for k in range(2)] == [[[1], [2], [0], [0]], [[2], [2], [0], [0]]]
    _check_views(dyn, [one_peer(t2, r) for r in range(4)], 6)
    lonely = Topology(np.eye(3))
    assert next(one_peer(lonely, 1)) == ([], [])


LAYOUTS = [(6, 3), (9, 3), (12, 3), (8, 4), (12, 4), (16, 4), (10, 5), (15, 5), (12, 6), (14, 7)]


@pytest.mark.parametrize(("size", "local_size"), LAYOUTS)
def test_inner_outer_views_agree(size: int, local_size: int) -> None:
    for build, gen in (
        (dynamic_inner_outer_exponential_two, inner_outer_exponential_two),
        (dynamic_inner_outer_ring, inner_outer_ring),
    ):
        dyn = build(size, local_size)
        _check_views(dyn, [gen(size, local_size, r) for r in range(size)], 2 * size)
        for k in range(2 * size):
            sends = dyn.send_ranks(k)
            outside = k % local_size
            for r in range(size):
                # one peer each; only local rank k mod local_size leaves its machine
                assert len(sends[r]) == 1 and sends[r] != [r]
                crosses = sends[r][0] // local_size != r // local_size
                assert crosses == (r % local_size == outside)
                if crosses:
                    assert sends[r][0] % local_size == outside
            assert dyn.at(k).is_doubly_stochastic()


def test_inner_outer_ring_by_hand() -> None:
    # 2 machines of 3; step 0: local rank 0 crosses (0 <-> 3); the others swap inside the machine
    dyn = dynamic_inner_outer_ring(6, 3)
    assert dyn.send_ranks(0) == [[3], [2], [1], [0], [5], [4]]
    # step 1: local rank 1 crosses; 2 -> 0 -> 2 inside
    assert dyn.send_ranks(1) == [[2], [4], [0], [5], [1], [3]]
    # 3 machines: the crossing rank goes to the next machine and hears from the previous one
    assert list(itertools.islice(inner_outer_ring(9, 3, 3), 1)) == [([6], [0])]


def test_inner_outer_exponential_two_by_hand() -> None:
    # 2 machines of 4 (inner distances 1, 2, skipping the crossing rank; outer distance 1)
    dyn = dynamic_inner_outer_exponential_two(8, 4)
    assert dyn.send_ranks(0)[:4] == [[4], [2], [3], [1]]  # step 0: 0 crosses, ring 1 -> 2 -> 3 -> 1
    assert dyn.send_ranks(1)[:4] == [[3], [5], [0], [2]]  # step 1: 1 crosses, 0 -> 3 -> 2 -> 0
    # 4 machines of 3: the outer distance cycles 1, 2 with the step
    gen = inner_outer_exponential_two(12, 3, 0)
    outer = [s for k, (s, _) in enumerate(itertools.islice(gen, 6)) if k % 3 == 0]
    assert outer == [[3], [6]]  # step 0: distance 2**0; step 3: distance 2**(3 mod 2)


def test_dynamic_errors() -> None:
    for fn_ in (inner_outer_exponential_two, inner_outer_ring):
        with pytest.raises(InvalidArgumentError, match="local_size must be > 2"):
            fn_(8, 2, 0)
        with pytest.raises(InvalidArgumentError, match="local_size 4 does not divide size 6"):
            fn_(6, 4, 0)
        with pytest.raises(InvalidArgumentError, match="at least 2 machines, got size 4 with local_size 4"):
            fn_(4, 4, 0)
        with pytest.raises(InvalidArgumentError, match=r"rank must be in \[0, 6\), got 6"):
            fn_(6, 3, 6)
        with pytest.raises(InvalidArgumentError, match="local_size must be >= 1, got 0"):
            fn_(6, 0, 0)
    for build in (dynamic_inner_outer_exponential_two, dynamic_inner_outer_ring):
        with pytest.raises(InvalidArgumentError, match="local_size must be > 2"):
            build(4, 1)
    with pytest.raises(InvalidArgumentError, match=r"one_peer: rank must be in \[0, 3\), got 3"):
        one_peer(ring(3), 3)
    with pytest.raises(
        InvalidArgumentError, match=r"topology must be a lowband\.topology\.Topology, got DiGraph"
    ):
        one_peer(ring(3).to_networkx(), 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="topology must be"):
        dynamic_one_peer(np.eye(2))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="size must be >= 1"):
        one_peer_exponential_two(0, 0)
    with pytest.raises(InvalidArgumentError, match=r"one_peer_exponential_two: rank must be in \[0, 2\)"):
        one_peer_exponential_two(2, 2)
    dyn = dynamic_one_peer_exponential_two(4)
    with pytest.raises(InvalidArgumentError, match="step must be >= 0, got -1"):
        dyn.at(-1)
    with pytest.raises(InvalidArgumentError, match="kind must be 'pull' or 'push'"):
        dyn.at(0, kind="doubly")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"rank_view: rank must be in \[0, 4\)"):
        dyn.rank_view(4)


def test_custom_dynamic_topology() -> None:
    dyn = DynamicTopology(3, lambda k: [[(r + 1 + k % 2) % 3] for r in range(3)], name="spin")
    assert dyn.size == 3 and dyn.name == "spin" and repr(dyn) == "DynamicTopology(name='spin', size=3)"
    assert dyn.at(0) == ring(3, style="right") and dyn.at(1) == ring(3, style="left")
    assert dyn.at(5).name == "spin@5"
    bad = DynamicTopology(2, lambda k: [[0], [0]])
    with pytest.raises(InvalidArgumentError, match="dst_ranks of rank 0 contains the rank itself"):
        bad.at(0)
    short = DynamicTopology(3, lambda k: [[1]], name="short")
    with pytest.raises(InvalidArgumentError, match="'short' gave 1 send lists at step 0, expected 3"):
        short.send_ranks(0)
    with pytest.raises(InvalidArgumentError, match="sends must be a function"):
        DynamicTopology(2, [[1], [0]])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="size must be >= 1"):
        DynamicTopology(0, lambda k: [])
