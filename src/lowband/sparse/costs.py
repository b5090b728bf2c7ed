"""Communication cost of an embedding table's gradient (pure): the model of Table 2 of "EmbRace:
Accelerating Sparse Communication for Distributed Training of Deep Neural Networks", and exact byte
counts of the operations lowband runs for each scheme.

Table 2 (``N`` ranks on ``n`` machines, gradient density ``alpha`` = rows touched / rows, table of
``M`` bytes, bandwidth ``B`` bytes/s between any two ranks, start latency ``beta`` seconds):

- AlltoAll (column-partitioned table, lookup results and gradients exchanged): ``2 (N-1) (alpha M / (N B) + beta)``
- AllReduce (dense, ring): ``2 (N-1) (M / (N B) + beta)``
- PS (rows partitioned over the servers, push gradients and pull rows; lower bound ``S = n``):
  ``2 N (alpha M / (n B) + beta)``
- AllGather (every rank's sparse gradient to every rank): ``(N-1) (alpha M / B + beta)``

The ``*_time`` functions are these formulas; :data:`TABLE2` maps a scheme's name to its function with
one signature, and :func:`table2_terms` splits a scheme's time into (bytes on the critical path,
number of latency terms), the two features an alpha-beta fit needs.

The ``*_bytes`` functions are exact: bytes one rank *sends* in one operation, as lowband's byte
counters record it (``lowband.counters()``; every op here receives as many bytes as it sends for the
symmetric patterns). A coalesced sparse row carries an int64 index (8 bytes) next to its values where
the receiver cannot know it; an uneven allgather pads every rank's block to the largest (the counters
count what moves). With colocated servers a rank's own shard never crosses its link, so the PS
exchange of one rank per machine moves the same bytes as the AlltoAll exchange (``2 (N-1) alpha M / N``
without indices), not Table 2's ``2 alpha M``: the model's bound assumes servers apart from workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lowband.comm.reduce import ring_bytes
from lowband.errors import InvalidArgumentError

#: bytes of one row index on the wire (int64)
INDEX_BYTES = 8


def _check(n_ranks: int, n_machines: int, density: float, table_bytes: float, bw: float, lat: float) -> None:
    if n_ranks < 1 or n_machines < 1 or n_machines > n_ranks:
        raise InvalidArgumentError(
            f"sparse.costs: need 1 <= n_machines <= n_ranks, got n_ranks={n_ranks}, n_machines={n_machines}"
        )
    if not 0.0 <= density <= 1.0:
        raise InvalidArgumentError(f"sparse.costs: density must be in [0, 1], got {density}")
    if table_bytes < 0 or bw <= 0 or lat < 0:
        raise InvalidArgumentError(
            f"sparse.costs: need table_bytes >= 0, bandwidth > 0, latency >= 0; got {table_bytes}, {bw}, {lat}"
        )


def alltoall_time(
    n_ranks: int, n_machines: int, density: float, table_bytes: float, bw: float, lat: float
) -> float:
    """Table 2, AlltoAll: ``2 (N-1) (alpha M / (N B) + beta)``."""
    _check(n_ranks, n_machines, density, table_bytes, bw, lat)
    return 2 * (n_ranks - 1) * (density * table_bytes / (n_ranks * bw) + lat)


def allreduce_time(
    n_ranks: int, n_machines: int, density: float, table_bytes: float, bw: float, lat: float
) -> float:
    """Table 2, AllReduce (dense: the density does not matter): ``2 (N-1) (M / (N B) + beta)``."""
    _check(n_ranks, n_machines, density, table_bytes, bw, lat)
    return 2 * (n_ranks - 1) * (table_bytes / (n_ranks * bw) + lat)


def ps_time(
    n_ranks: int, n_machines: int, density: float, table_bytes: float, bw: float, lat: float
) -> float:
    """Table 2, PS with one server per machine (the bound): ``2 N (alpha M / (n B) + beta)``."""
    _check(n_ranks, n_machines, density, table_bytes, bw, lat)
    return 2 * n_ranks * (density * table_bytes / (n_machines * bw) + lat)


def allgather_time(
    n_ranks: int, n_machines: int, density: float, table_bytes: float, bw: float, lat: float
) -> float:
    """Table 2, AllGather: ``(N-1) (alpha M / B + beta)``."""
    _check(n_ranks, n_machines, density, table_bytes, bw, lat)
    return (n_ranks - 1) * (density * table_bytes / bw + lat)


CostFn = Callable[[int, int, float, float, float, float], float]

#: Table 2 by scheme: ``fn(n_ranks, n_machines, density, table_bytes, bandwidth, latency) -> seconds``
TABLE2: dict[str, CostFn] = {
    "alltoall": alltoall_time,
    "allreduce": allreduce_time,
    "ps": ps_time,
    "allgather": allgather_time,
}


def table2_terms(
    scheme: str, n_ranks: int, n_machines: int, density: float, table_bytes: float
) -> tuple[float, int]:
    """``(bytes, latencies)`` of Table 2's formula for ``scheme``: time = bytes / B + latencies * beta."""
    if scheme not in TABLE2:
        raise InvalidArgumentError(f"sparse.costs: unknown scheme {scheme!r}; known: {sorted(TABLE2)}")
    _check(n_ranks, n_machines, density, table_bytes, 1.0, 0.0)
    n, a, m = n_ranks, density, table_bytes
    return {
        "alltoall": (2 * (n - 1) * a * m / n, 2 * (n - 1)),
        "allreduce": (2 * (n - 1) * m / n, 2 * (n - 1)),
        "ps": (2 * n * a * m / n_machines, 2 * n),
        "allgather": ((n - 1) * a * m, n - 1),
    }[scheme]


