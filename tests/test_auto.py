"""``auto`` (lowband.strategies.auto): the plan's choice, built and trained as if given by hand; the drift
watch; a switch carries the consensus model and optimizer state; a checkpoint resumes the choice.

The profile is synthetic (the test model's own layers, fixed times, fixed operation costs) and the links
are given, so the choice is known in advance and is the same on every run.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_loop_api import _flat, _loss, _model, _opt
from test_plan_models import FixedOps

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile
from lowband.optim.layerwise import parameter_layers
from lowband.plan.drift import DriftWatch, window_steps
from lowband.plan.links import Links
from lowband.plan.planner import Acceptance, make_plan, recommend
from lowband.plan.profile import PlanProfile
from lowband.strategies import auto_switch, make_strategy
from lowband.strategies.registry import parse_strategy_spec, wants_probe
from lowband.testing import RankFailures, run_threads

MS = 1e-3
FAST = 1e12  # bytes/s: communication is free, so local steps (no compression work) are the fastest
SLOW = 1e3  # bytes/s: a compressor sending 1 % of the bytes (FixedOps) wins
# thread ranks cannot build torch DDP (ddp, powersgd): the candidates here are lowband's own reducers
ONLY = "compressed|localsgd"


def _profile() -> PlanProfile:
    layers = parameter_layers(_model())
    names = [n for n, _ in layers]
    nbytes = [sum(p.numel() * p.element_size() for p in ps) for _, ps in layers]
    cost = CostProfile.from_lists(
        [1 * MS] * len(names), [2 * MS] * len(names), [0.0] * len(names), names=names, nbytes=nbytes
    )
    shapes = tuple(tuple(tuple(p.shape) for p in ps) for _, ps in layers)
    return PlanProfile("test", 5, cost, shapes, tuple(8 for _ in names), 1 * MS, FixedOps())


def _expected(n: int, bandwidth: float, only: str, accept: Acceptance | None = None) -> str:
    entries = make_plan(auto_switch.candidate_specs(only), _profile(), Links(n, bandwidth))
    best = recommend(entries, accept or Acceptance())
    assert best is not None
    return best


# -- the drift watch (pure) -------------------------------------------------------------------------


@given(st.floats(1e-4, 10.0), st.lists(st.floats(0.81, 1.19), max_size=20))
def test_steps_within_the_tolerance_never_replan(base: float, factors: list[float]) -> None:
    w = DriftWatch(0.2)
    assert not w.observe(base)
    assert not any(w.observe(base * f) for f in factors)


@given(st.floats(1e-4, 10.0), st.floats(1.3, 10.0), st.integers(1, 4))
def test_drifted_windows_in_a_row_replan_and_one_outlier_does_not(base: float, f: float, k: int) -> None:
    w = DriftWatch(0.2, windows=k)
    w.observe(base)
    for _ in range(k - 1):
        assert not w.observe(base * f)
    if k > 1:
        assert not w.observe(base)  # back within the tolerance: the count starts again
        for _ in range(k - 1):
            assert not w.observe(base / f)
    assert w.observe(base / f if k > 1 else base * f)
    w.reset()
    assert w.baseline is None and not w.observe(base * f)


def test_drift_watch_refuses_bad_input() -> None:
    for bad in (0, -1.0, math.inf, "x"):
        with pytest.raises(InvalidArgumentError, match="tolerance"):
            DriftWatch(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="windows"):
        DriftWatch(0.2, windows=0)
    with pytest.raises(InvalidArgumentError, match="seconds"):
        DriftWatch(0.2).observe(math.nan)


@given(st.integers(1, 500), st.integers(1, 50))
def test_windows_hold_whole_periods(every: int, h: int) -> None:
    w = window_steps(every, h)
    assert w % h == 0 and every <= w < every + h


# -- the choice, built as given by hand ---------------------------------------------------------------


def _train(name: str, opts: dict[str, Any], steps: int) -> tuple[list[float], str, dict[str, Any]]:
    r = lowband.rank()
    m = _model()
    s = make_strategy(name, m, _opt, **opts)
    for k in range(steps):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return _flat(m), s.label(), s.report()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(("bandwidth", "kind"), [(FAST, "localsgd"), (SLOW, "compressed")])
def test_auto_trains_exactly_as_the_plans_choice(n: int, bandwidth: float, kind: str) -> None:
    want = _expected(n, bandwidth, ONLY)
    opts = {"profile": _profile(), "links": Links(n, bandwidth), "only": ONLY, "drift": 0.0}
    got = run_threads(_train, n, "auto", opts, 6, timeout=120)
    name, options = parse_strategy_spec(want)
    direct = run_threads(_train, n, name, options, 6, timeout=120)
    assert n == 1 or want.startswith(kind)
    for (pa, label, rep), (pd, _, _) in zip(got, direct, strict=True):
        assert pa == pd
        assert label == f"auto({want})" and rep["auto"]["chosen"] == want
        assert rep["auto"]["history"][0]["why"].startswith(want)


def test_convergence_limits_narrow_the_choice() -> None:
    accept = Acceptance(max_local_steps=1)
    want = _expected(2, FAST, ONLY, accept)
    assert want.startswith("compressed")  # localsgd is faster, but takes local steps
    opts = {"profile": _profile(), "links": Links(2, FAST), "only": ONLY, "drift": 0.0}
    got = run_threads(_train, 2, "auto", {**opts, "max_local_steps": 1}, 2, timeout=60)
    assert {label for _, label, _ in got} == {f"auto({want})"}


def _lazy(loop: bool) -> tuple[list[float], str, str]:
    """No profile: the first training step profiles (its forward replayed, or train_step's loss)."""
    r, n = lowband.rank(), lowband.size()
    m = _model()
    s = make_strategy("auto", m, _opt, links=Links(n, FAST), only=ONLY, drift=0.0)
    assert s.label() == "auto(not chosen yet)"
    with torch.no_grad():
        s.module.eval()
        s.module(torch.zeros(1, 6, dtype=torch.float64))  # evaluation before training chooses nothing
        s.module.train()
    assert s.inner is None
    for k in range(6):
        if loop:
            s.zero_grad()
            s.backward(_loss(s.module, r, k))
            s.step()
        else:
            s.train_step(lambda mod, k=k: _loss(mod, r, k))
    return _flat(m), s.label(), s.history[0]["why"]


@pytest.mark.parametrize("loop", [True, False])
def test_without_a_profile_the_first_step_chooses_on_every_rank_alike(loop: bool) -> None:
    got = run_threads(_lazy, 3, loop, timeout=120)
    labels = {label for _, label, _ in got}
    assert len(labels) == 1
    spec = labels.pop()[len("auto(") : -1]
    name, options = parse_strategy_spec(spec)
    direct = run_threads(_train, 3, name, options, 6, timeout=120)
    for (pa, _, why), (pd, _, _) in zip(got, direct, strict=True):
        assert pa == pd and why.startswith(spec)


# -- switching ----------------------------------------------------------------------------------------


def _switch_from_local_steps() -> tuple[list[float], list[float], list[float], list[float], dict[str, Any]]:
    r = lowband.rank()
    m = _model()
    opts = {"profile": _profile(), "links": Links(lowband.size(), SLOW), "only": "localsgd", "drift": 0.0}
    s = make_strategy("auto", m, _opt, **opts)
    assert s.spec.startswith("localsgd")
    for k in range(7):  # mid-period: the replicas differ
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    before = _flat(m)
    mom = torch.cat(
        [st["momentum_buffer"].reshape(-1) for st in auto_switch.base_optimizer(s.optimizer).state.values()]
    )
    carried = auto_switch.switch(s, "stage")
    after = _flat(m)
    mom2 = torch.cat(
        [st["momentum_buffer"].reshape(-1) for st in auto_switch.base_optimizer(s.optimizer).state.values()]
    )
    for k in range(7, 10):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    assert s.steps == 10 and s.label() == "auto(stage)"
    return before, after, mom.tolist(), mom2.tolist(), carried


@pytest.mark.parametrize("n", [2, 3])
def test_a_switch_carries_the_consensus_model_and_optimizer_state(n: int) -> None:
    out = run_threads(_switch_from_local_steps, n, timeout=120)
    mean = torch.tensor([o[0] for o in out], dtype=torch.float64).mean(0)
    mean_mom = torch.tensor([o[2] for o in out], dtype=torch.float64).mean(0)
    assert len({tuple(o[0]) for o in out}) > 1  # the replicas differed before the switch
    for _, after, _, mom2, carried in out:
        assert torch.allclose(torch.tensor(after, dtype=torch.float64), mean, rtol=0, atol=1e-12)
        assert torch.allclose(torch.tensor(mom2, dtype=torch.float64), mean_mom, rtol=0, atol=1e-12)
        assert carried["model"] == "consensus" and carried["optimizer_state"] == "averaged"


def _replan_and_resume() -> tuple[list[float], list[float], str, str, list[dict[str, Any]]]:
    r, n = lowband.rank(), lowband.size()
    opts = {"profile": _profile(), "links": Links(n, FAST), "only": ONLY, "drift": 0.0}
    m = _model()
    s = make_strategy("auto", m, _opt, **opts)
    first = s.spec
    for k in range(3):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    assert s.replan("the test", links=Links(n, SLOW))
    sd = copy.deepcopy(s.state_dict())
    m2 = _model()
    s2 = make_strategy("auto", m2, _opt, **opts)  # fast links: starts with the first choice
    assert s2.spec == first
    s2.load_state_dict(sd)
    for t in (s, s2):
        for k in range(3, 6):
            t.train_step(lambda mod, k=k: _loss(mod, r, k))
    assert [h["reason"] for h in s2.history] == ["resumed"]
    return _flat(m), _flat(m2), first, s2.spec, json.loads(json.dumps(s.history))


@pytest.mark.parametrize("n", [2, 3])
def test_a_replan_switches_and_a_checkpoint_resumes_the_choice_exactly(n: int) -> None:
    out = run_threads(_replan_and_resume, n, timeout=120)
    for a, b, first, resumed, history in out:
        assert first.startswith("localsgd") and resumed.startswith("compressed")
        assert a == b
        assert [h["reason"] for h in history] == ["start", "the test"]
        assert history[1]["carried"]["optimizer_state"] == "averaged"


def _slow_down(sleep_from: int) -> list[dict[str, Any]]:
    r, n = lowband.rank(), lowband.size()
    opts = {
        "profile": _profile(),
        "links": Links(n, FAST),
        "only": "compressed",
        "drift": 1.5,  # a window 2.5x the baseline; steps of 40 ms against 200 ms: load cannot fake it
        "check_every": 4,
    }
    m = _model()
    s = make_strategy("auto", m, _opt, **opts)

    def loss(mod: torch.nn.Module, k: int) -> torch.Tensor:
        time.sleep(0.04 if k < sleep_from else 0.2)
        return _loss(mod, r, k)

    for k in range(28):
        s.train_step(lambda mod, k=k: loss(mod, k))
    return list(s.history)


def test_a_slower_pace_replans_and_a_steady_one_does_not() -> None:
    steady = run_threads(_slow_down, 2, 10_000, timeout=120)
    assert all(len(h) == 1 and len(h[0]["windows_ms"]) == 6 for h in steady)
    slowed = run_threads(_slow_down, 2, 12, timeout=120)
    for h in slowed:
        assert [e["reason"].split(":")[0] for e in h] == ["start", "drift"]
        assert h[1]["step"] == 20  # warm-up 1-4, baseline 5-8, within 9-12, drifted 13-16 and 17-20
        assert h[1]["spec"] == h[0]["spec"]  # the same links: the same choice, nothing switched


# -- profiles and bad input ---------------------------------------------------------------------------


def test_a_plan_json_profile_round_trips(tmp_path: Path) -> None:
    p = _profile()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"profile": p.to_json()}))
    data = json.loads(path.read_text())["profile"]
    q = PlanProfile.from_json(data)
    assert q.cost.layers == p.cost.layers and q.shapes == p.shapes and q.elem_sizes == p.elem_sizes
    assert q.step_s == pytest.approx(p.step_s)
    with pytest.raises(InvalidArgumentError, match="not a plan profile"):
        PlanProfile.from_json({"layers": []})


