"""The communication engine: one worker per group running every lane's tasks in issue order, lanes
keeping their own errors, one ordering policy at a time per group, ``then`` of works without a future
on one completion thread (no thread per call), and no engine thread left after shutdown."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

import lowband
from lowband.comm.engine import NegotiatedOrder, engine_for, issue_lane
from lowband.comm.lane import LaneError
from lowband.errors import InvalidArgumentError
from lowband.teardown import lowband_threads
from lowband.testing import nccl_emulated, run_threads


def _two_lanes() -> dict[str, object]:
    r = lowband.rank()
    a = issue_lane(None, where="lane a")
    b = issue_lane(None, where="lane b")
    seen: list[str] = []
    threads: set[str] = set()

    def task(tag: str, i: int) -> torch.Tensor:
        seen.append(f"{tag}{i}")
        threads.add(threading.current_thread().name)
        return lowband.allreduce(torch.tensor([float(10 * i + r)], dtype=torch.float64), "sum")

    handles = [(a if i % 2 else b).submit(functools.partial(task, "ab"[i % 2], i)) for i in range(20)]
    # a task may return a handle: the lane's handle completes with its result
    inner = a.submit(lambda: lowband.iallreduce(torch.ones(2) * (r + 1), "average"))
    values = [float(h.wait()[0]) for h in handles]
    # a failing task fails its lane's later tasks, not the other lane's
    a.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    skipped = a.submit(lambda: seen.append("never"))
    fine = b.submit(lambda: lowband.allreduce(torch.ones(1), "sum"))
    with pytest.raises(LaneError, match="boom"):
        skipped.wait()
    with pytest.raises(LaneError, match="lane a: a task failed: ValueError: boom"):
        a.drain()
    return {
        "order": seen[:20] == [f"{'ab'[i % 2]}{i}" for i in range(20)],
        "one_thread": threads == {"lowband-engine-world"},
        "values": values,
        "inner": inner.wait().tolist(),
        "other_lane": float(fine.wait()[0]),
        "never": "never" not in seen,
    }


@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_lanes_share_one_worker_in_issue_order(n: int) -> None:
    res = run_threads(_two_lanes, n, timeout=60)
    for out in res:
        assert out == {
            "order": True,
            "one_thread": True,
            "values": [float(n * 10 * i + n * (n - 1) // 2) for i in range(20)],
            "inner": [(n + 1) / 2] * 2,
            "other_lane": float(n),
            "never": True,
        }


def _exclusive() -> list[str]:
    eng = engine_for(lowband.world())
    fifo = issue_lane(None, where="fifo")
    neg = eng.lane(NegotiatedOrder(2, "negotiated"), where="negotiated")
    gate = threading.Event()
    msgs = []
    fifo.submit(lambda: gate.wait(10))  # holds the worker
    fifo.submit(lambda: None)  # waits in the FIFO
    with pytest.raises(InvalidArgumentError) as e1:
        neg.submit(lambda: None, key=0)
    msgs.append(str(e1.value))
    gate.set()
    fifo.drain()
    gate.clear()
    started = threading.Event()
    fifo.submit(lambda: (started.set(), gate.wait(10)))
    assert started.wait(10)  # the worker runs it: the FIFO is empty
    h1 = neg.submit(lambda: None, key=1)  # pending until the worker is free
    with pytest.raises(InvalidArgumentError) as e2:
        fifo.submit(lambda: None)
    msgs.append(str(e2.value))
    gate.set()
    neg.submit(lambda: None, key=0).wait()
    h1.wait()
    fifo.submit(lambda: None).wait()  # the round is over: issue order again
    neg.close()
    with pytest.raises(InvalidArgumentError, match="after close"):
        neg.submit(lambda: None, key=0)
    return msgs


def test_one_ordering_policy_at_a_time() -> None:
    msgs = run_threads(_exclusive, 1, timeout=60)[0]
    assert "another lane of group 'world' has tasks waiting" in msgs[0]
    assert "a negotiated round of group 'world' is in progress" in msgs[1]


def _many_thens(count: int) -> tuple[list[float], int]:
    r = lowband.rank()
    got: list[float] = []
    if r == 0:
        hs = [
            lowband.irecv(torch.zeros(1), 1, tag=i).then(lambda t: got.append(float(t[0])))
            for i in range(count)
        ]
        lowband.barrier()  # every ``then`` is registered, none complete yet
        most = len(lowband_threads())
        lowband.barrier()
        for h in hs:
            h.wait()
        return got, most
    lowband.barrier()
    lowband.barrier()
    for i in range(count):
        lowband.send(torch.tensor([float(i)]), 0, tag=i)
    return got, 0


def test_pending_thens_need_no_thread_each() -> None:
    """50 pending ``then``s of receives (gloo works without a future) run on one completion thread,
    in order, with the right values."""
    res = run_threads(functools.partial(_many_thens, 50), 2, timeout=60)
    got, most = res[0]
    assert got == [float(i) for i in range(50)]
    assert most <= 3, most  # rank 0's completion thread, and at most the engines of both thread ranks


def test_engine_threads_end_at_shutdown() -> None:
    if nccl_emulated():
        pytest.skip(
            "a two-way unbatched exchange between two ranks: NCCL deadlocks on it (the emulator raises)"
        )

    def fn() -> None:
        lane = issue_lane(None, where="x")
        lane.submit(lambda: lowband.allreduce(torch.ones(1), "sum")).wait()
        lowband.irecv(torch.zeros(1), 1 - lowband.rank()).then(lambda t: None)
        lowband.send(torch.ones(1), 1 - lowband.rank())

    run_threads(fn, 2, timeout=60)
    deadline = time.monotonic() + 10
    while [t.name for t in lowband_threads()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t.name for t in lowband_threads()] == []


def _worker_dies(monkeypatch_loop: object) -> list[str]:
    lane = issue_lane(None, where="dying lane")
    msgs = []
    for _ in range(2):  # the task queued when the worker died, and one submitted after
        try:
            lane.submit(lambda: None).wait(5.0)
        except lowband.LowbandError as exc:
            msgs.append(str(exc))
    with pytest.raises(lowband.LowbandError, match="worker broke"):
        lane.drain()
    return msgs


def test_a_failed_worker_fails_its_tasks_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the worker itself fails (here on starting; on a GPU a bad device did), every task waiting and
    every later submission raises its error: nobody waits for a worker that is gone."""
    from lowband.comm.engine import Engine

    def broken(self: Engine) -> None:
        raise RuntimeError("worker broke")

    monkeypatch.setattr(Engine, "_loop", broken)
    msgs = run_threads(_worker_dies, 1, None, timeout=30)[0]
    assert len(msgs) == 2 and all("worker broke" in m for m in msgs), msgs


