"""Bad input raises a clear error naming the op and the rank; nothing hangs or aborts the process."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lowband
from lowband.testing import RankFailures, run_threads


def test_ops_before_init() -> None:
    assert not lowband.is_initialized()
    for call, op in [
        (lambda: lowband.allreduce(torch.ones(2)), "allreduce"),
        (lambda: lowband.ibroadcast(torch.ones(2)), "broadcast"),
        (lambda: lowband.send(torch.ones(2), 1), "send"),
        (lambda: lowband.rank(), "rank"),
        (lambda: lowband.grouped_allreduce([torch.ones(1)]), "grouped_allreduce"),
    ]:
        with pytest.raises(lowband.NotInitializedError, match=rf"lowband\.{op}: .*lowband\.init\(\)"):
            call()


def _each_rank_raises(
    n: int, fn: Callable[[], Any], exc: type[BaseException], pattern: str, **kw: Any
) -> None:
    """Run ``fn`` on n ranks; every rank must raise ``exc`` whose message matches ``pattern``
    (``{rank}`` is replaced by the rank)."""

    def rank_fn() -> str:
        r = lowband.rank()
        try:
            fn()
        except exc as e:
            msg = str(e)
            want = pattern.replace("{rank}", str(r))
            assert re.search(want, msg), f"rank {r}: {msg!r} does not match {want!r}"
            return msg
        raise AssertionError(f"rank {r}: no {exc.__name__}")

    run_threads(rank_fn, n, **kw)


LOCAL_CASES: list[tuple[str, Callable[[], Any], str]] = [
    (
        "non-tensor",
        lambda: lowband.allreduce([1.0, 2.0]),
        r"lowband\.allreduce on rank {rank}: tensor must be a torch\.Tensor, got list",
    ),
    (
        "complex",
        lambda: lowband.allreduce(torch.ones(2, dtype=torch.complex64)),
        r"allreduce on rank {rank}: .*unsupported dtype torch\.complex64",
    ),
    ("sparse", lambda: lowband.broadcast(torch.ones(2).to_sparse()), r"broadcast on rank {rank}: .*dense"),
    (
        "average-int",
        lambda: lowband.allreduce(torch.ones(2, dtype=torch.int64)),
        r"allreduce on rank {rank}: op='average' needs a floating-point",
    ),
    (
        "sum-bool",
        lambda: lowband.allreduce(torch.ones(2, dtype=torch.bool), op="sum"),
        r"op='sum' is not defined for bool",
    ),
    (
        "bad-op",
        lambda: lowband.allreduce(torch.ones(2), op="mean"),
        r"allreduce on rank {rank}: op must be one of",
    ),
    (
        "root-range",
        lambda: lowband.broadcast(torch.ones(2), root=7),
        r"broadcast on rank {rank}: root=7 is not a rank of group 'world'",
    ),
    ("root-type", lambda: lowband.broadcast(torch.ones(2), root=1.0), r"root must be an int rank"),
    (
        "name-type",
        lambda: lowband.allreduce(torch.ones(2), name=3),
        r"allreduce on rank {rank}: name must be a str",
    ),
    ("group-type", lambda: lowband.allreduce(torch.ones(2), group="world"), r"group must be a lowband Group"),
    (
        "a2a-splits",
        lambda: lowband.alltoall(torch.ones(5), [1, 1]),
        r"alltoall on rank {rank}: splits=\[1, 1\] must be 2 non-negative ints summing to 5",
    ),
    (
        "a2a-indivisible",
        lambda: lowband.alltoall(torch.ones(5)),
        r"first dimension 5 is not divisible by the group size 2",
    ),
    ("a2a-0d", lambda: lowband.alltoall(torch.tensor(1.0)), r"at least one dimension"),
    (
        "rs-indivisible",
        lambda: lowband.reduce_scatter(torch.ones(3)),
        r"reduce_scatter on rank {rank}: .*divisible by the group size 2",
    ),
    (
        "send-self",
        lambda: lowband.send(torch.ones(1), lowband.rank()),
        r"send on rank {rank}: cannot send to itself",
    ),
    ("recv-range", lambda: lowband.recv(torch.ones(1), 5), r"recv on rank {rank}: src=5 is not a rank"),
    (
        "tag",
        lambda: lowband.isend(torch.ones(1), 1 - lowband.rank(), tag=-1),
        r"send on rank {rank}: tag must be an int",
    ),
    (
        "grouped-not-list",
        lambda: lowband.grouped_allreduce(torch.ones(2)),
        r"grouped_allreduce on rank {rank}: tensors must be a list",
    ),
    (
        "grouped-item",
        lambda: lowband.grouped_allreduce([torch.ones(2), "x"]),
        r"tensors\[1\] must be a torch\.Tensor",
    ),
    (
        "allgather-sizes",
        lambda: lowband.allgather(torch.ones(2), sizes=[2]),
        r"allgather on rank {rank}: sizes=\[2\] must hold 2",
    ),
    (
        "allgather-float-sizes",
        lambda: lowband.allgather(torch.ones(2), sizes=[2.0, 2.5]),
        r"allgather on rank {rank}: sizes must hold ints, got 2\.0",
    ),
    (
        "a2a-float-splits",
        lambda: lowband.alltoall(torch.ones(4), [1.5, 2.5]),
        r"alltoall on rank {rank}: splits must hold ints, got 1\.5",
    ),
    (
        "a2a-bool-recv-splits",
        lambda: lowband.alltoall(torch.ones(4), [2, 2], recv_splits=[True, 3]),
        r"alltoall on rank {rank}: recv_splits must hold ints, got True",
    ),
    (
        "meta",
        lambda: lowband.allreduce(torch.ones(2, device="meta")),
        r"allreduce on rank {rank}: tensor is on the meta device",
    ),
    (
        "meta-grouped",
        lambda: lowband.grouped_allreduce([torch.ones(2), torch.ones(2, device="meta")]),
        r"grouped_allreduce on rank {rank}: tensors\[1\] is on the meta device",
    ),
]


@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_bad_arguments(case: tuple[str, Callable[[], Any], str]) -> None:
    _, fn, pattern = case
    _each_rank_raises(2, fn, lowband.InvalidArgumentError, pattern)


def test_inplace_targets_rejected_before_sending() -> None:
    """inplace=True on a leaf that requires grad, or on an expanded tensor, raises on the calling
    rank before anything is sent: every rank's tensor is left as it was (not a sum)."""

    def body() -> None:
        r = lowband.rank()
        leaf = torch.full((3,), float(r + 1), requires_grad=True)
        with pytest.raises(lowband.InvalidArgumentError, match=rf"allreduce on rank {r}: .*requires grad"):
            lowband.allreduce(leaf, inplace=True)
        assert leaf.detach().tolist() == [float(r + 1)] * 3
        with pytest.raises(lowband.InvalidArgumentError, match=r"broadcast on rank .*requires grad"):
            lowband.broadcast(leaf, inplace=True)
        base = torch.full((1, 3), float(r + 1))
        wide = base.expand(4, 3)
        with pytest.raises(lowband.InvalidArgumentError, match=r"allreduce on rank .*share memory"):
            lowband.allreduce(wide, inplace=True)
        with pytest.raises(lowband.InvalidArgumentError, match=r"grouped_allreduce on rank .*share memory"):
            lowband.grouped_allreduce([torch.ones(2), wide], inplace=True)
        assert base.tolist() == [[float(r + 1)] * 3]
        # the documented ways still work: under no_grad, or on the detached tensor (same memory)
        with torch.no_grad():
            lowband.allreduce(leaf, inplace=True)
        lowband.allreduce(leaf.detach(), op="sum", inplace=True)
        n = lowband.size()
        assert leaf.detach().tolist() == [float(sum(range(1, n + 1)))] * 3
        out = lowband.allreduce(wide)  # out of place is fine
        assert out.shape == (4, 3)

    run_threads(body, 2)


