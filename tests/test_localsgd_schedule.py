"""DreamDDP's cost model and schedulers (pure maths, one process).

Oracles: hand-computed event-model timelines (binary fractions, so equalities are exact), brute-force
enumeration for the dynamic programme, a literal walk of Algorithm 2's listing for the memoised search,
and closed forms where the paper's properties make DreamDDP exact.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowband.errors import InvalidArgumentError
from lowband.localsgd import (
    SCHEDULERS,
    CostProfile,
    IntervalCosts,
    LayerCost,
    Schedule,
    count_dreamddp_solutions,
    dreamddp_sets,
    dreamddp_solutions,
    exposed_comm_time,
    fill_bubbles,
    flsgd_period_time,
    iteration_time,
    make_schedule,
    objective_eq8,
    period_time,
    random_profile,
    schedule_bruteforce,
    schedule_dreamddp,
    schedule_enp,
    schedule_full,
    schedule_optimal,
    scheduler_names,
)


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-11, abs=1e-15)


def hand_profile(comm: tuple[float, float, float] = (2.0, 1.0, 4.0)) -> CostProfile:
    # forward 3 s; backward of index 2, 1, 0 ends at 3, 5, 6 s after the forward
    return CostProfile.from_lists([1.0, 1.0, 1.0], [1.0, 2.0, 3.0], list(comm))


PROFILES = [
    random_profile(L, seed, comm_ratio=r)
    for L in (1, 2, 3, 5, 8)
    for seed in (0, 1, 2)
    for r in (0.0, 0.3, 1.0, 3.0, 10.0)
]


# ----------------------------------------------------------------------------- the event model


@pytest.mark.parametrize(
    ("layer_set", "expected"),
    [
        ((), 9.0),  # 3 + 6
        ((2,), 10.0),  # comm 3 -> 7
        ((1,), 9.0),  # comm 5 -> 6, hidden exactly
        ((0,), 11.0),  # comm 6 -> 8, after the backward
        ((1, 2), 11.0),  # 3 -> 7, then 7 -> 8 (layer 1 waits for the link)
        ((0, 2), 12.0),  # 3 -> 7, then 7 -> 9
        ((0, 1, 2), 13.0),  # 3 -> 7 -> 8 -> 10
    ],
)
def test_iteration_time_by_hand(layer_set: tuple[int, ...], expected: float) -> None:
    assert iteration_time(hand_profile(), layer_set) == expected
    assert iteration_time(hand_profile(), reversed(layer_set)) == expected  # order of the set is irrelevant


def test_period_and_eq8_by_hand() -> None:
    p = hand_profile()
    sets = [(2,), (1,), (0,)]
    assert period_time(p, sets) == 30.0
    assert exposed_comm_time(p, sets) == 3.0  # 30 - 3 * (3 + 6)
    # Eq. 8: 3 + max(3, 4) | 5 + max(1, 1) | 6 + max(0, 2)
    assert objective_eq8(p, sets) == 21.0
    assert objective_eq8(p, [(), (0, 1, 2)]) == 6.0 + 3.0 + max(3.0, 7.0)
    assert flsgd_period_time(p, 3) == 27.0 + 7.0
    # a wait the interval approximation ignores: layer 0's averaging waits for its backward
    q = hand_profile((2.0, 1.0, 0.5))
    assert iteration_time(q, (0, 2)) == 11.0  # 3 -> 3.5, then 6 -> 8
    assert objective_eq8(q, [(0, 2)]) + q.fwd_total == 9.0  # 3 + max(3, 2.5), + forward


def test_fill_bubbles_by_hand() -> None:
    q = hand_profile((2.0, 1.0, 0.5))
    s = Schedule.from_sets(q, [(1, 2), (0,)], "manual")
    f = fill_bubbles(q, s)
    # set 0 holds the latest layer: nothing to add; set 1: {2} and then {2, 1} fit in its bubble (end 8)
    assert f.sets == ((1, 2), (0, 1, 2))
    assert f.predicted_iterations == s.predicted_iterations == (9.0, 11.0)
    p = hand_profile()  # comm(2) = 4 no longer fits before layer 0's averaging: nothing added
    assert fill_bubbles(p, Schedule.from_sets(p, [(1, 2), (0,)], "manual")).sets == ((1, 2), (0,))


@pytest.mark.parametrize("profile", PROFILES[::3])
def test_event_model_bounds(profile: CostProfile) -> None:
    L, base = profile.L, profile.fwd_total + profile.bwd_total
    full = tuple(range(L))
    # never below the compute time; the first layer's averaging is never hidden; never above serial
    assert iteration_time(profile, full) >= base
    assert iteration_time(profile, full) >= base + profile.layers[0].comm - 1e-15
    assert iteration_time(profile, full) <= base + profile.comm_total + 1e-15
    sets = schedule_enp(profile, 3).sets
    assert period_time(profile, sets) >= objective_eq8(profile, sets) + 3 * profile.fwd_total - 1e-12


# ----------------------------------------------------------------------------- every scheduler


@pytest.mark.parametrize("method", sorted(SCHEDULERS))
@pytest.mark.parametrize("H", [1, 2, 3, 5])
def test_schedules_valid(method: str, H: int) -> None:
    for p in PROFILES:
        s = make_schedule(method, p, H)
        assert s.period == H and len(s.sets) == H and len(s.predicted_iterations) == H
        s.validate(p.L)
        assert all(0 <= i < p.L for st_ in s.sets for i in st_)
        assert all(c >= 1 for c in s.sync_counts(p.L))
        assert s.predicted_period == approx(period_time(p, s.sets))
        assert s.predicted_iterations == tuple(iteration_time(p, x) for x in s.sets)
        if H == 1:
            assert s.sets == (tuple(range(p.L)),)
        if method not in ("dreamddp", "dreamddp-ls"):  # only bubble filling makes sets overlap
            assert sum(len(x) for x in s.sets) == p.L
        for step in range(2 * H + 1):
            assert s.layers_at(step) == s.sets[step % H]


def test_enp_and_full() -> None:
    p = random_profile(10, 0)
    assert schedule_enp(p, 4).sets == ((7, 8, 9), (4, 5, 6), (2, 3), (0, 1))
    assert schedule_enp(random_profile(2, 0), 4).sets == ((1,), (0,), (), ())
    assert schedule_full(p, 3).sets == ((), (), tuple(range(10)))
    assert schedule_full(p, 3).method == "full" and schedule_enp(p, 3).method == "enp"


@pytest.mark.parametrize("objective", ["event", "eq8"])
def test_dp_equals_bruteforce(objective: str) -> None:
    cost = {"event": period_time, "eq8": objective_eq8}[objective]
    for p in PROFILES:
        for H in (1, 2, 3, 4):
            dp, bf = (
                schedule_optimal(p, H, objective=objective),
                schedule_bruteforce(p, H, objective=objective),
            )
            assert cost(p, dp.sets) == approx(cost(p, bf.sets))
            for other in ("enp", "full", "dreamddp"):  # unfilled: the same search space
                o = make_schedule(other, p, H, **({"fill_bubbles": False} if other == "dreamddp" else {}))
                assert cost(p, dp.sets) <= cost(p, o.sets) * (1 + 1e-12) + 1e-15
    assert schedule_optimal(p, 2, objective="eq8").method == "optimal-eq8"


@pytest.mark.parametrize("measure", ["span", "sum"])
def test_dreamddp_matches_literal_algorithm2(measure: str) -> None:
    for p in PROFILES + [random_profile(14, s, comm_ratio=r) for s in range(4) for r in (0.5, 1.5, 4.0)]:
        for H in (1, 2, 3, 4, 6):
            omega = dreamddp_solutions(p, H, measure=measure)
            assert len(omega) == count_dreamddp_solutions(p, H, measure=measure) <= 2 ** (H - 1)
            assert len(set(omega)) == len(omega)
            chosen = dreamddp_sets(p, H, measure=measure)
            assert chosen in omega
            assert period_time(p, chosen) == approx(min(period_time(p, o) for o in omega))
            for o in omega:  # the search space: consecutive intervals, sets[0] the latest layers
                flat = [i for s in o for i in reversed(s)]
                assert flat == list(range(p.L - 1, -1, -1))
            unfilled = schedule_dreamddp(p, H, fill_bubbles=False, measure=measure)
            assert unfilled.sets == chosen
            assert unfilled.predicted_period >= schedule_optimal(p, H).predicted_period * (1 - 1e-12)


@pytest.mark.parametrize("measure", ["span", "sum"])
def test_dreamddp_exact_when_all_comm_hides(measure: str) -> None:
    # comm(i) <= bwd(i - 1) and sum(comm) <= backward after the latest layer: every averaging hides but
    # layer 0's, which no schedule can hide. Algorithm 2 puts every layer but maybe layer 0 into L_1
    # (Property 1; "sum" takes layer 0 too, "span" sees it spill and searches both) and is optimal.
    for seed in range(5):
        base = random_profile(12, seed, comm_ratio=0.0)
        layers = list(base.layers)
        for i in range(1, len(layers)):
            layers[i] = LayerCost(layers[i].name, layers[i].fwd, layers[i].bwd, 0.9 * layers[i - 1].bwd)
        layers[0] = LayerCost(layers[0].name, layers[0].fwd, layers[0].bwd, 0.7e-3)
        p = CostProfile(tuple(layers))
        assert p.comm_total <= p.bwd_below[p.L - 1]
        for H in (1, 2, 5):
            expected = H * (p.fwd_total + p.bwd_total) + p.layers[0].comm
            first = dreamddp_sets(p, H, measure=measure)[0]
            assert (
                first == tuple(range(p.L))
                if measure == "sum" or H == 1
                else first[-p.L + 1 :] == tuple(range(1, p.L))
            )
            d, o = schedule_dreamddp(p, H, measure=measure), schedule_optimal(p, H)
            assert d.predicted_period == approx(expected)
            assert o.predicted_period == approx(expected)
            # the bubbles of the other iterations take every layer but layer 0 (always exposed)
            assert all(set(s) >= set(range(1, p.L)) for s in d.sets)


def test_dreamddp_span_reaches_the_optimum() -> None:
    # Empirical, on fixed inputs (no proof): with Eq. 7's span measure, Algorithm 2's argmin over Ω has been
    # optimal on every profile tried (20,000 random small ones, every profile of the benchmark). The "sum" reading
    # is not (see test below); this pins the behaviour the benchmark reports.
    extra = [random_profile(L, s, comm_ratio=r) for L in (12, 25) for s in range(3) for r in (0.5, 1.0, 2.0)]
    for p in PROFILES + extra:
        for H in (2, 3, 5):
            d = schedule_dreamddp(p, H, fill_bubbles=False)
            assert d.predicted_period == approx(schedule_optimal(p, H).predicted_period)


def test_dreamddp_sum_reading_can_miss() -> None:
    # Eq. 10's sum says everything hides in L_1, but the late layers' averagings wait for their backward
    p = random_profile(30, 0, comm_ratio=1.0)
    d, o = schedule_dreamddp(p, 5, measure="sum"), schedule_optimal(p, 5)
    assert dreamddp_sets(p, 5, measure="sum")[0] == tuple(range(30))
    assert d.predicted_period > o.predicted_period + 1e-3


def test_dreamddp_h1_and_l_below_h() -> None:
    p = random_profile(3, 4, comm_ratio=2.0)
    assert schedule_dreamddp(p, 1).sets == ((0, 1, 2),)
    s = schedule_dreamddp(p, 6, fill_bubbles=False)
    s.validate(3)
    assert s.predicted_period == approx(schedule_optimal(p, 6).predicted_period)  # H >= L: singletons


@pytest.mark.parametrize("method", ["dreamddp", "optimal", "enp", "full"])
def test_bubble_filling_invariants(method: str) -> None:
    for p in PROFILES:
        for H in (1, 2, 4):
            kw = {"fill_bubbles": False} if method == "dreamddp" else {}
            s = make_schedule(method, p, H, **kw)
            f = fill_bubbles(p, s)
            assert f.predicted_iterations == s.predicted_iterations  # never slower (nor faster)
            L = p.L
            for a, b in zip(s.sets, f.sets):
                added = sorted(set(b) - set(a), reverse=True)
                assert set(a) <= set(b)
                assert added == list(range(L - 1, L - 1 - len(added), -1))  # a run of the latest layers
                if L - 1 in a:
                    assert a == b


def test_dreamddp_fast_at_scale() -> None:
    p = random_profile(200, 0, comm_ratio=2.0)
    t0 = time.perf_counter()
    s = schedule_dreamddp(p, 10)
    assert time.perf_counter() - t0 < 10.0  # loose sanity bound: it takes milliseconds
    s.validate(200)
    assert s.predicted_period >= schedule_optimal(p, 10).predicted_period * (1 - 1e-12)


# ----------------------------------------------------------------------------- determinism, JSON, errors


def test_determinism_and_json_round_trips() -> None:
    assert random_profile(9, 3, comm_ratio=1.5) == random_profile(9, 3, comm_ratio=1.5)
    assert random_profile(9, 3) != random_profile(9, 4)
    p = random_profile(9, 3, comm_ratio=1.5)
    assert p.comm_total == approx(1.5 * p.bwd_total)
    q = CostProfile.from_json(json.loads(json.dumps(p.to_json())))
    assert q == p and q.alpha == p.alpha and q.beta == p.beta
    for name in scheduler_names():
        s = make_schedule(name, p, 4)
        assert make_schedule(name, p, 4) == s
        assert Schedule.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_bad_inputs() -> None:
    p = random_profile(4, 0)
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(InvalidArgumentError, match="H"):
            schedule_dreamddp(p, bad)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgumentError, match="make_schedule: unknown scheduler 'nope'; known: bruteforce"
    ):
        make_schedule("nope", p, 2)
    with pytest.raises(InvalidArgumentError, match="unknown option"):
        make_schedule("enp", p, 2, fill_bubbles=True)
    with pytest.raises(InvalidArgumentError, match="measure"):
        schedule_dreamddp(p, 2, measure="max")
    with pytest.raises(InvalidArgumentError, match="objective"):
        schedule_optimal(p, 2, objective="wall")
    with pytest.raises(InvalidArgumentError, match="layer index 4"):
        iteration_time(p, [4])
    with pytest.raises(InvalidArgumentError, match="comm"):
        LayerCost("x", 1.0, 1.0, math.nan)
    with pytest.raises(InvalidArgumentError, match="bwd"):
        LayerCost("x", 1.0, -1.0, 1.0)
    with pytest.raises(InvalidArgumentError, match="at least one layer"):
        CostProfile(())
    with pytest.raises(InvalidArgumentError, match="never averaged"):
        Schedule(2, ((0, 1), (2,)), "m", 1.0, (0.5, 0.5)).validate(4)
    with pytest.raises(InvalidArgumentError, match="holds layer"):
        Schedule(1, ((0, 1, 2, 3, 4),), "m", 1.0, (1.0,)).validate(4)
    with pytest.raises(InvalidArgumentError, match="one set per local iteration"):
        Schedule(2, ((0, 1, 2, 3),), "m", 1.0, (1.0,))
    with pytest.raises(InvalidArgumentError, match="twice"):
        Schedule(1, ((0, 0),), "m", 1.0, (1.0,))
    with pytest.raises(InvalidArgumentError, match="step"):
        schedule_full(p, 2).layers_at(-1)
    with pytest.raises(InvalidArgumentError, match="max_candidates"):
        schedule_bruteforce(random_profile(60, 0), 8)
    with pytest.raises(InvalidArgumentError, match="limit"):
        dreamddp_solutions(random_profile(40, 1, comm_ratio=1.0), 8, limit=0)
    with pytest.raises(InvalidArgumentError, match=r"Schedule\.from_json"):
        Schedule.from_json({"period": 1})


# ----------------------------------------------------------------------------- properties

times = st.floats(min_value=0.0, max_value=1e-2, allow_nan=False, allow_infinity=False)


@st.composite
def profiles(draw: st.DrawFn, max_layers: int = 6) -> CostProfile:
    L = draw(st.integers(1, max_layers))
    cols = [draw(st.lists(times, min_size=L, max_size=L)) for _ in range(3)]
    return CostProfile.from_lists(cols[0], cols[1], cols[2])


@settings(max_examples=150, deadline=None)
@given(profiles(), st.integers(1, 4), st.sampled_from(["span", "sum"]))
def test_property_schedulers(p: CostProfile, H: int, measure: str) -> None:
    opt = schedule_optimal(p, H)
    assert opt.predicted_period == approx(schedule_bruteforce(p, H).predicted_period)
    d = schedule_dreamddp(p, H, measure=measure)
    d.validate(p.L)
    assert d.predicted_period >= opt.predicted_period * (1 - 1e-12) - 1e-15
    nofill = schedule_dreamddp(p, H, fill_bubbles=False, measure=measure)
    assert d.predicted_iterations == nofill.predicted_iterations
    assert nofill.sets in dreamddp_solutions(p, H, measure=measure)
    assert period_time(p, d.sets) >= objective_eq8(p, d.sets) + H * p.fwd_total - 1e-12
    assert flsgd_period_time(p, H) >= schedule_full(p, H).predicted_period - 1e-12


@settings(max_examples=150, deadline=None)
@given(profiles(8), st.data())
def test_property_event_model(p: CostProfile, data: st.DataObject) -> None:
    L = p.L
    s = data.draw(st.sets(st.integers(0, L - 1)))
    extra = data.draw(st.integers(0, L - 1))
    # adding a layer never shortens an iteration (what bubble filling's bisection relies on)
    assert iteration_time(p, s | {extra}) >= iteration_time(p, s)
    # splitting an interval into two iterations never costs more than keeping it whole plus an empty one
    lo, hi = sorted(data.draw(st.tuples(st.integers(0, L - 1), st.integers(0, L - 1))))
    cut = data.draw(st.integers(lo, hi))
    whole = iteration_time(p, range(lo, hi + 1)) + iteration_time(p, ())
    split = iteration_time(p, range(cut + 1, hi + 1)) + iteration_time(p, range(lo, cut + 1))
    assert split <= whole + 1e-15


# ----------------------------------------------------------------------------- interference (kappa, sigma)


def eq7_reference(p: CostProfile, layer_set: tuple[int, ...]) -> float:
    """Eq. 7 written out independently (no interference), the oracle for kappa = sigma = 0."""
    bwd_end, t, comm = 0.0, 0.0, -math.inf
    ends = {}
    for i in range(p.L - 1, -1, -1):
        t += p.layers[i].bwd
        ends[i] = t
    bwd_end = t
    for i in sorted(layer_set, reverse=True):
        comm = max(ends[i], comm) + p.layers[i].comm
    return p.fwd_total + max(bwd_end, comm)


@pytest.mark.parametrize(
    ("comm", "kappa", "sigma", "layer_set", "expected"),
    [
        # kappa = sigma = 1: both run at half speed while overlapped (backward ends at 3, 5, 6 quietly)
        ((2.0, 1.0, 4.0), 1.0, 1.0, (), 9.0),
        ((2.0, 1.0, 4.0), 1.0, 1.0, (2,), 13.0),  # 3..9 both (bwd 3 done, comm 3 of 4), comm 9..10; +3
        ((2.0, 1.0, 4.0), 1.0, 1.0, (1,), 10.0),  # 5..7 both: comm 1 and bwd 1 end together; +3
        ((2.0, 1.0, 4.0), 1.0, 1.0, (0,), 11.0),  # no overlap: 6..8; +3
        (
            (2.0, 1.0, 4.0),
            1.0,
            1.0,
            (1, 2),
            14.0,
        ),  # 3..7 layer 1 (q 4 -> 2, +1), 7..9 layer 0 (q 3 -> 2), 9..11
        ((2.0, 1.0, 4.0), 1.0, 1.0, (0, 2), 15.0),  # 3..7 (q -> 2), 7..9 (q -> 1, +2), 9..12
        ((2.0, 1.0, 4.0), 1.0, 1.0, (0, 1, 2), 16.0),  # 3..7 (q -> 2, +1), 7..9 (q -> 2, +2), 9..13
        # only computation slowed: comm 3..7 beside 2 s of backward, 1 s of backward left, ends 8; +3
        ((2.0, 1.0, 4.0), 1.0, 0.0, (2,), 11.0),
        # only communication slowed: backward 3..6 beside 1.5 s of comm, 2.5 s left, ends 8.5; +3
        ((2.0, 1.0, 4.0), 0.0, 1.0, (2,), 11.5),
        # the queue drains inside layer 1: 3..3.5 both (layer 1 at 0.25 of 2), layer 1 ends 5.25,
        # layer 0 alone 5.25..6.25, then its comm 6.25..8.25; +3
        ((2.0, 1.0, 0.5), 1.0, 0.0, (0, 2), 11.25),
    ],
)
def test_interference_by_hand(
    comm: tuple[float, float, float], kappa: float, sigma: float, layer_set: tuple[int, ...], expected: float
) -> None:
    p = hand_profile(comm).with_interference(kappa, sigma)
    assert p.interference == (kappa > 0 or sigma > 0)
    assert iteration_time(p, layer_set) == expected
    if layer_set:  # the interval costs of the dynamic programme run the same timeline
        lo, hi = min(layer_set), max(layer_set)
        if layer_set == tuple(range(lo, hi + 1)):
            assert IntervalCosts(p).cost(lo, hi) == expected


def test_interference_period_and_schedules_by_hand() -> None:
    p = hand_profile().with_interference(1.0, 1.0)
    assert period_time(p, [(2,), (1,), (0,)]) == 13.0 + 10.0 + 11.0
    assert exposed_comm_time(p, [(2,), (1,), (0,)]) == 34.0 - 27.0
    assert flsgd_period_time(p, 3) == 27.0 + 7.0  # no overlap, no interference
    assert objective_eq8(p, [(2,), (1,), (0,)]) == 21.0  # the paper's formula, unchanged
    # {0, 1} alone: layer 1 ends at 5 (q 1), 5..7 layer 0 beside it (q 1 -> 0, +2), 7..9; +3 -> 12
    assert iteration_time(p, (0, 1)) == 12.0
    # H = 2, every cut of 2 <- 1 <- 0: {}+{0,1,2} 9+16, {2}+{0,1} 13+12, {1,2}+{0} 14+11, {0,1,2}+{} 16+9
    assert schedule_optimal(p, 2).predicted_period == 25.0
    assert schedule_bruteforce(p, 2).predicted_period == 25.0
    assert schedule_dreamddp(p, 2).predicted_period == 25.0


def test_interference_zero_is_eq7() -> None:
    for p in PROFILES:
        z = p.with_interference(0.0, 0.0)
        assert z == p and not z.interference
        tiny = p.with_interference(1e-15, 1e-15)  # takes the timeline code path
        sets = [tuple(range(p.L)), tuple(range(0, p.L, 2)), (p.L - 1,), ()]
        for s in sets:
            assert iteration_time(z, s) == eq7_reference(p, s)  # bit-identical to Eq. 7
            assert iteration_time(tiny, s) == approx(eq7_reference(p, s))
        for H in (1, 3):
            assert schedule_optimal(z, H) == schedule_optimal(p, H)
            assert schedule_dreamddp(tiny, H, fill_bubbles=False).predicted_period == approx(
                schedule_dreamddp(p, H, fill_bubbles=False).predicted_period
            )


INTERFERENCE = [(0.5, 0.0), (0.0, 0.5), (0.75, 0.3), (2.0, 1.0)]


@pytest.mark.parametrize(("kappa", "sigma"), INTERFERENCE)
def test_interference_dp_bruteforce_and_dreamddp(kappa: float, sigma: float) -> None:
    for p0 in PROFILES[::2]:
        p = p0.with_interference(kappa, sigma)
        for H in (1, 2, 3):
            dp, bf = schedule_optimal(p, H), schedule_bruteforce(p, H)
            assert period_time(p, dp.sets) == approx(period_time(p, bf.sets))
            for measure in ("span", "sum"):
                omega = dreamddp_solutions(p, H, measure=measure)
                assert len(omega) == count_dreamddp_solutions(p, H, measure=measure)
                chosen = dreamddp_sets(p, H, measure=measure)
                assert chosen in omega
                assert period_time(p, chosen) == approx(min(period_time(p, o) for o in omega))
                d = schedule_dreamddp(p, H, measure=measure)
                assert d.predicted_period >= dp.predicted_period * (1 - 1e-12)
                nofill = schedule_dreamddp(p, H, fill_bubbles=False, measure=measure)
                # bubble filling keeps every iteration's time (to rounding: the timeline is not
                # monotone at the last ulp)
                assert d.predicted_iterations == pytest.approx(nofill.predicted_iterations, rel=1e-12)
                assert d.predicted_iterations == tuple(iteration_time(p, s) for s in d.sets)


def test_interference_fast_at_scale() -> None:
    p = random_profile(200, 0, comm_ratio=2.0).with_interference(0.7, 0.3)
    t0 = time.perf_counter()
    s = schedule_dreamddp(p, 10)
    assert time.perf_counter() - t0 < 10.0  # loose sanity bound: it takes milliseconds
    s.validate(200)
    opt = schedule_optimal(p, 10)
    assert s.predicted_period >= opt.predicted_period * (1 - 1e-12)
    # the interference makes the same schedule slower than the paper's model predicts
    assert period_time(p, opt.sets) > period_time(random_profile(200, 0, comm_ratio=2.0), opt.sets)


def test_interference_json_and_validation() -> None:
    p = random_profile(5, 1, comm_ratio=1.5).with_interference(0.8125, 1 / 3)
    d = json.loads(json.dumps(p.to_json()))
    assert d["kappa"] == 0.8125 and d["sigma"] == 1 / 3
    q = CostProfile.from_json(d)
    assert q == p and (q.kappa, q.sigma) == (0.8125, 1 / 3)
    del d["kappa"], d["sigma"]  # a profile saved before interference was measured
    old = CostProfile.from_json(d)
    assert (old.kappa, old.sigma) == (0.0, 0.0) and old == p.with_interference(0.0, 0.0)
    for bad in (-0.1, math.nan, math.inf, True, "1"):
        with pytest.raises(InvalidArgumentError, match="kappa"):
            p.with_interference(bad, 0.0)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="sigma"):
            CostProfile(p.layers, sigma=bad)  # type: ignore[arg-type]


factors = st.floats(min_value=0.0, max_value=3.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(profiles(6), st.data(), factors, factors, factors, factors)
def test_property_interference_monotone(
    p: CostProfile, data: st.DataObject, k: float, s: float, dk: float, ds: float
) -> None:
    L = p.L
    layers = data.draw(st.sets(st.integers(0, L - 1)))
    extra = data.draw(st.integers(0, L - 1))
    lo, hi = p.with_interference(k, s), p.with_interference(k + dk, s + ds)
    # larger kappa or sigma never decreases the predicted time; never below the paper's model
    assert iteration_time(hi, layers) >= iteration_time(lo, layers) - 1e-15
    assert iteration_time(lo, layers) >= iteration_time(p, layers) - 1e-15
    # adding a layer never shortens an iteration (bubble filling's bisection relies on it)
    assert iteration_time(lo, layers | {extra}) >= iteration_time(lo, layers) - 1e-15
    # never above running everything serially, slowed throughout
    serial = p.fwd_total + (1 + k) * p.bwd_total + (1 + s) * sum(p.layers[i].comm for i in layers)
    assert iteration_time(lo, layers) <= serial + 1e-12


@settings(max_examples=100, deadline=None)
@given(profiles(), st.integers(1, 4), st.sampled_from(["span", "sum"]), factors, factors)
def test_property_interference_schedulers(p: CostProfile, H: int, measure: str, k: float, s: float) -> None:
    p = p.with_interference(k, s)
    opt = schedule_optimal(p, H)
    assert opt.predicted_period == approx(schedule_bruteforce(p, H).predicted_period)
    d = schedule_dreamddp(p, H, measure=measure)
    d.validate(p.L)
    assert d.predicted_period >= opt.predicted_period * (1 - 1e-12) - 1e-15
    nofill = schedule_dreamddp(p, H, fill_bubbles=False, measure=measure)
    assert d.predicted_iterations == pytest.approx(nofill.predicted_iterations, rel=1e-12, abs=1e-15)
    assert nofill.sets in dreamddp_solutions(p, H, measure=measure)
