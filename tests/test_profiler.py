"""DreamDDP's profiler: per-layer times on a real model (positive, in the order backward actually runs,
the same on every rank, the model left untouched), the alpha-beta communication fit, JSON round trip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd import CostProfile
from lowband.localsgd.interference import measure_interference
from lowband.localsgd.profiler import (
    comm_sizes_for,
    fit_comm,
    load_profile,
    measure_comm,
    profile_model,
    refit_comm,
    save_profile,
    with_comm,
)
from lowband.testing import run_threads

SIZES = [4096, 16384]


def _mlp() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def _loss(m: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(lowband.rank())
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    return ((m(x) - y) ** 2).mean()


class Swapped(nn.Module):
    """Registers ``late`` before ``early`` but runs ``early`` first; ``unused`` gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(5, 3)
        self.unused = nn.Linear(2, 2)
        self.early = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.tanh(self.early(x)))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_profile_small_mlp(n: int) -> None:
    def rank_fn() -> dict[str, object]:
        m = _mlp()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        prof = profile_model(m, _loss, warmup=1, repeats=3, comm_sizes=SIZES, comm_repeats=2)
        after = m.state_dict()
        return {
            "profile": prof.to_json(),
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "no_grads": all(p.grad is None for p in m.parameters()),
        }

    res = run_threads(rank_fn, n, timeout=120)
    prof = CostProfile.from_json(res[0]["profile"])  # type: ignore[arg-type]
    assert [lc.name for lc in prof.layers] == ["0", "1", "3", "5"]  # forward order == reversed backward
    assert [lc.nbytes for lc in prof.layers] == [
        4 * (8 * 16 + 16),
        4 * 32,
        4 * (16 * 16 + 16),
        4 * (16 * 4 + 4),
    ]
    assert all(lc.fwd > 0 and lc.bwd > 0 for lc in prof.layers)
    assert prof.alpha >= 0 and prof.beta >= 0
    for lc in prof.layers:
        assert lc.comm == pytest.approx(prof.alpha + prof.beta * lc.nbytes, rel=1e-12, abs=1e-15)
    assert math.isfinite(prof.kappa) and prof.kappa >= 0 and math.isfinite(prof.sigma) and prof.sigma >= 0
    if n == 1:
        assert prof.alpha == prof.beta == 0.0  # no links to measure
        assert prof.kappa == prof.sigma == 0.0  # nothing to interfere with
    for out in res:
        assert out["profile"] == res[0]["profile"], "every rank gets the same profile"
        assert out["unchanged"] and out["no_grads"], "profiling left parameters, BN statistics, grads alone"


def test_backward_order_is_the_observed_one() -> None:
    def rank_fn() -> CostProfile:
        m = Swapped()
        return profile_model(
            m, lambda mod: mod(torch.randn(3, 4)).sum(), warmup=0, repeats=2, comm_sizes=SIZES
        )

    prof = run_threads(rank_fn, 1)[0]
    # backward order: late, early, then the unused layer -> forward order is its reverse
    assert [lc.name for lc in prof.layers] == ["unused", "early", "late"]
    assert prof.layers[0].bwd == 0.0 and prof.layers[0].fwd == 0.0
    assert prof.layers[1].bwd > 0 and prof.layers[2].bwd > 0


def test_fit_recovers_alpha_beta() -> None:
    alpha, beta = 2e-4, 8e-9
    sizes = [4096 * 4**k for k in range(6)]
    a, b = fit_comm([(s, alpha + beta * s) for s in sizes])
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    g = torch.Generator().manual_seed(0)
    noisy = [
        (s, (alpha + beta * s) * (1 + 0.02 * float(torch.randn(1, generator=g))))
        for s in sizes
        for _ in range(5)
    ]
    a, b = fit_comm(noisy)
    assert a == pytest.approx(alpha, rel=0.3) and b == pytest.approx(beta, rel=0.05)
    # constrained to non-negative: a decreasing cloud -> flat; a negative intercept -> through the origin
    assert fit_comm([(1000, 2.0), (2000, 1.0)]) == (1.5, 0.0)
    a, b = fit_comm([(1000, 0.5), (2000, 2.0)])
    assert a == 0.0 and b == pytest.approx((1000 * 0.5 + 2000 * 2.0) / (1000**2 + 2000**2))
    for bad in (
        [(1000, 1.0)],
        [(1000, 1.0), (1000, 2.0)],
        [(1000, -1.0), (2000, 1.0)],
        [(True, 1.0), (8, 1.0)],
    ):
        with pytest.raises(InvalidArgumentError, match="fit_comm"):
            fit_comm(bad)


