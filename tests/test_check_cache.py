"""The argument check without a round trip per op: predicted calls skip the wait, and a mismatch after
any warm-up still raises CollectiveMismatchError on every rank (never a gloo abort, never a timeout)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from oracle import data, reduce

import lowband
from lowband.comm import control
from lowband.comm.agree import agree
from lowband.errors import CollectiveMismatchError
from lowband.runtime import current
from lowband.testing import run_threads

# A test that ended in a timeout instead of the mismatch error would fail on the error's kind; the
# bound is short because a rank that issued the pending op waits it out when its groups are freed.
COMM_TIMEOUT = 6.0


def _release(done: threading.Barrier) -> None:
    """After a mismatch a data op is left pending: once every rank has seen its error, abort this
    rank's process groups (as a program would destroy the unusable group), so that nothing waits
    for the pending op when the groups are collected."""
    done.wait(COMM_TIMEOUT)
    world = current().world
    for pg in (world.pg, world.ctl):
        if pg is not None:
            pg.abort()


def _state() -> control.ControlState:
    return control.state_of(current().world)


def _mixed_round(it: int, n: int) -> list[torch.Tensor]:
    """One round of every checked collective, with seeded inputs that vary by iteration and rank."""
    r = lowband.rank()
    a = data(r, (3, 4), torch.float64, salt=it)
    out = [lowband.allreduce(a, "sum")]
    out.append(lowband.broadcast(data(r, (5,), torch.float32, salt=it), root=n - 1))
    sizes = [1 + (q % 2) for q in range(n)]
    out.append(lowband.allgather(data(r, (sizes[r], 2), torch.int64, salt=it), sizes=sizes))
    splits = [(r + q) % 2 for q in range(n)]
    recv = [(q + r) % 2 for q in range(n)]
    x = data(r, (sum(splits), 3), torch.float64, salt=it)
    out.append(lowband.alltoall(x, splits, recv_splits=recv)[0])
    out.append(lowband.reduce_scatter(data(r, (2 * n,), torch.float64, salt=it), "sum"))
    out.extend(lowband.grouped_allreduce([a, data(r, (7,), torch.int32, salt=it)], "max"))
    return out


def _oracle_round(it: int, n: int, r: int) -> list[torch.Tensor]:
    a = [data(q, (3, 4), torch.float64, salt=it) for q in range(n)]
    out = [reduce(a, "sum"), data(n - 1, (5,), torch.float32, salt=it)]
    sizes = [1 + (q % 2) for q in range(n)]
    out.append(torch.cat([data(q, (sizes[q], 2), torch.int64, salt=it) for q in range(n)]))
    rows = []
    for q in range(n):
        splits = [(q + j) % 2 for j in range(n)]
        x = data(q, (sum(splits), 3), torch.float64, salt=it)
        start = sum(splits[:r])
        rows.append(x[start : start + splits[r]])
    out.append(torch.cat(rows))
    rs = reduce([data(q, (2 * n,), torch.float64, salt=it) for q in range(n)], "sum")
    out.append(rs[2 * r : 2 * r + 2])
    out.append(reduce(a, "max"))
    out.append(reduce([data(q, (7,), torch.int32, salt=it) for q in range(n)], "max"))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_predicted_ops_skip_the_wait_and_stay_exact(n: int) -> None:
    iters = 6

    def body() -> tuple[list[list[torch.Tensor]], int, int, int]:
        results = [_mixed_round(0, n), _mixed_round(1, n)]
        st = _state()
        blocking_after_warmup = st.blocking
        results += [_mixed_round(it, n) for it in range(2, iters)]
        return results, blocking_after_warmup, st.blocking, st.predicted

    for r, (results, warm, final, predicted) in enumerate(run_threads(body, n)):
        for it, got in enumerate(results):
            for g, want in zip(got, _oracle_round(it, n, r), strict=True):
                torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
        if n > 1:
            assert final == warm, "the rounds after the first two should all be predicted"
            assert predicted >= (iters - 2) * 7


def _expect_mismatch(fn: Any) -> str:
    try:
        fn()
    except CollectiveMismatchError as e:
        return str(e)
    raise AssertionError(f"rank {lowband.rank()}: no CollectiveMismatchError")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_changed_shape_after_warmup_raises_on_every_rank(n: int) -> None:
    done = threading.Barrier(n)

    def body() -> tuple[str, str]:
        r = lowband.rank()
        for _ in range(20):
            lowband.allreduce(torch.ones(8))
        shape = (9,) if r == n - 1 else (8,)
        msg = _expect_mismatch(lambda: lowband.allreduce(torch.ones(shape)))
        # the group is unusable afterwards: any op raises at once, sending nothing
        later = _expect_mismatch(lambda: lowband.allreduce(torch.ones(8)))
        _release(done)
        return msg, later

    for r, (msg, later) in enumerate(run_threads(body, n, comm_timeout=COMM_TIMEOUT)):
        assert f"lowband.allreduce on rank {r}" in msg, msg
        assert (
            "shape (8,)" in msg and f"rank {n - 1} called allreduce of a float32 tensor of shape (9,)" in msg
        )
        assert "the group is unusable" in msg, msg
        assert "an earlier mismatch on this group" in later, later


@pytest.mark.parametrize("n", [2, 3])
def test_swapped_order_after_warmup_raises_and_never_aborts(n: int) -> None:
    """Both orders were seen (and verified) many times; swapping them on one rank must not let the
    ranks issue allreduces of different sizes (gloo would abort the process)."""
    done = threading.Barrier(n)

    def body() -> str:
        r = lowband.rank()
        for _ in range(10):
            lowband.allreduce(torch.ones(10))
            lowband.allreduce(torch.ones(20))
        order = (20, 10) if r == 0 else (10, 20)

        def run() -> None:
            for k in order:
                lowband.allreduce(torch.ones(k))

        msg = _expect_mismatch(run)
        _release(done)
        return msg

    for msg in run_threads(body, n, comm_timeout=COMM_TIMEOUT):
        assert "shape (10,)" in msg and "shape (20,)" in msg, msg


def test_mismatch_seen_by_ranks_that_issued_nonblocking_ops() -> None:
    """Ranks that issued several predicted ops before waiting still get the mismatch at the wait."""
    done = threading.Barrier(2)

    def body() -> str:
        r = lowband.rank()
        for _ in range(5):
            lowband.wait_all([lowband.iallreduce(torch.ones(4)) for _ in range(3)])
        if r == 0:
            msg = _expect_mismatch(lambda: lowband.broadcast(torch.ones(4)))
            _release(done)
            return msg
        # the mismatch surfaces at a wait, or at the next op's issue once the table is in
        msg = _expect_mismatch(
            lambda: lowband.wait_all([lowband.iallreduce(torch.ones(4)) for _ in range(3)])
        )
        _release(done)
        return msg

    msgs = run_threads(body, 2, comm_timeout=COMM_TIMEOUT)
    assert all("rank 0 called broadcast" in m and "rank 1 called allreduce" in m for m in msgs), msgs


def test_agree_against_a_predicted_op() -> None:
    done = threading.Barrier(2)

    def body() -> str:
        r = lowband.rank()
        for _ in range(5):
            lowband.allreduce(torch.ones(3))
        if r == 0:
            msg = _expect_mismatch(lambda: agree(None, "the layout", [1, 2]))
        else:
            msg = _expect_mismatch(lambda: lowband.allreduce(torch.ones(3)))
        _release(done)
        return msg

    a, b = run_threads(body, 2, comm_timeout=COMM_TIMEOUT)
    assert "lowband.agree" in a and "allreduce" in a, a
    assert "lowband.agree" in b, b


@pytest.mark.parametrize("n", [2, 3])
def test_sizes_given_on_some_ranks_only(n: int) -> None:
    """A rank that passes the sizes takes the predicted path; one that does not waits for the table,
    which is the predicted one: the op goes through, exactly."""

    def body() -> list[torch.Tensor]:
        r = lowband.rank()
        sizes = [q + 1 for q in range(n)]
        out = []
        for it in range(6):
            x = data(r, (r + 1, 2), torch.float64, salt=it)
            out.append(lowband.allgather(x, sizes=sizes if r == 0 or it < 2 else None))
        return out

    for got in run_threads(body, n, comm_timeout=COMM_TIMEOUT):
        for it, g in enumerate(got):
            want = torch.cat([data(q, (q + 1, 2), torch.float64, salt=it) for q in range(n)])
            assert torch.equal(g, want)


def test_a_new_pattern_on_every_rank_is_not_a_mismatch() -> None:
    """When every rank leaves the prediction the same way (a legitimate change of pattern), they all
    wait for the table, check it, and go on."""

    def body() -> list[float]:
        out = []
        for it in range(12):
            k = 8 if it % 4 else 5  # A A A B: the prediction is wrong on every rank at once
            out.append(float(lowband.allreduce(torch.full((k,), float(it)), "sum")[0]))
        return out

    for got in run_threads(body, 3, comm_timeout=COMM_TIMEOUT):
        assert got == [3.0 * it for it in range(12)]


def test_rows_met_in_the_store_are_deleted_once_every_rank_read_them() -> None:
    """Ops that need the other ranks' sizes meet in the store every time; their rows do not pile up."""

    def body() -> tuple[list[str], int, int]:
        r = lowband.rank()
        for it in range(8):
            lowband.allgather(data(r, (r + 1, 2), torch.float64, salt=it))
        lowband.allreduce(torch.ones(2))  # every rank got past the last meeting's deletion
        st = _state()
        keys = [f"{s}/{q}" for s in range(st.seq) for q in range(3)] + [f"{s}/n" for s in range(st.seq)]
        return [k for k in keys if st.store.check([k])], st.seq, st.blocking

    for left, seq, met in run_threads(body, 3, comm_timeout=COMM_TIMEOUT):
        assert left == [] and seq == 9 and met == 9
