"""``diloco``'s automatic choices: ``fragments=auto`` (the pure rule, property-tested; the strategy's choice
from a given or a measured profile, the same on every rank, checkpointed) and ``inner_steps=auto`` (the
pure budget rule; per-machine inner steps with the outer average weighted by them, against a
single-process oracle to 1e-10 at 1-4 ranks; measured steps agreed by every rank); bad options refused."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_loop_api import _flat, _loss, _model

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, LayerCost
from lowband.localsgd.fragments import choose_fragments, max_fragments, split_fragments
from lowband.localsgd.inner_budget import CAP, budget_steps, machine_times, sample_scales
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_threads

OUTER = "sgd:lr=0.7;momentum=0.9;nesterov=true"
SIZES = [512, 192, 48, 96, 16]  # the test model's tensors in bytes (float64)


def _opt(p: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


# -- fragments=auto: the pure rule ------------------------------------------------------------------


def _exposed(sizes: list[int], f: int, window: float, alpha: float, beta: float, ratio: float) -> float:
    return sum(
        max(0.0, alpha + beta * ratio * sum(sizes[i] for i in fr) - window)
        for fr in split_fragments(sizes, f)
    )


@given(
    st.lists(st.integers(1, 10**7), min_size=1, max_size=25),
    st.floats(0.0, 2.0),
    st.floats(0.0, 0.1),
    st.floats(0.0, 1e-6),
    st.integers(1, 40),
    st.integers(1, 6),
    st.floats(0.001, 1.0),
)
def test_auto_fragments_are_the_fewest_with_the_least_exposed_time(
    sizes: list[int], step: float, alpha: float, beta: float, H: int, delay: int, ratio: float
) -> None:
    most = max_fragments(len(sizes), H, delay)
    kw = {
        "step_seconds": step,
        "alpha": alpha,
        "beta": beta,
        "inner_steps": H,
        "delay": delay,
        "ratio": ratio,
    }
    if most < 1:
        with pytest.raises(InvalidArgumentError, match="fragments=auto"):
            choose_fragments(sizes, **kw)  # type: ignore[arg-type]
        return
    c = choose_fragments(sizes, **kw)  # type: ignore[arg-type]
    f = c.count
    assert 1 <= f <= most and delay * f < H and f <= len(sizes)
    assert [i for fr in c.fragments for i in fr] == list(range(len(sizes)))  # every tensor once, in order
    assert all(c.fragments)
    window = delay * step
    want = [_exposed(sizes, g, window, alpha, beta, ratio) for g in range(1, most + 1)]
    assert c.exposed == want
    assert want[f - 1] == min(want)  # the least exposed time ...
    assert all(want[g] > want[f - 1] for g in range(f - 1))  # ... and no fewer fragments reach it
    if want[f - 1] == 0.0:
        assert max(c.exchange) <= window  # every exchange hidden
    assert str(f) in c.explain()


def test_auto_fragments_on_known_numbers() -> None:
    # 900 bytes at 1/288 s per byte: 3.1 s in one exchange; a 1.5 s window (delay 1) is first met by
    # 3 fragments of 300 B (1.04 s); with a 10 s window one fragment already fits
    kw = {"alpha": 0.0, "beta": 1 / 288, "inner_steps": 12, "delay": 1}
    c = choose_fragments([100] * 9, step_seconds=1.5, **kw)  # type: ignore[arg-type]
    assert c.count == 3 and c.exposed[-1] == 0.0 and c.exposed[0] > 0.0  # 300 B -> 1.04 s <= 1.5 s
    assert choose_fragments([100] * 9, step_seconds=10.0, **kw).count == 1  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="delay=0"):
        choose_fragments([1, 2], step_seconds=1.0, alpha=0.0, beta=1.0, inner_steps=4, delay=0)


# -- fragments=auto: the strategy -------------------------------------------------------------------


def _profile(step: float, beta: float) -> CostProfile:
    return CostProfile((LayerCost("a", step / 3, 2 * step / 3, 0.0, 864),), alpha=0.0, beta=beta)


def _run(opts: dict[str, object], steps: int) -> tuple[list[float], dict[str, object], dict[str, object]]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("diloco", m, _opt, outer=OUTER, **opts)
    for k in range(steps):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return _flat(m), s.report(), s.state_dict()


@pytest.mark.parametrize("n", [1, 3])
def test_auto_fragments_from_a_profile_train_as_the_chosen_split(n: int) -> None:
    # 864 B at beta: 2.5 s in one exchange against a 1 s window (delay 1, step 1 s)
    prof = _profile(1.0, 2.5 / 864)
    want_f = choose_fragments(SIZES, step_seconds=1.0, alpha=0.0, beta=2.5 / 864, inner_steps=6, delay=1)
    auto = run_threads(
        _run, n, {"inner_steps": 6, "fragments": "auto", "delay": 1, "profile": prof}, 9, timeout=120
    )
    fixed = run_threads(_run, n, {"inner_steps": 6, "fragments": want_f.count, "delay": 1}, 9, timeout=120)
    assert want_f.fragments == split_fragments(SIZES, want_f.count)
    for (pa, ra, sa), (pf, _, _) in zip(auto, fixed, strict=True):
        assert pa == pf
        assert ra["fragments_chosen"] == want_f.count > 1
        assert "fragments=auto chose F=" in ra["auto"][0]  # type: ignore[index]
        assert sa["extra"]["fragments"] == want_f.fragments  # type: ignore[index]


def test_auto_fragments_under_inner_ddp_from_a_profile() -> None:
    prof = _profile(1.0, 2.5 / 864)
    base = {"inner_steps": 6, "delay": 1, "inner": "ddp"}
    auto = run_threads(_run, 4, {**base, "fragments": "auto", "profile": prof}, 9, timeout=120, local_size=2)
    f = auto[0][1]["fragments_chosen"]
    fixed = run_threads(_run, 4, {**base, "fragments": f}, 9, timeout=120, local_size=2)
    assert f > 1 and all(rep["fragments_chosen"] == f for _, rep, _ in auto)
    for (pa, _, _), (pf, _, _) in zip(auto, fixed, strict=True):
        assert pa == pf


def _lazy(path: str) -> tuple[list[list[int]], list[float], list[float]]:
    """fragments=auto measured at the first step (saved to ``path``); a fresh run loading its checkpoint
    takes the split from it without profiling, and continues exactly."""
    r = lowband.rank()
    opts = {"inner_steps": 4, "fragments": "auto", "delay": 1, "profile": path}
    m1 = _model()
    s1 = make_strategy("diloco", m1, _opt, outer=OUTER, **opts)
    for k in range(3):
        s1.train_step(lambda mod, k=k: _loss(mod, r, k))
    sd = copy.deepcopy(s1.state_dict())
    m2 = _model()
    s2 = make_strategy("diloco", m2, _opt, outer=OUTER, **{**opts, "profile": None})
    s2.load_state_dict(sd)
    assert s2.fragments == s1.fragments and s2._replay is not None
    for s in (s1, s2):
        for k in range(3, 7):
            s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return s1.fragments, _flat(m1), _flat(m2)


def test_auto_fragments_measured_at_the_first_step_agree_and_resume(tmp_path: Path) -> None:
    path = str(tmp_path / "prof.json")
    out = run_threads(_lazy, 2, path, timeout=120)
    assert out[0][0] == out[1][0] and [i for f in out[0][0] for i in f] == list(range(5))
    for _, a, b in out:
        assert a == b
    assert Path(path).exists()


# -- inner_steps=auto: the pure rule ----------------------------------------------------------------


@given(st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=8), st.integers(1, 50))
def test_budget_steps_fit_the_slowest_machines_period(times: list[float], base: int) -> None:
    steps = budget_steps(times, base)
    slow = max(times)
    if slow <= 1.1 * min(times):
        assert steps == [base] * len(times)  # homogeneous: the documented fallback
        return
    for h, t in zip(steps, times, strict=True):
        assert base <= h <= CAP * base
        assert h == base or h * t <= base * slow * (1 + 1e-12)  # fits the budget
        assert h == CAP * base or (h + 1) * t > base * slow * (1 - 1e-12)  # and no more would
    assert steps[times.index(slow)] == base
    scales = sample_scales(steps)
    assert math.isclose(sum(scales), len(steps))


def test_machine_times_take_each_machines_slowest_rank() -> None:
    assert machine_times([1.0, 3.0, 2.0, 0.5], 2) == [3.0, 2.0]
    with pytest.raises(InvalidArgumentError, match="machines of 2"):
        machine_times([1.0, 2.0, 3.0], 2)


# -- inner_steps=auto: the weighted outer step against an oracle ------------------------------------

PERIODS = 3
STEPS_OF = [3, 5, 2, 4]  # fixed inner steps per machine


def _weighted_oracle(hs: list[int], per: int = 1) -> list[list[float]]:
    """Every machine m (``per`` ranks training one replica on the mean of their gradients) takes
    ``hs[m]`` inner steps per period on its ranks' own batches (their k-th step's), then the global
    parameters take an outer Nesterov step on sum_m H_m * (global - local_m) / sum_m H_m and every
    machine continues from them."""
    glob = _model()
    gp = list(glob.parameters())
    reps = [copy.deepcopy(glob) for _ in hs]
    inner = [_opt(m.parameters()) for m in reps]
    outer = torch.optim.SGD(gp, lr=0.7, momentum=0.9, nesterov=True)
    done = [0] * len(hs)
    for _ in range(PERIODS):
        for mi, m in enumerate(reps):
            for _ in range(hs[mi]):
                grads = []
                for lr in range(per):
                    m.zero_grad()
                    _loss(m, mi * per + lr, done[mi]).backward()
                    grads.append([q.grad.clone() for q in m.parameters()])  # type: ignore[union-attr]
                for i, q in enumerate(m.parameters()):
                    q.grad = sum(g[i] for g in grads) / per  # type: ignore[assignment]
                inner[mi].step()
                done[mi] += 1
        with torch.no_grad():
            for i, g in enumerate(gp):
                g.grad = sum(hs[m] * (g - list(reps[m].parameters())[i]) for m in range(len(hs))) / sum(hs)
            outer.step()
            outer.zero_grad(set_to_none=True)
            for m in reps:
                for q, g in zip(m.parameters(), gp, strict=True):
                    q.copy_(g)
    return [_flat(reps[r // per]) for r in range(len(hs) * per)]


def _weighted(hs: list[int], per: int) -> list[float]:
    opts: dict[str, object] = {
        "inner_steps": "auto",
        "base_steps": 2,
        "machine_steps": ",".join(map(str, hs)),
    }
    if per > 1:
        opts["inner"] = "ddp"
    got, rep, _ = _run(opts, PERIODS * hs[lowband.rank() // per])
    assert rep["machine_steps"] == hs and rep["outer_steps"] == PERIODS
    return got


@pytest.mark.parametrize(("n", "per"), [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2)])
def test_sample_weighted_outer_step_matches_the_oracle(n: int, per: int) -> None:
    hs = STEPS_OF[: n // per]
    got = run_threads(_weighted, n, hs, per, timeout=120, local_size=per if per > 1 else None)
    want = _weighted_oracle(hs, per)
    for r in range(n):
        worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(got[r], want[r], strict=True))
        assert worst < 1e-10, worst


def _resume_steps(opts: dict[str, object], hs: list[int]) -> tuple[list[float], list[float]]:
    """Per-machine steps with a fragment in flight: every rank saves at the end of its first period (its
    ``H_m`` steps: the same exchanges done on every rank, the last fragment's still in flight), loads
    into a fresh strategy and continues; the uninterrupted run takes the same steps."""
    r = lowband.rank()
    m1, m2 = _model(), _model()
    s1 = make_strategy("diloco", m1, _opt, outer=OUTER, **opts)
    assert s1.period_steps == hs[r]  # type: ignore[attr-defined]
    for k in range(hs[r]):
        s1.train_step(lambda mod, k=k: _loss(mod, r, k))
    sd = copy.deepcopy(s1.state_dict())
    assert sd["extra"]["pending"]  # the last fragment's exchange, due one step later
    s2 = make_strategy("diloco", m2, _opt, outer=OUTER, **opts)
    s2.load_state_dict(sd)
    for s in (s1, s2):
        for k in range(hs[r], 3 * hs[r]):
            s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return _flat(m1), _flat(m2)


def test_resume_with_per_machine_steps_and_fragments_in_flight_is_exact() -> None:
    hs = [3, 5, 4]
    opts = {
        "inner_steps": "auto", "base_steps": 3, "machine_steps": "3,5,4", "fragments": 2, "delay": 1,
        "compressor": "topk:ratio=0.3",
    }  # fmt: skip
    for a, b in run_threads(_resume_steps, 3, opts, hs, timeout=120):
        assert a == b


def _measured() -> tuple[list[int] | None, list[str]]:
    """Rank 1 is slow (a 40 ms sleep in each step's loss): after the first period of base_steps, every
    rank holds the same steps per machine, the slow one keeping the base."""
    r = lowband.rank()
    s = make_strategy("diloco", _model(), _opt, inner_steps="auto", base_steps=2)

    def loss(mod: torch.nn.Module, k: int) -> torch.Tensor:
        if r == 1:
            time.sleep(0.04)
        return _loss(mod, r, k)

    for k in range(2):
        s.train_step(lambda mod, k=k: loss(mod, k))
    return s.machine_steps, s.auto_log


def test_measured_inner_steps_agree_and_favour_the_fast_rank() -> None:
    (s0, log0), (s1, _) = run_threads(_measured, 2, timeout=120)
    assert s0 == s1 and s0 is not None
    assert s0[1] == 2 and s0[0] > 2
    assert "inner_steps=auto" in log0[0]


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"fragments": "auto", "inner_steps": 4}, "fragments=auto needs delay >= 1"),
        ({"fragments": "auto", "delay": 1, "topology": "ring"}, "fragments=auto models"),
        ({"fragments": 2, "profile": "x.json"}, "profile= is read by fragments=auto"),
        ({"inner_steps": "auto", "topology": "ring"}, "inner_steps=auto weights"),
        ({"inner_steps": 4, "machine_steps": "3,4"}, "machine_steps= goes with inner_steps=auto"),
        ({"inner_steps": "auto", "machine_steps": "3,x"}, "machine_steps='3,x'"),
        ({"inner_steps": "auto", "machine_steps": "3,4"}, "one per machine"),
        ({"inner_steps": "auto", "base_steps": 4, "machine_steps": "3"}, "ints >= base_steps=4"),
        ({"inner_steps": "soon"}, "inner_steps"),
        ({"fragments": "auto", "delay": 1, "profile": "/no/such/dir/p.json"}, "no such directory"),
    ],
)
def test_bad_auto_options_are_refused(opts: dict[str, object], message: str) -> None:
    def fn() -> None:
        make_strategy("diloco", _model(), lambda p: torch.optim.SGD(p, lr=0.1), **opts)

    with pytest.raises(RankFailures, match=message):
        run_threads(fn, 1, timeout=60)


def test_the_bench_refuses_inner_steps_auto_before_it_starts() -> None:
    from lowband.bench.validate import check_fixed_steps

    check_fixed_steps(["ddp", "diloco:inner_steps=20,fragments=auto,delay=1"])
    with pytest.raises(InvalidArgumentError, match="inner_steps=auto"):
        check_fixed_steps(["ddp", "diloco:inner_steps=auto,base_steps=20"])
