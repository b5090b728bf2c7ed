"""Mixed precision: bf16 autocast training of every compressed strategy tracks float32 training, the
strategies' state stays float32, and fp16 loss scaling unscales before compression, skips an overflowed
step on every rank and keeps error-feedback memories finite (torch 2.13 has fp16 autocast and an
enabled GradScaler on the CPU, so the scaler path itself runs here).

Tolerance (bf16): autocast rounds every matmul input to bf16 (8 significant bits: relative error up to
2**-9 per element, accumulated in float32), so one forward's loss moves by about 1e-3 relative, and over
12 steps of SGD on a small MLP the trajectories drift apart slowly. Every step's mean loss must stay
within 3 % (plus 0.02 absolute) of the float32 run's: several times the drift measured here (below 1 %),
far below what a wrong precision path gives (unscaled gradients: losses off by orders of magnitude; a
step lost or applied twice: several %). fp16 (11 significant bits) must stay within 1 %. Compressors that
*select* (SlimGC's 1-bit threshold quantizer, gs-SGD's sketched top-k) are discontinuous: a rounding
that moves one element across the threshold changes the update by a whole quantum, and the runs part
faster (up to 7 % on one step here): they get 10 % per step. Every run's mean loss over all steps must
also be within 2 % of float32's (measured: below 0.8 %).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.bench.precision import autocast_loss, move_batch
from lowband.errors import InvalidArgumentError
from lowband.localsgd.schedule import Schedule
from lowband.optim.scaling import GradUnscaler
from lowband.strategies import make_strategy
from lowband.testing import run_processes, run_threads

STEPS = 12
CPU = torch.device("cpu")


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(7)  # thread ranks share torch's global RNG: a private one
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:].sum(1) > 0).long()


def _loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(m(batch[0]), batch[1])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return (
        [t for v in vars(obj).values() for t in _tensors(v)] if hasattr(obj, "__dataclass_fields__") else []
    )


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


SCHEDULE = Schedule(2, ((0,), (1, 2)), "hand", 0.0, (0.0, 0.0))
#: selecting compressors: the per-step bf16 tolerance (module docstring)
SELECTING = {"slimgc": 0.1, "gs-sgd": 0.1}
#: (strategy, options): each compressed strategy, its baselines and DreamDDP's averaged copies
THREADED: dict[str, tuple[str, dict[str, Any]]] = {
    "stage": ("stage", {"bucket_mb": 0}),
    "topk": ("compressed", {"compressor": "topk:ratio=0.2", "bucket_mb": 0}),
    "scaledsign": ("compressed", {"compressor": "scaledsign", "bucket_mb": 0}),
    "qsgd-ps": ("compressed", {"compressor": "qsgd:levels=16", "reducer": "ps"}),
    "fp16-wire": ("compressed", {"compressor": "fp16", "reducer": "allreduce"}),
    "slimgc": ("slimgc", {"comm_threshold": 0, "offload": False}),
    "gs-sgd": ("gs-sgd", {"density": 0.2}),
    "dreamddp": ("dreamddp", {"schedule": SCHEDULE}),
}
PROCESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "powersgd": ("powersgd", {"rank": 1, "start_iter": 3}),
    "localsgd": ("localsgd", {"period": 3}),
}


def _train(name: str, opts: dict[str, Any], precision: str, scaler: bool = False) -> dict[str, Any]:
    r = lowband.rank()
    s = make_strategy(name, _model(), _sgd, **opts)
    if scaler:
        s.set_grad_scaler(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    losses = []
    for k in range(STEPS):
        batch = move_batch(_batch(r, k), CPU)
        losses.append(s.train_step(autocast_loss(_loss, batch, CPU, precision)))
    state = s.state_dict()
    out = {
        "losses": losses,
        "dtypes": sorted({str(t.dtype) for t in _tensors(state) if t.is_floating_point()}),
        "params": sorted({str(p.dtype) for p in s.local_module.parameters()}),
    }
    s.close()
    return out


def _mean_losses(res: list[dict[str, Any]]) -> list[float]:
    return [sum(x["losses"][k] for x in res) / len(res) for k in range(STEPS)]


def _check_tracks(
    what: str, low: list[dict[str, Any]], ref: list[dict[str, Any]], rel: float, abs_: float
) -> None:
    a, b = _mean_losses(low), _mean_losses(ref)
    assert all(math.isfinite(x) for x in a), f"{what}: {a}"
    for k, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y) + abs_, f"{what}: step {k}: {x} vs float32 {y} (all: {a} vs {b})"
    assert abs(sum(a) - sum(b)) <= 0.02 * abs(sum(b)), (
        f"{what}: mean loss {sum(a) / STEPS} vs {sum(b) / STEPS}"
    )
    assert a != b, f"{what}: identical to float32: the autocast did nothing"
    assert b[-1] < b[0], f"{what}: the float32 run does not train: {b}"
    for x in low:  # parameters, gradients and every piece of strategy state stay float32
        assert x["params"] == ["torch.float32"] and x["dtypes"] == ["torch.float32"], f"{what}: {x}"


@pytest.mark.parametrize("key", sorted(THREADED))
def test_bf16_tracks_fp32_on_thread_ranks(key: str) -> None:
    name, opts = THREADED[key]
    bf16 = run_threads(_train, 2, name, opts, "bf16", timeout=120)
    fp32 = run_threads(_train, 2, name, opts, "fp32", timeout=120)
    _check_tracks(key, bf16, fp32, SELECTING.get(key, 0.03), 0.02)


def _train_all(precision: str) -> dict[str, Any]:
    return {key: _train(name, opts, precision) for key, (name, opts) in PROCESSES.items()}


def test_bf16_tracks_fp32_with_torch_ddp() -> None:
    """ddp, powersgd, localsgd (torch's DDP and averagers need real process groups)."""
    bf16 = run_processes(_train_all, 2, "bf16", timeout=240)
    fp32 = run_processes(_train_all, 2, "fp32", timeout=240)
    for key in PROCESSES:
        _check_tracks(key, [x[key] for x in bf16], [x[key] for x in fp32], 0.03, 0.02)


@pytest.mark.parametrize("key", ["stage", "topk", "qsgd-ps", "gs-sgd"])
def test_fp16_with_scaler_tracks_fp32(key: str) -> None:
    name, opts = THREADED[key]
    fp16 = run_threads(_train, 2, name, opts, "fp16", True, timeout=120)
    fp32 = run_threads(_train, 2, name, opts, "fp32", timeout=120)
    _check_tracks(key, fp16, fp32, 0.01, 0.005)


def _train_fp16_processes() -> dict[str, Any]:
    return {key: _train(name, opts, "fp16", scaler=True) for key, (name, opts) in PROCESSES.items()}


def test_fp16_with_scaler_torch_ddp() -> None:
    fp16 = run_processes(_train_fp16_processes, 2, timeout=240)
    fp32 = run_processes(_train_all, 2, "fp32", timeout=240)
    for key in PROCESSES:
        _check_tracks(key, [x[key] for x in fp16], [x[key] for x in fp32], 0.01, 0.005)


INF_STEP = 4


def _overflow(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """fp16 with a scaler; at step INF_STEP rank 1's loss is infinite (its gradients inf/NaN)."""
    r = lowband.rank()
    s = make_strategy(name, _model(), _sgd, **opts)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    s.set_grad_scaler(scaler)
    params, scales, losses = [], [], []
    batches = [_batch(r, k) for k in range(STEPS // 2)]  # inputs on the CPU, built outside meta
    with torch.device("meta"):  # device discipline: anything made without a device lands on meta
        for k, batch in enumerate(batches):

            def fn(m: nn.Module, batch: Any = batch, k: int = k) -> torch.Tensor:
                loss = autocast_loss(_loss, batch, CPU, "fp16")(m)
                return loss * math.inf if (k == INF_STEP and r == 1) else loss

            losses.append(s.train_step(fn))
            params.append(_flat(s.local_module))
            scales.append(scaler.get_scale())
    state = [t for t in _tensors(s.state_dict()) if t.is_floating_point()]
    s.close()
    assert all(t.device == CPU for t in state) and all(p.device == CPU for p in params)
    return {
        "params": params,
        "scales": scales,
        "losses": losses,
        "finite": all(bool(t.isfinite().all()) for t in state),
    }


@pytest.mark.parametrize("key", ["topk", "scaledsign", "gs-sgd"])
def test_fp16_overflow_skips_the_step_on_every_rank(key: str) -> None:
    """The overflow of one rank skips the step on both (parameters unchanged), halves both scales, leaves
    every error-feedback memory finite, and training goes on in sync."""
    name, opts = THREADED[key]
    res = run_threads(_overflow, 2, name, opts, timeout=120)
    for r, x in enumerate(res):
        assert x["finite"], f"rank {r}: inf/NaN in the strategy's state"
        assert torch.equal(x["params"][INF_STEP], x["params"][INF_STEP - 1]), (
            f"rank {r}: the step was applied"
        )
        assert not torch.equal(x["params"][INF_STEP + 1], x["params"][INF_STEP]), f"rank {r}: stuck after it"
        assert x["scales"][INF_STEP] == x["scales"][INF_STEP - 1] / 2 == 2.0**9, x["scales"]
        assert torch.equal(x["params"][-1], res[0]["params"][-1])  # the replicas stayed identical
        assert all(math.isfinite(v) for i, v in enumerate(x["losses"]) if (i, r) != (INF_STEP, 1))


def test_unit_unscaling_matches_torch_unscale() -> None:
    """GradUnscaler (per unit, torch's fused kernel) and torch's own GradScaler.unscale_ give the same
    gradients, the same skip decision and the same next scale: the private state it writes is torch's."""
    outs = []
    for mine in (False, True):
        m = _model()
        opt = _sgd(m.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        for k, bad in enumerate((False, True, False)):
            opt.zero_grad()
            loss = _loss(m, _batch(0, k)) * (math.inf if bad else 1.0)
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            if mine:
                u = GradUnscaler(scaler, per_unit=True, agree=False, where="test")
                for p in m.parameters():  # one unit per tensor, as the stage hands them over
                    assert p.grad is not None
                    u.unscale_([p.grad])
                u.finish(opt, None)
            else:
                scaler.unscale_(opt)
            grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            scaler.step(opt)
            scaler.update()
            outs.append((mine, k, grads, scaler.get_scale(), _flat(m)))
    torch_runs, mine_runs = outs[:3], outs[3:]
    for (_, k, g0, s0, p0), (_, _, g1, s1, p1) in zip(torch_runs, mine_runs):
        assert s0 == s1 and torch.equal(p0, p1), f"step {k}"
        if k != 1:  # on the overflow torch leaves inf/NaN in .grad; the unit path zeroes the unit
            assert all(torch.equal(a, b) for a, b in zip(g0, g1)), f"step {k}"
        else:
            assert all(bool(b.isfinite().all()) for b in g1)
    assert torch_runs[1][3] == 2.0**11  # the overflow backed the scale off


def _refused(name: str, opts: dict[str, Any]) -> str:
    s = make_strategy(name, _model(), _sgd, **opts)
    try:
        s.set_grad_scaler(torch.amp.GradScaler("cpu"))
    except InvalidArgumentError as e:
        return str(e)
    finally:
        s.close()
    return ""


@pytest.mark.parametrize("key", ["slimgc", "dreamddp"])
def test_fp16_refused_where_it_cannot_be_correct(key: str) -> None:
    name, opts = THREADED[key]
    msg = run_threads(_refused, 1, name, opts, timeout=60)[0]
    assert f"strategy {name!r} cannot train with fp16 loss scaling" in msg and "bf16" in msg, msg
