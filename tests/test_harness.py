"""The harness leaves nothing behind: no child processes after a hang, no leaked sockets or threads."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

import lowband
from lowband.testing import RankFailures, run_processes, run_threads


def _hang_on_rank(r: int) -> int:
    if lowband.rank() == r:
        time.sleep(600)
    return lowband.rank()


def test_run_processes_hard_timeout_kills_children() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailures, match=r"rank 1 ---\nno result within the hard timeout of 8 s"):
        run_processes(_hang_on_rank, 2, 1, timeout=8)
    assert time.monotonic() - t0 < 30
    assert multiprocessing.active_children() == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_run_threads_releases_sockets_and_threads() -> None:
    def rank_fn() -> None:
        lowband.allreduce(torch.ones(100))
        lowband.barrier()

    run_threads(rank_fn, 4)  # warm up whatever torch caches once
    fds, threads = _open_fds(), threading.active_count()
    for _ in range(10):
        run_threads(rank_fn, 4)
    time.sleep(0.2)
    assert _open_fds() <= fds + 4, f"file descriptors grew from {fds} to {_open_fds()}"
    assert threading.active_count() <= threads
