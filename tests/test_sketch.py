"""CountSketch and HEAVYMIX (pure): seeded tables, linearity, estimates within CountSketch's bounds,
planted heavy coordinates recalled, HEAVYMIX's exact-k selection, ties, gTop-k's merge."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.compress.heavymix import candidates, heavymix, keep_largest, merge_topk, topk_indices
from lowband.compress.sketch import CountSketch, lower_median
from lowband.errors import InvalidArgumentError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_tables_are_a_function_of_the_seed() -> None:
    a, b, c = (
        CountSketch(1000, 3, 50, seed=7),
        CountSketch(1000, 3, 50, seed=7),
        CountSketch(1000, 3, 50, seed=8),
    )
    assert torch.equal(a.buckets, b.buckets) and torch.equal(a.signs, b.signs)
    assert a.checksum() == b.checksum() != c.checksum()
    assert not torch.equal(a.buckets, c.buckets)
    assert int(a.buckets.min()) >= 0 and int(a.buckets.max()) < 50
    assert set(a.signs.unique().tolist()) == {-1, 1}
    assert CountSketch(1000, 3, 51, seed=7).checksum() != a.checksum()


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(0, 300),
    rows=st.integers(1, 6),
    cols=st.integers(1, 40),
    seed=st.integers(0, 2**40),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
)
def test_linear_exactly_on_integer_inputs(
    d: int, rows: int, cols: int, seed: int, dtype: torch.dtype
) -> None:
    sk = CountSketch(d, rows, cols, seed=seed)
    g = _gen(seed % 1000)
    a = torch.randint(-4, 5, (d,), generator=g).to(dtype)
    b = torch.randint(-4, 5, (d,), generator=g).to(dtype)
    sa, sb, sab = sk.sketch(a), sk.sketch(b), sk.sketch(a + b)
    assert sab.shape == (rows, cols) and sab.dtype == dtype
    assert torch.equal(sab, sa + sb)
    # the sketch is the matrix product with the explicit +-1 matrix
    dense = torch.zeros(rows, cols, d, dtype=torch.float64)
    for j in range(rows):
        dense[j, sk.buckets[j].long(), torch.arange(d)] = sk.signs[j].double()
    assert torch.equal(
        sa.double(), (dense @ a.double()) if d else torch.zeros(rows, cols, dtype=torch.float64)
    )


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), n=st.integers(0, 50), seed=st.integers(0, 1000))
def test_lower_median_is_torch_median(rows: int, n: int, seed: int) -> None:
    x = torch.randint(-3, 4, (rows, n), generator=_gen(seed)).float()
    assert torch.equal(lower_median(list(x)), x.median(dim=0).values)
    sk = CountSketch(n, rows, 4, seed=seed)
    t = sk.sketch(x[0])
    assert torch.equal(sk.estimate(t), sk.row_estimates(t).median(dim=0).values)


def test_single_row_estimate_is_unbiased() -> None:
    d, cols, draws = 200, 20, 400
    x = torch.randn(d, generator=_gen(1), dtype=torch.float64)
    total = torch.zeros(d, dtype=torch.float64)
    for s in range(draws):
        sk = CountSketch(d, 1, cols, seed=s)
        total += sk.estimate(sk.sketch(x))
    mean = total / draws
    # each draw's error has variance sum_{j != i} x_j^2 / cols; the mean's is that / draws
    std = ((x.square().sum() - x.square()) / cols / draws).sqrt()
    assert bool(((mean - x).abs() <= 5 * std).all()), float(((mean - x).abs() / std).max())


@pytest.mark.parametrize("rows", [1, 5])
def test_badly_estimated_fraction_within_the_bound(rows: int) -> None:
    d, cols = 100_000, 400
    x = torch.randn(d, generator=_gen(2), dtype=torch.float64)
    sk = CountSketch(d, rows, cols, seed=3)
    err = (sk.estimate(sk.sketch(x)) - x).abs()
    eps = 2 / math.sqrt(cols)
    bad = float((err > eps * x.norm()).double().mean())
    # one row: Chebyshev, P(|err| > eps ||x||) <= 1 / (cols eps^2) = 1/4; the median of r rows is bad
    # only if at least ceil(r/2) rows are
    p = 1 / (cols * eps * eps)
    bound = sum(math.comb(rows, j) * p**j * (1 - p) ** (rows - j) for j in range((rows + 1) // 2, rows + 1))
    assert bad <= bound + 0.01, (bad, bound)


def test_norm_estimate() -> None:
    x = torch.randn(50_000, generator=_gen(4), dtype=torch.float64)
    sk = CountSketch(x.numel(), 5, 2000, seed=5)
    assert abs(sk.norm_sq(sk.sketch(x)) / float(x.square().sum()) - 1) < 0.1


def test_planted_heavy_coordinates_recalled() -> None:
    d, k, h = 500_000, 1000, 100
    g = _gen(6)
    x = torch.randn(d, generator=g)
    where = torch.randperm(d, generator=g)[:h]
    # g_i^2 >= 2 ||g||^2 / k with ||g||^2 = ||noise||^2 + h v^2
    v2 = 2 * float(x.square().sum()) / k / (1 - 2 * h / k)
    x[where] = math.sqrt(v2) * torch.where(torch.rand(h, generator=g) < 0.5, -1.0, 1.0)
    assert bool((x[where].square() >= 2 * x.square().sum() / k * 0.999).all())
    sk = CountSketch(d, 5, 10_000, seed=7)
    t = sk.sketch(x)
    idx = heavymix(sk.estimate(t), sk.norm_sq(t), k, _gen(8))
    recall = float(torch.isin(where, idx).double().mean())
    assert recall >= 0.99, recall


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 400), k=st.integers(1, 500), seed=st.integers(0, 10_000), spread=st.floats(0.0, 3.0))
def test_heavymix_exactly_k_unique_and_reproducible(d: int, k: int, seed: int, spread: float) -> None:
    est = torch.randn(d, generator=_gen(seed)) * torch.rand(d, generator=_gen(seed + 1)).pow(spread * 4)
    norm = float(est.square().sum())
    a = heavymix(est, norm, k, _gen(seed))
    b = heavymix(est.clone(), norm, k, _gen(seed))
    assert torch.equal(a, b)
    assert a.numel() == min(k, d) == a.unique().numel()
    assert bool((a[1:] > a[:-1]).all()) and int(a.min()) >= 0 and int(a.max()) < d
    heavy = (est.double().square() >= norm / min(k, d)).nonzero().view(-1)
    if heavy.numel() <= min(k, d):
        assert bool(torch.isin(heavy, a).all())  # every heavy coordinate, filled at random
    else:
        assert torch.equal(a, heavy[topk_indices(est[heavy], min(k, d))])  # truncated by magnitude


def test_heavymix_zero_sketch_and_bad_k() -> None:
    est = torch.zeros(10)
    assert torch.equal(heavymix(est, 0.0, 3, _gen(0)), torch.tensor([0, 1, 2]))  # ties: smaller index
    with pytest.raises(InvalidArgumentError):
        heavymix(est, 0.0, 0, _gen(0))


@settings(max_examples=80, deadline=None)
@given(vals=st.lists(st.integers(-3, 3), max_size=60), k=st.integers(0, 70))
def test_topk_indices_ties_by_smaller_index(vals: list[int], k: int) -> None:
    x = torch.tensor(vals, dtype=torch.float32)
    ref = sorted(sorted(range(len(vals)), key=lambda i: (-abs(vals[i]), i))[:k])
    assert topk_indices(x, k).tolist() == ref


def test_candidates_and_keep_largest() -> None:
    assert (
        candidates(10, 1.0, 100) == 10 and candidates(10, 2.5, 100) == 25 and candidates(10, 20.0, 100) == 100
    )
    i, v = keep_largest(torch.tensor([3, 5, 9]), torch.tensor([1.0, -4.0, 2.0]), 2)
    assert i.tolist() == [5, 9] and v.tolist() == [-4.0, 2.0]


@settings(max_examples=60, deadline=None)
@given(
    a=st.dictionaries(st.integers(0, 30), st.integers(-5, 5), min_size=1, max_size=12),
    b=st.dictionaries(st.integers(0, 30), st.integers(-5, 5), min_size=1, max_size=12),
)
def test_merge_topk_against_a_dict(a: dict[int, int], b: dict[int, int]) -> None:
    k = min(len(a), len(b))
    ia, va = torch.tensor(sorted(a)), torch.tensor([float(a[i]) for i in sorted(a)], dtype=torch.float64)
    ib, vb = torch.tensor(sorted(b)), torch.tensor([float(b[i]) for i in sorted(b)], dtype=torch.float64)
    s = dict(a)
    for i, v in b.items():
        s[i] = s.get(i, 0) + v
    kept = sorted(sorted(s, key=lambda i: (-abs(s[i]), i))[:k])
    idx, val, di, dv = merge_topk(ia, va, ib, vb, k)
    assert idx.tolist() == kept and val.tolist() == [s[i] for i in kept]
    assert di.tolist() == sorted(set(s) - set(kept)) and dv.tolist() == [s[i] for i in di.tolist()]


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        CountSketch(10, 0, 5)
    with pytest.raises(InvalidArgumentError):
        CountSketch(10, 2, 0)
    sk = CountSketch(10, 2, 5)
    with pytest.raises(InvalidArgumentError):
        sk.sketch(torch.zeros(11))
    with pytest.raises(InvalidArgumentError):
        sk.sketch(torch.zeros(10, dtype=torch.int64))