MISMATCH_CASES: list[tuple[str, Callable[[], Any], str]] = [
    (
        "allreduce-shape",
        lambda: lowband.allreduce(torch.ones(lowband.rank() + 1)),
        r"allreduce on rank {rank} \(group 'world'\): shape differ across ranks: rank 0 called allreduce of a float32 tensor of shape \(1,\), rank 1 called allreduce of a float32 tensor of shape \(2,\)",
    ),
    (
        "allreduce-dtype",
        lambda: lowband.allreduce(torch.ones(2, dtype=torch.float32 if lowband.rank() else torch.float64)),
        r"allreduce on rank {rank} .*dtype differ .*float64.*rank 1 .*float32",
    ),
    (
        "allreduce-op",
        lambda: lowband.allreduce(torch.ones(2), op="sum" if lowband.rank() else "max"),
        r"allreduce on rank {rank} .*op differ .*rank 0 called allreduce .* with op='max', rank 1 .* with op='sum'",
    ),
    (
        "broadcast-root",
        lambda: lowband.broadcast(torch.ones(2), root=lowband.rank()),
        r"broadcast on rank {rank} .*root differ .*shape \(2,\) from root 0, rank 1 .* from root 1",
    ),
    (
        "broadcast-shape",
        lambda: lowband.broadcast(torch.ones(2, lowband.rank() + 1)),
        r"broadcast on rank {rank} .*shape differ",
    ),
    (
        "allgather-rest",
        lambda: lowband.allgather(torch.ones(2, lowband.rank() + 1)),
        r"allgather on rank {rank} .*shape differ",
    ),
    (
        "alltoall-rest",
        lambda: lowband.alltoall(torch.ones(2, lowband.rank() + 1)),
        r"alltoall on rank {rank} .*shape differ",
    ),
    (
        "reduce_scatter-shape",
        lambda: lowband.reduce_scatter(torch.ones(2 * (lowband.rank() + 1))),
        r"reduce_scatter on rank {rank} .*shape differ",
    ),
    (
        "different-ops",
        lambda: lowband.allreduce(torch.ones(2)) if lowband.rank() else lowband.broadcast(torch.ones(2)),
        r"on rank {rank} .*op.* differ",
    ),
    (
        "grouped-shapes",
        lambda: lowband.grouped_allreduce([torch.ones(2), torch.ones(lowband.rank() + 1)]),
        r"grouped_allreduce on rank {rank} .*differ",
    ),
]


