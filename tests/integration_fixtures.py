"""What the framework integration tests share: a model with an embedding table (every strategy runs it,
EmbRace partitions the table), every rank's seeded batches, and lowband's own loop over them, the
reference every framework's loss sequence is compared with."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowband
from lowband.strategies import make_strategy

STEPS, EPOCH = 20, 10  # 20 steps: two epochs of ten batches (checkpoints at the epoch's end)
BATCH = 8
LR = 0.05

#: the strategies every integration trains (issue 27): name -> options
STRATEGIES: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": 1, "start_iter": 2},
    "compressed": {"compressor": "onebit", "reducer": "twostage"},
    "dreamddp": {"period": 2, "trial_periods": 0},  # + a profile file the reference run measures
    "atc": {"allreduce_every": 2},
    "embrace": {},
}
#: their first step after a resume replays its forward once (torch DDP rebuilds its buckets on it:
#: lowband.strategies.replay), so a loss recorded in the forward is recorded twice
REPLAY_AFTER_RESUME = ("powersgd",)
#: not bit for bit between two runs of lowband's own loop already (tests/test_loop_api.py: ROUNDING)
ROUNDING = ("atc",)


class Net(nn.Module):
    """An embedding table read at ids derived from the inputs, then dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 7).long() % 16
        return self.head(self.emb(ids).mean(1))  # type: ignore[no-any-return]


def init_net(net: Net) -> Net:
    """The same parameters on every call (rank 0's are broadcast anyway)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


class Holder(nn.Module):
    """The reference's model: ``Net`` as attribute ``net``, named as in the frameworks' modules."""

    def __init__(self) -> None:
        super().__init__()
        self.net = init_net(Net())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's EPOCH batches of BATCH rows, in order."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(EPOCH * BATCH, 6, generator=g), torch.randn(EPOCH * BATCH, 2, generator=g)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = rank_data(rank)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def options(name: str, folder: str) -> dict[str, Any]:
    opts = dict(STRATEGIES[name])
    if name == "dreamddp":
        opts["profile"] = str(Path(folder) / "dreamddp-profile.json")
    return opts


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule of the scheduler tests: halved every 3 steps."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def reference(
    name: str,
    folder: str,
    *,
    accumulate: int = 1,
    clip: float | None = None,
    bf16: bool = False,
    scheduled: bool = False,
) -> list[float]:
    """lowband's own loop: STEPS passes over this rank's batches (EPOCH per epoch), the losses; with
    ``accumulate=J`` a step every J passes, ``clip`` the norm clipped to before each step, ``bf16`` the
    forward and loss under CPU bf16 autocast, ``scheduled`` :func:`step_lr` on the strategy's optimizer,
    stepped after every step."""
    rank = lowband.rank()
    model = Holder()
    extra = {"accumulate": accumulate} if accumulate > 1 else {}
    s = make_strategy(name, model, optimizer, **options(name, folder), **extra)
    schedule = step_lr(s.optimizer) if scheduled else None
    data = batches(rank)
    losses = []
    for k in range(STEPS):
        x, y = data[k % EPOCH]
        s.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(s.module(x), y)
        s.backward(loss)
        if clip is not None:
            s.clip_grad_norm_(clip)
        s.step()
        if schedule is not None:
            schedule.step()
        losses.append(float(loss.detach()))
    s.close()
    return losses


def check(name: str, got: list[float], want: list[float], where: str, *, rounding: bool = False) -> None:
    """Bit for bit, except ATC and ``rounding`` (to 1e-5 relative: float32 rounding)."""
    assert len(got) == len(want), f"{where}: {len(got)} losses, want {len(want)}"
    if name in ROUNDING or rounding:
        for i, (a, b) in enumerate(zip(got, want)):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), f"{where}: step {i}: {a} != {b}"
    else:
        assert got == want, f"{where}: losses differ from lowband's own loop"


def without_replay(name: str, resumed: list[float], where: str) -> list[float]:
    """The losses a resumed run recorded, less the replayed first forward of REPLAY_AFTER_RESUME."""
    if name not in REPLAY_AFTER_RESUME:
        return resumed
    assert len(resumed) > 1 and resumed[0] == resumed[1], f"{where}: the replay differs from the step"
    return resumed[1:]


def hook_reference(compressor: str = "onebit", reducer: str = "twostage") -> list[float]:
    """lowband's comm-hook route in a plain loop: torch DDP with ``lowband.ddp_comm_hook`` of the
    compressed reducer, STEPS steps over this rank's batches."""
    from lowband.compress.specs import build_reducer

    model = Holder()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(*lowband.ddp_comm_hook(build_reducer(compressor, reducer), model))
    opt = optimizer(ddp.parameters())
    data = batches(lowband.rank())
    losses = []
    for k in range(STEPS):
        x, y = data[k % EPOCH]
        opt.zero_grad()
        loss = loss_of(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return losses
