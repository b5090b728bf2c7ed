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


# -- the collectives of the scale predictions ----------------------------------------------------------
def _new_times(nb: int, n: int, bw: float, lat: float) -> list[float]:
    return [
        coll.tree_allreduce_time(nb, n, bw, lat),
        coll.alltoall_time([nb] * (n - 1), n, bw, lat),
        coll.ps_time(nb, nb, n, bw, lat),
        coll.gossip_time(nb, min(1, n - 1), n, bw, lat),
        coll.halving_doubling_time(nb, n, bw, lat),
        coll.star_time(nb, n, bw, lat),
    ]


@settings(max_examples=200, deadline=None)
@given(sizes, sizes, worlds, bandwidths, latencies)
def test_new_collectives_monotonic_in_bytes(a: int, b: int, n: int, bw: float, lat: float) -> None:
    lo, hi = sorted((a, b))
    for t_lo, t_hi in zip(_new_times(lo, n, bw, lat), _new_times(hi, n, bw, lat)):
        assert 0.0 <= t_lo <= t_hi
    assert coll.tree_allreduce_sent(lo, n) <= coll.tree_allreduce_sent(hi, n)
    assert coll.halving_doubling_sent(lo, n) <= coll.halving_doubling_sent(hi, n)
    assert coll.ps_sent(lo, lo, n) <= coll.ps_sent(hi, hi, n)


@settings(max_examples=200, deadline=None)
@given(sizes, worlds, worlds, bandwidths, latencies)
def test_monotonic_in_world_size(nb: int, a: int, b: int, bw: float, lat: float) -> None:
    # more ranks never cost less for the ring collectives, an all-to-all of equal blocks, the
    # halving/doubling tree and a star; one-peer gossip costs the same at every size above one
    small, big = sorted((a, b))
    for f in (coll.allreduce_time, coll.allgather_time, coll.halving_doubling_time, coll.star_time):
        assert f(nb, small, bw, lat) <= f(nb, big, bw, lat) * (1 + 1e-12)
    assert coll.alltoall_time([nb] * (small - 1), small, bw, lat) <= coll.alltoall_time(
        [nb] * (big - 1), big, bw, lat
    ) * (1 + 1e-12)
    if small > 1:
        assert coll.gossip_time(nb, 1, small, bw, lat) == coll.gossip_time(nb, 1, big, bw, lat)


@settings(max_examples=100, deadline=None)
@given(sizes, bandwidths, latencies)
def test_new_collectives_world_of_one_cost_nothing(nb: int, bw: float, lat: float) -> None:
    assert _new_times(nb, 1, bw, lat) == [0.0] * 6
    assert coll.tree_allreduce_sent(nb, 1) == 0 and coll.halving_doubling_sent(nb, 1) == 0
    assert coll.ps_sent(nb, nb, 1) == 0 and coll.gossip_sent(nb, 1, 1) == 0
    assert coll.alltoall_sent([], 1) == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**7), st.integers(1, 40))
def test_tree_bytes_agree_with_lowbands_schedule(message: int, n: int) -> None:
    # gs-SGD's tree as lowband runs it (lowband.compress.tree) and counts it (sparse_costs): the mean
    # over ranks of the bytes sent is the formula's
    from lowband.compress.sparse_costs import gs_sgd_bytes, schedule_bytes
    from lowband.compress.tree import tree_schedule

    s = tree_schedule(n)
    total = sum(schedule_bytes(s, r, message)[0] for r in range(n))
    assert total == pytest.approx(coll.halving_doubling_sent(message, n) * n)
    assert s.rounds == coll.halving_doubling_rounds(n)
    gs = sum(gs_sgd_bytes(1000, n, r, k=10, rows=5, cols=40)[0] for r in range(n)) / n
    assert gs == pytest.approx(coll.halving_doubling_sent(5 * 40 * 4, n) + coll.allreduce_sent(40, n))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 64), st.integers(1, 10**5))
def test_ps_bytes_agree_with_the_transports_model(numel: int, n: int, push: int) -> None:
    # lowband's ps transport (tests/test_compress_transports_state.py's byte model): the all-to-all
    # sends one payload to each other owner, the allgather (n - 1) padded shards of float32
    shard = math.ceil(numel / n) * 4
    assert coll.ps_sent(push, shard, n) == (n - 1) * push + (n - 1) * math.ceil(numel / n) * 4
    assert coll.alltoall_sent([push] * (n - 1), n) == (n - 1) * push


def test_new_collectives_by_hand() -> None:
    assert [coll.tree_allreduce_steps(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 3, 2, 4, 3, 5]
    assert coll.tree_allreduce_time(1e6, 8, 1e6, 0.01) == pytest.approx(3 * 1.01)
    assert coll.alltoall_time([1e6, 2e6, 0], 4, 1e6, 0.01) == pytest.approx(3.03)  # uneven blocks
    assert coll.ps_time(1e5, 2.5e5, 4, 1e6) == pytest.approx(0.3 + 0.75)
    assert coll.gossip_time(1e6, 2, 8, 1e6, 0.01) == pytest.approx(2.01)  # two peers at once
    assert coll.halving_doubling_time(1e6, 5, 1e6) == pytest.approx(6.0)  # 2 ceil(log2 5) rounds
    assert coll.star_time(1e6, 4, 1e6) == pytest.approx(6.0)  # 3 in, 3 out over the root's link
    with pytest.raises(InvalidArgumentError, match="one block per other rank"):
        coll.alltoall_time([1.0], 3, 1e6)
    with pytest.raises(InvalidArgumentError, match="peers"):
        coll.gossip_time(1.0, 4, 4, 1e6)


def test_links_at_another_size() -> None:
    links = Links(4, 12.5e6, 0.002, "4 ranks, 100 Mbit/s per rank")
    big = links.at(1024)
    assert (big.world, big.bandwidth, big.latency) == (1024, 12.5e6, 0.002)
    assert big.allreduce(1e6) == coll.allreduce_time(1e6, 1024, 12.5e6, 0.002)
    assert big.halving_doubling(1e3) == coll.halving_doubling_time(1e3, 1024, 12.5e6, 0.002)
    assert links.at(1).gossip(1e6, 0) == 0.0
    with pytest.raises(InvalidArgumentError):
        links.at(0)
