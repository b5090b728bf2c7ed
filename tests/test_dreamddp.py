"""Partial-synchronisation strategies (DreamDDP, PLSGD-ENP, FLSGD overlapped) against a single-process
simulation of Algorithm 1: K model copies, each rank's seeded batches, the same torch optimizer per copy,
and the scheduled layers averaged after each step. Ranks run as threads (lowband ops only).

Fixed schedules (a hand-made one, or one built from a synthetic profile) make the oracle tests
independent of timing; one test profiles lazily and checks the run against the oracle of the schedule it
chose.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch
from oracle import WORLD_SIZES
from torch import nn

import lowband
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.localsgd import CostProfile, Schedule, make_schedule
from lowband.localsgd.divergence import model_divergence
from lowband.localsgd.profiler import load_profile, save_profile
from lowband.localsgd.strategy import PartialSyncStrategy
from lowband.optim import parameter_layers
from lowband.strategies import make_strategy, strategy_names
from lowband.testing import run_threads

H = 3
R = 2 * H + 1
ATOL = 1e-9  # float64 models: the distributed run equals the simulation up to summation order

Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
OPTS: dict[str, Factory] = {
    "sgdm": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


def _seeded(m: nn.Module, seed: int) -> nn.Module:
    """Parameters from a private generator: ranks are threads, and the global RNG is shared."""
    g = torch.Generator().manual_seed(seed)
    m = m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def _mlp() -> nn.Module:
    return _seeded(
        nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 2)
        ),
        123,
    )


class Tied(nn.Module):
    """``b`` shares ``a``'s weight and runs first: its forward must wait for ``a``'s averaging."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.a(torch.tanh(self.b(x)))))


def _tied() -> nn.Module:
    return _seeded(Tied(), 7)


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": _mlp, "tied": _tied}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(5, 2, generator=g, dtype=torch.float64)


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((m(b[0]) - b[1]) ** 2).mean()


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _profile(model: str, comm: float) -> CostProfile:
    """A synthetic profile of the model's layers (registration order = forward order here)."""
    names = [n for n, _ in parameter_layers(MODELS[model]())]
    L = len(names)
    return CostProfile.from_lists(
        [1e-3] * L, [2e-3 + 1e-4 * i for i in range(L)], [comm * (1 + i % 2) for i in range(L)], names=names
    )


# name -> (model, strategy, options builder, optimizers)
HAND = ((3,), (0, 2, 3), (1, 3))  # overlapping sets: layer 3 in every iteration
CASES: dict[str, tuple[str, str, Callable[[], dict[str, Any]]]] = {
    "hand": ("mlp", "dreamddp", lambda: {"schedule": Schedule(H, HAND, "hand", 0.0, (0.0,) * H)}),
    "enp": ("mlp", "plsgd-enp", lambda: {"profile": _profile("mlp", 1e-3), "period": H}),
    "full": ("mlp", "flsgd-overlap", lambda: {"profile": _profile("mlp", 1e-3), "period": H}),
    "dreamddp": ("mlp", "dreamddp", lambda: {"profile": _profile("mlp", 4e-3), "period": H}),
    "tied": ("tied", "dreamddp", lambda: {"schedule": Schedule(2, ((0,), (1, 2)), "hand", 0.0, (0.0, 0.0))}),
}


def _run(case: str, opt: str, steps: int, **extra: Any) -> tuple[PartialSyncStrategy, nn.Module, list[bool]]:
    model_name, strat, options = CASES[case]
    m = MODELS[model_name]()
    s = make_strategy(strat, m, OPTS[opt], **{**options(), **extra})
    assert isinstance(s, PartialSyncStrategy)
    r = lowband.rank()
    in_sync = []
    for k in range(steps):
        batch = _batch(r, k)
        s.train_step(lambda mod, b=batch: _loss(mod, b))
        in_sync.append(s.in_sync())
    s.synchronize()
    return s, m, in_sync


def _summary(s: PartialSyncStrategy, m: nn.Module, in_sync: list[bool]) -> dict[str, Any]:
    assert s.schedule is not None
    return {
        "params": _flat(m).tolist(),
        "sets": s.schedule.sets,
        "order": s.report()["layers"],
        "counts": list(s.averager.launch_counts),
        "max_gap": list(s.averager.max_gap),
        "in_sync": in_sync,
        "gammas": [g for _, g in s.divergence_log],
    }


