"""SlimGC's model backup (Eq. 8) against single-process oracles:

- one rank, a lossy compressor with error feedback and a separate local learning rate: the Eq. 8 and
  Eq. 1 recurrences written out by hand (w_loc(i+1) = w(i) - lr_loc*g(i); w(i+1) = w(i) - lr*Q(g(i)+e));
- 1-4 ranks, the identity compressor: delayed gradient averaging with delay 1,
  x(t+1) = x(t) - lr*g(t) - lr*(mean g(t-1) - g(t-1)), for every rank's weights, to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowband
from lowband.strategies import make_strategy
from lowband.strategies.slimgc import SlimGCStrategy
from lowband.testing import run_threads

STEPS = 6
LR, LOCAL_LR = 0.1, 0.05


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(11)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, generator=g, dtype=torch.float64)
    return ((m(x) - y) ** 2).mean()


def _grads(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    """The gradient of rank ``rank``'s loss at ``step`` at the weights ``params``."""
    m = _model()
    with torch.no_grad():
        for p, v in zip(m.parameters(), params):
            p.copy_(v)
    _loss(m, rank, step).backward()  # type: ignore[no-untyped-call]
    return [p.grad.detach().clone() for p in m.parameters()]  # type: ignore[union-attr]


def _train(opts: dict[str, object]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("slimgc", m, lambda ps: torch.optim.SGD(ps, lr=LR), **opts)
    assert isinstance(s, SlimGCStrategy) and s.backup is not None
    for k in range(STEPS):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    local = [p.detach().clone() for p in m.parameters()]
    glob = [w.detach().clone() for w in s.backup.weights]
    s.close()
    return local, glob


@pytest.mark.parametrize("offload", [False, True])
def test_backup_one_rank_is_eq8_with_error_feedback(offload: bool) -> None:
    opts = {
        "compressor": "fp16",
        "reducer": "allreduce",
        "comm_threshold": 0,
        "offload": offload,
        "local_lr": LOCAL_LR,
    }
    [(local, glob)] = run_threads(_train, 1, opts, timeout=60)
    w = [p.detach().clone() for p in _model().parameters()]
    x = [t.clone() for t in w]
    e = [torch.zeros_like(t) for t in w]
    for i in range(STEPS):
        g = _grads(x, 0, i)
        x = [wi - LOCAL_LR * gi for wi, gi in zip(w, g)]  # Eq. 8, from w(i)
        p = [gi + ei for gi, ei in zip(g, e)]  # error feedback, then the fp16 wire
        q = [pi.to(torch.float16).to(torch.float64) for pi in p]
        e = [pi - qi for pi, qi in zip(p, q)]
        w = [wi - LR * qi for wi, qi in zip(w, q)]  # Eq. 1 at N = 1
    for got, want in zip(local, x):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for got, want in zip(glob, w):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # the backup is not the plain update: the run differs from S-SGD on the same data
    assert any(not torch.allclose(a, b) for a, b in zip(local, glob))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("threshold", [0, "inf"])
def test_backup_is_delayed_gradient_averaging(n: int, threshold: object) -> None:
    opts = {"compressor": "identity", "reducer": "allreduce", "comm_threshold": threshold, "offload": True}
    res = run_threads(_train, n, opts, timeout=90)
    w0 = [p.detach().clone() for p in _model().parameters()]
    xs = [[t.clone() for t in w0] for _ in range(n)]
    prev_g: list[list[torch.Tensor]] | None = None
    prev_mean: list[torch.Tensor] | None = None
    total = [torch.zeros_like(t) for t in w0]
    for t in range(STEPS):
        gs = [_grads(xs[r], r, t) for r in range(n)]
        mean = [sum(g[k] for g in gs) / n for k in range(len(w0))]
        for r in range(n):
            corr = (
                [torch.zeros_like(a) for a in w0]
                if prev_g is None or prev_mean is None
                else [pm - pg for pm, pg in zip(prev_mean, prev_g[r])]
            )
            xs[r] = [x - LR * g - LR * c for x, g, c in zip(xs[r], gs[r], corr)]
        prev_g, prev_mean = gs, mean
        total = [a + m for a, m in zip(total, mean)]
    w = [a - LR * s for a, s in zip(w0, total)]
    for r, (local, glob) in enumerate(res):
        for got, want in zip(local, xs[r]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for got, want in zip(glob, w):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # every rank holds the same global weights
        for a, b in zip(glob, res[0][1]):
            assert torch.equal(a, b)


def test_local_step_follows_the_global_learning_rate_unless_fixed() -> None:
    from lowband.compress.slimgc import ModelBackup

    for local_lr in (None, 0.5):
        p = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
        b = ModelBackup([p], lambda ps: torch.optim.SGD(ps, lr=0.1), local_lr=local_lr)
        b.global_step([torch.tensor([1.0, 1.0], dtype=torch.float64)])  # w = [0.9, 1.9]
        b.global_optimizer.param_groups[0]["lr"] = 0.2  # a schedule's change
        p.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
        b.local_step()  # p = w - lr_loc * g
        lr = 0.2 if local_lr is None else local_lr
        torch.testing.assert_close(p.detach(), torch.tensor([0.9 - lr, 1.9 + lr], dtype=torch.float64))
        torch.testing.assert_close(b.weights[0].detach(), torch.tensor([0.9, 1.9], dtype=torch.float64))