def test_measure_comm_stops_at_the_time_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes go up until one allreduce took COMM_TIME_CAP on the slowest rank (at least two sizes):
    with a cap of 0 every rank stops after the two smallest, whatever order they were given in."""
    monkeypatch.setattr("lowband.localsgd.profiler.COMM_TIME_CAP", 0.0)
    res = run_threads(lambda: measure_comm(None, [262144, 4096, 16384, 65536], repeats=1), 3, timeout=120)
    assert all([s for s, _ in r[2]] == [4096, 16384] for r in res)
    assert all(r == res[0] for r in res), "the same samples and fit on every rank"


@pytest.mark.parametrize("n", [1, 2])
def test_measure_and_refit_comm(n: int) -> None:
    base = CostProfile.from_lists(
        [1e-3, 2e-3], [1e-3, 1e-3], [5.0, 5.0], names=["a", "b"], nbytes=[400, 40000]
    )

    def rank_fn() -> tuple[tuple[float, float, list[tuple[int, float]]], CostProfile]:
        return measure_comm(None, [4096, 65536, 65537], repeats=2), refit_comm(base, sizes=SIZES, repeats=1)

    res = run_threads(rank_fn, n, timeout=120)
    (alpha, beta, samples), refit = res[0]
    assert [s for s, _ in samples] == [4096, 65536]  # whole float32 elements, each size once
    assert alpha >= 0 and beta >= 0
    for m, p in res:
        assert m == res[0][0] and p == refit, "the same fit on every rank"
    assert [(lc.fwd, lc.bwd, lc.nbytes) for lc in refit.layers] == [(1e-3, 1e-3, 400), (2e-3, 1e-3, 40000)]
    assert refit == with_comm(base, refit.alpha, refit.beta)
    if n == 1:
        assert (alpha, beta) == (0.0, 0.0) and all(lc.comm == 0.0 for lc in refit.layers)
    assert comm_sizes_for(100) == (4096, 16384)
    assert comm_sizes_for(3 << 20) == (4096, 16384, 65536, 262144, 1048576, 4194304)
    assert max(comm_sizes_for(1 << 30)) == 16 << 20


def test_json_round_trip(tmp_path: Path) -> None:
    prof = CostProfile.from_lists(
        [1e-3, 2.5e-3], [3e-3, 1 / 3], [4e-4, 5e-4], names=["enc", "head"], nbytes=[1024, 2048]
    )
    prof = with_comm(prof.with_interference(0.625, 0.3), 1e-4, 1 / 7e8)
    assert (prof.kappa, prof.sigma) == (0.625, 0.3)  # with_comm keeps the interference
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(InvalidArgumentError, match="cannot read a profile"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(InvalidArgumentError, match="cannot read a profile"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(InvalidArgumentError, match="save_profile"):
        save_profile({"layers": []}, path)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    def rank_fn() -> list[str]:
        m = _mlp()
        calls = [
            lambda: profile_model(m, _loss, warmup=-1),
            lambda: profile_model(m, _loss, repeats=0),
            lambda: profile_model(m, lambda mod: mod(torch.randn(4, 8)), repeats=1, comm_sizes=SIZES),
            lambda: profile_model(nn.ReLU(), _loss),
            lambda: profile_model("model", _loss),  # type: ignore[arg-type]
            lambda: measure_comm(None, [4096], 1),
            lambda: measure_comm(None, [4096, 2], 1),
            lambda: measure_comm(None, SIZES, 0),
        ]
        errs = []
        for c in calls:
            try:
                c()
                errs.append("no error")
            except InvalidArgumentError as e:
                errs.append(str(e))
        return errs

    errs = run_threads(rank_fn, 1)[0]
    wants = ["warmup must be an int >= 0, got -1", "repeats must be an int >= 1, got 0", "one-element tensor",
             "no trainable parameters", "model must be an nn.Module", "at least 2 distinct sizes",
             "every size must be an int >= 4, got 2", "repeats must be an int >= 1, got 0"]  # fmt: skip
    for want, got in zip(wants, errs):
        assert want in got and "on rank 0" in got, (want, got)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_measure_interference(n: int) -> None:
    def rank_fn() -> dict[str, object]:
        m = _mlp()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        rng = torch.get_rng_state()
        pair = measure_interference(m, _loss, repeats=2, nbytes=65536)
        default = measure_interference(m, _loss, repeats=1)  # nbytes: the model's parameter bytes
        quiet = profile_model(
            m, _loss, warmup=0, repeats=1, comm_sizes=SIZES, comm_repeats=1, interference=False
        )
        after = m.state_dict()
        return {
            "pair": pair,
            "default": default,
            "quiet": (quiet.kappa, quiet.sigma),
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "no_grads": all(p.grad is None for p in m.parameters()),
            "rng": torch.equal(rng, torch.get_rng_state()),
        }

    res = run_threads(rank_fn, n, timeout=120)
    for out in res:
        for kappa, sigma in (out["pair"], out["default"]):  # type: ignore[misc]
            assert math.isfinite(kappa) and kappa >= 0 and math.isfinite(sigma) and sigma >= 0
        assert out["pair"] == res[0]["pair"] and out["default"] == res[0]["default"], "MAX across ranks"
        assert out["quiet"] == (0.0, 0.0)
        assert out["unchanged"] and out["no_grads"]
        if n == 1:  # the CPU RNG is process-wide: with several rank threads another rank may move it
            assert out["rng"]
            assert out["pair"] == out["default"] == (0.0, 0.0)


def test_measure_interference_bad_arguments() -> None:
    def rank_fn() -> list[str]:
        m = _mlp()
        calls = [
            lambda: measure_interference(m, _loss, repeats=0),
            lambda: measure_interference(m, _loss, nbytes=2),
            lambda: measure_interference(nn.ReLU(), _loss),
            lambda: measure_interference("model", _loss),  # type: ignore[arg-type]
            lambda: profile_model(m, _loss, interference=1),  # type: ignore[arg-type]
        ]
        errs = []
        for c in calls:
            try:
                c()
                errs.append("no error")
            except InvalidArgumentError as e:
                errs.append(str(e))
        return errs

    errs = run_threads(rank_fn, 1)[0]
    wants = ["repeats must be an int >= 1, got 0", "nbytes must be an int >= 4, got 2", "no trainable parameters",
             "model must be an nn.Module", "interference must be a bool, got 1"]  # fmt: skip
    for want, got in zip(wants, errs, strict=True):
        assert want in got and "on rank 0" in got, (want, got)


def test_measure_interference_bad_loss_across_ranks() -> None:
    def rank_fn() -> str:
        m = _mlp()
        try:
            measure_interference(m, lambda mod: mod(torch.randn(4, 8)), repeats=1)
        except InvalidArgumentError as e:
            return str(e)
        return "no error"

    for msg in run_threads(rank_fn, 2, timeout=120):
        assert "one-element tensor" in msg
