"""SlimGC's default quantizer trains on PyTorch's mean-reduced gradients: a least-squares model on 2 and
3 thread ranks, every tensor compressed (``comm_threshold=0``), reaches the loss of synchronous SGD on
the same data (the single-process oracle on the ranks' averaged gradient), where MXNet's absolute
threshold in Gluon's batch-summed units (``threshold_mode=absolute``, the default before) does not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.strategies import make_strategy
from lowband.testing import run_threads

STEPS, BATCH, DIM, LR = 60, 16, 24, 0.1


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Linear(DIM, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    return m


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, DIM, generator=g)
    # the target map, the same on every rank; small, so gradients are of a network's averaged scale
    w = torch.linspace(-0.01, 0.01, DIM * 4).view(4, DIM)
    return x, x @ w.T + 1e-4 * torch.randn(BATCH, 4, generator=g)


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]), b[1])  # mean-reduced, as PyTorch's losses are


def _final_loss(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


def _train(options: dict[str, Any]) -> float:
    r = lowband.rank()
    s = make_strategy("slimgc", _model(), lambda ps: torch.optim.SGD(ps, lr=LR), comm_threshold=0, **options)
    losses = []
    for k in range(STEPS):
        b = _batch(r, k)
        losses.append(s.train_step(lambda m, b=b: _loss(m, b)))
    s.close()
    return _final_loss(losses)


def _oracle(n: int) -> float:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        per_rank = [_loss(m, _batch(r, k)) for r in range(n)]
        (sum(per_rank) / n).backward()  # type: ignore[union-attr]
        opt.step()
        losses.append(float(per_rank[0].detach()))
    return _final_loss(losses)


@pytest.mark.parametrize("n", [2, 3])
def test_the_default_threshold_trains_like_synchronous_sgd(n: int) -> None:
    want = _oracle(n)
    start = float(_loss(_model(), _batch(0, 0)).detach())
    default = run_threads(_train, n, {}, timeout=120)
    mxnet = run_threads(_train, n, {"compressor": "onebit:threshold_mode=absolute"}, timeout=120)
    assert want < 0.05 * start  # the problem trains
    for got in default:
        assert got < 2 * want + 0.01 * start, (got, want, start)
    for got in mxnet:
        assert got > 10 * want, (got, want, start)
