"""Static topology builders. Each returns a :class:`~lowband.topology.Topology` whose weights equal
those of the BlueFog builder of the same graph (``bluefog.common.topology_util``):

- directed or regular graphs (rings, exponential graphs, fully connected) get uniform pull weights:
  each rank averages itself and its in-neighbors equally, ``1 / (1 + in_degree)``;
- :func:`star` and :func:`mesh_grid_2d` get Metropolis-Hastings weights, as BlueFog's ``StarGraph``
  and ``MeshGrid2DGraph`` do (for a star these are BlueFog's ``1/n`` and ``1 - 1/n``).

All weight matrices returned here are row-stochastic; the undirected ones are doubly stochastic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from lowband.errors import InvalidArgumentError
from lowband.topology._args import check_base, check_rank, check_size, fn
from lowband.topology.graph import Topology
from lowband.topology.weights import (
    BoolMatrix,
    as_adjacency,
    metropolis_hastings_weights,
    uniform_pull_weights,
)

RingStyle = Literal["bidirectional", "left", "right"]
RING_STYLES: tuple[str, ...] = ("bidirectional", "left", "right")


def _circulant(size: int, offsets: Iterable[int]) -> BoolMatrix:
    """Adjacency where every rank ``j`` sends to ``(j + o) % size`` for each offset ``o``."""
    a = np.zeros((size, size), dtype=np.bool_)
    cols = np.arange(size)
    for o in offsets:
        a[(cols + o) % size, cols] = True
    np.fill_diagonal(a, False)
    return a


def _powers_below(size: int, base: int) -> list[int]:
    """``[1, base, base**2, ...]`` below ``size`` (exact integer arithmetic)."""
    out: list[int] = []
    p = 1
    while p < size:
        out.append(p)
        p *= base
    return out


def _is_power(x: int, base: int) -> bool:
    while x % base == 0 and x > 1:
        x //= base
    return x == 1


def ring(size: int, *, style: RingStyle = "bidirectional") -> Topology:
    """A ring: ``"bidirectional"`` (each rank exchanges with ``rank - 1`` and ``rank + 1``),
    ``"left"`` (each rank sends to ``rank - 1``) or ``"right"`` (each rank sends to ``rank + 1``),
    with uniform pull weights (1/3, or 1/2 for one-way rings and for ``size == 2``)."""
    where = fn("ring")
    n = check_size(where, size)
    if style not in RING_STYLES:
        raise InvalidArgumentError(f"{where}: style must be one of {RING_STYLES}, got {style!r}")
    offsets = {"bidirectional": (1, -1), "left": (-1,), "right": (1,)}[style]
    name = "ring" if style == "bidirectional" else f"ring({style})"
    return Topology(uniform_pull_weights(_circulant(n, offsets)), name=name)


def exponential(size: int, base: int = 2) -> Topology:
    """Exponential graph (BlueFog's ``ExponentialGraph``): each rank sends to ``rank + base**k``
    (mod ``size``) for every ``base**k < size``; uniform pull weights (doubly stochastic)."""
    where = fn("exponential")
    n = check_size(where, size)
    b = check_base(where, base)
    return Topology(uniform_pull_weights(_circulant(n, _powers_below(n, b))), name=f"exponential(base={b})")


def exponential_two(size: int) -> Topology:
    """Exponential-2 graph (BlueFog's ``ExponentialTwoGraph``): :func:`exponential` with base 2."""
    n = check_size(fn("exponential_two"), size)
    return Topology(uniform_pull_weights(_circulant(n, _powers_below(n, 2))), name="exponential_two")


def symmetric_exponential(size: int, base: int = 2) -> Topology:
    """Symmetric exponential graph (BlueFog's ``SymmetricExponentialGraph``, whose default base is
    4): ranks ``i`` and ``i + d`` are linked iff ``min(d, size - d)`` is a power of ``base``;
    undirected, uniform weights (doubly stochastic)."""
    where = fn("symmetric_exponential")
    n = check_size(where, size)
    b = check_base(where, base)
    offsets = [d for d in range(1, n) if _is_power(min(d, n - d), b)]
    return Topology(uniform_pull_weights(_circulant(n, offsets)), name=f"symmetric_exponential(base={b})")


def grid_shape(size: int) -> tuple[int, int]:
    """The most square ``(nrow, ncol)`` with ``nrow * ncol == size`` and ``nrow <= ncol``."""
    nrow = math.isqrt(size)
    while size % nrow != 0:
        nrow -= 1
    return nrow, size // nrow


def mesh_grid_2d(size: int, shape: tuple[int, int] | None = None) -> Topology:
    """2-D mesh grid (BlueFog's ``MeshGrid2DGraph``): ranks laid out row-major on an ``nrow x ncol``
    grid (``shape``; by default the most square factorisation, ``nrow <= ncol``; a prime ``size``
    gives a path), linked to their grid neighbours; Metropolis-Hastings weights."""
    where = fn("mesh_grid_2d")
    n = check_size(where, size)
    if shape is None:
        nrow, ncol = grid_shape(n)
    else:
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 2:
            raise InvalidArgumentError(f"{where}: shape must be a pair (nrow, ncol), got {shape!r}")
        nrow = check_size(where, shape[0], what="shape[0] (nrow)")
        ncol = check_size(where, shape[1], what="shape[1] (ncol)")
        if nrow * ncol != n:
            raise InvalidArgumentError(f"{where}: shape {nrow}x{ncol} does not match size {n}")
    a = np.zeros((n, n), dtype=np.bool_)
    for i in range(n):
        if (i + 1) % ncol != 0:
            a[i, i + 1] = a[i + 1, i] = True
        if i + ncol < n:
            a[i, i + ncol] = a[i + ncol, i] = True
    return Topology(metropolis_hastings_weights(a), name=f"mesh_grid_2d({nrow}x{ncol})")


def star(size: int, center: int = 0) -> Topology:
    """Star (BlueFog's ``StarGraph``): every rank linked to ``center``; Metropolis-Hastings weights
    (``1/size`` on every edge and at the centre, ``1 - 1/size`` self weight elsewhere)."""
    where = fn("star")
    n = check_size(where, size)
    c = check_rank(where, center, n, what="center")
    w = np.zeros((n, n))
    np.fill_diagonal(w, 1.0 - 1.0 / n)
    w[c, :] = w[:, c] = 1.0 / n  # = metropolis_hastings_weights of the star, written as BlueFog does
    return Topology(w, name=f"star(center={c})")


def fully_connected(size: int) -> Topology:
    """Complete graph (BlueFog's ``FullyConnectedGraph``): every weight is ``1/size``."""
    n = check_size(fn("fully_connected"), size)
    return Topology(np.full((n, n), 1.0 / n), name="fully_connected")


def metropolis_hastings(adjacency: Any) -> Topology:
    """Metropolis-Hastings weights of an undirected graph, given as a symmetric 0/1 matrix or a
    networkx graph on nodes ``0..n-1`` (diagonal and self-loops ignored):
    ``w_ij = 1 / (1 + max(d_i, d_j))`` on each edge, ``w_ii = 1 - sum_j w_ij``. Doubly stochastic."""
    a = as_adjacency(fn("metropolis_hastings"), adjacency, symmetric=True)
    return Topology(metropolis_hastings_weights(a), name="metropolis_hastings")


__all__ = [
    "RING_STYLES",
    "RingStyle",
    "exponential",
    "exponential_two",
    "fully_connected",
    "grid_shape",
    "mesh_grid_2d",
    "metropolis_hastings",
    "ring",
    "star",
    "symmetric_exponential",
]
