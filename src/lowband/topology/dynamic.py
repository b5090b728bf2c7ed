"""Time-varying (dynamic) topologies, in two views that agree step by step.

- Rank-local generators, as in BlueFog: each rank iterates its own infinite sequence of
  ``(send_ranks, recv_ranks)``, one pair per step, computed from its rank alone. The sequences are
  BlueFog's (``GetDynamicOnePeerSendRecvRanks``, ``GetInnerOuterExpo2DynamicSendRecvRanks``,
  ``GetInnerOuterRingDynamicSendRecvRanks``).
- The global view, :class:`DynamicTopology`: every rank's destinations at any step, and
  ``at(step)``, a :class:`~lowband.topology.Topology` with uniform weights, for oracles and for
  choosing push or pull weights.

A dynamic machine topology (hierarchical averaging) is one of these of size ``machine_size``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np

from lowband.errors import InvalidArgumentError
from lowband.topology._args import check_local_size, check_rank, check_size, check_step, fn
from lowband.topology.builders import exponential_two
from lowband.topology.graph import Topology
from lowband.topology.infer import infer_sources
from lowband.topology.weights import uniform_pull_weights

SendRecv = tuple[list[int], list[int]]
SendsFn = Callable[[int], Sequence[Sequence[int]]]


class DynamicTopology:
    """A time-varying topology seen globally: ``sends(step)[r]`` lists the ranks rank ``r`` sends to
    at ``step`` (a pure function of ``step >= 0``).

    ``at(step)`` is that step's :class:`Topology`. With ``kind="pull"`` (the default) each rank
    averages itself and what it receives uniformly, ``1 / (1 + #recv)`` (row-stochastic); with
    ``kind="push"`` each rank splits itself uniformly among itself and its destinations,
    ``1 / (1 + #send)`` (column-stochastic). In the one-peer exponential-2 and inner/outer
    schedules every rank sends to one rank and receives from one, so both are doubly stochastic.
    """

    __slots__ = ("_name", "_sends", "_size")

    def __init__(self, size: int, sends: SendsFn, *, name: str = "dynamic") -> None:
        self._size = check_size("lowband.topology.DynamicTopology", size)
        if not callable(sends):
            raise InvalidArgumentError(
                f"lowband.topology.DynamicTopology: sends must be a function of the step, got {type(sends).__name__}"
            )
        self._sends = sends
        self._name = name

    @property
    def size(self) -> int:
        return self._size

    @property
    def name(self) -> str:
        return self._name

    def send_ranks(self, step: int) -> list[list[int]]:
        """Every rank's destinations at ``step`` (each in the order the rank sends)."""
        where = "lowband.topology.DynamicTopology.send_ranks"
        k = check_step(where, step)
        sends = self._sends(k)
        if len(sends) != self._size:
            raise InvalidArgumentError(
                f"{where}: topology {self._name!r} gave {len(sends)} send lists at step {k}, expected {self._size}"
            )
        infer_sources(sends)  # validates every list (ranks in range, distinct, not the owner)
        return [[int(r) for r in s] for s in sends]

    def recv_ranks(self, step: int) -> list[list[int]]:
        """Every rank's sources at ``step`` (sorted ascending)."""
        return infer_sources(self.send_ranks(step))

    def at(self, step: int, kind: Literal["pull", "push"] = "pull") -> Topology:
        """The topology of ``step`` with uniform ``kind`` weights (see the class docstring)."""
        if kind not in ("pull", "push"):
            raise InvalidArgumentError(
                f"lowband.topology.DynamicTopology.at: kind must be 'pull' or 'push', got {kind!r}"
            )
        sends = self.send_ranks(step)
        a = np.zeros((self._size, self._size), dtype=np.bool_)
        for j, dsts in enumerate(sends):
            a[dsts, j] = True  # a[i, j]: j sends to i
        w = uniform_pull_weights(a) if kind == "pull" else uniform_pull_weights(a.T).T
        return Topology(w, name=f"{self._name}@{int(step)}")

    def rank_view(self, rank: int) -> Iterator[SendRecv]:
        """Rank ``rank``'s ``(send_ranks, recv_ranks)`` for steps 0, 1, 2, ... (from the global view)."""
        r = check_rank("lowband.topology.DynamicTopology.rank_view", rank, self._size)
        return self._view(r)

    def _view(self, rank: int) -> Iterator[SendRecv]:
        for k in itertools.count():
            sends = self.send_ranks(k)
            yield sends[rank], infer_sources(sends)[rank]

    def __repr__(self) -> str:
        return f"DynamicTopology(name={self._name!r}, size={self._size})"


# -- one peer: cycle through the out-neighbors of a static graph --------------------------------


def _clockwise_out_neighbors(topology: Topology) -> list[list[int]]:
    """Every rank's out-neighbors sorted by clockwise distance ``(dst - rank) mod n``."""
    n = topology.size
    return [_clockwise(n, r, topology.out_neighbors(r)) for r in range(n)]


def _clockwise(n: int, rank: int, peers: list[int]) -> list[int]:
    return sorted(peers, key=lambda d: (d - rank) % n)


def _one_peer_send(outs: list[list[int]], rank: int, step: int) -> list[int]:
    peers = outs[rank]
    return [peers[step % len(peers)]] if peers else []


def _check_topology(where: str, topology: object) -> Topology:
    if not isinstance(topology, Topology):
        raise InvalidArgumentError(
            f"{where}: topology must be a lowband.topology.Topology, got {type(topology).__name__}"
        )
    return topology


def one_peer(topology: Topology, rank: int) -> Iterator[SendRecv]:
    """One-peer variant of a static graph, seen from ``rank`` (BlueFog's
    ``GetDynamicOnePeerSendRecvRanks``): at step ``k`` every rank sends to its ``k``-th out-neighbor
    (cyclically, out-neighbors ordered clockwise from the rank); yields ``([dst], sorted sources)``.
    A rank without out-neighbors sends to nobody (``[]``)."""
    where = fn("one_peer")
    topo = _check_topology(where, topology)
    r = check_rank(where, rank, topo.size)
    outs = _clockwise_out_neighbors(topo)
    others = [o for o in range(topo.size) if o != r and outs[o]]

    def step(k: int) -> SendRecv:
        return _one_peer_send(outs, r, k), [o for o in others if outs[o][k % len(outs[o])] == r]

    return (step(k) for k in itertools.count())


def one_peer_exponential_two(size: int, rank: int) -> Iterator[SendRecv]:
    """:func:`one_peer` of :func:`~lowband.topology.exponential_two`: at step ``k`` rank ``r`` sends to
    ``r + 2**(k mod m)`` and receives from ``r - 2**(k mod m)``, ``m`` the number of powers of 2 below
    ``size``."""
    where = fn("one_peer_exponential_two")
    n = check_size(where, size)
    return one_peer(exponential_two(n), check_rank(where, rank, n))


def dynamic_one_peer(topology: Topology) -> DynamicTopology:
    """The global view of :func:`one_peer` of ``topology``."""
    topo = _check_topology(fn("dynamic_one_peer"), topology)
    outs = _clockwise_out_neighbors(topo)
    return DynamicTopology(
        topo.size,
        lambda k: [_one_peer_send(outs, r, k) for r in range(topo.size)],
        name=f"one_peer({topo.name})",
    )


def dynamic_one_peer_exponential_two(size: int) -> DynamicTopology:
    """The global view of :func:`one_peer_exponential_two`."""
    n = check_size(fn("dynamic_one_peer_exponential_two"), size)
    return dynamic_one_peer(exponential_two(n))


# -- inner / outer: one rank per machine talks across machines, the others inside -------------


def _check_layout(where: str, size: object, local_size: object) -> tuple[int, int, int]:
    """``(size, local_size, machine_size)``; BlueFog's conditions: equal machines of more than two
    ranks; and (lowband) at least two machines."""
    n = check_size(where, size)
    ls, ms = check_local_size(where, n, local_size)
    if ls <= 2:
        raise InvalidArgumentError(f"{where}: local_size must be > 2 (as in BlueFog), got {ls}")
    if ms < 2:
        raise InvalidArgumentError(f"{where}: needs at least 2 machines, got size {n} with local_size {ls}")
    return n, ls, ms


def _floor_log2(x: int) -> int:
    return x.bit_length() - 1


def _inner_outer_expo2_step(size: int, local_size: int, rank: int, k: int) -> SendRecv:
    """BlueFog's inner-exp2 / outer-exp2 schedule: at step ``k`` local rank ``k mod local_size`` of each
    machine exchanges with the same local rank ``2**j`` machines away; the others form an exp-2
    ring inside the machine that skips that rank."""
    ms = size // local_size
    machine, local = divmod(rank, local_size)
    outside = k % local_size
    if local == outside:
        d = 2 ** (k % (_floor_log2(ms - 1) + 1))
        return [((machine + d) % ms) * local_size + local], [((machine - d) % ms) * local_size + local]
    inner = 2 ** (k % (_floor_log2(local_size - 2) + 1))
    fwd = inner + 1 if inner >= (outside - local) % local_size else inner
    back = inner + 1 if inner >= (local - outside) % local_size else inner
    base = machine * local_size
    return [base + (local + fwd) % local_size], [base + (local - back) % local_size]


def _inner_outer_ring_step(size: int, local_size: int, rank: int, k: int) -> SendRecv:
    """BlueFog's inner-ring / outer-ring schedule: at step ``k`` local rank ``k mod local_size`` of each
    machine sends to the same local rank of the next machine; the others form a one-way ring inside
    the machine that skips that rank."""
    ms = size // local_size
    machine, local = divmod(rank, local_size)
    outside = k % local_size
    if local == outside:
        return [((machine + 1) % ms) * local_size + local], [((machine - 1) % ms) * local_size + local]
    nxt = (local + 1) % local_size
    nxt = (nxt + 1) % local_size if nxt == outside else nxt
    prv = (local - 1) % local_size
    prv = (prv - 1) % local_size if prv == outside else prv
    base = machine * local_size
    return [base + nxt], [base + prv]


_Step = Callable[[int, int, int, int], SendRecv]


def _rank_local(where: str, step: _Step, size: int, local_size: int, rank: int) -> Iterator[SendRecv]:
    n, ls, _ = _check_layout(where, size, local_size)
    r = check_rank(where, rank, n)
    return (step(n, ls, r, k) for k in itertools.count())


def _global(where: str, step: _Step, size: int, local_size: int, name: str) -> DynamicTopology:
    n, ls, _ = _check_layout(where, size, local_size)
    return DynamicTopology(n, lambda k: [step(n, ls, r, k)[0] for r in range(n)], name=f"{name}({ls})")


def inner_outer_exponential_two(size: int, local_size: int, rank: int) -> Iterator[SendRecv]:
    """Inner-exp2 / outer-exp2 schedule seen from ``rank`` (BlueFog's
    ``GetInnerOuterExpo2DynamicSendRecvRanks``); ``local_size`` ranks per machine, ``> 2``, and at
    least two machines. Yields ``([dst], [src])`` per step."""
    return _rank_local(fn("inner_outer_exponential_two"), _inner_outer_expo2_step, size, local_size, rank)


def inner_outer_ring(size: int, local_size: int, rank: int) -> Iterator[SendRecv]:
    """Inner-ring / outer-ring schedule seen from ``rank`` (BlueFog's
    ``GetInnerOuterRingDynamicSendRecvRanks``); same conditions as :func:`inner_outer_exponential_two`."""
    return _rank_local(fn("inner_outer_ring"), _inner_outer_ring_step, size, local_size, rank)


def dynamic_inner_outer_exponential_two(size: int, local_size: int) -> DynamicTopology:
    """The global view of :func:`inner_outer_exponential_two`."""
    where = fn("dynamic_inner_outer_exponential_two")
    return _global(where, _inner_outer_expo2_step, size, local_size, "inner_outer_exponential_two")


def dynamic_inner_outer_ring(size: int, local_size: int) -> DynamicTopology:
    """The global view of :func:`inner_outer_ring`."""
    return _global(
        fn("dynamic_inner_outer_ring"), _inner_outer_ring_step, size, local_size, "inner_outer_ring"
    )
