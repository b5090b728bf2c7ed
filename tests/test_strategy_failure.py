"""A rank that dies under the strategies that communicate through torch's own machinery (DDP's reducer,
torch's model averager) makes the others raise lowband's errors, naming the strategy and the rank,
within a bounded time, instead of torch's raw gloo errors.

Real processes (a rank must really die), one launch per strategy.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import lowband
from lowband.strategies import make_strategy, parse_strategy_spec
from lowband.testing import run_processes

COMM_TIMEOUT = 10.0


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(5)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _train_until_peer_dies(spec: str, victim: int) -> tuple[str, str, float] | None:
    r = lowband.rank()
    name, opts = parse_strategy_spec(spec)
    s = make_strategy(name, _model(), lambda ps: torch.optim.SGD(ps, lr=0.01), **opts)
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    for _ in range(3):  # every rank is up and has communicated
        s.train_step(lambda m: ((m(x) - y) ** 2).mean())
    lowband.barrier()
    if r == victim:
        time.sleep(0.3)
        os._exit(3)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            s.train_step(lambda m: ((m(x) - y) ** 2).mean())
            time.sleep(0.01)
    except (lowband.CommFailedError, lowband.CommTimeoutError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


@pytest.mark.parametrize("spec", ["ddp", "powersgd:start_iter=2,rank=1", "localsgd:period=2"])
def test_dead_rank_under_torch_strategies(spec: str) -> None:
    n, victim = 2, 1
    out = run_processes(
        _train_until_peer_dies, n, spec, victim, timeout=120, allow_exit=(victim,), comm_timeout=COMM_TIMEOUT
    )
    name = spec.partition(":")[0]
    for r in range(n):
        if r == victim:
            continue
        assert out[r] is not None, f"rank {r} trained on with a dead peer"
        kind, msg, waited = out[r]
        assert f"strategy {name!r}" in msg and f"on rank {r}" in msg, msg
        assert waited < COMM_TIMEOUT + 10, f"rank {r} took {waited:.1f} s to notice ({kind}: {msg})"
