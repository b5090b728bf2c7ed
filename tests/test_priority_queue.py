"""The negotiated priority queue: every rank runs the same tasks in the same order whatever its timing,
a task submitted later overtakes those not started by priority, results and errors reach the handles,
and a dead rank makes the others fail within the timeout."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import lowband
from lowband.comm.handle import Handle
from lowband.comm.priority import NegotiatedQueue
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.testing import RankFailures, run_threads


def _reduce(key: int, rnd: int) -> Handle[torch.Tensor]:
    """An allreduce named by the key: a collective issued in another order on two ranks would mismatch."""
    t = torch.tensor([float(key + 10 * rnd + lowband.rank())], dtype=torch.float64)
    return lowband.iallreduce(t, "sum", name=f"k{key}", group=lowband.world().unchecked())


@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_random_submission_orders_and_delays_agree(n: int) -> None:
    """Each rank submits each round's 6 keys in its own random order with random sleeps: every rank runs
    them in one order, and every result is the sum over the ranks."""
    keys, rounds = 6, 15

    def fn() -> tuple[list[list[int]], list[float]]:
        r = lowband.rank()
        rng = random.Random(100 + r)
        q = NegotiatedQueue(keys, group=lowband.world().unchecked(), timeout=30, where="test queue")
        orders, results = [], []
        for rnd in range(rounds):
            handles = {}
            for k in rng.sample(range(keys), keys):
                time.sleep(rng.random() * 0.003)
                handles[k] = q.submit(k, lambda k=k, rnd=rnd: _reduce(k, rnd))
            results += [float(handles[k].wait()[0]) for k in range(keys)]
            time.sleep(0.01)  # the last task's bookkeeping
            orders.append(list(q.last_order))
        q.close()
        return orders, results

    res = run_threads(fn, n, timeout=120)
    for orders, results in res:
        assert orders == res[0][0]
        assert all(sorted(o) == list(range(keys)) for o in orders)
        want = [n * (k + 10 * rnd) + n * (n - 1) / 2 for rnd in range(rounds) for k in range(keys)]
        assert results == want


def test_a_later_submission_overtakes_by_priority() -> None:
    """Key 3 runs first (alone ready) and holds the thread; keys 2, 1, 0 are submitted meanwhile in
    reverse priority order, then run 0, 1, 2."""

    def fn() -> list[int]:
        q = NegotiatedQueue(4, group=lowband.world().unchecked(), timeout=30, where="test queue")
        started, release = threading.Event(), threading.Event()

        def gate() -> Handle[torch.Tensor]:
            started.set()
            assert release.wait(30)
            return _reduce(3, 0)

        hs = [q.submit(3, gate)]
        assert started.wait(30)
        hs += [q.submit(k, lambda k=k: _reduce(k, 0)) for k in (2, 1, 0)]
        release.set()
        for h in hs:
            h.wait()
        time.sleep(0.01)
        q.close()
        return list(q.last_order)

    for order in run_threads(fn, 3, timeout=60):
        assert order == [3, 0, 1, 2]


def test_bad_keys_are_refused() -> None:
    def fn() -> None:
        q = NegotiatedQueue(2, group=lowband.world(), timeout=5, where="test queue")
        with pytest.raises(InvalidArgumentError, match=r"key must be an int in \[0, 2\)"):
            q.submit(2, lambda: _reduce(0, 0))
        q.submit(0, lambda: _reduce(0, 0)).wait()
        with pytest.raises(InvalidArgumentError, match="submitted twice"):
            q.submit(0, lambda: _reduce(0, 0))
        q.close()
        with pytest.raises(InvalidArgumentError, match="after close"):
            q.submit(1, lambda: _reduce(1, 0))
        with pytest.raises(InvalidArgumentError, match="n must be an int >= 1"):
            NegotiatedQueue(0, group=lowband.world(), timeout=5)

    run_threads(fn, 1, timeout=30)


def test_dead_rank_fails_the_others_within_the_timeout() -> None:
    timeout = 2.0
    seen: dict[int, float] = {}

    def fn() -> None:
        r = lowband.rank()
        q = NegotiatedQueue(2, group=lowband.world().unchecked(), timeout=timeout, where="test queue")
        q.submit(0, lambda: _reduce(0, 0)).wait()
        if r == 2:
            raise ValueError("rank 2 dies")
        t0 = time.monotonic()
        with pytest.raises((CommTimeoutError, CommFailedError), match=f"on rank {r}"):
            q.submit(1, lambda: _reduce(1, 0)).wait(timeout + 5)
        seen[r] = time.monotonic() - t0

    with pytest.raises(RankFailures) as ei:
        run_threads(fn, 3, comm_timeout=timeout, timeout=60)
    assert set(ei.value.errors) == {2}, ei.value
    assert set(seen) == {0, 1} and max(seen.values()) < timeout + 5, seen
