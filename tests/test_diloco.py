"""DiLoCo against single-process oracles that rebuild every rank's seeded inputs (float64, 1-4 ranks):
H = 1 with outer SGD lr 1 and no momentum is synchronous data-parallel SGD; H = 3 with the paper's
Nesterov outer step is Algorithm 1 simulated rank by rank; bad outer specs are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from test_loop_api import _flat, _loss, _model

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_threads

STEPS = 7


def _train(inner_steps: int, outer: str, momentum: float) -> list[float]:
    r = lowband.rank()
    m = _model()
    s = make_strategy(
        "diloco",
        m,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=momentum),
        inner_steps=inner_steps,
        outer=outer,
    )
    for k in range(STEPS):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return _flat(m)


def _sync_sgd(n: int) -> list[float]:
    """Synchronous data-parallel SGD: every step, the mean over ranks of their gradients."""
    m = _model()
    for k in range(STEPS):
        grads = []
        for r in range(n):
            m.zero_grad()
            _loss(m, r, k).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p -= 0.05 * sum(g[i] for g in grads) / n
    return _flat(m)


def _algorithm1(n: int, inner_steps: int) -> list[float]:
    """DiLoCo's Algorithm 1: replicas train H steps from θ, θ steps on the mean of θ - θ_r (Nesterov)."""
    glob = _model()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    reps = [copy.deepcopy(glob) for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in reps]
    for k in range(STEPS):
        for r in range(n):
            inner[r].zero_grad()
            _loss(reps[r], r, k).backward()
            inner[r].step()
        if (k + 1) % inner_steps == 0:
            with torch.no_grad():
                for i, g in enumerate(glob.parameters()):
                    g.grad = sum(g.detach() - list(m.parameters())[i].detach() for m in reps) / n
            outer.step()
            with torch.no_grad():
                for m in reps:
                    for p, g in zip(m.parameters(), glob.parameters(), strict=True):
                        p.copy_(g)
    # every replica's parameters (mid-period after step 7 with H = 3: rank 0's)
    return _flat(reps[0])


def _close(a: list[float], b: list[float], tol: float) -> None:
    assert len(a) == len(b)
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b, strict=True))
    assert worst < tol, worst


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_one_inner_step_and_plain_outer_sgd_is_synchronous_sgd(n: int) -> None:
    got = run_threads(_train, n, 1, "sgd:lr=1.0;momentum=0", 0.0, timeout=120)
    want = _sync_sgd(n)
    for r in range(n):
        _close(got[r], want, 1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_algorithm_1(n: int) -> None:
    got = run_threads(_train, n, 3, "sgd:lr=0.7;momentum=0.9;nesterov=true", 0.9, timeout=120)
    want = _algorithm1(n, 3)
    _close(got[0], want, 1e-10)
    if n > 1:  # mid-period the replicas differ (each trained on its own data since the outer step)
        assert got[0] != got[1]


@pytest.mark.parametrize(
    ("outer", "message"),
    [
        ("rmsprop:lr=1", "outer optimizer 'rmsprop' is not one of"),
        ("sgd:lr=-1", "Invalid learning rate"),
        ("sgd:lr=0.7;nesterov=true", "Nesterov momentum requires a momentum"),
    ],
)
def test_bad_outer_specs_are_refused(outer: str, message: str) -> None:
    def fn() -> None:
        make_strategy("diloco", _model(), lambda p: torch.optim.SGD(p, lr=0.1), outer=outer)

    with pytest.raises(RankFailures, match=message):
        run_threads(fn, 1, timeout=60)
    with pytest.raises(InvalidArgumentError):
        from lowband.strategies.diloco import parse_outer

        parse_outer(outer)
