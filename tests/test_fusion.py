"""Tensor fusion: the bucket plan (pure) and grouped allreduce == the unfused ops, at N = 1..4."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import WORLD_SIZES, data, reduce, same

import lowband
from lowband.comm.fusion import plan_buckets
from lowband.testing import run_threads

_DT = [torch.float32, torch.float64, torch.float16, torch.int64]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.sampled_from(range(len(_DT)))), max_size=30),
    st.integers(0, 300),
)
def test_plan_buckets_invariants(specs: list[tuple[int, int]], threshold: int) -> None:
    ts = [torch.empty(numel, dtype=_DT[d]) for numel, d in specs]
    buckets = plan_buckets(ts, threshold)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(ts)))  # every tensor exactly once
    for b in buckets:
        assert b == sorted(b)  # order kept inside a bucket
        assert len({ts[i].dtype for i in b}) == 1  # one dtype per buffer
        total = sum(ts[i].numel() * ts[i].element_size() for i in b)
        assert len(b) == 1 or total <= threshold  # within the threshold unless alone
    if threshold == 0:
        assert all(len(b) == 1 for b in buckets)


def test_plan_buckets_example() -> None:
    f = [torch.empty(4) for _ in range(5)]  # 16 bytes each
    assert plan_buckets(f, 32) == [[0, 1], [2, 3], [4]]
    assert plan_buckets(f, 10**9) == [[0, 1, 2, 3, 4]]
    assert plan_buckets([torch.empty(100), *f[:2]], 32) == [[0], [1, 2]]  # a large tensor travels alone


def _tensors(rank: int, *, integer: bool) -> list[torch.Tensor]:
    shapes = [(), (0,), (7,), (3, 5), (2, 3, 4), (0, 2), (257,), (1,)]
    dts = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float32]
    ts = []
    for i, shape in enumerate(shapes * 3):
        dt = dts[i % len(dts)]
        ts.append(data(rank, shape, dt, i, integer=integer))
    return ts


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("threshold", [0, 64, 1024, 64 << 20])
@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_grouped_allreduce_exact(n: int, threshold: int, op: str) -> None:
    """Integer-valued data: fused results are bit-identical to the oracle and to the unfused ops."""

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        all_ts = [_tensors(q, integer=True) for q in range(n)]
        want = [reduce([all_ts[q][i] for q in range(n)], op) for i in range(len(all_ts[0]))]
        mine = [t.clone() for t in all_ts[r]]
        fused = lowband.grouped_allreduce(mine, op=op, fusion_threshold=threshold, name="fused")
        unfused = [lowband.allreduce(t, op=op) for t in mine]
        for i, (f, u, w) in enumerate(zip(fused, unfused, want)):
            if not (same(f, w) and same(u, w)):
                bad.append(f"rank {r} tensor {i} {tuple(w.shape)} {w.dtype}: fused {f} unfused {u} want {w}")
        if not all(same(a, b) for a, b in zip(mine, all_ts[r])):
            bad.append(f"rank {r}: out-of-place grouped_allreduce changed its inputs")
        h = lowband.igrouped_allreduce(mine, op=op, inplace=True, fusion_threshold=threshold)
        res = h.wait()
        if not all(same(a, w) and a.data_ptr() == m.data_ptr() for a, w, m in zip(res, want, mine)):
            bad.append(f"rank {r}: in-place igrouped_allreduce")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_grouped_allreduce_random_floats(n: int) -> None:
    """Random floats: fused == unfused bit for bit on 1-2 ranks; to rounding on more (gloo's reduction
    order depends on an element's position in the buffer)."""

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        mine = [data(r, (s,), torch.float32, s, integer=False) for s in (1, 10, 100, 1000, 3333)]
        fused = lowband.grouped_allreduce(mine, op="sum")
        unfused = [lowband.allreduce(t, op="sum") for t in mine]
        oracle = [
            torch.stack([data(q, (s,), torch.float64, s, integer=False) for q in range(n)]).sum(0)
            for s in (1, 10, 100, 1000, 3333)
        ]
        for f, u, o in zip(fused, unfused, oracle):
            if n <= 2 and not torch.equal(f, u):
                bad.append(f"rank {r}: fused != unfused bitwise at n={n}")
            if not torch.allclose(f.double(), o, rtol=1e-5, atol=1e-5):
                bad.append(f"rank {r}: fused differs from the float64 oracle")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad)


def test_grouped_allreduce_uses_few_ops() -> None:
    """With fusion, 100 small tensors travel in one collective (counted by the tracer)."""

    def rank_fn() -> tuple[int, int]:
        ts = [torch.ones(16) for _ in range(100)]
        lowband.reset_trace()
        works_fused = lowband.igrouped_allreduce(ts, op="sum")
        nf = len(works_fused._works)
        works_unfused = lowband.igrouped_allreduce(ts, op="sum", fusion_threshold=0)
        nu = len(works_unfused._works)
        works_fused.wait()
        works_unfused.wait()
        return nf, nu

    for nf, nu in run_threads(rank_fn, 2):
        assert (nf, nu) == (1, 100)
