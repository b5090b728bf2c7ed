"""Topologies for decentralized averaging: pure maths, nothing here communicates.

A :class:`Topology` is a directed graph over ranks ``0..n-1`` given by a float64 weight matrix in the
BlueFog paper's convention: ``weights[i, j]`` is the weight rank ``i`` applies to the value it receives
from rank ``j`` (so partial averaging is ``x <- W @ x``); pull = row-stochastic, push =
column-stochastic, standard = doubly stochastic. networkx graphs use BlueFog's transposed convention
(see :mod:`lowband.topology.graph`).

- static builders: :func:`ring`, :func:`exponential`, :func:`exponential_two`,
  :func:`symmetric_exponential`, :func:`mesh_grid_2d`, :func:`star`, :func:`fully_connected`,
  :func:`metropolis_hastings` (weights equal to BlueFog's builders');
- dynamic topologies: rank-local generators yielding ``(send_ranks, recv_ranks)`` per step
  (:func:`one_peer`, :func:`one_peer_exponential_two`, :func:`inner_outer_exponential_two`,
  :func:`inner_outer_ring`) and the global view :class:`DynamicTopology` (``.at(step)``), built by
  :func:`dynamic_one_peer`, :func:`dynamic_one_peer_exponential_two`,
  :func:`dynamic_inner_outer_exponential_two`, :func:`dynamic_inner_outer_ring`;
- :func:`infer_sources` / :func:`infer_destinations` over every rank's lists.

Machine topologies (hierarchical averaging) are nothing special: a ``Topology`` (or
``DynamicTopology``) of size ``machine_size`` whose ranks are machine ranks.
"""

from lowband.topology.builders import (
    RING_STYLES,
    RingStyle,
    exponential,
    exponential_two,
    fully_connected,
    grid_shape,
    mesh_grid_2d,
    metropolis_hastings,
    ring,
    star,
    symmetric_exponential,
)
from lowband.topology.dynamic import (
    DynamicTopology,
    SendRecv,
    dynamic_inner_outer_exponential_two,
    dynamic_inner_outer_ring,
    dynamic_one_peer,
    dynamic_one_peer_exponential_two,
    inner_outer_exponential_two,
    inner_outer_ring,
    one_peer,
    one_peer_exponential_two,
)
from lowband.topology.graph import KINDS, Kind, Topology
from lowband.topology.infer import infer_destinations, infer_sources
from lowband.topology.weights import metropolis_hastings_weights, uniform_pull_weights

__all__ = [
    "KINDS",
    "RING_STYLES",
    "DynamicTopology",
    "Kind",
    "RingStyle",
    "SendRecv",
    "Topology",
    "dynamic_inner_outer_exponential_two",
    "dynamic_inner_outer_ring",
    "dynamic_one_peer",
    "dynamic_one_peer_exponential_two",
    "exponential",
    "exponential_two",
    "fully_connected",
    "grid_shape",
    "infer_destinations",
    "infer_sources",
    "inner_outer_exponential_two",
    "inner_outer_ring",
    "mesh_grid_2d",
    "metropolis_hastings",
    "metropolis_hastings_weights",
    "one_peer",
    "one_peer_exponential_two",
    "ring",
    "star",
    "symmetric_exponential",
    "uniform_pull_weights",
]
