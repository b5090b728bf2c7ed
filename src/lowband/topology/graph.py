"""A static topology: a directed graph over ranks ``0..n-1`` given by its weight matrix.

Convention (the BlueFog paper's, §II-A): ``weights[i, j]`` is the weight rank ``i`` applies to the
value it receives from rank ``j``, and ``weights[i, i]`` is rank ``i``'s self weight. The edge
``j -> i`` exists iff ``i != j`` and ``weights[i, j] != 0``. Partial averaging is ``x <- W @ x``.
A *pull* matrix is row-stochastic (each receiver's weights sum to 1), a *push* matrix
column-stochastic (each sender's outgoing weights sum to 1), a *standard* one doubly stochastic.

networkx graphs follow BlueFog's convention instead: ``nx.to_numpy_array(G)[i, j]`` is the weight of
the edge ``i -> j``, which receiver ``j`` applies to ``i``'s value, and self-loops carry self weights;
so ``to_numpy_array(G) == W.T``. :meth:`Topology.from_networkx` and :meth:`Topology.to_networkx`
convert between the two.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

import networkx as nx
import numpy as np
import numpy.typing as npt

from lowband.errors import InvalidArgumentError
from lowband.topology._args import check_rank

Kind = Literal["pull", "push", "doubly"]
KINDS: tuple[str, ...] = get_args(Kind)

_TOL = 1e-9


def _check_kind(where: str, kind: object) -> Kind:
    if kind not in KINDS:
        raise InvalidArgumentError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
    return kind  # type: ignore[return-value]


def _as_matrix(where: str, w: object) -> npt.NDArray[np.float64]:
    """``w`` as a fresh float64 square matrix with finite, non-negative entries, or an error."""
    try:
        a = np.array(w, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{where}: weights must be a square matrix of numbers ({e})") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise InvalidArgumentError(f"{where}: weights must be a square matrix, got shape {a.shape}")
    if a.shape[0] < 1:
        raise InvalidArgumentError(f"{where}: weights must be at least 1x1, got shape {a.shape}")
    bad = np.argwhere(~np.isfinite(a))
    if bad.size:
        i, j = (int(v) for v in bad[0])
        raise InvalidArgumentError(f"{where}: weights[{i}, {j}] is {a[i, j]}; weights must be finite")
    neg = np.argwhere(a < 0)
    if neg.size:
        i, j = (int(v) for v in neg[0])
        raise InvalidArgumentError(
            f"{where}: weights[{i}, {j}] is {a[i, j]}; weights must be >= 0 (rank {i} from rank {j})"
        )
    return a


class Topology:
    """Immutable directed graph over ranks ``0..n-1`` with a float64 weight matrix.

    ``weights[i, j]`` is the weight rank ``i`` applies to the value it receives from rank ``j``;
    ``weights[i, i]`` is rank ``i``'s self weight; the edge ``j -> i`` exists iff ``i != j`` and
    ``weights[i, j] != 0``. Weights are finite and non-negative; whether they are normalised is for
    :meth:`check` (or ``require=`` of the constructors) to enforce.

    A machine topology (the graph between machines of hierarchical averaging) is nothing special: a
    ``Topology`` of size ``machine_size`` whose ranks are machine ranks.

    Two topologies are equal iff their weight matrices are equal (their names are ignored).
    """

    __slots__ = ("_in", "_name", "_out", "_w")

    _w: npt.NDArray[np.float64]
    _name: str
    _in: tuple[tuple[int, ...], ...]
    _out: tuple[tuple[int, ...], ...]

    def __init__(self, weights: object, *, name: str = "custom") -> None:
        """Build from a weight matrix (copied); see :meth:`from_matrix` for the checked form."""
        where = "lowband.topology.Topology"
        if not isinstance(name, str):
            raise InvalidArgumentError(f"{where}: name must be a str, got {type(name).__name__}")
        w = _as_matrix(where, weights)
        w.setflags(write=False)
        nz = w != 0
        np.fill_diagonal(nz, False)
        object.__setattr__(self, "_w", w)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_in", tuple(tuple(int(j) for j in np.flatnonzero(row)) for row in nz))
        object.__setattr__(self, "_out", tuple(tuple(int(i) for i in np.flatnonzero(col)) for col in nz.T))

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"lowband.topology.Topology is immutable (cannot set {key!r})")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_matrix(cls, w: object, *, name: str = "custom", require: Kind | None = None) -> Topology:
        """A topology with weight matrix ``w`` (any array-like, copied to float64).

        Raises :class:`InvalidArgumentError` if ``w`` is not square, has NaN/inf or negative entries,
        or (with ``require``) is not pull (row-), push (column-) or doubly stochastic.
        """
        if require is not None:
            _check_kind("lowband.topology.Topology.from_matrix", require)
        topo = cls(w, name=name)
        if require is not None:
            topo.check(require)
        return topo

    @classmethod
    def from_networkx(cls, g: Any, *, name: str | None = None, require: Kind | None = None) -> Topology:
        """A topology from a networkx graph in BlueFog's convention.

        Nodes must be exactly the ints ``0..n-1``. The edge ``i -> j`` with attribute ``weight``
        (1.0 when absent) is the weight receiver ``j`` applies to ``i``'s value; a self-loop is a
        self weight (0 when absent). An undirected graph counts each edge in both directions. The
        name defaults to ``g.graph["name"]`` or ``"networkx"``.
        """
        where = "lowband.topology.Topology.from_networkx"
        if not isinstance(g, nx.Graph):
            raise InvalidArgumentError(f"{where}: g must be a networkx graph, got {type(g).__name__}")
        if g.is_multigraph():
            raise InvalidArgumentError(f"{where}: multigraphs are not supported, got {type(g).__name__}")
        n = g.number_of_nodes()
        if n < 1:
            raise InvalidArgumentError(f"{where}: the graph has no nodes")
        nodes = set(g.nodes)
        if nodes != set(range(n)):
            extra = sorted(repr(v) for v in nodes - set(range(n)))[:3]
            raise InvalidArgumentError(
                f"{where}: nodes must be the ints 0..{n - 1}; unexpected nodes: {', '.join(extra)}"
            )
        a = nx.to_numpy_array(g, nodelist=list(range(n)), dtype=np.float64)
        if name is None:
            gname = g.graph.get("name")
            name = gname if isinstance(gname, str) and gname else "networkx"
        return cls.from_matrix(a.T, name=name, require=require)

    def to_networkx(self) -> nx.DiGraph:
        """This topology as a networkx DiGraph in BlueFog's convention.

        One node per rank; an edge ``j -> i`` with attribute ``weight = weights[i, j]`` for every
        nonzero entry, self-loops included; ``nx.to_numpy_array(G) == weights.T``.
        """
        g = nx.from_numpy_array(np.array(self._w.T), create_using=nx.DiGraph)
        g.graph["name"] = self._name
        return g

    # -- attributes -----------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of ranks."""
        return int(self._w.shape[0])

    @property
    def name(self) -> str:
        return self._name

    @property
    def weights(self) -> npt.NDArray[np.float64]:
        """The read-only ``[n, n]`` float64 weight matrix (receiver rows, sender columns)."""
        return self._w

    @property
    def num_edges(self) -> int:
        """Number of directed edges between distinct ranks (self weights are not edges)."""
        return sum(len(s) for s in self._in)

    def _rank(self, method: str, rank: object) -> int:
        return check_rank(f"lowband.topology.Topology.{method}", rank, self.size)

    def in_neighbors(self, rank: int) -> list[int]:
        """Ranks that send to ``rank`` (sorted ascending)."""
        return list(self._in[self._rank("in_neighbors", rank)])

    def out_neighbors(self, rank: int) -> list[int]:
        """Ranks that ``rank`` sends to (sorted ascending)."""
        return list(self._out[self._rank("out_neighbors", rank)])

    def self_weight(self, rank: int) -> float:
        """``weights[rank, rank]``."""
        r = self._rank("self_weight", rank)
        return float(self._w[r, r])

    def src_weights(self, rank: int) -> dict[int, float]:
        """``{j: weights[rank, j]}`` over the in-neighbors ``j`` of ``rank`` (ascending): the weights
        ``rank`` applies to what it receives."""
        r = self._rank("src_weights", rank)
        return {j: float(self._w[r, j]) for j in self._in[r]}

    def dst_weights(self, rank: int) -> dict[int, float]:
        """``{i: weights[i, rank]}`` over the out-neighbors ``i`` of ``rank`` (ascending): the weights
        applied to what ``rank`` sends."""
        r = self._rank("dst_weights", rank)
        return {i: float(self._w[i, r]) for i in self._out[r]}

    # -- properties -------------------------------------------------------------------------------

    def is_row_stochastic(self, tol: float = _TOL) -> bool:
        """Every row sums to 1 within ``tol`` (a pull matrix)."""
        return bool(np.all(np.abs(self._w.sum(axis=1) - 1.0) <= tol))

    def is_column_stochastic(self, tol: float = _TOL) -> bool:
        """Every column sums to 1 within ``tol`` (a push matrix)."""
        return bool(np.all(np.abs(self._w.sum(axis=0) - 1.0) <= tol))

    def is_doubly_stochastic(self, tol: float = _TOL) -> bool:
        """Rows and columns sum to 1 within ``tol`` (a standard weight matrix)."""
        return self.is_row_stochastic(tol) and self.is_column_stochastic(tol)

    def is_symmetric(self, tol: float = _TOL) -> bool:
        """The graph is undirected and ``|weights[i, j] - weights[j, i]| <= tol`` for all ``i, j``."""
        return all(self._in[r] == self._out[r] for r in range(self.size)) and bool(
            np.all(np.abs(self._w - self._w.T) <= tol)
        )

    def is_strongly_connected(self) -> bool:
        """Every rank reaches every other rank along directed edges."""
        return _reaches_all(self._out) and _reaches_all(self._in)

    def is_regular(self) -> bool:
        """All ranks have the same in-degree and the same out-degree (self weights not counted)."""
        return len({len(s) for s in self._in}) == 1 and len({len(s) for s in self._out}) == 1

    def check(self, kind: Kind) -> None:
        """Raise :class:`InvalidArgumentError` naming the first row (``"pull"``), column (``"push"``)
        or either (``"doubly"``) that does not sum to 1 within 1e-9."""
        where = f"lowband.topology.Topology.check({kind!r})"
        _check_kind("lowband.topology.Topology.check", kind)
        if kind in ("pull", "doubly"):
            sums = self._w.sum(axis=1)
            for i in _bad(sums):
                raise InvalidArgumentError(
                    f"{where}: topology {self._name!r} row {i} (the weights rank {i} applies to what "
                    f"it receives, self weight included) sums to {float(sums[i])!r}, not 1"
                )
        if kind in ("push", "doubly"):
            sums = self._w.sum(axis=0)
            for j in _bad(sums):
                raise InvalidArgumentError(
                    f"{where}: topology {self._name!r} column {j} (the weights applied to what rank "
                    f"{j} sends, self weight included) sums to {float(sums[j])!r}, not 1"
                )

    # -- python protocol ----------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self.size == other.size and bool(np.array_equal(self._w, other._w))

    def __hash__(self) -> int:
        return hash((self.size, self._w.tobytes()))

    def __repr__(self) -> str:
        return f"Topology(name={self._name!r}, size={self.size}, edges={self.num_edges})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (np.array(self._w), self._name))


def _rebuild(w: npt.NDArray[np.float64], name: str) -> Topology:
    return Topology(w, name=name)


def _bad(sums: npt.NDArray[np.float64]) -> Iterable[int]:
    return (int(i) for i in np.flatnonzero(np.abs(sums - 1.0) > _TOL))


def _reaches_all(adj: tuple[tuple[int, ...], ...]) -> bool:
    seen = {0}
    stack = [0]
    while stack:
        for v in adj[stack.pop()]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return len(seen) == len(adj)


__all__ = ["KINDS", "Kind", "Topology"]
