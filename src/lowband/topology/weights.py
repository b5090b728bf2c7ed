"""Weight rules: from an unweighted graph (a boolean adjacency matrix) to a weight matrix.

Adjacency matrices here follow the weight convention of :class:`~lowband.topology.Topology`:
``adjacency[i, j]`` is true iff rank ``j`` sends to rank ``i``; the diagonal is ignored.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from lowband.errors import InvalidArgumentError

BoolMatrix = npt.NDArray[np.bool_]
FloatMatrix = npt.NDArray[np.float64]


def uniform_pull_weights(adjacency: BoolMatrix) -> FloatMatrix:
    """Each rank averages itself and what it receives uniformly: ``w_ij = 1 / (1 + in_degree(i))``
    for ``j = i`` and every in-neighbor ``j``. Row-stochastic; doubly stochastic on regular graphs."""
    a = np.array(adjacency, dtype=np.bool_)
    np.fill_diagonal(a, True)
    w: FloatMatrix = a / a.sum(axis=1, keepdims=True)
    return w


def metropolis_hastings_weights(adjacency: BoolMatrix) -> FloatMatrix:
    """Metropolis-Hastings weights of a symmetric (undirected) adjacency matrix:
    ``w_ij = 1 / (1 + max(d_i, d_j))`` for each edge, ``w_ii = 1 - sum_{j != i} w_ij``.
    Symmetric and doubly stochastic."""
    a = np.array(adjacency, dtype=np.bool_)
    np.fill_diagonal(a, False)
    deg = a.sum(axis=1)
    w = np.where(a, 1.0 / (1.0 + np.maximum.outer(deg, deg)), 0.0)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def as_adjacency(where: str, adjacency: Any, *, symmetric: bool) -> BoolMatrix:
    """A boolean adjacency matrix from a square 0/1 matrix or a networkx graph on nodes ``0..n-1``
    (the diagonal, and self-loops, are dropped); with ``symmetric`` the graph must be undirected."""
    if isinstance(adjacency, nx.Graph):
        n = adjacency.number_of_nodes()
        if n < 1 or set(adjacency.nodes) != set(range(n)):
            raise InvalidArgumentError(f"{where}: the graph's nodes must be the ints 0..n-1 with n >= 1")
        m = nx.to_numpy_array(adjacency, nodelist=list(range(n)), weight=None, dtype=np.float64)
        a: BoolMatrix = (m != 0).T
    else:
        try:
            m = np.array(adjacency, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"{where}: adjacency must be a 0/1 matrix or a networkx graph ({e})"
            ) from None
        if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
            raise InvalidArgumentError(
                f"{where}: adjacency must be a non-empty square matrix, got shape {m.shape}"
            )
        bad = np.argwhere((m != 0) & (m != 1))
        if bad.size:
            i, j = (int(v) for v in bad[0])
            raise InvalidArgumentError(f"{where}: adjacency[{i}, {j}] is {m[i, j]}; entries must be 0 or 1")
        a = m != 0
    a = np.array(a)
    np.fill_diagonal(a, False)
    if symmetric:
        asym = np.argwhere(a != a.T)
        if asym.size:
            i, j = (int(v) for v in asym[0])
            raise InvalidArgumentError(
                f"{where}: adjacency must be symmetric (an undirected graph), but adjacency[{i}, {j}] "
                f"is {bool(a[i, j])} and adjacency[{j}, {i}] is {bool(a[j, i])}"
            )
    return a