def crossover_density(
    scheme: str, n_ranks: int, n_machines: int, table_bytes: float, bw: float, lat: float
) -> float | None:
    """The density at which ``scheme`` takes as long as the dense AllReduce under Table 2 (below it
    the sparse scheme is faster); ``None`` when it is faster at every density up to 1 (or slower at 0)."""
    b0, l0 = table2_terms(scheme, n_ranks, n_machines, 0.0, table_bytes)
    b1, _ = table2_terms(scheme, n_ranks, n_machines, 1.0, table_bytes)
    target = allreduce_time(n_ranks, n_machines, 1.0, table_bytes, bw, lat)
    fixed = b0 / bw + l0 * lat
    slope = (b1 - b0) / bw
    if slope <= 0 or fixed >= target:
        return None
    d = (target - fixed) / slope
    return d if d <= 1.0 else None


# -- exact bytes per operation (what lowband's counters record on one rank) ---------------------------


def allreduce_bytes(numel: int, itemsize: int, n_ranks: int) -> int:
    """A ring allreduce of ``numel`` elements: ``2 (N-1) / N`` of the buffer (integer division)."""
    return ring_bytes(numel * itemsize, n_ranks)


def sparse_allgather_bytes(rows: Sequence[int], dim: int, itemsize: int) -> int:
    """One allgather of every rank's coalesced rows (index + values), padded to the largest block:
    ``(N-1) * max(rows) * (8 + dim * itemsize)``."""
    return (len(rows) - 1) * max(rows, default=0) * (INDEX_BYTES + dim * itemsize)


def alltoall_bytes(send_rows: Sequence[int], rank: int, row_bytes: int) -> int:
    """An all-to-all sending ``send_rows[j]`` rows of ``row_bytes`` to rank ``j`` (its own stay)."""
    return (sum(send_rows) - send_rows[rank]) * row_bytes


def ps_push_bytes(to_owner: Sequence[int], rank: int, dim: int, itemsize: int) -> int:
    """PS push: ``to_owner[j]`` coalesced rows (index + values) to each owner ``j``."""
    return alltoall_bytes(to_owner, rank, INDEX_BYTES + dim * itemsize)


def ps_request_bytes(to_owner: Sequence[int], rank: int) -> int:
    """PS pull request: ``to_owner[j]`` row ids to each owner ``j``."""
    return alltoall_bytes(to_owner, rank, INDEX_BYTES)


def ps_reply_bytes(from_rank: Sequence[int], rank: int, dim: int, itemsize: int) -> int:
    """PS pull reply (or the pull of pushed rows): the owner sends ``from_rank[q]`` rows (values only:
    the requester knows the ids) back to each rank ``q``."""
    return alltoall_bytes(from_rank, rank, dim * itemsize)


def column_lookup_bytes(rows: Sequence[int], dims: Sequence[int], rank: int, itemsize: int) -> int:
    """The forward AlltoAll of a column-partitioned table (rank ``j`` holds ``dims[j]`` columns): the
    owner ``rank`` sends each rank ``q`` its columns of ``rows[q]`` rows (values only)."""
    return (sum(rows) - rows[rank]) * dims[rank] * itemsize


def column_gradient_bytes(rows: int, dims: Sequence[int], rank: int, itemsize: int) -> int:
    """The backward AlltoAll of a column-partitioned table: ``rows`` coalesced rows, their column
    block ``j`` to owner ``j`` (values only: the ids are known on both sides)."""
    return rows * (sum(dims) - dims[rank]) * itemsize


def column_split(dim: int, n_ranks: int) -> list[int]:
    """Columns per rank for ``dim`` columns over ``n_ranks`` ranks (the first ``dim % N`` one more)."""
    q, r = divmod(dim, n_ranks)
    return [q + (j < r) for j in range(n_ranks)]


def fit_link(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(bandwidth B, latency beta)`` fitting ``seconds = bytes / B + latencies * beta`` to samples
    ``(bytes, latencies, seconds)`` by least squares on the relative error (every sample counts alike,
    whatever its size), with ``1/B >= 0`` and ``beta >= 0``. ``B`` is ``inf`` when no sample's time
    grows with its bytes."""
    rows = [(b / t, lat / t) for b, lat, t in samples if t > 0]
    if not rows:
        raise InvalidArgumentError("sparse.costs.fit_link: needs at least one sample with a positive time")

    def solve(use: tuple[bool, bool]) -> tuple[float, float, float]:
        # normal equations of min sum (x * a + y * c - 1)^2 over the free coefficients
        saa = sum(a * a for a, _ in rows)
        scc = sum(c * c for _, c in rows)
        sac = sum(a * c for a, c in rows)
        sa = sum(a for a, _ in rows)
        sc = sum(c for _, c in rows)
        x = y = 0.0
        if use[0] and use[1]:
            det = saa * scc - sac * sac
            if det > 0:
                x, y = (sa * scc - sc * sac) / det, (sc * saa - sa * sac) / det
        elif use[0] and saa > 0:
            x = sa / saa
        elif use[1] and scc > 0:
            y = sc / scc
        err = sum((x * a + y * c - 1) ** 2 for a, c in rows)
        return x, y, err

    fits = [
        f
        for f in (solve((True, True)), solve((True, False)), solve((False, True)))
        if f[0] >= 0 and f[1] >= 0
    ]
    x, y, _ = min(fits, key=lambda f: f[2])
    return (1.0 / x if x > 0 else float("inf")), y
