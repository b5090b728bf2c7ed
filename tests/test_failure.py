"""A rank that dies makes the others raise within a bounded time; launch() reports failed ranks.

These use real processes (a rank must really die), so they cost a few seconds each.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lowband
from lowband.launcher import failure_report
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


def _fail_while_peers_wait(bad: int) -> int:
    lowband.barrier()
    if lowband.rank() == bad:
        raise ValueError(f"rank {bad} was told to fail")
    lowband.allreduce(torch.ones(3))  # fails on the others once rank `bad` is gone: a follow-on error
    return lowband.rank()


def test_launch_reports_root_cause_first(tmp_path: Path) -> None:
    """The rank that raised is named first, where in the user's code, before the others' follow-on
    errors; its traceback is in its log."""
    with pytest.raises(lowband.LowbandError) as ei:
        lowband.launch(
            _fail_while_peers_wait, 2, (1,), init_kwargs={"timeout": COMM_TIMEOUT}, log_dir=str(tmp_path)
        )
    msg = str(ei.value)
    assert re.match(
        r"lowband\.launch: rank 1 failed: ValueError: rank 1 was told to fail \(test_failure\.py, line \d+\)\n",
        msg,
    ), msg
    assert "in _fail_while_peers_wait" in (tmp_path / "rank1.log").read_text()  # the root cause's traceback
    # rank 0's follow-on error, when it got to report one before torch's agent stopped it, comes after
    assert "rank 0" not in msg.split("\n", 1)[0], msg
    if "then rank 0" in msg:
        assert "\nlowband.launch: then rank 0 failed because of it" in msg, msg


def test_launch_dead_rank_bounded() -> None:
    """A rank that exits without a Python error is the root cause, not the others' CommFailedError."""
    t0 = time.monotonic()
    with pytest.raises(
        lowband.LowbandError,
        match=r"^lowband\.launch: rank 2 exited with code 7 before reporting a Python error",
    ):
        lowband.launch(_exit_on_rank, 3, (2,), init_kwargs={"timeout": COMM_TIMEOUT})
    assert time.monotonic() - t0 < 60


def _failure(tmp_path: Path, rank: int, exitcode: int) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(rank, 1000 + rank, exitcode, str(tmp_path / f"none{rank}.json"))


def _report(error: str, when: float, follow_on: bool = False) -> dict[str, Any]:
    return {"error": error, "traceback": f"Traceback: {error}", "time": when, "follow_on": follow_on}


def test_failure_report_orders_root_causes(tmp_path: Path) -> None:
    """The errors that are not follow-ons come first, earliest first, whatever the ranks and which
    ranks torch saw fail (rank 3 was stopped before it exited: only its report knows); then the
    follow-ons; then the rank torch's agent stopped (SIGTERM) once the others had failed."""
    failures = {0: _failure(tmp_path, 0, 1), 1: _failure(tmp_path, 1, -15), 2: _failure(tmp_path, 2, 1)}
    reports = {
        0: _report("CommFailedError: lowband.allreduce on rank 0 failed", 100.0, follow_on=True),
        2: _report("KeyError: 'late'", 100.5),
        3: _report("ValueError: first", 100.2),
    }
    assert failure_report(failures, reports).splitlines() == [
        "lowband.launch: rank 3 failed: ValueError: first",
        "lowband.launch: rank 2 failed: KeyError: 'late'",
        "lowband.launch: then rank 0 failed because of them (follow-on errors; the first: CommFailedError: "
        "lowband.allreduce on rank 0 failed)",
        "lowband.launch: rank 1 stopped by the launcher once another rank had failed",
    ]
    # a rank that exited without a report (os._exit, a crash) is a root cause; follow-ons are not
    msg = failure_report(
        {0: _failure(tmp_path, 0, 7)}, {1: _report("CommTimeoutError: t", 1.0, follow_on=True)}
    )
    assert msg.startswith("lowband.launch: rank 0 exited with code 7 before reporting a Python error"), msg
