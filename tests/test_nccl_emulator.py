"""The NCCL-semantics emulator (lowband.comm.nccl_emulator): each rule catches its violation on gloo, correct
use passes, and lowband's own ops run under it."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lowband
from lowband.comm.batch import Channel, recv_op, send_op
from lowband.comm.nccl_emulator import NcclContractError, NcclEmulator, op_log, register_backend
from lowband.runtime import current
from lowband.testing import run_threads

CPU = torch.device("cpu")


def _pg() -> Any:
    return current().world.pg


def _expect(fn: Any) -> str:
    """Run ``fn``; return the NcclContractError's message ("" if none was raised)."""
    try:
        fn()
    except NcclContractError as exc:
        return str(exc)
    return ""


def _run(fn: Any, n: int = 2) -> list[Any]:
    return run_threads(fn, n, emulate_nccl=True, timeout=30)


def test_correct_use_passes_and_is_logged() -> None:
    def fn() -> dict[str, Any]:
        pg, r = _pg(), lowband.rank()
        assert isinstance(pg, NcclEmulator) and not isinstance(current().world.ctl, NcclEmulator)
        x = torch.ones(4) * (r + 1)
        dist.all_reduce(x, group=pg)
        outs = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(outs, torch.full((2,), float(r)), group=pg)
        y = torch.full((3,), float(r))
        dist.broadcast(y, group=pg, group_src=0)
        rs = torch.zeros(2)
        pg._reduce_scatter_base(rs, torch.arange(4, dtype=torch.float32), dist.ReduceScatterOptions()).wait()
        # both directions of the exchange in one batch (NCCL's startCoalescing/endCoalescing)
        a, b = torch.full((3,), float(r)), torch.zeros(3)
        pg._start_coalescing(CPU)
        pg.send([a], 1 - r, 0)
        pg.recv([b], 1 - r, 0)
        pg._end_coalescing(CPU).wait()
        w = dist.all_reduce(torch.ones(2), group=pg, async_op=True)
        w.wait()
        return {"x": x.tolist(), "g": [o.tolist() for o in outs], "y": y.tolist(), "rs": rs.tolist(),
                "b": b.tolist(), "log": op_log(pg)}  # fmt: skip

    res = _run(fn)
    for r, out in enumerate(res):
        assert out["x"] == [3.0] * 4 and out["g"] == [[0.0, 0.0], [1.0, 1.0]] and out["y"] == [0.0] * 3
        assert out["rs"] == ([0.0, 2.0] if r == 0 else [4.0, 6.0]) and out["b"] == [float(1 - r)] * 3
        log = out["log"]
        assert [o.op for o in log] == ["allreduce", "allgather", "broadcast", "reduce_scatter_base", "send", "recv", "allreduce"]  # fmt: skip
        assert log[0].dtypes == ("torch.float32",) and log[0].shapes == ((4,),) and log[0].nbytes == 16
        assert log[4].peer == 1 - r and log[4].batched and log[0].thread == f"lowband-rank{r}"


def test_timed_wait_that_expires_aborts_the_group() -> None:
    def fn() -> tuple[str, str]:
        pg, r = _pg(), lowband.rank()
        if r == 1:
            time.sleep(0.5)  # late: rank 0's 1 ms wait expires
        first = _expect(lambda: dist.all_reduce(torch.ones(2), group=pg, async_op=True).wait(datetime.timedelta(milliseconds=1)))  # fmt: skip
        later = _expect(lambda: dist.all_reduce(torch.ones(2), group=pg))
        return first, later

    (first0, later0), (first1, later1) = _run(fn)
    assert "timed wait" in first0 and "WorkNCCL::wait" in first0
    assert "aborted" in later0 and "timed wait" in later0  # the group is unusable after the abort
    assert "aborted" in first1 and "aborted" in later1  # the peer learns it too


def test_timed_wait_that_completes_passes() -> None:
    def fn() -> list[float]:
        x = torch.ones(2)
        dist.all_reduce(x, group=_pg(), async_op=True).wait(datetime.timedelta(seconds=20))
        return x.tolist()

    assert _run(fn) == [[2.0, 2.0]] * 2


