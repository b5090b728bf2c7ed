"""Whole-run conventions: DreamDDP repeatable from a saved profile however the timings fall, a rank that
does more than the others (an extra training forward) ends in lowband's error on every rank, a BlueFog
program that forgot ``bf.init()`` is told so, and every registered strategy's ``train_step`` returns a
float.

Thread ranks, except the registry run (torch DDP needs real processes); data from private generators.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import lowband
import lowband.compat.bluefog.torch as bf
from lowband.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    InvalidArgumentError,
    NotInitializedError,
)
from lowband.localsgd import rescheduling
from lowband.localsgd.costmodel import CostProfile, LayerCost
from lowband.optim import parameter_layers
from lowband.strategies import make_strategy, strategy_names
from lowband.strategies.registry import STRATEGIES
from lowband.testing import run_processes, run_threads

LR = 0.05


def _model(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                      nn.Linear(12, 2)).double()  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return m


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(
        4, 2, generator=g, dtype=torch.float64
    )


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((m(b[0]) - b[1]) ** 2).mean()


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # type: ignore[arg-type]


# -- DreamDDP: repeatable from a saved profile -----------------------------------------------------
def _timed_profile(links: str) -> object:
    """A stand-in for the measured profile: what the timings of this model would be on ``links``
    ("fast": communication far cheaper than backward; "slow": far dearer)."""

    def profile(model: nn.Module, _loss_fn: object, **_kw: object) -> CostProfile:
        layers = []
        for i, (name, ps) in enumerate(parameter_layers(model)):
            nbytes = sum(p.numel() * p.element_size() for p in ps)
            bwd = 1e-3 * (1 + i)
            comm = (1e-7 if links == "fast" else 1e-5) * nbytes
            layers.append(LayerCost(name, bwd / 2, bwd, comm, nbytes))
        return CostProfile(tuple(layers), 1e-5, 1e-7 if links == "fast" else 1e-5)

    return profile


def _dream(profile: str | None) -> tuple[torch.Tensor, list[list[int]], int]:
    m = _model(seed=3)
    s = make_strategy("dreamddp", m, _sgd, period=3, **({"profile": profile} if profile else {}))
    for k in range(7):
        batch = _batch(lowband.rank(), k)
        s.train_step(lambda mod, b=batch: _loss(mod, b))
    s.synchronize()
    sched = s.report()["schedule"]
    out = torch.cat([p.detach().reshape(-1) for p in m.parameters()]), sched, s.report()["split_bytes"]
    s.close()
    return out


def test_dreamddp_repeats_from_a_saved_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n, path = 3, str(tmp_path / "profile.json")
    monkeypatch.setattr(rescheduling, "profile_model", _timed_profile("fast"))
    first = run_threads(_dream, n, path)  # profiles (fast links), rank 0 saves the profile
    assert Path(path).exists()
    monkeypatch.setattr(rescheduling, "profile_model", _timed_profile("slow"))
    again = run_threads(_dream, n, path)  # other timings, same saved profile: the same run, bit for bit
    fresh = run_threads(_dream, n, None)  # other timings, measured anew: another schedule
    for r in range(n):
        assert torch.equal(first[r][0], again[r][0])
        assert first[r][1:] == again[r][1:]
    assert fresh[0][1:] != first[0][1:]
    assert not torch.equal(fresh[0][0], first[0][0])


# -- a rank that does more than the others ---------------------------------------------------------
def _extra_forward(kind: str) -> str:
    r = lowband.rank()
    bf.init()
    m = _model(seed=1)
    base = torch.optim.SGD(m.parameters(), lr=LR)
    with pytest.warns(PendingDeprecationWarning):
        opt = (
            bf.DistributedAllreduceOptimizer
            if kind == "allreduce"
            else bf.DistributedNeighborAllreduceOptimizer
        )(base, model=m)
    for k in range(2):
        opt.zero_grad()
        _loss(m, _batch(r, k)).backward()  # type: ignore[no-untyped-call]
        opt.step()
    if r == 0:
        _loss(m, _batch(r, 9))  # a training forward the other ranks do not run: it communicates
    try:
        lowband.allreduce(torch.ones(5, dtype=torch.float64))  # what every rank does next
        opt.synchronize()
    except (CollectiveMismatchError, CommTimeoutError) as exc:
        return type(exc).__name__
    return "no error"


@pytest.mark.parametrize("kind", ["allreduce", "neighbor"])
def test_an_extra_forward_on_one_rank_is_a_lowband_error_everywhere(kind: str) -> None:
    out = run_threads(_extra_forward, 3, kind, timeout=60, comm_timeout=3)
    if kind == "allreduce":
        # the layers' allreduces run on the checked path: every rank names the mismatch, and no data of
        # different sizes is ever paired inside gloo
        assert out == ["CollectiveMismatchError"] * 3, out
    else:
        # neighbor averaging is tagged point-to-point: rank 0 waits for messages nobody sends and gets the
        # bounded timeout; the others' own operations all completed, so they have nothing to report
        assert out == ["CommTimeoutError", "no error", "no error"], out


# -- BlueFog without bf.init() ---------------------------------------------------------------------
def test_bluefog_op_before_init_names_bf_init() -> None:
    caught: list[BaseException] = []

    def body() -> None:
        try:
            bf.allreduce(torch.ones(2))
        except BaseException as exc:
            caught.append(exc)

    if lowband.is_initialized():
        pytest.skip("this process already has a global lowband context")
    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert len(caught) == 1 and isinstance(caught[0], NotInitializedError)
    assert "call bf.init() first" in str(caught[0]) and "lowband.compat.bluefog.torch.allreduce" in str(
        caught[0]
    )


# -- train_step's result over the registry ---------------------------------------------------------
def _every_strategy() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in strategy_names():
        m = _model(seed=2)
        try:
            s = make_strategy(name, m, lambda ps: torch.optim.SGD(ps, lr=LR))
        except InvalidArgumentError as exc:  # a strategy for other models (e.g. embedding tables)
            out[name] = f"refused: {exc}"
            continue
        batch = _batch(lowband.rank(), 0)
        loss = s.train_step(lambda mod, b=batch: _loss(mod, b))
        s.synchronize()
        s.close()
        out[name] = type(loss).__name__
    return out


def test_train_step_returns_a_float_for_every_strategy() -> None:
    res = run_processes(_every_strategy, 2, timeout=300)[0]
    # lowband's own strategies: the ranks are fresh processes, which do not import test fixtures that
    # register more (tests/sharded_model.py)
    assert set(res) == {n for n in strategy_names() if STRATEGIES.get(n).__module__.startswith("lowband.")}
    ran = {n for n, t in res.items() if not t.startswith("refused")}
    assert {"ddp", "powersgd", "localsgd", "stage", "atc", "awc", "dreamddp", "winput"} <= ran, res
    assert all(res[n] == "float" for n in ran), res


# -- the initial broadcast of torch's own strategies -------------------------------------------------
def _torch_initial() -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    for name in ("ddp", "powersgd", "localsgd"):
        for flag in (True, False):
            m = _model(seed=40 + lowband.rank())
            s = make_strategy(name, m, _sgd, broadcast_init=flag)
            out.setdefault(name, []).append(
                torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
            )
            s.close()
    return out


def test_torch_strategies_start_from_rank0_model_unless_told_not_to() -> None:
    n = 2
    res = run_processes(_torch_initial, n, timeout=120)
    want = [
        torch.cat([p.detach().reshape(-1) for p in _model(40 + r).parameters()]).tolist() for r in range(n)
    ]
    for r in range(n):
        assert sorted(res[r]) == ["ddp", "localsgd", "powersgd"]
        for name, (on, off) in res[r].items():
            assert on == want[0], name
            assert off == want[r], name
