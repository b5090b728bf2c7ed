"""The planner's collective cost formulas and link model (pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.errors import InvalidArgumentError
from lowband.plan import collectives as coll
from lowband.plan.links import Links, links_from_layout
from lowband.testbed.links import build_layout

sizes = st.integers(0, 10**9)
worlds = st.integers(1, 1024)
bandwidths = st.floats(1e3, 1e11)
latencies = st.floats(0.0, 0.5)
TIMES = (coll.allreduce_time, coll.allgather_time)


@settings(max_examples=200, deadline=None)
@given(sizes, sizes, worlds, bandwidths, latencies)
def test_monotonic_in_bytes(a: int, b: int, n: int, bw: float, lat: float) -> None:
    lo, hi = sorted((a, b))
    for f in TIMES:
        assert f(lo, n, bw, lat) <= f(hi, n, bw, lat)
    assert coll.allreduce_sent(lo, n) <= coll.allreduce_sent(hi, n)
    assert coll.allgather_sent(lo, n) <= coll.allgather_sent(hi, n)


@settings(max_examples=200, deadline=None)
@given(sizes, worlds, bandwidths, bandwidths, latencies, latencies)
def test_faster_links_never_slower(nb: int, n: int, b1: float, b2: float, l1: float, l2: float) -> None:
    slow, fast = sorted((b1, b2))
    short, long_ = sorted((l1, l2))
    for f in TIMES:
        assert f(nb, n, fast, short) <= f(nb, n, slow, short)
        assert f(nb, n, fast, short) <= f(nb, n, fast, long_)
        # latency and bandwidth terms add up
        assert f(nb, n, fast, short) == pytest.approx(f(nb, n, math.inf, short) + f(nb, n, fast, 0.0))
        assert f(nb, n, math.inf, 0.0) == 0.0  # unshaped and no latency: free


@settings(max_examples=100, deadline=None)
@given(sizes, bandwidths, latencies)
def test_world_of_one_costs_nothing(nb: int, bw: float, lat: float) -> None:
    for f in TIMES:
        assert f(nb, 1, bw, lat) == 0.0
    assert coll.allreduce_sent(nb, 1) == 0 and coll.allgather_sent(nb, 1) == 0


@settings(max_examples=200, deadline=None)
@given(sizes, st.integers(2, 1024))
def test_bytes_bounds(nb: int, n: int) -> None:
    # a ring allreduce sends just under twice the buffer, an allgather n - 1 buffers
    assert nb <= coll.allreduce_sent(nb, n) * n / (n - 1) / 2 + 1
    assert coll.allreduce_sent(nb, n) <= 2 * nb
    assert coll.allgather_sent(nb, n) == (n - 1) * nb


def test_hand_computed() -> None:
    # 4 ranks, 1 MB, 1 MB/s: allreduce 6 steps of 0.25 MB; allgather 3 steps of 1 MB
    assert coll.allreduce_time(1e6, 4, 1e6) == pytest.approx(1.5)
    assert coll.allgather_time(1e6, 4, 1e6) == pytest.approx(3.0)
    assert coll.allreduce_time(0, 4, 1e6, 0.01) == pytest.approx(0.06)  # latency term: 2 (n - 1) steps
    assert coll.allgather_time(0, 3, 1e6, 0.01) == pytest.approx(0.02)
    assert coll.allreduce_sent(1000, 4) == 1500


@pytest.mark.parametrize(
    "args",
    [(-1, 2, 1.0, 0.0), (1, 0, 1.0, 0.0), (1, 2, 0.0, 0.0), (1, 2, 1.0, -1.0), (math.nan, 2, 1.0, 0.0)],
)
def test_bad_arguments(args: tuple[float, int, float, float]) -> None:
    with pytest.raises(InvalidArgumentError):
        coll.allreduce_time(*args)


def test_links_from_layout() -> None:
    flat = links_from_layout(build_layout(4, rate="100mbit"))
    assert (flat.world, flat.bandwidth, flat.latency) == (4, 12.5e6, 0.0)
    het = links_from_layout(build_layout(4, rates=["10mbit", "100mbit", "100mbit", "100mbit"], delay_ms=20))
    assert het.bandwidth == pytest.approx(1.25e6) and het.latency == pytest.approx(0.02)
    tiers = links_from_layout(build_layout(4, rate="1gbit", ranks_per_machine=2, intra_rate="100mbit"))
    assert tiers.bandwidth == pytest.approx(12.5e6)  # the slower link inside a machine paces the ring
    free_inside = links_from_layout(build_layout(4, rate="1gbit", ranks_per_machine=2))
    assert free_inside.bandwidth == pytest.approx(125e6)
    with pytest.raises(InvalidArgumentError, match="unshaped"):
        links_from_layout(build_layout(2, rate=None))


def test_fit_is_the_allreduce_line() -> None:
    links = Links(4, 12.5e6, 0.002)
    alpha, beta = links.fit()
    assert alpha == pytest.approx(6 * 0.002)
    assert beta == pytest.approx(6 / (4 * 12.5e6))
    assert Links(1, 12.5e6, 0.002).fit() == (0.0, 0.0)
