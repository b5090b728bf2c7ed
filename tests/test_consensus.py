"""Consensus for evaluation and export: ``Strategy.average_state_dict`` / ``average_model`` of
strategies whose replicas differ by design equal the mean of every rank's parameters (the oracle:
each rank's parameters, gathered here), and leave training untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.localsgd import Schedule
from lowband.strategies import make_strategy
from lowband.testing import run_processes, run_threads

STEPS = 3


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(31)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Linear(3, 2)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def _opt(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)  # type: ignore[arg-type]


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 * rank + step)
    return torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(
        4, 2, generator=g, dtype=torch.float64
    )


def _flat(sd: dict[str, torch.Tensor]) -> list[float]:
    return torch.cat([v.reshape(-1) for v in sd.values()]).tolist()  # type: ignore[no-any-return]


SPECS: dict[str, dict[str, Any]] = {
    "atc": {"topology": "ring"},
    "awc": {"topology": "ring"},
    # every step an allreduce of the parameters, then the local gradient applied: replicas still differ
    "awc-allreduce": {"topology": "ring", "allreduce_every": 1},
    "winput": {"topology": "ring"},
    # layer 0 averaged in even iterations, layers 1 and 2 in odd ones: after 3 steps they differ
    "dreamddp": {"schedule": Schedule(2, ((0,), (1, 2)), "hand", 0.0, (0.0, 0.0))},
    "localsgd": {"period": 3},  # averaged after steps 1, 4, ...
    "gradient-allreduce": {},
}


def _consensus(name: str) -> dict[str, Any]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("awc" if name == "awc-allreduce" else name, m, _opt, **SPECS[name])
    for k in range(STEPS):
        b = _batch(r, k)
        s.train_step(lambda mod, b=b: ((mod(b[0]) - b[1]) ** 2).mean())
    s.synchronize()
    before = _flat(m.state_dict())
    avg = s.average_state_dict()
    into = s.average_model(_model())
    out = {
        "own": before,
        "after": _flat(m.state_dict()),
        "average": _flat(avg),
        "model": _flat(into.state_dict()),
        "in_sync": s.in_sync(),
        "spread": s.replica_spread(),
    }
    s.close()
    return out


def _check(res: list[dict[str, Any]], name: str) -> None:
    n = len(res)
    mean = torch.tensor([r["own"] for r in res], dtype=torch.float64).mean(0)
    for got in res:
        assert got["after"] == got["own"], "averaging must not touch the training replica"
        for key in ("average", "model"):
            torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64), mean, rtol=0, atol=1e-12)
    if n == 1:
        assert res[0]["spread"] == 0.0
    elif name == "gradient-allreduce":
        assert all(g["in_sync"] and g["spread"] == 0.0 for g in res)
    elif n == 4 or name in ("dreamddp", "localsgd", "awc-allreduce"):
        # replicas differ by design here (at 2 ranks a ring's neighbor average is the exact mean)
        assert all(not g["in_sync"] and g["spread"] > 1e-6 for g in res), name


@pytest.mark.parametrize("n", (1, 2, 4))
@pytest.mark.parametrize("name", ("atc", "awc", "awc-allreduce", "winput", "dreamddp", "gradient-allreduce"))
def test_average_is_the_mean_of_the_replicas(name: str, n: int) -> None:
    _check(run_threads(_consensus, n, name, timeout=90), name)


def test_localsgd_average_between_averagings() -> None:
    # torch's model averager needs a process-wide process group: ranks as processes
    _check(run_processes(_consensus, 2, "localsgd", timeout=120), "localsgd")


def _spreads(case: str) -> dict[str, Any]:
    """Every rank's parameters set to seeded rank-dependent values (``case``: all ranks the same; one
    entry different on the last rank; every entry rank-dependent; a NaN on every rank; every entry
    rank-dependent, one layer in float32)."""
    r, n = lowband.rank(), lowband.size()
    m = _model()
    if case == "mixed":  # its last layer in float32: each dtype travels as itself
        m[3].float()
    s = make_strategy("atc", m, _opt, topology="ring")
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            g = torch.Generator().manual_seed(100 * i + (r if case in ("all", "mixed") else 0))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
            if case == "one" and r == n - 1 and i == 2:
                p.view(-1)[1] += 0.25
            if case == "nan" and i == 1:
                p.view(-1)[0] = float("nan")
    out = {"own": _flat(m.state_dict()), "spread": s.replica_spread()}
    s.close()
    return out


@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("case", ("same", "one", "all", "nan", "mixed"))
def test_replica_spread_is_the_largest_difference_across_ranks(case: str, n: int) -> None:
    """The oracle: every rank's parameters gathered here, max over entries of (max - min) over ranks;
    the hash shortcut answers 0.0 only where the replicas are identical."""
    res = run_threads(_spreads, n, case, timeout=60)
    own = torch.tensor([x["own"] for x in res], dtype=torch.float64)
    want = float((own.max(0).values - own.min(0).values).abs().max())
    for x in res:
        if case == "nan":
            assert x["spread"] != x["spread"], x["spread"]  # NaN: not a silent 0.0
        else:
            assert x["spread"] == want, (x["spread"], want)
    assert (want > 0) == (case in ("one", "all", "mixed") and n > 1)