@pytest.mark.parametrize("case", MISMATCH_CASES, ids=[c[0] for c in MISMATCH_CASES])
def test_cross_rank_mismatch(case: tuple[str, Callable[[], Any], str]) -> None:
    """Every rank raises the same CollectiveMismatchError (gloo itself would abort the process)."""
    _, fn, pattern = case
    _each_rank_raises(2, fn, lowband.CollectiveMismatchError, pattern)


def test_mismatch_then_recovers() -> None:
    """After a mismatch is caught, the group is still usable."""

    def rank_fn() -> float:
        try:
            lowband.allreduce(torch.ones(lowband.rank() + 1))
        except lowband.CollectiveMismatchError:
            pass
        return float(lowband.allreduce(torch.ones(1), op="sum").item())

    assert run_threads(rank_fn, 3) == [3.0, 3.0, 3.0]


def test_recv_mismatch() -> None:
    """Both sides of a mismatched send/recv raise at once (well inside the timeout), each showing both full
    shapes and dtypes, and the pair can go on communicating afterwards."""

    def rank_fn() -> tuple[str, float, list[float]]:
        t0 = time.monotonic()
        if lowband.rank() == 0:
            h = lowband.isend(torch.ones(2, 3, 5, 7, 11, 13, 17), 1)
            with pytest.raises(lowband.CollectiveMismatchError) as ei:
                h.wait()  # the receiver refuses the data
        else:
            with pytest.raises(lowband.CollectiveMismatchError) as ei:
                lowband.recv(torch.zeros(2, 3, 5, 7, 11, 13, 19, dtype=torch.float64), 0)
        waited = time.monotonic() - t0
        if lowband.rank() == 0:
            lowband.send(torch.arange(3.0), 1)
            return str(ei.value), waited, []
        return str(ei.value), waited, lowband.recv(torch.zeros(3), 0).tolist()

    out = run_threads(rank_fn, 2, comm_timeout=30, timeout=60)
    sent = "a float32 tensor of shape (2, 3, 5, 7, 11, 13, 17)"
    posted = "a float64 tensor of shape (2, 3, 5, 7, 11, 13, 19)"
    assert out[0][0] == (
        f"lowband.send on rank 0 (to rank 1, tag 0): the receiver posted a receive for {posted} "
        f"but this rank sent {sent}"
    )
    assert out[1][0] == (
        f"lowband.recv on rank 1: rank 0 sent {sent} (tag 0) but this rank posted a receive for {posted}"
    )
    assert max(out[0][1], out[1][1]) < 15, "the sender waited for its timeout"
    assert out[1][2] == [0.0, 1.0, 2.0]


def test_missing_peer_times_out() -> None:
    """A rank that never joins the op: the others raise CommTimeoutError within the configured time."""

    def rank_fn() -> float:
        if lowband.rank() == 2:
            time.sleep(4)  # alive, but never calls the allreduce
            return 0.0
        t0 = time.monotonic()
        with pytest.raises(
            lowband.CommTimeoutError,
            match=r"lowband\.allreduce on rank [01] \(argument check\): no completion within 1.5 s",
        ):
            lowband.allreduce(torch.ones(2), name="lonely")
        return time.monotonic() - t0

    waited = run_threads(rank_fn, 3, comm_timeout=1.5, timeout=30)
    assert all(1.0 < w < 5.0 for w in waited[:2]), waited


def test_harness_reports_every_rank() -> None:
    def rank_fn() -> None:
        if lowband.rank() in (1, 2):
            raise ValueError(f"boom from {lowband.rank()}")

    with pytest.raises(RankFailures) as ei:
        run_threads(rank_fn, 3)
    assert set(ei.value.errors) == {1, 2}
    assert "boom from 1" in ei.value.errors[1] and "boom from 2" in ei.value.errors[2]


def test_harness_hard_timeout() -> None:
    def rank_fn() -> None:
        if lowband.rank() == 0:
            lowband.allreduce(torch.ones(1))  # rank 1 never joins; comm timeout far beyond the hard one
        else:
            time.sleep(3)

    t0 = time.monotonic()
    with pytest.raises(RankFailures, match=r"still running after 1 s \(hard timeout\)"):
        run_threads(rank_fn, 2, timeout=1, comm_timeout=60)
    assert time.monotonic() - t0 < 15


def test_set_check_toggle() -> None:
    """Checks can be turned off (same call on every rank) and back on."""

    def rank_fn() -> float:
        lowband.set_check(False)
        assert not lowband.runtime.current().config.check
        s = float(lowband.allreduce(torch.ones(3), op="sum")[0])
        lowband.set_check(True)
        with pytest.raises(lowband.CollectiveMismatchError):
            lowband.allreduce(torch.ones(lowband.rank() + 1))
        return s

    assert run_threads(rank_fn, 2) == [2.0, 2.0]
