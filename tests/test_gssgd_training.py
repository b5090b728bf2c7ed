"""The gs-sgd, sketched-sgd and gtopk strategies: with k = d (every coordinate, exact values) training
equals dense allreduce training; a checkpoint taken mid-run resumes bit-identically; options checked."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_threads

STEPS, RESUME_AT = 6, 3


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(7)
    m = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    return ((m(x) - y) ** 2).mean()


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _train(name: str, opts: dict[str, Any], steps: range, ckpt: bytes | None) -> tuple[torch.Tensor, bytes]:
    r = lowband.rank()
    m = _model()
    s = make_strategy(name, m, _opt, **opts)
    if ckpt is not None:
        s.load_state_dict(torch.load(io.BytesIO(ckpt), weights_only=True))
    saved = b""
    for k in steps:
        if k == RESUME_AT:
            s.synchronize()
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            saved = buf.getvalue()
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    s.close()
    return _flat(m), saved


def _versus_dense(name: str, opts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    sparse, _ = _train(name, opts, range(STEPS), None)
    buckets = {k: v for k, v in opts.items() if k.endswith("bucket_mb")}
    dense, _ = _train("stage", buckets, range(STEPS), None)
    return sparse, dense


EXACT = [
    ("gs-sgd", {"k": 10**6}),
    ("gs-sgd", {"k": 10**6, "reduce": "allreduce", "bucket_mb": 0.0001, "first_bucket_mb": 0.0001}),
    ("gs-sgd", {"density": 1.0, "recovery": "topk"}),
    ("sketched-sgd", {"k": 10**6}),
    ("gtopk", {"density": 1.0}),
]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize(("name", "opts"), EXACT)
def test_k_equal_d_is_dense_allreduce(n: int, name: str, opts: dict[str, Any]) -> None:
    for sparse, dense in run_threads(_versus_dense, n, name, opts, timeout=90):
        assert float((sparse - dense).abs().max()) <= 1e-6
        assert float((sparse - _flat(_model())).abs().max()) > 1e-3  # it trained


def _whole_and_resumed(name: str, opts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    whole, ckpt = _train(name, opts, range(STEPS), None)
    resumed, _ = _train(name, opts, range(RESUME_AT, STEPS), ckpt)
    fresh, _ = _train(name, opts, range(RESUME_AT, STEPS), None)
    return whole, resumed, fresh


RESUME = [
    ("gs-sgd", {"density": 0.2, "rows": 3, "cols": 6}),
    ("gs-sgd", {"density": 0.2, "rows": 3, "cols": 6, "recovery": "heavymix"}),  # its fill's seed resumes
    (
        "gs-sgd",
        {"k": 9, "reduce": "allreduce", "oversample": 2.0, "bucket_mb": 0.0001, "first_bucket_mb": 0.0001},
    ),
    ("sketched-sgd", {"density": 0.2, "momentum": 0.9, "masking": True}),
    ("gtopk", {"density": 0.1}),
    ("topk-allgather", {"density": 0.2}),
    ("gs-sgd", {"density": 0.05, "rows": 3, "warmup": "0.5/0.2", "warmup_steps": 2}),  # resumed mid-warm-up
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(("name", "opts"), RESUME)
def test_checkpoint_resumes_bit_identically(n: int, name: str, opts: dict[str, Any]) -> None:
    for whole, resumed, fresh in run_threads(_whole_and_resumed, n, name, opts, timeout=90):
        assert torch.equal(whole, resumed)
        assert not torch.equal(whole, fresh)  # the checkpoint's state mattered


def _build(name: str, opts: dict[str, Any]) -> None:
    make_strategy(name, _model(), _opt, **opts)


@pytest.mark.parametrize(
    ("name", "opts"),
    [
        ("gs-sgd", {"recovery": "median"}),
        ("gs-sgd", {"reduce": "ring"}),
        ("gs-sgd", {"rowz": 3}),
        ("gtopk", {"feedback": "none"}),
        ("sketched-sgd", {"reduce": "tree"}),
    ],
)
def test_bad_strategy_options(name: str, opts: dict[str, Any]) -> None:
    with pytest.raises((InvalidArgumentError, RankFailures)) as info:
        run_threads(_build, 1, name, opts, timeout=30)
    assert "InvalidArgumentError" in str(info.value) or isinstance(info.value, InvalidArgumentError)


def _report() -> tuple[dict[str, Any], dict[str, Any], int]:
    s = make_strategy("gs-sgd", _model(), _opt, density=0.1, bucket_mb=0.0001, first_bucket_mb=0.0001)
    s.train_step(lambda mod: _loss(mod, lowband.rank(), 0))
    return s.hparams(), s.report(), len(s.stage.units)  # type: ignore[attr-defined]


def test_hparams_and_report() -> None:
    hp, rep, units = run_threads(_report, 2, timeout=30)[0]
    assert hp["density"] == 0.1 and hp["reduce"] == "tree" and hp["rows"] == 5
    assert units > 1 and rep["timings"]["units"] == units and rep["timings"]["compress_s"] > 0
    assert rep["breakdown"]["compression_s"][0] > 0  # the stage's step breakdown sees the reducer's time
