"""Real processes: the sketch tables agree across processes (the same seed, no communication), and a
rank that dies makes every other rank of a gs-sgd step raise within the timeout (the tree executor, which
every sparse scheme uses)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import lowband
from lowband.compress.sketch import CountSketch
from lowband.strategies import make_strategy
from lowband.testing import run_processes

COMM_TIMEOUT = 10.0


def _opt(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def _die_in_a_step(name: str, victim: int) -> tuple[int, str, float] | None:
    r = lowband.rank()
    torch.set_num_threads(1)
    checksum = CountSketch(300_001, 5, 1000, seed=12345).checksum()
    g = torch.Generator().manual_seed(r)
    s = make_strategy(name, nn.Linear(40, 30), _opt, density=0.1)
    x = torch.randn(4, 40, generator=g)
    s.train_step(lambda m: m(x).square().sum())  # everybody is up and connected
    if r == victim:
        time.sleep(0.3)
        os._exit(3)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            s.train_step(lambda m: m(x).square().sum())
    except (lowband.CommFailedError, lowband.CommTimeoutError) as exc:
        return checksum, f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None


@pytest.mark.parametrize(("name", "victim"), [("gs-sgd", 2)])
def test_dead_rank_raises_on_the_others(name: str, victim: int) -> None:
    n = 3
    out = run_processes(
        _die_in_a_step, n, name, victim, timeout=120, allow_exit=(victim,), comm_timeout=COMM_TIMEOUT
    )
    here = CountSketch(300_001, 5, 1000, seed=12345).checksum()
    for r in range(n):
        if r == victim:
            continue
        res = out[r]
        assert res is not None, f"rank {r} never noticed the dead rank"
        checksum, msg, waited = res
        assert checksum == here, "another process drew other hash tables from the same seed"
        assert f"on rank {r}" in msg, msg
        assert waited < COMM_TIMEOUT + 5, f"rank {r} took {waited:.1f} s to notice"
