"""The compressed transports where they run: as the reducer of the gradient stage (several buckets
launched from backward hooks, and per-layer stepping that polls and waits unit by unit) and as a DDP
comm hook (the reduction finished on torch's callback thread). With the identity compressor training
matches plain allreduce; with a lossy compressor every rank ends with bit-identical weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transport_oracle import Int8Scale

import lowband
from lowband.compress import make_reducer
from lowband.optim import GradientStage, LayerwiseOptimizer, bucket_units, parameter_layers, parameter_names
from lowband.optim.reducer import AllreduceReducer, Reducer
from lowband.testing import run_threads

TRANSPORTS = ("allgather", "ps", "twostage")
STEPS = 3


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(11)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def _loss(m: nn.Module, rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * rank + k)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    return ((m(x) - y) ** 2).mean()


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _torch_group() -> dist.ProcessGroup:
    """A torch ProcessGroup (what DDP takes) over this thread rank's gloo backend."""
    pg = dist.ProcessGroup(lowband.rank(), lowband.size())
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, lowband.world().pg)
    return pg


def _train(how: str, reducer: Reducer) -> torch.Tensor:
    r, m = lowband.rank(), _model()
    if how == "layerwise":
        lw = LayerwiseOptimizer(
            parameter_layers(m),
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            reducer=reducer,
            names=parameter_names(m),
        )
        for k in range(STEPS):
            _loss(m, r, k).backward()
            lw.step()
        return _flat(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if how == "ddp":
        ddp = DistributedDataParallel(m, process_group=_torch_group(), bucket_cap_mb_list=[0.0002, 0.0002])
        state, hook = lowband.ddp_comm_hook(reducer, m)
        ddp.register_comm_hook(state, hook)
        for k in range(STEPS):
            opt.zero_grad()
            _loss(ddp, r, k).backward()
            opt.step()
        return _flat(m)
    stage = GradientStage(bucket_units(m, 40e-6, 40e-6), reducer)
    assert len(stage.units) >= 3, "several units per backward"
    for k in range(STEPS):
        opt.zero_grad()
        _loss(m, r, k).backward()
        stage.wait()
        opt.step()
    return _flat(m)


@pytest.mark.parametrize("how", ["stage", "layerwise", "ddp"])
@pytest.mark.parametrize("n", [2, 3])
def test_transports_in_training(n: int, how: str) -> None:
    def rank_fn() -> dict[str, torch.Tensor]:
        out = {"plain": _train(how, AllreduceReducer())}
        for t in TRANSPORTS:
            out[f"{t}/identity"] = _train(how, make_reducer(t, "identity"))
            out[f"{t}/int8"] = _train(how, make_reducer(t, Int8Scale()))
        return out

    res = run_threads(rank_fn, n, timeout=120)
    for r in range(n):
        for t in TRANSPORTS:
            diff = float((res[r][f"{t}/identity"] - res[r]["plain"]).abs().max())
            assert diff < 1e-6, f"{how} {t} identity rank {r}: {diff}"
            assert torch.equal(res[r][f"{t}/int8"], res[0][f"{t}/int8"]), (
                f"{how} {t} rank {r} differs from rank 0"
            )
            assert not torch.equal(res[r][f"{t}/int8"], res[r]["plain"]), "the lossy format changed nothing"