def oracle(
    model: str, opt: str, n: int, sets: Sequence[Sequence[int]], order: Sequence[str], steps: int
) -> tuple[list[torch.Tensor], list[float]]:
    """Algorithm 1 in one process: n copies; after each local step, average the scheduled layers.
    Returns every copy's parameters and Gamma after each step."""
    models = [MODELS[model]() for _ in range(n)]
    opts = [OPTS[opt](m.parameters()) for m in models]
    layers = [dict(parameter_layers(m)) for m in models]
    gammas = []
    for step in range(steps):
        for k in range(n):
            opts[k].zero_grad()
            _loss(models[k], _batch(k, step)).backward()  # type: ignore[no-untyped-call]
            opts[k].step()
        with torch.no_grad():
            for f in sets[step % len(sets)]:
                for ps in zip(*(lay[order[f]] for lay in layers)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
        flats = [_flat(m) for m in models]
        avg = torch.stack(flats).mean(0)
        gammas.append(float(sum(((avg - f) ** 2).sum() for f in flats)) / n)
    return [_flat(m) for m in models], gammas


def _expected_counts(
    sets: Sequence[Sequence[int]], order: Sequence[str], names: list[str], steps: int
) -> list[int]:
    counts = [0] * len(names)
    for step in range(steps):
        for f in sets[step % len(sets)]:
            counts[names.index(order[f])] += 1
    return counts


def _check_against_oracle(res: list[dict[str, Any]], model: str, opt: str, n: int, steps: int) -> None:
    sets, order = res[0]["sets"], res[0]["order"]
    want, gammas = oracle(model, opt, n, sets, order, steps)
    names = [nm for nm, _ in parameter_layers(MODELS[model]())]
    period = len(sets)
    for r in range(n):
        assert res[r]["sets"] == sets and res[r]["order"] == order, f"rank {r} schedule differs"
        got = torch.tensor(res[r]["params"], dtype=torch.float64)
        err = float((got - want[r]).abs().max())
        assert err < ATOL, f"rank {r}: parameters differ from Algorithm 1 by {err}"
        assert res[r]["counts"] == _expected_counts(sets, order, names, steps)
        assert max(res[r]["max_gap"]) <= period and min(res[r]["max_gap"]) >= 1  # every layer once per H
        full = [len(sets[k % period]) == len(names) for k in range(steps)]
        assert res[r]["in_sync"] == full
        if res[r]["gammas"]:
            assert res[r]["gammas"] == pytest.approx(gammas, rel=1e-7, abs=1e-12)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_schedules_match_algorithm1(n: int) -> None:
    """Hand-made overlapping sets, ENP, full, DreamDDP and a tied-weight model, SGD+momentum and Adam."""
    plan = [(c, o) for c in ("hand", "enp", "full", "dreamddp", "tied") for o in ("sgdm", "adam")]

    def rank_fn() -> dict[tuple[str, str], dict[str, Any]]:
        out = {}
        for case, opt in plan:
            extra = {"divergence_every": 1} if (case, opt) == ("hand", "sgdm") else {}
            out[case, opt] = _summary(*_run(case, opt, R, **extra))
        return out

    res = run_threads(rank_fn, n, timeout=120)
    for case, opt in plan:
        _check_against_oracle([x[case, opt] for x in res], CASES[case][0], opt, n, R)
    # the variants' schedules are what the schedulers say for the profile
    assert res[0]["enp", "sgdm"]["sets"] == make_schedule("enp", _profile("mlp", 1e-3), H).sets
    assert res[0]["full", "sgdm"]["sets"] == ((), (), (0, 1, 2, 3))
    assert res[0]["dreamddp", "adam"]["sets"] == make_schedule("dreamddp", _profile("mlp", 4e-3), H).sets
    assert res[0]["hand", "sgdm"]["gammas"], "divergence was logged"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_period_one_is_synchronous_sgd(n: int) -> None:
    """H = 1 (every layer averaged every step), plain SGD: equal to S-SGD on the mean gradient."""
    steps = 5

    def rank_fn() -> dict[str, Any]:
        return _summary(*_run("full", "sgd", steps, period=1))

    res = run_threads(rank_fn, n)
    m = _mlp()
    opt = OPTS["sgd"](m.parameters())
    for k in range(steps):
        opt.zero_grad()
        sum(_loss(m, _batch(r, k)) for r in range(n)).backward()  # type: ignore[union-attr]
        for p in m.parameters():
            assert p.grad is not None
            p.grad /= n
        opt.step()
    for r in range(n):
        assert res[r]["in_sync"] == [True] * steps
        err = float((torch.tensor(res[r]["params"], dtype=torch.float64) - _flat(m)).abs().max())
        assert err < 1e-6, f"rank {r}: H=1 differs from S-SGD by {err}"


@pytest.mark.parametrize("n", [2, 3])
def test_lazy_profile_then_oracle(n: int, tmp_path: Any) -> None:
    """No profile given: the first train_step profiles (every rank gets the same profile and schedule)
    and the run then equals Algorithm 1 with that schedule: profiling changed nothing."""

    def rank_fn() -> dict[str, Any]:
        m = _mlp()
        s = make_strategy("dreamddp", m, OPTS["sgdm"], period=H)
        assert isinstance(s, PartialSyncStrategy)
        assert s.schedule is None and s.predicted_step_time() is None and not s.in_sync()
        r, in_sync = lowband.rank(), []
        for k in range(R):
            batch = _batch(r, k)
            s.train_step(lambda mod, b=batch: _loss(mod, b))
            in_sync.append(s.in_sync())
        s.synchronize()
        assert s.profile is not None
        path = tmp_path / f"profile{r}.json"
        save_profile(s.profile, path)
        out = _summary(s, m, in_sync)
        out["profile_roundtrip"] = load_profile(path) == s.profile
        out["profile"] = s.profile.to_json()
        out["predicted"] = s.predicted_step_time()
        rep = s.report()
        out["interference"] = (rep["kappa"], rep["sigma"])
        out["model"] = (s.profile.kappa, s.profile.sigma)
        return out

    res = run_threads(rank_fn, n, timeout=120)
    _check_against_oracle(res, "mlp", "sgdm", n, R)
    for r in range(n):
        assert res[r]["profile"] == res[0]["profile"], "every rank has the same profile"
        assert res[r]["profile_roundtrip"]
        assert res[r]["predicted"] > 0
        # lazy profiling measured the interference too; the report shows the profile's values
        kappa, sigma = res[r]["interference"]
        assert res[r]["interference"] == res[r]["model"] == res[0]["interference"]
        assert math.isfinite(kappa) and kappa >= 0 and math.isfinite(sigma) and sigma >= 0
    assert res[0]["order"] == ["0", "2", "4", "5"]  # a Sequential's backward runs in reverse


@pytest.mark.parametrize("n", [1, 2, 3])
def test_resume_is_identical(n: int) -> None:
    """A checkpoint after 4 steps, loaded into a fresh strategy built with no schedule (the checkpoint
    carries profile, schedule and counters), continues exactly as the uninterrupted run."""
    cut = 4

    def rank_fn() -> dict[str, Any]:
        r = lowband.rank()
        s, m, _ = _run("dreamddp", "adam", R)
        s2, _, _ = _run("dreamddp", "adam", cut)
        buf = io.BytesIO()
        torch.save(s2.state_dict(), buf)
        buf.seek(0)
        layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 2)]
        m3 = _seeded(nn.Sequential(*layers), 99 + r)  # other weights: the checkpoint must restore them
        s3 = make_strategy("dreamddp", m3, OPTS["adam"])
        assert isinstance(s3, PartialSyncStrategy)
        s3.load_state_dict(torch.load(buf, weights_only=True))
        restored = s3.schedule == s2.schedule and s3.steps == cut and s3.period == H
        for k in range(cut, R):
            batch = _batch(r, k)
            s3.train_step(lambda mod, b=batch: _loss(mod, b))
        s3.synchronize()
        return {
            "restored": restored,
            "same": torch.equal(_flat(m), _flat(m3)),
            "counts": (s.averager.launch_counts, s3.averager.launch_counts),
        }

    for out in run_threads(rank_fn, n, timeout=120):
        assert out["restored"] and out["same"]
        assert out["counts"][0] == out["counts"][1]


