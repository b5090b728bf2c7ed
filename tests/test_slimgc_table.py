"""SlimGC's communication threshold table, pure: the table built from warm-up samples against a
per-element reference, BestCT's rule and its edge cases, the compress decision, comm_threshold's
parsing, and the table's state."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress.slimgc import (
    Row,
    Samples,
    ThresholdTable,
    build_table,
    compress_mask,
    compressed_step,
    parse_comm_threshold,
)
from lowband.errors import InvalidArgumentError


def _reference(
    sizes: list[int], comm: torch.Tensor, comp: torch.Tensor
) -> dict[int, tuple[float, float, float]]:
    """Per size, (t_c, t_cq, t_pq) from explicit loops: per unit the mean of its steps of each kind,
    then the mean over the units of that size."""
    per_unit = []
    for i in range(len(sizes)):
        full = [float(comm[s, i]) for s in range(comm.shape[0]) if s % 2 == 0]
        q = [float(comm[s, i]) for s in range(comm.shape[0]) if s % 2 == 1]
        pq = [float(comp[s, i]) for s in range(comm.shape[0]) if s % 2 == 1]
        per_unit.append((sum(full) / len(full), sum(q) / len(q), sum(pq) / len(pq)))
    out = {}
    for size in set(sizes):
        us = [per_unit[i] for i, s in enumerate(sizes) if s == size]
        out[size] = tuple(sum(u[k] for u in us) / len(us) for k in range(3))  # type: ignore[assignment]
    return out


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=9),
    steps=st.integers(2, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_table_matches_reference(sizes: list[int], steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    comm = torch.rand(steps, len(sizes), generator=g, dtype=torch.float64)
    comp = torch.rand(steps, len(sizes), generator=g, dtype=torch.float64)
    table = build_table(sizes, comm, comp)
    ref = _reference(sizes, comm, comp)
    assert [r.size for r in table.rows] == sorted(ref)
    for r in table.rows:
        assert r.units == sizes.count(r.size)
        for got, want in zip((r.t_c, r.t_cq, r.t_pq), ref[r.size]):
            assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15)
        assert math.isclose(r.ratio, ref[r.size][0] / (ref[r.size][1] + ref[r.size][2]), rel_tol=1e-12)
    best = table.best_threshold()
    above = [r.size for r in table.rows if r.t_c / (r.t_cq + r.t_pq) > 1]
    assert best == (min(above) if above else math.inf)
    # stable: the smallest size from which every larger size pays off
    stable = table.best_threshold("stable")
    suffix = [r.size for k, r in enumerate(table.rows) if all(q.ratio > 1 for q in table.rows[k:])]
    assert stable == (min(suffix) if suffix else math.inf) and stable >= best


def _table(*rows: tuple[int, float, float, float]) -> ThresholdTable:
    return ThresholdTable(tuple(Row(s, 1, c, cq, pq) for s, c, cq, pq in rows))


def test_best_threshold_rule_and_edges() -> None:
    # the paper's Fig. 6: 1 MB 0.93, 1.6 MB 0.96, 2.2 MB 1.15, 4 MB 1.65 -> BestCT = 2.2 MB
    fig6 = _table(
        (1_000_000, 28.5, 24.3, 6.3), (1_600_000, 30.5, 25.3, 6.5), (2_200_000, 40.2, 28.3, 6.8), (4_000_000, 75.5, 37.3, 8.5)
    )  # fmt: skip
    assert [round(r.ratio, 2) for r in fig6.rows] == [0.93, 0.96, 1.15, 1.65]
    assert fig6.best_threshold() == 2_200_000
    # none above 1: compress nothing; all above 1: the smallest size (compress everything)
    assert _table((10, 1.0, 1.0, 0.5), (20, 1.0, 0.9, 0.2)).best_threshold() == math.inf
    assert _table((10, 3.0, 1.0, 0.5), (20, 4.0, 0.9, 0.2)).best_threshold() == 10
    # the first size above 1 wins even if a larger one falls back below (the paper's scan)
    assert _table((10, 1.0, 2.0, 0.1), (20, 3.0, 1.0, 0.1), (30, 1.0, 1.0, 0.1)).best_threshold() == 20
    # the stable rule: one noisy small size does not switch compression on for larger ones
    noisy = _table((10, 1.0, 2.0, 0.1), (20, 3.0, 1.0, 0.1), (30, 1.0, 1.0, 0.1), (40, 3.0, 1.0, 0.1))
    assert noisy.best_threshold("stable") == 40 and noisy.best_threshold("paper") == 20
    assert fig6.best_threshold("stable") == 2_200_000
    assert _table((10, 1.0, 1.0, 0.5)).best_threshold("stable") == math.inf
    with pytest.raises(InvalidArgumentError, match="rule must be"):
        fig6.best_threshold("median")
    # exactly 1 is no benefit; a zero cost is an infinite benefit
    assert _table((10, 1.5, 1.0, 0.5)).best_threshold() == math.inf
    assert _table((10, 1.0, 0.0, 0.0)).best_threshold() == 10
    assert ThresholdTable(()).best_threshold() == math.inf


@given(
    sizes=st.lists(st.integers(0, 10**7), max_size=20),
    threshold=st.one_of(st.integers(0, 10**7).map(float), st.just(math.inf)),
)
def test_compress_mask(sizes: list[int], threshold: float) -> None:
    mask = compress_mask(sizes, threshold)
    assert mask == [s >= threshold for s in sizes]
    assert all(compress_mask(sizes, 0.0))
    assert not any(compress_mask(sizes, math.inf))
    # a larger threshold never compresses a unit a smaller one sends in full precision
    for lo, hi in ((threshold, threshold * 2 + 1),):
        assert all(a or not b for a, b in zip(compress_mask(sizes, lo), compress_mask(sizes, hi)))


def test_warmup_alternates() -> None:
    assert [compressed_step(s) for s in range(6)] == [False, True, False, True, False, True]


def test_parse_comm_threshold() -> None:
    w = "test"
    assert parse_comm_threshold(w, "auto") is None
    assert parse_comm_threshold(w, "inf") == math.inf
    assert parse_comm_threshold(w, math.inf) == math.inf
    assert parse_comm_threshold(w, 0) == 0.0
    assert parse_comm_threshold(w, 4096) == 4096.0
    assert parse_comm_threshold(w, "2048") == 2048.0
    for bad in (-1, "fast", True, float("nan"), None, [1]):
        with pytest.raises(InvalidArgumentError, match="comm_threshold"):
            parse_comm_threshold(w, bad)


def test_table_and_samples_state_roundtrip() -> None:
    t = _table((30, 2.0, 1.0, 0.5), (10, 1.0, 2.0, 0.1))
    back = ThresholdTable.from_state_dict(t.state_dict())
    assert back.rows == tuple(sorted(t.rows, key=lambda r: r.size))
    assert back.report()[0]["ratio"] == back.rows[0].ratio
    with pytest.raises(InvalidArgumentError, match="malformed"):
        ThresholdTable.from_state_dict({"rows": [{"size": 1}]})
    s = Samples(4, 3)
    s.add(1, 2, 0.5, 0.25)
    s2 = Samples(4, 3)
    s2.load_state_dict(s.state_dict())
    assert torch.equal(s2.comm, s.comm) and torch.equal(s2.compress, s.compress)
    with pytest.raises(InvalidArgumentError, match="shape"):
        Samples(5, 3).load_state_dict(s.state_dict())
    with pytest.raises(InvalidArgumentError, match="at least 2"):
        Samples(1, 3)
    with pytest.raises(InvalidArgumentError, match="sizes"):
        build_table([1, 2], torch.zeros(4, 3), torch.zeros(4, 3))