def _saved_profile(path: str) -> tuple[str, bool, str]:
    r, n = lowband.rank(), lowband.size()
    opts = {"profile": path, "links": Links(n, SLOW), "only": ONLY, "drift": 0.0}
    s = make_strategy("auto", _model(), _opt, **opts)  # a missing file: measured at the first step, saved
    s.train_step(lambda mod: _loss(mod, r, 0))
    saved = Path(path).exists()
    s2 = make_strategy("auto", _model(), _opt, **opts)  # read at construction: chosen before any step
    return s.label(), saved, s2.label()


def test_a_missing_profile_file_is_measured_and_saved_for_the_next_run(tmp_path: Path) -> None:
    out = run_threads(_saved_profile, 2, str(tmp_path / "plan.json"), timeout=120)
    for first, saved, second in out:
        assert saved and first == second != "auto(not chosen yet)"
    assert (
        PlanProfile.from_json(json.loads((tmp_path / "plan.json").read_text())["profile"]).workload == "auto"
    )


def _build(opts: dict[str, Any]) -> None:
    make_strategy("auto", _model(), _opt, **opts)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"profile": "x.json", "probe": _loss}, "not both"),
        ({"profile": __file__}, "cannot read the profile"),  # not JSON
        ({"links": Links(3, FAST), "probe": _loss}, "describes 3 ranks but the group has 2"),
        ({"only": "nope", "probe": _loss}, "only must be"),
        ({"only": "auto", "probe": _loss}, "only must be"),
        ({"check_every": 0, "probe": _loss}, "check_every"),
    ],
)
def test_bad_options_are_one_clear_error(opts: dict[str, Any], match: str) -> None:
    with pytest.raises(RankFailures, match=match):
        run_threads(_build, 2, opts, timeout=60)


