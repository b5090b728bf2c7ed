"""The Future bridge (``Handle.future``) and ``lowband.ddp_comm_hook``: the allreduce reducer as a DDP
comm hook trains exactly as DDP's default allreduce (to float error) and as the single-process oracle,
on thread ranks (DDP gets a torch ProcessGroup over the thread rank's gloo backend)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lowband
from lowband.comm.handle import Handle
from lowband.errors import CommFailedError, InvalidArgumentError
from lowband.optim import AllreduceReducer, ReduceContext, Reducer, Unit
from lowband.testing import run_threads

STEPS = 4


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(3)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return ((m(torch.randn(6, 8, generator=g)) - torch.randn(6, 3, generator=g)) ** 2).mean()


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


class Named(Reducer):
    """The allreduce reducer, recording the names and steps it is given."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, ...], int]] = []

    def reduce(self, unit: Unit, grads: list[torch.Tensor], ctx: ReduceContext) -> Handle[list[torch.Tensor]]:
        self.seen.append((unit.names, ctx.step))
        return AllreduceReducer().reduce(unit, grads, ctx)


def _torch_group() -> dist.ProcessGroup:
    """A torch ProcessGroup (what DDP takes) over this thread rank's gloo backend."""
    pg = dist.ProcessGroup(lowband.rank(), lowband.size())
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, lowband.world().pg)
    return pg


def _train(hooked: bool) -> dict[str, Any]:
    r = lowband.rank()
    m = _model()
    # small buckets: several per iteration (DDP rebuilds them after the first iteration)
    ddp = DistributedDataParallel(m, process_group=_torch_group(), bucket_cap_mb_list=[0.001, 0.002])
    red = Named()
    if hooked:
        state, hook = lowband.ddp_comm_hook(red, m)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for k in range(STEPS):
        opt.zero_grad()
        _loss(ddp, r, k).backward()
        opt.step()
    return {"params": _flat(m), "seen": red.seen}


def _both() -> dict[str, Any]:
    return {"default": _train(False), "hook": _train(True)}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allreduce_reducer_as_ddp_hook_equals_ddp_default(n: int) -> None:
    res = run_threads(_both, n, timeout=120)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for k in range(STEPS):
        opt.zero_grad()
        (sum(_loss(ref, r, k) for r in range(n)) / n).backward()  # type: ignore[union-attr]
        opt.step()
    names = {name for name, _ in ref.named_parameters()}
    for r in range(n):
        default, hooked = res[r]["default"]["params"], res[r]["hook"]["params"]
        assert float((hooked - default).abs().max()) < 1e-5, f"rank {r}"
        assert float((hooked - _flat(ref)).abs().max()) < 1e-5, f"rank {r}"
        seen = res[r]["hook"]["seen"]
        assert len(seen) >= 2 * STEPS, "several buckets per iteration"
        for k in range(STEPS):  # every parameter named once per iteration, the step counting iterations
            got = [nm for ns, step in seen if step == k for nm in ns]
            assert sorted(got) == sorted(names), f"rank {r} step {k}"


# -- Handle.future ---------------------------------------------------------------------------------------


def _futures() -> list[Any]:
    r = lowband.rank()
    t = torch.full((3,), float(r + 1))
    fut = lowband.iallreduce(t, op="sum").future()
    chained = lowband.iallreduce(t, op="sum").then(lambda x: x * 2).future()
    return [fut.wait(), chained.wait()]


@pytest.mark.parametrize("n", [1, 3])
def test_future_completes_with_the_result(n: int) -> None:
    total = n * (n + 1) / 2
    for got, doubled in run_threads(_futures, n, timeout=60):
        assert torch.equal(got, torch.full((3,), total))
        assert torch.equal(doubled, torch.full((3,), 2 * total))


def test_future_carries_the_error() -> None:
    def boom() -> torch.Tensor:
        raise ValueError("unpacking failed")

    h: Handle[torch.Tensor] = Handle([], boom, op="allreduce", name="x", rank=0, timeout=1.0)
    fut = h.future()
    assert fut.done()
    with pytest.raises(CommFailedError, match=r"lowband\.allreduce 'x' on rank 0 failed: unpacking failed"):
        fut.wait()
    with pytest.raises(CommFailedError):
        h.then(lambda x: x).future().wait()


def _bad_hooks() -> list[str]:
    errs = []
    for args in ((object(), _model()), (AllreduceReducer(), "model")):
        try:
            lowband.ddp_comm_hook(*args)  # type: ignore[arg-type]
        except InvalidArgumentError as exc:
            errs.append(str(exc))
    return errs


def test_bad_arguments() -> None:
    errs = run_threads(_bad_hooks, 1, timeout=60)[0]
    assert len(errs) == 2
    assert "reducer must be a lowband.optim.Reducer, got object" in errs[0]
    assert "model must be the torch.nn.Module DDP wraps, got str" in errs[1]
