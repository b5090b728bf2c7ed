"""Column-partitioned tables: the partition maths (properties), the forward bitwise equal to
``nn.Embedding`` on the full table, each shard's gradient against the column slice of the
single-process gradient, per-rank memory, and the lazy-Adam step fix."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.sparse import PartitionedEmbedding, column_partition, split_rows, unique_rows
from lowband.sparse.lazy import lazy_step, sparse_rows
from lowband.testing import RankFailures, run_threads

V = 11


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8))
def test_column_partition_tiles_the_columns(dim: int, world: int) -> None:
    if dim < world:
        with pytest.raises(InvalidArgumentError, match=r"table 't'.*dimension"):
            column_partition(dim, world, table="t")
        return
    parts = column_partition(dim, world, table="t")
    assert [s for s, _ in parts] == [sum(w for _, w in parts[:r]) for r in range(world)]
    assert sum(w for _, w in parts) == dim
    assert max(w for _, w in parts) == math.ceil(dim / world)
    assert min(w for _, w in parts) == dim // world


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=30), st.lists(st.integers(0, 9), max_size=30))
def test_unique_rows_and_split(ids: list[int], nxt: list[int]) -> None:
    t = torch.tensor(ids, dtype=torch.int64)
    rows, inv = unique_rows(t)
    assert torch.equal(rows[inv], t) and rows.tolist() == sorted(set(ids))
    mask = split_rows(rows, torch.tensor(nxt, dtype=torch.int64))
    assert [bool(b) for b in mask] == [r in set(nxt) for r in rows.tolist()]


def _ids(rank: int, n: int) -> torch.Tensor:
    """Uneven per-rank batches with duplicates; rank 1 of a group of 2 or more is empty."""
    g = torch.Generator().manual_seed(31 * rank + n)
    rows = 0 if rank == 1 else rank + 2
    return torch.randint(0, V, (rows, 3), generator=g)


def _table(dim: int) -> nn.Embedding:
    g = torch.Generator().manual_seed(dim)
    e = nn.Embedding(V, dim, padding_idx=2, dtype=torch.float64)
    with torch.no_grad():
        e.weight.copy_(torch.randn(V, dim, generator=g, dtype=torch.float64))
    return e


def _forward_backward(n: int, dim: int) -> tuple[object, torch.Tensor, torch.Tensor, int]:
    pe = PartitionedEmbedding.from_embedding(_table(dim), name="words")
    r = lowband.rank()
    out = pe(_ids(r, n))
    w = torch.arange(out.numel(), dtype=torch.float64).view_as(out) / 7
    (out * w).sum().backward()
    assert pe.weight.grad is not None
    return pe.spec, out.detach(), pe.weight.grad, pe.weight.numel()


@pytest.mark.parametrize("dim", (5, 8))
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_forward_bitwise_and_shard_gradients(n: int, dim: int) -> None:
    res = run_threads(_forward_backward, n, n, dim, timeout=60)
    full = _table(dim)
    loss = torch.zeros((), dtype=torch.float64)
    for r, (_spec, out, _g, _m) in enumerate(res):
        ref = full(_ids(r, n))
        assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref)
        w = torch.arange(ref.numel(), dtype=torch.float64).view_as(ref) / 7
        loss = loss + (ref * w).sum()
    loss.backward()
    assert full.weight.grad is not None and not full.weight.grad[2].any()
    for spec, _out, grad, numel in res:
        torch.testing.assert_close(grad, spec.slice(full.weight.grad), rtol=0, atol=1e-12)  # type: ignore[attr-defined]
        assert numel == V * spec.length <= V * math.ceil(dim / n)  # type: ignore[attr-defined]
    assert max(m for *_, m in res) * dim == V * math.ceil(dim / n) * dim  # ceil(D/N)/D of the table


def test_dimension_below_world_size_is_rejected() -> None:
    def fn() -> None:
        PartitionedEmbedding(V, 2, name="tiny")

    with pytest.raises(RankFailures) as ei:
        run_threads(fn, 3, timeout=30)
    assert all("'tiny' has dimension 2 < 3 ranks" in tb for tb in ei.value.errors.values()), ei.value


def test_split_adam_updates_equal_one_update_only_with_the_step_fix() -> None:
    """Rows of one iteration applied in two SparseAdam calls: torch's counter advances twice and the
    result differs from one call; lazy_step pins the counter and matches exactly."""
    g = torch.Generator().manual_seed(3)
    start = torch.randn(6, 4, generator=g, dtype=torch.float64)
    grads = [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    first, second = torch.tensor([0, 2, 5]), torch.tensor([1, 3])

    def run(mode: str) -> torch.Tensor:
        p = nn.Parameter(start.clone())
        opt = torch.optim.SparseAdam([p], lr=0.1)
        for it, gr in enumerate(grads, start=1):
            parts = [torch.cat([first, second])] if mode == "one" else [first, second]
            for rows in parts:
                sg = sparse_rows(rows, gr[rows], p.shape)
                if mode == "fixed":
                    lazy_step(opt, {p: sg}, it)
                else:
                    p.grad = sg
                    opt.step()
        return p.detach()

    one = run("one")
    assert torch.equal(run("fixed"), one)
    assert not torch.allclose(run("unfixed"), one, rtol=0, atol=1e-6)
