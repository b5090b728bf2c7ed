"""The Table 2 cost model, the alpha-beta fit, row partitions and packed rows (pure, one process)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.errors import InvalidArgumentError
from lowband.sparse import costs
from lowband.sparse.rows import RowPartition, coalesce, pack_rows, unpack_rows

ranks = st.integers(1, 16)
density = st.floats(0.0, 1.0)
table = st.floats(1.0, 1e10)
bandwidth = st.floats(1e3, 1e11)
latency = st.floats(0.0, 1e-2)


def test_table2_formulas_at_a_point() -> None:
    n, m, a, mb, bw, lat = 4, 2, 0.1, 1e8, 1e9, 1e-4
    assert costs.alltoall_time(n, m, a, mb, bw, lat) == pytest.approx(2 * 3 * (a * mb / (4 * bw) + lat))
    assert costs.allreduce_time(n, m, a, mb, bw, lat) == pytest.approx(2 * 3 * (mb / (4 * bw) + lat))
    assert costs.ps_time(n, m, a, mb, bw, lat) == pytest.approx(2 * 4 * (a * mb / (2 * bw) + lat))
    assert costs.allgather_time(n, m, a, mb, bw, lat) == pytest.approx(3 * (a * mb / bw + lat))


@given(ranks, st.data(), density, table, bandwidth, latency)
def test_terms_are_the_formulas(
    n: int, data: st.DataObject, a: float, mb: float, bw: float, lat: float
) -> None:
    machines = data.draw(st.integers(1, n))
    for name, fn in costs.TABLE2.items():
        b, k = costs.table2_terms(name, n, machines, a, mb)
        assert fn(n, machines, a, mb, bw, lat) == pytest.approx(b / bw + k * lat, rel=1e-9, abs=1e-15)


@given(st.integers(2, 16), st.data(), density, table, bandwidth, latency)
def test_alltoall_is_never_slower_than_allreduce_or_ps(
    n: int, data: st.DataObject, a: float, mb: float, bw: float, lat: float
) -> None:
    # the paper's claim for N > 1, N >= n, alpha <= 1
    machines = data.draw(st.integers(1, n))
    t = costs.alltoall_time(n, machines, a, mb, bw, lat)
    assert t <= costs.allreduce_time(n, machines, a, mb, bw, lat) * (1 + 1e-12)
    assert t <= costs.ps_time(n, machines, a, mb, bw, lat) * (1 + 1e-12)


@given(st.integers(2, 16), table, bandwidth, latency)
def test_crossover_is_where_the_times_meet(n: int, mb: float, bw: float, lat: float) -> None:
    d = costs.crossover_density("allgather", n, n, mb, bw, lat)
    ar = costs.allreduce_time(n, n, 1.0, mb, bw, lat)
    if d is None:
        assert (
            costs.allgather_time(n, n, 1.0, mb, bw, lat) <= ar
            or costs.allgather_time(n, n, 0.0, mb, bw, lat) >= ar
        )
    else:
        assert costs.allgather_time(n, n, d, mb, bw, lat) == pytest.approx(ar, rel=1e-9)
    # the dense allreduce of the whole table at density 1 costs the same as itself: no crossover below 1
    assert costs.crossover_density("allreduce", n, n, mb, bw, lat) in (None, 1.0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="n_machines"):
        costs.alltoall_time(2, 3, 0.1, 1e6, 1e9, 0.0)
    with pytest.raises(InvalidArgumentError, match="density"):
        costs.ps_time(2, 2, 1.5, 1e6, 1e9, 0.0)
    with pytest.raises(InvalidArgumentError, match="unknown scheme"):
        costs.table2_terms("ring", 2, 2, 0.1, 1e6)
    with pytest.raises(InvalidArgumentError, match="positive time"):
        costs.fit_link([])


@settings(max_examples=50)
@given(st.floats(1e5, 1e10), st.floats(0.0, 1e-2), st.integers(2, 8))
def test_fit_recovers_the_link(bw: float, lat: float, n: int) -> None:
    samples = []
    for scheme in costs.TABLE2:
        for a in (0.001, 0.01, 0.1, 1.0):
            b, k = costs.table2_terms(scheme, n, n, a, 1e7)
            samples.append((b, k, b / bw + k * lat))
    got_bw, got_lat = costs.fit_link(samples)
    assert got_bw == pytest.approx(bw, rel=1e-6)
    assert got_lat == pytest.approx(lat, rel=1e-6, abs=1e-12)


def test_fit_without_byte_dependence() -> None:
    bw, lat = costs.fit_link([(0.0, 2, 2e-3), (0.0, 4, 4e-3)])
    assert math.isinf(bw) and lat == pytest.approx(1e-3)


def test_exact_bytes() -> None:
    assert costs.allreduce_bytes(10, 4, 4) == 2 * 3 * 40 // 4
    assert costs.sparse_allgather_bytes([3, 5, 1], 4, 8) == 2 * 5 * (8 + 32)
    assert costs.ps_push_bytes([2, 0, 3], 2, 4, 4) == 2 * (8 + 16)
    assert costs.ps_request_bytes([2, 0, 3], 0) == 3 * 8
    assert costs.ps_reply_bytes([1, 4, 2], 1, 3, 8) == 3 * 24
    assert costs.column_split(10, 4) == [3, 3, 2, 2]
    assert costs.column_lookup_bytes([2, 3, 4, 5], [3, 3, 2, 2], 2, 4) == (2 + 3 + 5) * 2 * 4
    assert costs.column_gradient_bytes(4, [3, 3, 2, 2], 2, 4) == 4 * 8 * 4


@given(st.integers(0, 200), st.integers(1, 9), st.sampled_from(["range", "modulo"]))
def test_row_partition_covers_every_row_once(rows: int, n: int, kind: str) -> None:
    part = RowPartition(kind, rows, n)
    owned = [part.owned(j) for j in range(n)]
    assert sorted(torch.cat(owned).tolist()) == list(range(rows))
    assert [o.numel() for o in owned] == part.counts()
    assert max(part.counts()) - min(part.counts()) <= 1
    for j, o in enumerate(owned):
        assert (part.owner(o) == j).all()
        assert part.local(o).tolist() == list(range(o.numel()))
    ids = torch.arange(rows).flip(0)
    by, counts = part.by_owner(ids)
    assert counts == part.counts() and sorted(by.tolist()) == list(range(rows))
    assert part.owner(by).tolist() == sorted(part.owner(by).tolist())


def test_row_partition_refuses_unknown_kinds() -> None:
    with pytest.raises(InvalidArgumentError, match="partition"):
        RowPartition("hash", 10, 2)


@given(st.integers(0, 20), st.integers(0, 5), st.sampled_from([torch.float32, torch.float64, torch.float16]))
def test_pack_unpack_roundtrip(k: int, dim: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(k * 31 + dim)
    ids = torch.randint(0, 2**40, (k,), generator=g)
    vals = torch.randn(k, dim, generator=g).to(dtype)
    buf = pack_rows(ids, vals)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == (k, 8 + dim * vals.element_size())
    back_ids, back_vals = unpack_rows(buf, dim, dtype)
    assert torch.equal(back_ids, ids) and torch.equal(back_vals, vals)


def test_coalesce() -> None:
    assert coalesce([torch.tensor([[3, 1], [3, 0]]), torch.tensor([1, 7])]).tolist() == [0, 1, 3, 7]
    assert coalesce([]).numel() == 0