def test_reprofile_on_drift() -> None:
    """With a tiny drift threshold the measured bandwidth always 'moves': the ranks re-measure and
    re-schedule at a period boundary, identically, and keep training."""
    steps = 7

    def rank_fn() -> dict[str, Any]:
        s, _, _ = _run("dreamddp", "sgdm", steps, period=2, reprofile_drift=1e-12)
        return {"reschedules": s.reschedules, "sets": s.schedule.sets if s.schedule else None,
                "profile": s.profile.to_json() if s.profile else None,
                "max_gap": s.averager.max_gap}  # fmt: skip

    res = run_threads(rank_fn, 2, timeout=120)
    assert res[0]["reschedules"] >= 1
    for out in res:
        assert out["reschedules"] == res[0]["reschedules"]
        assert out["sets"] == res[0]["sets"] and out["profile"] == res[0]["profile"]
        assert max(out["max_gap"]) <= 2 * 2 - 1  # at most 2H - 1 across a re-schedule


@pytest.mark.parametrize("n", [1, 3])
def test_model_divergence(n: int) -> None:
    def rank_fn() -> float:
        m = _mlp()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(lowband.rank() * 0.1)
        return model_divergence(m)

    gammas = run_threads(rank_fn, n)
    flats = [_flat(_mlp()) + 0.1 * r for r in range(n)]
    avg = torch.stack(flats).mean(0)
    want = float(sum(((avg - f) ** 2).sum() for f in flats)) / n
    assert gammas == pytest.approx([want] * n, rel=1e-9, abs=1e-15)


