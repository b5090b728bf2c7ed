"""Differentiable collectives: forward values against a single-process reference and
``torch.autograd.gradcheck`` (float64) of the collective as a whole, at world sizes 1-4.

gradcheck runs on every thread-rank. To make it collective-safe and to check the Jacobian of the whole
distributed function (every rank's outputs with respect to every rank's inputs), each rank is given
the same inputs: all ranks' tensors ``X = (x_0, ..., x_{n-1})``, identical everywhere. Rank ``r`` feeds
``x_r`` to the op (:class:`_Mine`, whose backward allgathers every rank's input gradient) and the
ranks' outputs are collected into one replicated vector (:class:`_Collect`, whose backward takes this
rank's slice). The function is then the same on every rank, gradcheck perturbs the same element on
every rank at the same time, and every rank runs the same sequence of collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lowband
from lowband.nn import functional as nnf
from lowband.testing import run_threads

WORLD_SIZES = (1, 2, 3, 4)
COLS = 2


class _Mine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, r: int, *xs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [x.shape for x in xs]
        return xs[r].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        flat = lowband.allgather(grad.contiguous().reshape(-1))
        parts = flat.split([s.numel() for s in ctx.shapes])
        return (None, *[p.view(s) for p, s in zip(parts, ctx.shapes, strict=True)])


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        sizes = [int(v) for v in lowband.allgather(torch.tensor([y.numel()])).tolist()]
        ctx.shape, ctx.sizes = y.shape, sizes
        return lowband.allgather(y.detach().contiguous().reshape(-1), sizes=sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        r = lowband.rank()
        start = sum(ctx.sizes[:r])
        return grad[start : start + ctx.sizes[r]].reshape(ctx.shape).clone()


def _inputs(rows: list[int], salt: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + salt)
    return [torch.randn(k, COLS, generator=g, dtype=torch.float64, requires_grad=True) for k in rows]


def _check(op: Callable[[torch.Tensor], torch.Tensor], xs: list[torch.Tensor], want: torch.Tensor) -> None:
    r = lowband.rank()

    def f(*inputs: torch.Tensor) -> torch.Tensor:
        return _Collect.apply(op(_Mine.apply(r, *inputs)))

    got = f(*xs)
    # exact for data movement; a sum's order of additions may differ from the reference's
    torch.testing.assert_close(got, want.reshape(-1), rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(f, tuple(xs), eps=1e-6, atol=1e-7, rtol=1e-5)


def _allgather_rows(n: int) -> list[int]:
    return [(2 * q + 1) % 3 for q in range(n)]  # includes an empty rank from n = 2


def _a2a_splits(n: int) -> list[list[int]]:
    return [[(q + 2 * j) % 3 for j in range(n)] for q in range(n)]  # S[q][j]: rows q sends to j


def _rs_sizes(n: int) -> list[int]:
    return [(j + 1) % 3 for j in range(n)]


def _allgather_case(pass_sizes: bool) -> None:
    n = lowband.size()
    rows = _allgather_rows(n)
    xs = _inputs(rows, salt=1)
    want = torch.cat([x.detach() for x in xs])
    sizes = rows if pass_sizes else None
    _check(lambda x: nnf.allgather(x, sizes=sizes), xs, torch.cat([want] * n))


def _alltoall_case(pass_recv: bool, nonblocking: bool) -> None:
    n, r = lowband.size(), lowband.rank()
    s = _a2a_splits(n)
    xs = _inputs([sum(row) for row in s], salt=2)
    recv = [s[q][r] for q in range(n)]
    blocks = [list(x.detach().split(row)) for x, row in zip(xs, s, strict=True)]
    want = torch.cat([torch.cat([blocks[q][j] for q in range(n)]) for j in range(n)])

    def op(x: torch.Tensor) -> torch.Tensor:
        rs = recv if pass_recv else None
        if nonblocking:
            return nnf.ialltoall(x, s[r], recv_splits=rs).wait()
        return nnf.alltoall(x, s[r], recv_splits=rs)

    _check(op, xs, want)


def _reduce_scatter_case(op_name: str, even: bool) -> None:
    n = lowband.size()
    sizes = [1] * n if even else _rs_sizes(n)
    xs = _inputs([sum(sizes)] * n, salt=3)
    total = torch.stack([x.detach() for x in xs]).sum(0)
    if op_name == "average":
        total = total / n
    want = total  # every rank's block, concatenated in rank order = the whole reduction

    def op(x: torch.Tensor) -> torch.Tensor:
        return nnf.ireduce_scatter(x, op_name, sizes=None if even else sizes).wait()

    _check(op, xs, want)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_allgather_gradcheck(n: int) -> None:
    run_threads(lambda: [_allgather_case(True), _allgather_case(False)], n)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_alltoall_gradcheck(n: int) -> None:
    run_threads(lambda: [_alltoall_case(True, False), _alltoall_case(False, True)], n)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter_gradcheck(n: int) -> None:
    run_threads(lambda: [_reduce_scatter_case("sum", False), _reduce_scatter_case("average", True)], n)


def _issue_counts(n: int) -> dict[str, int]:
    """Ops issued by each form, with the argument check off: one when the sizes are passed."""
    r = lowband.rank()
    x = torch.ones(r + 1, COLS, requires_grad=True)
    rows = [q + 1 for q in range(n)]
    to_0 = [r + 1] + [0] * (n - 1)  # every rank sends all its rows to rank 0
    from_all = rows if r == 0 else [0] * n
    counts = {}
    for key, fn in (
        ("allgather+sizes", lambda: nnf.iallgather(x, sizes=rows).wait()),
        ("allgather", lambda: nnf.iallgather(x).wait()),
        ("alltoall+recv", lambda: nnf.ialltoall(x, to_0, recv_splits=from_all).wait()),
        ("alltoall", lambda: nnf.ialltoall(x, to_0).wait()),
    ):
        lowband.reset_trace()
        fn()
        counts[key] = sum(c["calls"] for c in lowband.counters().values())
    return counts


@pytest.mark.parametrize("n", (2, 3))
def test_sizes_passed_means_no_exchange(n: int) -> None:
    for got in run_threads(_issue_counts, n, n, check=False, trace=True, timeout=30):
        assert got == {"allgather+sizes": 1, "allgather": 2, "alltoall+recv": 1, "alltoall": 2}


def _issue_before_peer(ready: threading.Event) -> list[float]:
    """Rank 0 issues its alltoall before rank 1 has called anything: issuing must not wait for peers."""
    r = lowband.rank()
    x = torch.full((2, 1), float(r + 1), requires_grad=True)
    if r == 1 and not ready.wait(30):
        raise AssertionError("rank 0 blocked while issuing an alltoall whose splits it was given")
    h = nnf.ialltoall(x, [1, 1], recv_splits=[1, 1])
    if r == 0:
        ready.set()
    y = h.wait()
    (y * torch.tensor([[1.0], [10.0]])).sum().backward()
    assert x.grad is not None
    return [*y.detach().reshape(-1).tolist(), *x.grad.reshape(-1).tolist()]


def test_nonblocking_issue_does_not_wait_for_peers() -> None:
    got = run_threads(_issue_before_peer, 2, threading.Event(), check=False, timeout=40)
    # rank r receives row r of each rank; the gradient of row j sent to rank j is rank j's weight of
    # the source rank's position (1 for rank 0's row, 10 for rank 1's)
    assert got[0] == [1.0, 2.0, 1.0, 1.0]
    assert got[1] == [1.0, 2.0, 10.0, 10.0]


def test_argument_errors() -> None:
    def body() -> None:
        x = torch.zeros(3, 2)
        with pytest.raises(lowband.InvalidArgumentError, match="sizes"):
            nnf.allgather(x, sizes=[3])
        with pytest.raises(lowband.InvalidArgumentError, match="splits"):
            nnf.alltoall(x, [1, 1])
        with pytest.raises(lowband.InvalidArgumentError, match="'sum' or 'average'"):
            nnf.reduce_scatter(torch.zeros(2, 2), "max")
        with pytest.raises(lowband.InvalidArgumentError, match="at least one dimension"):
            nnf.allgather(torch.tensor(1.0))

    run_threads(body, 2, timeout=20)
