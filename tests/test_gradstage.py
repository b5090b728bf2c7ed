"""The gradient stage against a float64 single-process oracle: the mean over ranks of every rank's
seeded gradient (summed over the J accumulated passes, a parameter without gradient counting as zero),
then one step of the same torch optimizer. Whole-model stepping (per-layer units and fused buckets),
per-layer stepping (LayerwiseOptimizer with a reducer), accumulation J = 1, 2, 3 and ``no_sync``, a
layer used by some ranks only and one never used, at world sizes 1-4."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.comm.handle import Handle
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.optim import (
    AllreduceReducer,
    GradientStage,
    LayerwiseOptimizer,
    ReduceContext,
    Reducer,
    Unit,
    bucket_units,
    layer_units,
    parameter_layers,
    parameter_names,
)
from lowband.strategies import make_strategy
from lowband.testing import run_threads

STEPS = 3
Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
FACTORIES: dict[str, Factory] = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.02),
}


class Net(nn.Module):
    """Three layers, a side branch some ranks use at some steps, and a layer nobody uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.side = nn.Linear(4, 2)
        self.unused = nn.Linear(3, 3)
        self.b = nn.Linear(6, 5)
        self.c = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return y + self.side(x) if side else y


def _model() -> Net:
    g = torch.Generator().manual_seed(7)
    m = Net().double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def _loss(m: nn.Module, rank: int, step: int, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + j)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    return ((m(x, side=(rank + step + j) % 3 == 0) - y) ** 2).mean()


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _oracle(n: int, opt: str, passes: int) -> torch.Tensor:
    m = _model()
    o = FACTORIES[opt](m.parameters())
    for k in range(STEPS):
        o.zero_grad()
        loss = sum(_loss(m, r, k, j) for r in range(n) for j in range(passes)) / n
        loss.backward()  # type: ignore[union-attr]
        for p in m.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        o.step()
    return _flat(m)


CASES = [(mode, opt, passes) for mode in ("layers", "buckets", "layerwise", "no_sync") for opt in FACTORIES
         for passes in (1, 2, 3)]  # fmt: skip


def _backwards(m: nn.Module, rank: int, k: int, passes: int, no_sync: Any) -> None:
    for j in range(passes):
        if no_sync is not None and j < passes - 1:
            with no_sync():
                _loss(m, rank, k, j).backward()
        else:
            _loss(m, rank, k, j).backward()


def _train(mode: str, opt: str, passes: int) -> torch.Tensor:
    r = lowband.rank()
    m = _model()
    if mode == "layerwise":
        lw = LayerwiseOptimizer(
            parameter_layers(m), FACTORIES[opt], reducer=AllreduceReducer(), accumulate=passes,
            names=parameter_names(m),
        )  # fmt: skip
        for k in range(STEPS):
            _backwards(m, r, k, passes, None)
            assert all(p.grad is None for p in m.parameters()), "stepped during the last backward"
            lw.step()  # nothing left
        return _flat(m)
    if mode == "buckets":
        units = bucket_units(m, 100e-6, 50e-6)  # a few parameters per bucket
    else:
        units = layer_units(parameter_layers(m), parameter_names(m))
    stage = GradientStage(units, AllreduceReducer(), accumulate=1 if mode == "no_sync" else passes)
    o = FACTORIES[opt](m.parameters())
    for k in range(STEPS):
        o.zero_grad()
        _backwards(m, r, k, passes, stage.no_sync if mode == "no_sync" else None)
        assert stage.in_flight() == list(range(len(units))), "every unit launched from the backward"
        stage.wait()
        assert stage.in_flight() == []
        o.step()
    return _flat(m)


def _all_cases() -> dict[tuple[str, str, int], torch.Tensor]:
    return {c: _train(*c) for c in CASES}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_stage_is_mean_gradient_then_step(n: int) -> None:
    results = run_threads(_all_cases, n, timeout=120)
    for mode, opt, passes in CASES:
        want = _oracle(n, opt, passes)
        for r in range(n):
            got = results[r][(mode, opt, passes)]
            assert float((got - want).abs().max()) < 1e-10, f"{mode} {opt} J={passes} rank {r}"


# -- what a reducer is given -------------------------------------------------------------------------