def test_registry_and_bad_options(tmp_path: Any) -> None:
    assert {"dreamddp", "plsgd-enp", "flsgd-overlap"} <= set(strategy_names())
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    wrong = CostProfile.from_lists([1e-3], [1e-3], [1e-3], names=["nope"])
    partial = Schedule(2, ((0,), (1,)), "hand", 0.0, (0.0, 0.0))  # layers 2, 3 never averaged
    cases: list[tuple[dict[str, Any], str]] = [
        ({"period": 0}, "period must be an int >= 1 or None, got 0"),
        ({"period": 2.5}, "period must be an int >= 1 or None, got 2.5"),
        ({"period": True}, "period must be an int >= 1 or None, got True"),
        ({"reprofile_drift": -0.1}, "reprofile_drift must be a number >= 0, got -0.1"),
        ({"divergence_every": -1}, "divergence_every must be an int >= 0, got -1"),
        ({"profile": 3}, "profile must be a JSON path or a Path or a CostProfile or None, got 3"),
        ({"profile": str(tmp_path / "nodir" / "missing.json")}, "cannot read a profile"),
        ({"profile": str(bad_json)}, "cannot read a profile"),
        ({"profile": wrong}, "the profile's layers ['nope'] are not the model's layers"),
        ({"schedule": "x"}, "schedule must be a Schedule or None, got 'x'"),
        ({"schedule": partial, "period": 3}, "period must be the schedule's period (got period=3, schedule=a Schedule)"),
        ({"schedule": partial}, "never averaged"),
        ({"schedule": Schedule(4, (*HAND, ()), "h", 0.0, (0.0,) * 4), "reprofile_drift": 0.5},
         "re-schedules from a profile"),
        ({"H": 3}, "unknown option(s) ['H']"),
    ]  # fmt: skip

    def rank_fn() -> list[str]:
        errs = []
        for opts, _ in cases:
            try:
                make_strategy("dreamddp", _mlp(), OPTS["sgd"], **opts)
                errs.append("no error")
            except InvalidArgumentError as e:
                errs.append(str(e))
        s = PartialSyncStrategy(_mlp(), OPTS["sgd"], lowband.world())
        try:
            s.backward(torch.zeros(()))
            errs.append("no error")
        except InvalidArgumentError as e:
            errs.append(str(e))
        return errs

    errs = run_threads(rank_fn, 1)[0]
    for (_, want), got in zip(cases, errs):
        assert want in got, f"expected {want!r} in {got!r}"
    assert "on rank 0" in errs[0]
    assert "no schedule yet" in errs[-1]


def test_layout_mismatch_across_ranks() -> None:
    """Rank 1 has another model: every rank raises, naming rank 1 (before any averaging could abort gloo)."""

    def rank_fn() -> str:
        m = _mlp() if lowband.rank() != 1 else nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 2)).double()
        try:
            make_strategy("dreamddp", m, OPTS["sgd"], period=2)
        except CollectiveMismatchError as e:
            return str(e)
        return "no error"

    for e in run_threads(rank_fn, 3):  # the configuration agreement of make_strategy names the layouts
        assert "configurations differ" in e and "missing on rank 1" in e, e
