"""The right rank is blamed, and survivors get out fast.

A rank killed by a signal, or one that stopped answering (SIGSTOP: alive, in state T, silent), is the
cause of the others' follow-on communication errors: the launcher (:func:`lowband.launch`) and
``lowband run`` name it first. A survivor that raised exits within a second (no helper thread waited on
for seconds at shutdown). Real processes: each launch costs a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lowband
from lowband.blame import failure_report
from lowband.strategies import make_strategy
from lowband.testbed.procs import wait_procs
from lowband.testing import run_processes

COMM_TIMEOUT = 3.0
TESTS = Path(__file__).parent


def _train_then_signal(spec: str, victim: int, sig: int) -> int:
    r = lowband.rank()
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    s = make_strategy(spec, m, lambda ps: torch.optim.SGD(ps, lr=0.01))
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    for _ in range(3):
        s.train_step(lambda m: ((m(x) - y) ** 2).mean())
    if r == victim:
        time.sleep(0.2)
        os.kill(os.getpid(), sig)
    for _ in range(100_000):
        s.train_step(lambda m: ((m(x) - y) ** 2).mean())
        time.sleep(0.005)
    return r


@pytest.mark.parametrize(("spec", "sig"), [("ddp", signal.SIGKILL), ("compressed", signal.SIGSTOP)])
def test_launch_names_the_signalled_or_stopped_rank_first(spec: str, sig: int) -> None:
    n, victim = 3, 1
    t0 = time.monotonic()
    with pytest.raises(lowband.LowbandError) as ei:
        lowband.launch(_train_then_signal, n, (spec, victim, sig), init_kwargs={"timeout": COMM_TIMEOUT})
    took = time.monotonic() - t0
    first = str(ei.value).splitlines()[0]
    assert first.startswith(f"lowband.launch: rank {victim} "), str(ei.value)[-3000:]
    said = "signal SIGKILL" if sig == signal.SIGKILL else "stopped answering"
    assert said in first, first
    assert took < 30, f"the launch took {took:.1f} s"  # not torch's 30 s SIGTERM wait on a stopped rank


def _shutdown_after_peer_death(victim: int) -> float | None:
    r = lowband.rank()
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    s = make_strategy("slimgc", m, lambda ps: torch.optim.SGD(ps, lr=0.01))  # offloads to a helper thread
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(r))
    for _ in range(2):
        s.train_step(lambda m: m(x).square().mean())
    if r == victim:
        time.sleep(0.2)
        os._exit(3)
    try:
        for _ in range(100_000):
            s.train_step(lambda m: m(x).square().mean())
    except lowband.LowbandError:
        t0 = time.monotonic()
        lowband.shutdown()  # the strategy was never closed: its helper thread waits for work
        return time.monotonic() - t0
    return None


def test_shutdown_after_an_error_does_not_wait_for_idle_helper_threads() -> None:
    out = run_processes(_shutdown_after_peer_death, 2, 1, timeout=90, allow_exit=(1,), comm_timeout=10.0)
    assert out[0] is not None, "rank 0 trained on with a dead peer"
    assert out[0] < 1.0, f"shutdown took {out[0]:.2f} s"


def _failure(tmp_path: Path, rank: int, exitcode: int) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(rank, 1000 + rank, exitcode, str(tmp_path / f"none{rank}.json"))


def _report(
    error: str, when: float, follow_on: bool = False, stopped: list[int] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"error": error, "traceback": f"Traceback: {error}", "time": when}
    out["follow_on"] = follow_on
    if stopped is not None:
        out["stopped"] = stopped
    return out


def test_failure_report_puts_signal_deaths_and_stopped_ranks_before_follow_ons(tmp_path: Path) -> None:
    follow = _report("CommFailedError: lowband.allreduce on rank 0 failed", 1.0, follow_on=True)
    # the survivor reported before torch recorded the death (whole seconds): the death still comes first
    msg = failure_report({1: _failure(tmp_path, 1, -9)}, {0: follow})
    assert msg.startswith(
        "lowband.launch: rank 1 failed (exit code -9: signal SIGKILL): stopped by signal"
    ), msg
    assert "\nthen: rank 0 " in msg, msg
    # a stopped rank named by a survivor (seen in state T when its op timed out) is the cause
    timeout = _report("CommTimeoutError: no completion within 3 s", 5.0, follow_on=True, stopped=[2])
    msg = failure_report({0: _failure(tmp_path, 0, 1)}, {0: timeout})
    assert msg.startswith("lowband.launch: rank 2 stopped answering"), msg
    assert "rank 0" in msg.split("\n", 1)[1], msg
    # a Python error that is not a follow-on stays the cause when it came first
    msg = failure_report({2: _failure(tmp_path, 2, -9)}, {1: _report("ValueError: bad", 0.5), 0: follow})
    assert msg.startswith("lowband.launch: rank 1 failed"), msg


def test_wait_procs_sees_signal_deaths_and_stopped_processes_first() -> None:
    py = sys.executable
    procs = [
        subprocess.Popen(
            [py, "-c", "import time; time.sleep(0.3); raise SystemExit(1)"], start_new_session=True
        ),
        subprocess.Popen(
            [py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"], start_new_session=True
        ),
    ]
    order: list[int] = []
    stopped: list[int] = []
    codes = wait_procs(procs, 30, grace=0.5, exited=order, stopped=stopped)
    assert stopped == [1] and codes[0] == 1 and codes[1] == -signal.SIGKILL, (stopped, codes)
    procs = [
        subprocess.Popen([py, "-c", "raise SystemExit(1)"], start_new_session=True),
        subprocess.Popen(
            [py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], start_new_session=True
        ),
    ]
    time.sleep(1.0)  # both ended before the first poll: the signal death is seen first
    order = []
    wait_procs(procs, 30, grace=0.5, exited=order)
    assert order == [1, 0], order


@pytest.mark.parametrize(
    "testbed", [["--mode", "loopback", "--grace", "20"], []], ids=["testbed", "torchrun"]
)
def test_lowband_run_names_the_stopped_rank(testbed: list[str], tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) while rank 0 waits in a collective: rank 0 times out, and the run
    names rank 1 as the cause (not rank 0's exit), without waiting out the grace period (the testbed's)
    or torch's 30 s SIGTERM wait (torchrun's agent) on it."""
    cmd = [sys.executable, "-m", "lowband.cli", "run", "-n", "2", *testbed, "--timeout", "3"]
    t0 = time.monotonic()
    out = subprocess.run(
        [*cmd, str(TESTS / "_run_user_script.py"), "stop", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr[-3000:]
    assert "lowband run: rank 1 stopped answering first" in out.stderr, out.stderr[-3000:]
    assert took < 20, f"took {took:.1f} s: the stopped rank was left to the grace period"


def test_blame_line_of_lowband_run_and_bench() -> None:
    from lowband.testbed.run import blame_line

    assert blame_line([1, -9], [1, 0], [], 10).startswith("rank 1 was killed by SIGKILL (exit code -9) first")
    assert blame_line([1, 0], [0, 1], [], 10).startswith("rank 0 exited with code 1 first")
    assert blame_line([1, -9], [0, 1], [1], 10).startswith("rank 1 stopped answering first")