class Recording(Reducer):
    """The allreduce reducer, recording every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...], int]] = []
        self.inner = AllreduceReducer()

    def reduce(self, unit: Unit, grads: list[torch.Tensor], ctx: ReduceContext) -> Handle[list[torch.Tensor]]:
        assert [tuple(g.shape) for g in grads] == [tuple(p.shape) for p in unit.params]
        self.calls.append((unit.key, unit.names, ctx.step))
        return self.inner.reduce(unit, grads, ctx)


def _recorded() -> list[tuple[str, tuple[str, ...], int]]:
    r = lowband.rank()
    m = _model()
    rec = Recording()
    stage = GradientStage(bucket_units(m, 1.0, 150e-6), rec)
    for k in range(2):
        _loss(m, r, k, 0).backward()
        stage.wait()
        m.zero_grad()
    assert stage.state_dict() == {"rounds": 2, "reducer": {}}
    return rec.calls


def test_reducer_gets_names_in_backward_order_and_steps() -> None:
    calls = run_threads(_recorded, 2, timeout=60)
    assert calls[0] == calls[1]
    m = _model()
    units = bucket_units(m, 1.0, 150e-6)
    assert [u.names for u in units] == [("a.weight", "a.bias", "side.weight", "side.bias", "unused.weight",
                                         "unused.bias"), ("b.weight", "b.bias", "c.weight", "c.bias")]  # fmt: skip
    want = [(u.key, u.names, k) for k in range(2) for u in reversed(units)]
    assert calls[0] == want
    assert units[1].key == "b.weight..c.bias"


def test_bucket_plan_is_ddp_like() -> None:
    big = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8))  # 257 KiB per layer
    units = bucket_units(big, 0.6, 0.1)
    # backward order: the first bucket closes at >= 0.1 MB (so it takes 1.weight), the next at >= 0.6 MB
    assert [u.names for u in units] == [("0.weight", "0.bias"), ("1.weight", "1.bias", "2.weight", "2.bias")]
    with pytest.raises(InvalidArgumentError, match="bucket_mb must be a number > 0"):
        bucket_units(big, 0, 1)


def _strategy_run() -> tuple[torch.Tensor, dict[str, Any]]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("stage", m, FACTORIES["momentum"], bucket_mb=100e-6, first_bucket_mb=50e-6)
    for k in range(STEPS):
        s.train_step(lambda mod, k=k: _loss(mod, r, k, 0))
    st = s.state_dict()
    s.close()
    return _flat(m), st["extra"]


@pytest.mark.parametrize("n", [1, 3])
def test_stage_strategy(n: int) -> None:
    results = run_threads(_strategy_run, n, timeout=60)
    want = _oracle(n, "momentum", 1)
    for r in range(n):
        assert float((results[r][0] - want).abs().max()) < 1e-10
        assert results[r][1] == {"stage": {"rounds": STEPS, "reducer": {}}}


def _misuse() -> None:
    m = _model()
    stage = GradientStage(layer_units(parameter_layers(m), parameter_names(m)), AllreduceReducer())
    _loss(m, 0, 0, 1).backward()
    with pytest.raises(InvalidArgumentError, match="previous gradient reduction is not complete"):
        _loss(m, 0, 0, 1).backward()
    stage.wait()
    with pytest.raises(InvalidArgumentError, match="accumulate must be an int >= 1"):
        GradientStage(layer_units(parameter_layers(m)), None, accumulate=0)
    with pytest.raises(InvalidArgumentError, match="more than one unit"):
        GradientStage(layer_units(parameter_layers(m)) * 2, None)
    with pytest.raises(InvalidArgumentError, match=r"reducer must be a lowband\.optim\.Reducer"):
        GradientStage(layer_units(parameter_layers(m)), object())  # type: ignore[arg-type]


def test_misuse() -> None:
    run_threads(_misuse, 1, timeout=60)


def _mismatched_layout() -> str:
    m = _model() if lowband.rank() == 0 else nn.Linear(4, 2).double()
    try:
        GradientStage(layer_units(parameter_layers(m)), AllreduceReducer())
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_layout_mismatch_raises_on_every_rank() -> None:
    for msg in run_threads(_mismatched_layout, 2, timeout=60):
        assert "the gradient stage's units" in msg and "the number of units" in msg, msg


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_local_layerwise_accumulates(passes: int) -> None:
    """Without a reducer: J passes summed, the layers stepped during the J-th (no zeros for layers
    without gradient: torch's optimizer skips them, as one optimizer would)."""
    ref, mine = _model(), _model()
    o = FACTORIES["adam"](ref.parameters())
    seen: list[int] = []
    lw = LayerwiseOptimizer(
        parameter_layers(mine), FACTORIES["adam"], accumulate=passes, on_layer=seen.append
    )
    for k in range(STEPS):
        o.zero_grad()
        (sum(_loss(ref, 0, k, j) for j in range(passes))).backward()  # type: ignore[union-attr]
        o.step()
        for j in range(passes):
            seen.clear()
            _loss(mine, 0, k, j).backward()
            assert len(seen) == (len(lw.layers) if j == passes - 1 else 0)
    assert float((_flat(ref) - _flat(mine)).abs().max()) < 1e-12  # sums in another order
