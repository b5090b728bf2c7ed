"""lowband.comm.agree: every rank learns whether all ranks hold equal ints, and all raise the same error."""

from __future__ import annotations

import pytest
import torch

import lowband
from lowband.comm.agree import agree
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.testing import run_threads


def _values(rank: int, n: int, differ: set[int], at: int) -> list[int]:
    """Seeded values of length n; ranks in ``differ`` change position ``at``."""
    gen = torch.Generator().manual_seed(1234)
    vals = torch.randint(-(2**40), 2**40, (n,), generator=gen).tolist()
    if rank in differ:
        vals[at] += 1 + rank
    return vals


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 3, 40])  # empty, inline in the row, and longer than a row
def test_equal_values_pass(world: int, n: int) -> None:
    def body() -> int:
        r = lowband.rank()
        agree(None, "the values", _values(r, n, set(), 0))
        agree(None, "the values again", _values(r, n, set(), 0))
        return r

    assert run_threads(body, world) == list(range(world))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [3, 40])
def test_differing_values_raise_on_every_rank(world: int, n: int) -> None:
    differ = {world - 1}
    at = n - 2

    def body() -> str:
        r = lowband.rank()
        mine = _values(r, n, differ, at)
        try:
            agree(None, "the layout", mine, fields=[f"field{i}" for i in range(n)])
        except CollectiveMismatchError as e:
            return str(e)
        raise AssertionError(f"rank {r}: no error")

    msgs = run_threads(body, world)
    ref = _values(0, n, set(), 0)
    bad = _values(world - 1, n, differ, at)
    for r, msg in enumerate(msgs):
        assert f"lowband.agree on rank {r}: ranks [{world - 1}] differ from rank 0 in the layout" in msg
        assert f"field{at} is {ref[at]} on rank 0 but {bad[at]} on rank {world - 1}" in msg, msg


def test_differing_counts_and_subjects() -> None:
    def counts() -> str:
        r = lowband.rank()
        try:
            agree(None, "the sizes", [1] * (3 + r), where=f"test on rank {r}")
        except CollectiveMismatchError as e:
            return str(e)
        raise AssertionError("no error")

    for r, msg in enumerate(run_threads(counts, 3)):
        assert msg.startswith(f"test on rank {r}: ranks [1, 2] differ from rank 0 in the sizes")
        assert "3 values on rank 0 but 4 on rank 1" in msg, msg

    def subjects() -> str:
        r = lowband.rank()
        try:
            agree(None, f"thing {r}", [1])
        except CollectiveMismatchError as e:
            return str(e)
        raise AssertionError("no error")

    assert all("agree on different things" in m for m in run_threads(subjects, 2))


def test_agree_against_a_checked_collective_is_a_clean_error() -> None:
    """One rank agrees while the other runs a checked collective: both raise, no gloo abort."""

    def body() -> str:
        r = lowband.rank()
        try:
            if r == 0:
                agree(None, "the layout", [1, 2, 3])
            else:
                lowband.allreduce(torch.ones(3))
        except CollectiveMismatchError as e:
            return str(e)
        raise AssertionError("no error")

    a, b = run_threads(body, 2)
    assert "rank 1 of group 'world' called allreduce of a float32 tensor of shape (3,)" in a, a
    assert "lowband.agree" in b, b


def test_bad_arguments() -> None:
    def body() -> None:
        with pytest.raises(InvalidArgumentError, match="must be ints"):
            agree(None, "x", ["a"])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError, match="fit in int64"):
            agree(None, "x", [2**70])
        with pytest.raises(InvalidArgumentError, match="what must be a str"):
            agree(None, 3, [1])  # type: ignore[arg-type]

    run_threads(body, 2)
