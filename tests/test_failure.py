"""A rank that dies makes the others raise within a bounded time; launch() reports failed ranks.

These use real processes (a rank must really die), so they cost a few seconds each.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import lowband
from lowband.testing import RankFailures, run_processes

COMM_TIMEOUT = 10.0


def _die_then_allreduce(victim: int) -> tuple[str, float] | None:
    r = lowband.rank()
    lowband.allreduce(torch.ones(4))  # everybody is up and connected
    if r == victim:
        time.sleep(0.2)
        os._exit(3)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            lowband.allreduce(torch.ones(1 << 16), name="after-death")
            time.sleep(0.01)
    except (lowband.CommFailedError, lowband.CommTimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None


def _die_while_peer_receives() -> tuple[str, float] | None:
    r = lowband.rank()
    lowband.barrier()
    if r == 1:
        time.sleep(0.5)
        os._exit(3)
    t0 = time.monotonic()
    try:
        lowband.recv(torch.empty(10), 1)
    except (lowband.CommFailedError, lowband.CommTimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None


@pytest.mark.parametrize("n", [2, 3])
def test_dead_rank_in_collective(n: int) -> None:
    victim = n - 1
    out = run_processes(
        _die_then_allreduce, n, victim, timeout=90, allow_exit=(victim,), comm_timeout=COMM_TIMEOUT
    )
    for r in range(n):
        if r == victim:
            continue
        res = out[r]
        assert res is not None, f"rank {r} never noticed the dead rank"
        msg, waited = res
        assert f"on rank {r}" in msg and "lowband.allreduce" in msg, msg
        assert waited < COMM_TIMEOUT + 5, f"rank {r} took {waited:.1f} s to notice"


def test_dead_rank_in_recv() -> None:
    out = run_processes(_die_while_peer_receives, 2, timeout=90, allow_exit=(1,), comm_timeout=COMM_TIMEOUT)
    assert out[0] is not None
    msg, waited = out[0]
    assert "lowband.recv on rank 0" in msg, msg
    assert waited < COMM_TIMEOUT + 5


def _fail_on_rank(bad: int) -> int:
    if lowband.rank() == bad:
        raise ValueError(f"rank {bad} was told to fail")
    return lowband.rank()


def _exit_on_rank(bad: int) -> int:
    lowband.barrier()
    if lowband.rank() == bad:
        os._exit(7)
    lowband.allreduce(torch.ones(3))
    return lowband.rank()


def test_run_processes_surfaces_exceptions() -> None:
    with pytest.raises(RankFailures) as ei:
        run_processes(_fail_on_rank, 2, 1, timeout=60)
    assert set(ei.value.errors) == {1}
    assert "ValueError: rank 1 was told to fail" in ei.value.errors[1]


def test_launch_reports_failed_rank() -> None:
    with pytest.raises(lowband.LowbandError, match=r"rank 1 .*ValueError.*rank 1 was told to fail"):
        lowband.launch(_fail_on_rank, 2, (1,), init_kwargs={"timeout": COMM_TIMEOUT})


def test_launch_dead_rank_bounded() -> None:
    t0 = time.monotonic()
    with pytest.raises(lowband.LowbandError, match=r"lowband\.launch: rank"):
        lowband.launch(_exit_on_rank, 3, (2,), init_kwargs={"timeout": COMM_TIMEOUT})
    assert time.monotonic() - t0 < 60
