"""Top-k and random-k: exact selections against a sort-based reference (hypothesis), ties, sizes,
non-finite input, declared wire size, shared coordinates, unbiasedness of scaled random-k, error feedback
telescoping, and random-k summed on the wire by the allreduce transport at world sizes 1-4."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowband
from lowband.compress import CompressContext, Payload, ResidualMemory, make_compressor, make_reducer
from lowband.compress.sparse import RandomK, TopK, count_from_ratio, index_dtype
from lowband.errors import InvalidArgumentError
from lowband.optim import ReduceContext, Unit
from lowband.testing import run_threads

CTX = CompressContext("layer", step=3, rank=0, seed=7)
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31]
floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


def _ref_topk(x: torch.Tensor, k: int) -> list[int]:
    """The k largest |x|, ties by lowest index, by a full sort (ascending indices)."""
    order = sorted(range(x.numel()), key=lambda i: (-abs(float(x[i])), i))
    return sorted(order[:k])


@settings(max_examples=150, deadline=None)
@given(st.lists(floats, max_size=40), st.integers(0, 45), st.sampled_from([torch.float32, torch.float64]))
def test_topk_picks_exactly_the_k_largest(values: list[float], k: int, dtype: torch.dtype) -> None:
    x = torch.tensor(values, dtype=dtype)
    c = TopK(k=k)
    p = c.compress(x, CTX)
    kk = min(k, x.numel())
    idx, vals = p.data
    assert idx.dtype == torch.int32 and vals.dtype == dtype
    assert idx.tolist() == _ref_topk(x, kk)
    assert torch.equal(vals, x[idx.long()])
    assert p.nbytes == c.nbytes(x.numel(), dtype) == kk * (4 + x.element_size())
    out = c.decompress(p, CTX)
    want = torch.zeros_like(x)
    want[idx.long()] = x[idx.long()]
    assert out.dtype == dtype and torch.equal(out, want)


@settings(max_examples=100, deadline=None)
@given(st.lists(floats, max_size=40), st.integers(0, 45), st.booleans(), st.integers(0, 50))
def test_randomk_sends_k_values_at_shared_coordinates(
    values: list[float], k: int, scale: bool, step: int
) -> None:
    x = torch.tensor(values, dtype=torch.float64)
    d = x.numel()
    c = RandomK(k=k, scale=scale)
    ctx = CompressContext("u", step, rank=step % 3, seed=4)
    p = c.compress(x, ctx)
    kk = min(k, d)
    idx = RandomK(k=k).indices(d, CompressContext("u", step, rank=0, seed=4))  # another instance, rank
    assert idx.numel() == kk and sorted(set(idx.tolist())) == idx.tolist()
    assert len(p.data) == 1 and torch.equal(p.data[0], x[idx])
    assert p.nbytes == c.nbytes(d, x.dtype) == 8 * kk
    want = torch.zeros_like(x)
    want[idx] = x[idx] * (d / kk if scale and kk else 1.0)
    assert torch.equal(c.decompress(p, ctx), want)


def test_topk_ties_break_by_lowest_index() -> None:
    x = torch.tensor([3.0, -1.0, 2.0, -2.0, 2.0, 0.0, 2.0])
    assert TopK(k=3).compress(x, CTX).data[0].tolist() == [0, 2, 3]
    assert TopK(k=5).compress(x, CTX).data[0].tolist() == [0, 2, 3, 4, 6]
    assert TopK(k=4).compress(torch.ones(9), CTX).data[0].tolist() == [0, 1, 2, 3]
    zeros = TopK(k=2).compress(torch.zeros(8), CTX)
    assert zeros.data[0].tolist() == [0, 1]
    assert torch.equal(TopK(k=2).decompress(zeros, CTX), torch.zeros(8))


@pytest.mark.parametrize("name", ["topk", "randomk"])
@pytest.mark.parametrize("d", SIZES)
def test_sizes_and_empty_payloads(name: str, d: int) -> None:
    x = torch.randn(d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    for spec in (f"{name}:k=0", f"{name}:ratio=0.0"):
        p = make_compressor(spec).compress(x, CTX)
        assert p.nbytes == 0 and all(t.numel() == 0 for t in p.data)
        assert torch.equal(make_compressor(spec).decompress(p, CTX), torch.zeros(d, dtype=torch.float64))
    for ratio in (0.1, 0.5, 1.0):
        c = make_compressor(f"{name}:ratio={ratio}")
        p = c.compress(x, CTX)
        k = count_from_ratio(ratio, d)
        assert k == min(d, math.ceil(ratio * d - 1e-9))
        assert p.nbytes == c.nbytes(d, x.dtype)  # type: ignore[attr-defined]
        out = c.decompress(p, CTX)
        assert out.shape == (d,) and out.dtype == torch.float64
        assert int((out != 0).sum()) <= k
        if ratio == 1.0 and name == "topk":
            assert torch.equal(out, x)


def test_count_from_ratio_and_index_dtype() -> None:
    assert count_from_ratio(0.1, 30) == 3  # 0.1 * 30 = 3.0000000000000004: not 4
    assert count_from_ratio(0.01, 7) == 1
    assert count_from_ratio(0.5, 9) == 5
    assert count_from_ratio(1.0, 0) == 0
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


@pytest.mark.parametrize("name", ["topk", "randomk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_a_clear_error(name: str, bad: float) -> None:
    x = torch.ones(9)
    x[4] = bad
    with pytest.raises(InvalidArgumentError, match=rf"{name}.*'layer'.*rank 0.*non-finite.*element 4 of 9"):
        make_compressor(f"{name}:ratio=0.5").compress(x, CTX)


def test_bad_options() -> None:
    for spec, msg in [
        ("topk:ratio=0.1,k=3", r"give ratio or k, not both \(got ratio=0.1, k=3\)"),
        ("topk:ratio=1.5", r"ratio must be a number in \[0, 1\] or None, got 1.5"),
        ("randomk:k=-1", "k must be an int >= 0 or None, got -1"),
        ("randomk:scale=yes", "scale must be true or false, got 'yes'"),
        ("topk:k=2.5", "k must be an int >= 0 or None, got 2.5"),
        ("topk:levels=3", "unknown option"),
    ]:
        with pytest.raises(InvalidArgumentError, match=msg):
            make_compressor(spec)
    with pytest.raises(InvalidArgumentError, match="flat"):
        TopK(k=1).compress(torch.ones(2, 2), CTX)
    assert repr(make_compressor("randomk:k=3,scale=true")) == "RandomK(k=3, scale=True)"


def test_randomk_coordinates_shared_across_ranks_and_fresh_each_step() -> None:
    c = RandomK(ratio=0.25)
    x = torch.arange(1.0, 65.0)
    per_rank = [c.compress(x, CompressContext("u", 5, rank=r, seed=1)).data[0] for r in range(4)]
    assert all(torch.equal(per_rank[0], v) for v in per_rank[1:])
    idx = c.indices(64, CompressContext("u", 5, rank=2, seed=1))
    assert idx.numel() == 16 and len(set(idx.tolist())) == 16 and torch.equal(per_rank[0], x[idx])
    others = [c.indices(64, CompressContext("u", s, seed=1)) for s in range(6, 10)]
    assert all(not torch.equal(idx, o) for o in others), "a new draw every step"
    assert not torch.equal(idx, c.indices(64, CompressContext("v", 5, seed=1))), "and per unit"


def test_randomk_payloads_sum_on_the_wire() -> None:
    c = RandomK(k=5, scale=True)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(17, generator=g, dtype=torch.float64) for _ in range(3)]
    ctxs = [CompressContext("u", 4, rank=r) for r in range(3)]
    payloads = [c.compress(x, cc) for x, cc in zip(xs, ctxs)]
    summed = Payload((torch.stack([p.data[0] for p in payloads]).sum(0),), 17, torch.float64)
    each = torch.stack([c.decompress(p, cc) for p, cc in zip(payloads, ctxs)]).sum(0)
    assert torch.allclose(c.decompress(summed, ctxs[0]), each)


@pytest.mark.parametrize("scale", [True, False])
def test_scaled_randomk_is_unbiased(scale: bool) -> None:
    """Mean of the decode over many steps against x: within 5 standard errors when scaled; the unscaled
    one is measurably biased (x * k / d), so the bound has the power to fail."""
    d, k, steps = 16, 4, 4000
    x = torch.linspace(-2.0, 3.0, d, dtype=torch.float64)
    c = RandomK(k=k, scale=scale)
    total = torch.zeros(d, dtype=torch.float64)
    for s in range(steps):
        cc = CompressContext("u", s, seed=11)
        total += c.decompress(c.compress(x, cc), cc)
    mean = total / steps
    stderr = x.abs() * math.sqrt((d / k - 1) / steps)
    unbiased = bool(((mean - x).abs() <= 5 * stderr + 1e-12).all())
    assert unbiased == scale
    if not scale:
        assert torch.allclose(mean, x * k / d, atol=float(5 * stderr.max() * k / d))


@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.2", "topk:k=1", "randomk:ratio=0.3", "randomk:k=2,scale=true"]
)
def test_error_feedback_telescopes(spec: str) -> None:
    c = make_compressor(spec)
    mem = ResidualMemory()
    segs = (("w", 12), ("b", 5))
    g = torch.Generator().manual_seed(4)
    sent = torch.zeros(17, dtype=torch.float64)
    given_sum = torch.zeros(17, dtype=torch.float64)
    for step in range(12):
        grad = torch.randn(17, generator=g, dtype=torch.float64)
        given_sum += grad
        cc = CompressContext("w..b", step, seed=3)
        p = mem.compensate(segs, grad)
        d = c.decompress(c.compress(p, cc), cc)
        mem.update(segs, p, d)
        sent += d
    final = torch.cat([mem.tensors["w"], mem.tensors["b"]])
    assert torch.allclose(sent + final, given_sum, atol=1e-12)
    assert float(final.abs().sum()) > 0, "something was left in memory"


def _reduce_randomk() -> torch.Tensor:
    r, n = lowband.rank(), lowband.size()
    red = make_reducer("allreduce", "randomk:ratio=0.4,scale=true", "none", seed=5)
    w = torch.nn.Parameter(torch.zeros(13, dtype=torch.float64))
    grad = torch.randn(13, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
    unit = Unit("w", ("w",), (w,))
    out = red.reduce(unit, [grad], ReduceContext(lowband.world().unchecked(), 2)).wait()
    assert red.compressor.summable and n >= 1
    return out[0].clone()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_randomk_through_the_allreduce_transport_equals_the_mean_of_decodes(n: int) -> None:
    res = run_threads(_reduce_randomk, n, timeout=60)
    c = RandomK(ratio=0.4, scale=True)
    decodes = []
    for r in range(n):
        grad = torch.randn(13, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
        cc = CompressContext("w", 2, rank=r, seed=5)
        decodes.append(c.decompress(c.compress(grad, cc), cc))
    want = torch.stack(decodes).sum(0) / n
    for r in range(n):
        assert torch.allclose(res[r], want, atol=1e-12), f"rank {r}"
        assert torch.equal(res[r], res[0]), "every rank bit-identical"
