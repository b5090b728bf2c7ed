"""The strategy protocol and PyTorch's baselines (DDP, DDP + PowerSGD, periodic local SGD), checked
against single-process oracles that rebuild every rank's seeded data, and resumed from a checkpoint
(loaded with ``weights_only=True``) mid-run: bit for bit the uninterrupted run.

torch's DDP and model averagers need a registered (process-wide) process group, so these run ranks as
real processes; each test does several checks per launch to keep the suite fast.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy, parse_strategy_spec, strategy_names
from lowband.testing import run_processes

STEPS = 7
RESUME_AT = 4  # after PowerSGD's compression started (start_iter=3) and DDP rebuilt its buckets
LR = 0.05


def _model() -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(
        5, 2, generator=g, dtype=torch.float64
    )


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((m(b[0]) - b[1]) ** 2).mean()


def _opt(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # type: ignore[arg-type]


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _resume_state(s: object) -> dict[str, object]:
    """What must match after a resumed run: PowerSGD's hook state (iteration, error memory, factors)."""
    st = getattr(s, "state", None)
    if st is None:
        return {}
    return {
        "iter": st.iter,
        "error": {i: t.tolist() for i, t in st.error_dict.items()},
        "q": {i: t.tolist() for i, t in st.q_memory_dict.items()},
    }


def _train_all() -> dict[str, object]:
    """On each rank: every baseline for STEPS steps on this rank's seeded batches, checkpointed after
    RESUME_AT steps; a fresh strategy loads that checkpoint (``weights_only=True``) and trains the rest."""
    r = lowband.rank()
    out: dict[str, object] = {}
    for spec in ("ddp", "ddp:hook=fp16", "powersgd:start_iter=3,rank=1", "localsgd:period=3"):
        name, opts = parse_strategy_spec(spec)
        key = "ddp-fp16" if opts.get("hook") == "fp16" else name
        m = _model()
        s = make_strategy(name, m, _opt, **opts)
        in_sync = []
        buf = io.BytesIO()
        for k in range(STEPS):
            if k == RESUME_AT:
                torch.save(s.state_dict(), buf)
            batch = _batch(r, k)
            s.train_step(lambda mod, b=batch: _loss(mod, b))
            in_sync.append(s.in_sync())
        m2 = _model()
        s2 = make_strategy(name, m2, _opt, **opts)
        buf.seek(0)
        s2.load_state_dict(torch.load(buf, weights_only=True))
        for k in range(RESUME_AT, STEPS):
            batch = _batch(r, k)
            s2.train_step(lambda mod, b=batch: _loss(mod, b))
        # plain lists: tensors returned from a child process would be shared through its memory
        out[key] = {
            "params": _flat(m).tolist(),
            "resumed": _flat(m2).tolist(),
            "state": _resume_state(s),
            "resumed_state": _resume_state(s2),
            "in_sync": in_sync,
            "opt_step": s.state_dict()["optimizer"].get("step"),
        }
    return out


def _oracle_sync(n: int) -> torch.Tensor:
    """S-SGD: one model, gradient = mean over ranks of each rank's batch gradient."""
    m = _model()
    opt = _opt(m.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        loss = sum(_loss(m, _batch(r, k)) for r in range(n)) / n
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return _flat(m)


def _oracle_local(n: int, period: int) -> list[torch.Tensor]:
    """Periodic averaging as torch schedules it: average after steps 1, 1 + H, 1 + 2H, ..."""
    models = [_model() for _ in range(n)]
    opts = [_opt(m.parameters()) for m in models]
    for k in range(STEPS):
        for r in range(n):
            opts[r].zero_grad()
            _loss(models[r], _batch(r, k)).backward()  # type: ignore[no-untyped-call]
            opts[r].step()
        if k % period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [_flat(m) for m in models]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_baselines_against_oracles(n: int) -> None:
    res = run_processes(_train_all, n, timeout=180)
    sync = _oracle_sync(n)
    local = _oracle_local(n, 3)
    for r in range(n):
        ddp = res[r]["ddp"]
        assert torch.allclose(torch.tensor(ddp["params"], dtype=torch.float64), sync, atol=1e-10), (
            f"DDP rank {r} != S-SGD oracle"
        )
        assert all(ddp["in_sync"])
        # torch's fp16_compress_hook: the S-SGD oracle up to half-precision rounding, and not fp32 DDP
        fp16 = torch.tensor(res[r]["ddp-fp16"]["params"], dtype=torch.float64)
        assert torch.allclose(fp16, sync, atol=2e-3) and not torch.equal(fp16, sync)
        assert res[r]["ddp-fp16"]["params"] == res[0]["ddp-fp16"]["params"]
        assert torch.allclose(
            torch.tensor(res[r]["localsgd"]["params"], dtype=torch.float64), local[r], atol=1e-10
        ), f"local SGD rank {r}"
        assert res[r]["localsgd"]["in_sync"] == [k % 3 == 0 for k in range(STEPS)]
        # PowerSGD: replicas identical on every rank (the hook allreduces the factors)
        assert res[r]["powersgd"]["params"] == res[0]["powersgd"]["params"]
        assert res[r]["localsgd"]["opt_step"] == STEPS  # the averager's counter is checkpointed
        # resumed at RESUME_AT from a weights_only checkpoint: bit for bit the uninterrupted run
        for name in ("ddp", "ddp-fp16", "powersgd", "localsgd"):
            assert res[r][name]["resumed"] == res[r][name]["params"], f"{name} rank {r}: resume not exact"
            assert res[r][name]["resumed_state"] == res[r][name]["state"], f"{name} rank {r}: hook state"
        assert res[r]["powersgd"]["state"]["iter"] > 3 and res[r]["powersgd"]["state"]["error"]


def _bad_constructions() -> list[str]:
    errs = []
    for name, opts in (
        ("nope", {}),
        ("localsgd", {"period": 0}),
        ("localsgd", {"H": 3}),
        ("powersgd", {"start_iter": 1}),
        ("ddp", {"hook": "bf16"}),
    ):
        try:
            make_strategy(name, _model(), _opt, **opts)
        except InvalidArgumentError as e:
            errs.append(str(e))
    return errs


def test_registry_and_errors() -> None:
    assert {"ddp", "powersgd", "localsgd"} <= set(strategy_names())
    assert parse_strategy_spec("localsgd:period=5") == ("localsgd", {"period": 5})
    assert parse_strategy_spec("powersgd:rank=2,start_iter=4") == ("powersgd", {"rank": 2, "start_iter": 4})
    with pytest.raises(InvalidArgumentError, match="expected name:key=value"):
        parse_strategy_spec("localsgd:period")

    errs = run_processes(_bad_constructions, 1, timeout=60)[0]
    assert len(errs) == 5
    assert "unknown strategy 'nope'" in errs[0] and "ddp" in errs[0]
    assert "period must be an int >= 1" in errs[1]
    assert "unknown option(s) ['H']" in errs[2]
    assert "start_iter must be an int >= 2, got 1" in errs[3]
    assert "hook must be one of 'none', 'fp16', got 'bf16'" in errs[4]