def test_future_is_complete_at_enqueue_and_runs_callbacks_inline() -> None:
    def fn() -> tuple[bool, bool, list[float]]:
        x = torch.ones(2)
        fut = dist.all_reduce(x, group=_pg(), async_op=True).get_future()
        done = fut.done()  # NCCL: marked completed when the kernel is enqueued
        me = threading.get_ident()
        ran_here: list[bool] = []
        chained = fut.then(lambda f: ran_here.append(threading.get_ident() == me) or f.value()[0] * 10)
        return done, ran_here == [True], chained.wait().tolist()

    assert _run(fn) == [(True, True, [20.0, 20.0])] * 2


def test_unbatched_two_way_exchange_raises() -> None:
    def fn() -> str:
        pg, r = _pg(), lowband.rank()

        def exchange() -> None:  # both ranks send first: one shared stream per pair on NCCL, a deadlock
            s, rv = pg.send([torch.ones(3)], 1 - r, 0), pg.recv([torch.zeros(3)], 1 - r, 0)
            s.wait()
            rv.wait()

        return _expect(exchange)

    msgs = _run(fn)
    assert any("pair stream" in m and "ProcessGroupNCCL::pointToPoint" in m for m in msgs), msgs
    assert all(m for m in msgs)  # the other rank's ops fail on the aborted group


def test_mirrored_unbatched_exchange_passes() -> None:
    def fn() -> list[float]:
        pg, r = _pg(), lowband.rank()
        a, b = torch.full((3,), float(r)), torch.zeros(3)
        if r == 0:
            pg.send([a], 1, 0).wait()
            pg.recv([b], 1, 0).wait()
        else:
            pg.recv([b], 0, 0).wait()
            pg.send([a], 0, 0).wait()
        return b.tolist()

    assert _run(fn) == [[1.0] * 3, [0.0] * 3]


def test_receive_matched_only_by_tag_raises() -> None:
    def fn() -> str:
        pg, r = _pg(), lowband.rank()

        def swapped() -> None:
            pg._start_coalescing(CPU)
            if r == 0:
                pg.send([torch.ones(2)], 1, 1)
                pg.send([torch.ones(2)], 1, 2)
            else:  # gloo matches by tag; NCCL by order: tag 2 would get the tag-1 message
                pg.recv([torch.zeros(2)], 0, 2)
                pg.recv([torch.zeros(2)], 0, 1)
            pg._end_coalescing(CPU).wait()

        return _expect(swapped)

    msgs = _run(fn)
    assert any("tags ignored" in m for m in msgs), msgs


def test_collectives_from_two_threads_raise() -> None:
    def fn() -> str:
        pg, r = _pg(), lowband.rank()
        if r == 1:
            time.sleep(0.5)  # rank 0's first collective stays in flight meanwhile
            return _expect(lambda: dist.all_reduce(torch.ones(2), group=pg))
        w = dist.all_reduce(torch.ones(2), group=pg, async_op=True)
        seen: list[str] = []
        t = threading.Thread(
            target=lambda: seen.append(_expect(lambda: dist.all_reduce(torch.ones(2), group=pg)))
        )
        t.start()
        t.join(10)
        _expect(w.wait)
        return seen[0]

    m0, m1 = _run(fn)
    assert "one thread" in m0 and "in flight" in m0, m0
    assert "aborted" in m1


def test_one_thread_after_another_passes() -> None:
    def fn() -> list[float]:
        pg = _pg()
        x = torch.ones(2)
        dist.all_reduce(x, group=pg)
        t = threading.Thread(target=lambda: dist.all_reduce(x, group=pg))  # the first one was waited
        t.start()
        t.join(10)
        return x.tolist()

    assert _run(fn) == [[4.0, 4.0]] * 2


def test_a_dtype_nccl_lacks_raises() -> None:
    """Control: torch's own collective of an int16 tensor (gloo moves it, NCCL has no int16)."""

    def fn() -> str:
        return _expect(lambda: _pg().allreduce([torch.zeros(3, dtype=torch.int16)]))

    assert all("dtype" in m and "int16" in m for m in _run(fn))


