"""Nonblocking handles: wait (bounded), done, then, wait_all; many ops in flight at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import lowband
from lowband.testing import nccl_emulated, run_threads


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_many_in_flight_then_wait(n: int) -> None:
    def rank_fn() -> list[float]:
        r = lowband.rank()
        hs = [lowband.iallreduce(torch.full((100,), float(r + i)), op="sum", name=f"t{i}") for i in range(20)]
        vals = [h.wait()[0].item() for h in reversed(hs)]  # waited out of order
        return vals[::-1]

    base = sum(range(n))
    for vals in run_threads(rank_fn, n):
        assert vals == [float(base + n * i) for i in range(20)]


def test_done_and_wait_idempotent() -> None:
    def rank_fn() -> bool:
        h = lowband.iallreduce(torch.ones(3), op="sum")
        a = h.wait()
        b = h.wait()  # a second wait returns the same result without communicating
        deadline = time.monotonic() + 5
        while not h.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        return h.done() and a is b and a.tolist() == [2.0] * 3

    assert all(run_threads(rank_fn, 2))


@pytest.mark.parametrize("kind", ["allreduce", "recv", "allgather", "completed"])
def test_then_runs_without_wait(kind: str) -> None:
    if kind == "recv" and nccl_emulated():
        pytest.skip(
            "a two-way unbatched exchange between two ranks: NCCL deadlocks on it (the emulator raises)"
        )

    def rank_fn() -> tuple[float, bool, str]:
        r = lowband.rank()
        seen = threading.Event()
        thread_name: list[str] = []

        def cb(t: torch.Tensor) -> float:
            thread_name.append(threading.current_thread().name)
            seen.set()
            return float(t.sum().item())

        if kind == "allreduce":
            h = lowband.iallreduce(torch.ones(4), op="sum").then(cb)
        elif kind == "allgather":
            h = lowband.iallgather(torch.ones(r + 1)).then(cb)
        elif kind == "completed":
            h = lowband.iallreduce(torch.ones(4), op="sum")
            h.wait()
            h = h.then(cb)  # already complete: runs at once
        else:
            s = lowband.isend(torch.full((4,), 2.0), 1 - r)
            h = lowband.irecv(torch.empty(4), 1 - r).then(cb)
            s.wait()
        fired = seen.wait(10)  # the callback ran with nobody calling wait()
        return h.wait(), fired, thread_name[0] if thread_name else ""

    res = run_threads(rank_fn, 2)
    want = {"allreduce": 8.0, "recv": 8.0, "allgather": 3.0, "completed": 8.0}[kind]
    for val, fired, _ in res:
        assert fired and val == want


def test_then_error_surfaces_in_wait() -> None:
    def rank_fn() -> str:
        h = lowband.iallreduce(torch.ones(2)).then(lambda t: 1 / 0)
        with pytest.raises(
            lowband.CommFailedError, match=r"lowband\.allreduce on rank \d failed: division by zero"
        ):
            h.wait()
        return "ok"

    assert run_threads(rank_fn, 2) == ["ok", "ok"]


def test_chained_then() -> None:
    def rank_fn() -> float:
        return (
            lowband.iallreduce(torch.ones(2), op="sum")
            .then(lambda t: t * 10)
            .then(lambda t: float(t.sum()))
            .wait()
        )

    assert run_threads(rank_fn, 3) == [60.0] * 3


def test_handle_wait_timeout() -> None:
    """wait(timeout) raises CommTimeoutError naming the op (checks off, so iallreduce returns at once)."""

    def rank_fn() -> str:
        r = lowband.rank()
        if r == 1:
            time.sleep(1.5)
        h = lowband.iallreduce(torch.ones(2), op="sum", name="late")
        if r == 0:
            with pytest.raises(
                lowband.CommTimeoutError,
                match=r"lowband\.allreduce 'late' on rank 0: no completion within 0.3 s",
            ):
                h.wait(timeout=0.3)
            return "timed out"
        return str(h.wait().tolist())

    out = run_threads(rank_fn, 2, check=False)
    assert out == ["timed out", "[2.0, 2.0]"]


def test_wait_all() -> None:
    def rank_fn() -> list[list[float]]:
        hs = [lowband.ibroadcast(torch.full((2,), float(lowband.rank())), root=q) for q in range(3)]
        return [t.tolist() for t in lowband.wait_all(hs)]

    for res in run_threads(rank_fn, 3):
        assert res == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