def test_no_accepted_candidate_raises_on_every_rank() -> None:
    opts = {"profile": _profile(), "links": Links(2, SLOW), "only": "localsgd", "max_local_steps": 1}
    with pytest.raises(RankFailures, match="no candidate strategy") as e:
        run_threads(_build, 2, opts, timeout=60)
    assert "rank 0" in str(e.value) and "rank 1" in str(e.value)


def test_the_bench_gives_auto_a_probe_and_no_other_strategy() -> None:
    assert wants_probe("auto", {})
    assert not wants_probe("auto", {"profile": "plan.json"})
    assert not wants_probe("ddp", {})


def test_a_strategy_taking_over_a_run_gets_its_mid_run_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowband.strategies import registry
    from lowband.strategies.ddp import PowerSGDStrategy

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(registry, "make_strategy", lambda name, *a, **kw: seen.append(kw))

    class Fake:
        steps, local_module, _make, group, _nonfinite, _accumulate = 0, None, None, None, "raise", 1

    fake: Any = Fake()
    auto_switch.build(fake, "powersgd:rank=1")
    fake.steps = 5
    auto_switch.build(fake, "powersgd:rank=1")
    auto_switch.build(fake, "powersgd:rank=1,start_iter=7")
    assert "start_iter" not in seen[0]  # the first build trains from the first step: torch's warm-up
    assert seen[1]["start_iter"] == PowerSGDStrategy.mid_run_options["start_iter"] == 2
    assert seen[2]["start_iter"] == 7  # the spec's own option wins