def test_recv_from_any_source_raises() -> None:
    def fn() -> str:
        return _expect(lambda: _pg().recv_anysource([torch.zeros(1)], 0))

    assert all("recvAnysource" in m for m in _run(fn))


def test_lowband_collectives_run_under_the_emulator() -> None:
    def fn() -> dict[str, Any]:
        r, n = lowband.rank(), lowband.size()
        out = {
            "ar": lowband.allreduce(torch.ones(4) * (r + 1)).tolist(),
            "ag": lowband.allgather(torch.full((r + 1,), float(r))).tolist(),
            "bc": lowband.broadcast(torch.full((3,), float(r)), 0).tolist(),
            "a2a": lowband.alltoall(torch.arange(n, dtype=torch.float32) + 10 * r, [1] * n)[0].tolist(),
        }
        out["data_only"] = all(d in ("torch.float32",) for o in op_log(_pg()) for d in o.dtypes)
        return out

    res = _run(fn)
    for r, out in enumerate(res):
        assert out["ar"] == [1.5] * 4 and out["ag"] == [0.0, 1.0, 1.0] and out["bc"] == [0.0] * 3
        assert out["a2a"] == [float(r), float(10 + r)] and out["data_only"]


def test_lowband_p2p_puts_only_data_on_the_data_group() -> None:
    """lowband.send's (dtype, shape) header and its answer go on the control group (comm/p2p.py)."""

    def fn() -> list[str]:
        if lowband.rank() == 0:
            lowband.send(torch.ones(3), 1)
        else:
            assert lowband.recv(torch.zeros(3), 0).tolist() == [1.0] * 3
        return [d for o in op_log(_pg()) for d in o.dtypes]

    for dtypes in _run(fn):
        assert dtypes == ["torch.float32"], dtypes


def test_lowband_batched_exchange_under_the_emulator() -> None:
    """comm/batch.py posts an exchange round as one coalesced batch under NCCL's contract (receiving
    first, each message alone, would deadlock on NCCL's shared pair stream)."""

    def fn() -> list[float]:
        r = lowband.rank()
        buf = torch.zeros(3)
        Channel.of(None).batch(
            "exchange", [recv_op(buf, 1 - r, 7), send_op(torch.full((3,), float(r)), 1 - r, 7)]
        )
        return buf.tolist()

    assert _run(fn) == [[1.0] * 3, [0.0] * 3]


def _default_group_rank(rank: int, path: str, q: Any) -> None:
    try:
        register_backend()
        dist.init_process_group("nccl_emu", init_method=f"file://{path}", rank=rank, world_size=2)
        pg = dist.group.WORLD
        x = torch.ones(2) * (rank + 1)
        dist.all_reduce(x)
        a, b = torch.full((2,), float(rank)), torch.zeros(2)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, a, 1 - rank), dist.P2POp(dist.irecv, b, 1 - rank)]
        )
        for w in works:
            w.wait()
        ctl = dist.new_group([0, 1], backend="gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        model(torch.ones(4, 2) * (rank + 1)).sum().backward()
        grad = model.module.weight.grad
        assert grad is not None
        q.put((rank, type(pg).__name__, type(ctl).__name__, x.tolist(), b.tolist(), grad.tolist(),
               [(o.op, o.batched) for o in op_log(pg)]))  # fmt: skip
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, traceback.format_exc()))


def test_registered_backend_is_torchs_default_group(tmp_path: Path) -> None:
    """init_process_group("nccl_emu"): plain torch calls, batch_isend_irecv and DDP run through it."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_default_group_rank, args=(r, str(tmp_path / "store"), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    by_rank = {g[0]: g[1:] for g in got}
    for r in range(2):
        assert len(by_rank[r]) > 1, by_rank[r][0]
        pg, ctl, x, b, grad, log = by_rank[r]
        assert (pg, ctl, x, b) == ("NcclEmulator", "ProcessGroup", [3.0, 3.0], [float(1 - r)] * 2)
        assert grad == [[6.0, 6.0]]  # DDP averaged: (4 * 1 + 4 * 2) / 2 per weight
        assert ("send", True) in log and ("recv", True) in log  # batch_isend_irecv recognised as a batch
        assert log[0] == ("allreduce", False)
