"""The halving/doubling tree: the pure schedule for P = 1..64 (rounds, messages per rank, every
contribution reaching the root once), its executor bit-exact against the single-process sum at
P = 1..5, custom combines, byte counters, the star schedule, errors."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import data

import lowband
from lowband.comm.tree import itree
from lowband.compress.tree import TreeSchedule, star_schedule, tree_schedule
from lowband.errors import InvalidArgumentError
from lowband.testing import RankFailures, run_threads


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _modelled_receives(r: int, p: int) -> int:
    return sum(1 for i in range(1, _log2(p) + 1) if r % 2**i == 0 and r + 2 ** (i - 1) < p)


@pytest.mark.parametrize("p", range(1, 65))
def test_schedule(p: int) -> None:
    s = tree_schedule(p)
    assert len(s.reduce) == len(s.broadcast) == _log2(p) and s.rounds == 2 * _log2(p) and s.root == 0
    for rnd in s.reduce + s.broadcast:
        busy = [r for pair in rnd for r in pair]
        assert len(busy) == len(set(busy)), f"a rank in two messages of one round: {rnd}"
        assert all(0 <= r < p for r in busy)
    for r in range(p):
        rs, rr, bs, br = s.counts(r)
        assert (rs, br) == ((0, 0) if r == 0 else (1, 1))
        assert rr == bs == _modelled_receives(r, p)
    assert s.counts(0)[1] == _log2(p)
    # simulate: every rank's contribution reaches the root exactly once, the result reaches everyone
    held = [{r} for r in range(p)]
    for rnd in s.reduce:
        for src, dst in rnd:
            assert not held[src] & held[dst]
            held[dst] = held[dst] | held[src]
            held[src] = set()
    assert held[0] == set(range(p))
    have = [r == 0 for r in range(p)]
    for rnd in s.broadcast:
        for src, dst in rnd:
            assert have[src] and not have[dst]
            have[dst] = True
    assert all(have)
    assert s.broadcast == tuple(tuple((d, c) for c, d in rnd) for rnd in reversed(s.reduce))


def test_schedule_examples_and_errors() -> None:
    assert tree_schedule(3).reduce == (((1, 0),), ((2, 0),))
    assert tree_schedule(5).reduce == (((1, 0), (3, 2)), ((2, 0),), ((4, 0),))
    assert star_schedule(3, 1) == TreeSchedule(3, (((0, 1), (2, 1)),), (((1, 0), (1, 2)),), 1)
    assert star_schedule(1).rounds == 0
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgumentError):
            tree_schedule(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        star_schedule(3, 3)


def _tree_sum(n: int, dtype: torch.dtype, star: bool) -> tuple[list[torch.Tensor], dict[str, dict[str, int]]]:
    r = lowband.rank()
    a, b = data(r, (7, 3), dtype, 1), data(r, (5,), dtype, 2)
    sched = star_schedule(n) if star else tree_schedule(n)
    out = itree([a, b], sched, name="t").wait()
    again = itree([b], sched).wait()  # a second call on the same group (the next tag)
    assert torch.equal(again[0], out[1])
    assert torch.equal(a, data(r, (7, 3), dtype, 1))  # the input is not modified
    return out, lowband.counters()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
@pytest.mark.parametrize("star", [False, True])
def test_tree_sum_bit_exact(n: int, dtype: torch.dtype, star: bool) -> None:
    res = run_threads(_tree_sum, n, n, dtype, star, timeout=60, trace=True)
    ref_a = sum(data(r, (7, 3), dtype, 1) for r in range(n))
    ref_b = sum(data(r, (5,), dtype, 2) for r in range(n))
    sched = star_schedule(n) if star else tree_schedule(n)
    per_msg = (21 + 5) * torch.empty(0, dtype=dtype).element_size()
    for r, (out, counters) in enumerate(res):
        assert torch.equal(out[0], ref_a) and torch.equal(out[1], ref_b), f"rank {r}"
        rs, rr, bs, br = sched.counts(r)
        sent = sum(c["bytes_sent"] for op, c in counters.items() if op.startswith("tree_"))
        recv = sum(c["bytes_received"] for op, c in counters.items() if op.startswith("tree_"))
        one = 5 * torch.empty(0, dtype=dtype).element_size()  # the second call's message
        assert sent == (rs + bs) * (per_msg + one) and recv == (rr + br) * (per_msg + one), f"rank {r}"


def _custom(n: int) -> list[torch.Tensor]:
    r = lowband.rank()
    seen: list[int] = []

    def keep_max(mine: list[torch.Tensor], got: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        seen.append(src)
        return [torch.maximum(mine[0], got[0])]

    out = itree([torch.tensor([float(r), -float(r)])], tree_schedule(n), keep_max).wait()
    sched = tree_schedule(n)
    assert seen == [s for rnd in sched.reduce for s, d in rnd if d == lowband.rank()]
    partial = itree([torch.tensor([float(r)])], sched, broadcast=False).wait()
    return [out[0], partial[0]]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_custom_combine_and_reduce_only(n: int) -> None:
    res = run_threads(_custom, n, n, timeout=60)
    for r, (out, partial) in enumerate(res):
        assert out.tolist() == [float(n - 1), 0.0]
        held = [s for s in range(n) if s == r or (s > r and (r == 0 or (s - r) < (r & -r)))]
        assert partial.tolist() == [float(sum(held))], (r, partial)


def _wrong_schedule(n: int) -> None:
    itree([torch.zeros(2)], tree_schedule(n + 1))


def test_schedule_of_another_size_is_refused() -> None:
    with pytest.raises(RankFailures, match="TreeSchedule of 2 ranks"):
        run_threads(_wrong_schedule, 2, 2, timeout=30)
