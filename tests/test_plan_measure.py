"""``lowband.plan.measure``: the ring model from an allreduce fit (pure maths), and a real probe between
gloo ranks that gives every rank the same :class:`~lowband.plan.Links`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.errors import InvalidArgumentError
from lowband.localsgd.profiler import COMM_SIZES
from lowband.plan import Links
from lowband.plan.measure import PROBE_SIZES, describe, links_from_fit, measure_links, probe
from lowband.testing import run_threads


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 64),
    st.floats(1e-7, 1.0),
    st.floats(1e-12, 1e-3),
    st.sampled_from([0, 1, 4096, 10**6, 64 * 2**20]),
)
def test_fit_round_trip(n: int, alpha: float, beta: float, nbytes: int) -> None:
    """The converted links' ring allreduce costs what the fit says, and converting back gives the fit."""
    links = links_from_fit(n, alpha, beta)
    assert links.world == n
    assert math.isclose(links.allreduce(nbytes), alpha + beta * nbytes, rel_tol=1e-9)
    a2, b2 = links.fit()
    # the least-squares fit's rounding is relative to the largest fitted time
    assert math.isclose(a2, alpha, rel_tol=1e-6, abs_tol=1e-12 + 1e-9 * beta * max(COMM_SIZES))
    assert math.isclose(b2, beta, rel_tol=1e-6, abs_tol=1e-18)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 64), st.floats(1e3, 1e11), st.floats(0.0, 0.5))
def test_links_round_trip(n: int, bandwidth: float, latency: float) -> None:
    """Links -> (alpha, beta) -> Links gives the same bandwidth and latency."""
    alpha, beta = Links(n, bandwidth, latency).fit()
    back = links_from_fit(n, alpha, beta)
    assert math.isclose(back.bandwidth, bandwidth, rel_tol=1e-6)
    assert math.isclose(back.latency, latency, rel_tol=1e-6, abs_tol=1e-12)


def test_formula_and_edges() -> None:
    # 4 ranks: 6 steps; alpha 6 ms -> 1 ms per step; beta 1.5 / bandwidth -> 12.5 MB/s (100 Mbit/s)
    links = links_from_fit(4, 0.006, 1.5 / 12.5e6)
    assert math.isclose(links.latency, 0.001) and math.isclose(links.bandwidth, 12.5e6)
    assert links.label == "measured: 100.0 Mbit/s, 1 ms per step"
    assert links_from_fit(1, 0.5, 1e-6) == Links(1, math.inf, 0.0, describe(math.inf, 0.0))
    free = links_from_fit(3, 0.001, 0.0)
    assert free.bandwidth == math.inf and free.allreduce(10**9) == pytest.approx(0.001)
    assert links_from_fit(2, 0.0, 5e-324).bandwidth == math.inf  # beyond float: unshaped
    assert "Gbit/s" in links_from_fit(2, 0.0, 1e-9).label
    assert links_from_fit(2, 0.0, 1e-6, label="x").label == "x"
    for bad in ((0, 0.0, 0.0), (2, -1.0, 0.0), (2, 0.0, math.nan), (2, 0.0, math.inf), (True, 0.0, 0.0)):
        with pytest.raises(InvalidArgumentError, match="links_from_fit"):
            links_from_fit(*bad)  # type: ignore[arg-type]


def test_probe_sizes_cover_fast_links() -> None:
    """The largest probe takes longer than the cap at 1 Gbit/s over 2 ranks (so the slope is measured
    there), and at 10 Mbit/s the probe stops long before it (first size over the cap: under 1 MiB)."""
    from lowband.localsgd.profiler import COMM_TIME_CAP

    gbit, ten_mbit = Links(2, 125e6), Links(2, 1.25e6)
    assert gbit.allreduce(max(PROBE_SIZES)) > COMM_TIME_CAP
    first_over = next(s for s in PROBE_SIZES if ten_mbit.allreduce(s) >= COMM_TIME_CAP)
    assert first_over <= 2**20
    spent = sum(4 * ten_mbit.allreduce(s) for s in PROBE_SIZES if s <= first_over)  # warm-up + 3 timed
    assert spent < 5.0


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_gets_the_same_links(n: int) -> None:
    sizes = (4096, 65536, 2**20)

    def rank_fn() -> tuple[Links, dict[str, object]]:
        p = probe(sizes=sizes, repeats=2)
        assert measure_links(sizes=sizes, repeats=1).world == n
        return p.links, p.to_json()

    results = run_threads(rank_fn, n, timeout=60.0)
    links, record = results[0]
    assert all(r == results[0] for r in results)
    assert links.world == n and links.label.startswith("measured: ")
    assert links.bandwidth > 0 and links.latency >= 0
    measured = [b for b, _ in record["samples"]]  # type: ignore[attr-defined]
    assert record["measured"] is True and len(measured) >= 2 and measured == list(sizes[: len(measured)])


def test_world_of_one() -> None:
    (links,) = run_threads(lambda: measure_links(sizes=(4096, 8192)), 1)
    assert links.world == 1 and links.bandwidth == math.inf and links.latency == 0.0


def _loaded() -> tuple[float, float, float]:
    import lowband
    from lowband.plan.measure import loaded_latency

    p = probe(sizes=(4096, 16384))
    quiet = links_from_fit(p.links.world, p.alpha, p.beta).latency
    return loaded_latency(lowband.world(), repeats=3, burst_s=0.001), p.links.latency, quiet


def test_the_latency_is_the_larger_of_the_quiet_and_the_loaded_one() -> None:
    out = run_threads(_loaded, 3, timeout=120)
    assert len({o[1] for o in out}) == 1  # every rank alike
    for loaded, latency, quiet in out:
        assert loaded > 0
        assert latency >= quiet
