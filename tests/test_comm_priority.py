"""comm_priority: gloo's threads under SCHED_FIFO (root only; elsewhere refused and reported)."""

from __future__ import annotations

import os

import pytest

import lowband
from lowband.comm.priority import comm_threads, prioritize_comm_threads
from lowband.testing import run_processes

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE")


def _policies() -> dict[str, object]:
    threads = comm_threads()
    return {
        "n": len(threads),
        "fifo": all(os.sched_getscheduler(tid) == os.SCHED_FIFO for tid, _ in threads),
        "main_normal": os.sched_getscheduler(0) == os.SCHED_OTHER,
    }


def _raised_by_init() -> dict[str, object]:
    g = lowband.new_group([0, 1])  # a group made after init gets raised too
    assert g is not None
    return _policies()


def _raised_by_call() -> dict[str, object]:
    before = all(os.sched_getscheduler(tid) != os.SCHED_FIFO for tid, _ in comm_threads())
    raised, refused = prioritize_comm_threads()
    lowband.barrier()
    prioritize_comm_threads()  # threads gloo started since
    again = prioritize_comm_threads()  # idempotent
    return {**_policies(), "before": before, "raised": raised, "refused": refused, "again": again}


@needs_root
def test_init_with_comm_priority_raises_every_gloo_thread() -> None:
    for out in run_processes(_raised_by_init, 2, comm_priority=True):
        assert out["n"] >= 2 and out["fifo"] and out["main_normal"]


@needs_root
def test_explicit_call_is_idempotent() -> None:
    for out in run_processes(_raised_by_call, 2):
        assert out["before"] and out["fifo"] and out["main_normal"]
        assert out["raised"] >= 2 and out["refused"] == 0 and out["again"] == (out["n"], 0)


def test_no_threads_no_error() -> None:
    assert prioritize_comm_threads()[1] >= 0  # in the test process: no gloo threads need exist