def _cuda_streams() -> list[float]:
    """On a CUDA rank the engine runs tasks on its own stream: a task sees what the submitting thread
    queued before it (a long matmul chain), and the taker sees what the task wrote."""
    dev = lowband.device()
    lane = issue_lane(None, where="cuda lane")
    out = []
    for k in range(3):
        a = torch.full((2048, 2048), 1.0 / 2048, device=dev)
        x = a
        for _ in range(20):  # long enough that an unordered reader would see the old values
            x = x @ a
        x = x * (2048.0 * (k + 1))  # every entry k + 1
        h = lane.submit(lambda x=x: x.sum() / x.numel())
        inner = lane.submit(lambda x=x: lowband.iallreduce(x[0, :4].clone(), "sum"))
        out += [float(h.wait()), float(inner.wait().sum())]
    lane.drain()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_orders_its_cuda_stream() -> None:
    from lowband.testing import run_processes

    got = run_processes(_cuda_streams, 1, timeout=120, device="cuda")[0]
    assert got == pytest.approx([1.0, 4.0, 2.0, 8.0, 3.0, 12.0], rel=1e-5), got


def _second_thread() -> str:
    """Rank 0's helper thread is inside an allreduce (waiting in the argument check for rank 1, which
    is late) when rank 0's own thread issues another collective on the same group."""
    import threading
    import time

    from lowband.runtime import bind_thread, current

    if lowband.rank() == 1:
        time.sleep(1.0)
        lowband.allreduce(torch.ones(2), "sum")
        lowband.barrier()
        return ""
    ctx = current("test")
    out: list[torch.Tensor] = []

    def helper() -> None:
        bind_thread(ctx)
        out.append(lowband.allreduce(torch.ones(2), "sum"))

    t = threading.Thread(target=helper, name="user-helper")
    t.start()
    time.sleep(0.3)
    msg = ""
    try:
        lowband.barrier()
    except lowband.InvalidArgumentError as exc:
        msg = str(exc)
    t.join(30)
    lowband.barrier()  # the refused call sent nothing: the group is still matched
    assert out and out[0].tolist() == [2.0, 2.0]
    return msg


def test_a_second_thread_issuing_on_a_group_is_refused() -> None:
    msg = run_threads(_second_thread, 2, timeout=60)[0]
    assert "thread 'lowband-rank0' issued a collective on group 'world'" in msg, msg
    assert "thread 'user-helper' is inside allreduce" in msg, msg
