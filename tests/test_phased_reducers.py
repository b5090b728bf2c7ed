"""The reducer protocol without side channels: a lane's promise (a result a later task delivers), the
gradient stage preparing its reducer and handing a round over without waiting
(:meth:`GradientStage.hand_off`), and SlimGC's reducer returning real per-unit handles that complete
when the round's last operation is done. Oracles: the mean over ranks of seeded gradients."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.comm.engine import issue_lane
from lowband.comm.handle import Handle
from lowband.comm.lane import LaneError
from lowband.compress.reducer import make_reducer
from lowband.compress.slimgc.pipeline import SlimGCReducer
from lowband.errors import CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.optim import (
    AllreduceReducer,
    GradientStage,
    ReduceContext,
    Reducer,
    Unit,
    layer_units,
    parameter_layers,
    parameter_names,
)
from lowband.runtime import current
from lowband.strategies.slimgc import parameter_units
from lowband.testing import run_threads


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(3)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    return (m(x) ** 2).mean()


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    m = _model()
    _loss(m, rank, step).backward()
    return [p.grad.clone() for p in m.parameters() if p.grad is not None]


def _mean_grads(n: int, step: int) -> list[torch.Tensor]:
    per_rank = [_grads(r, step) for r in range(n)]
    return [sum(gs[k] for gs in per_rank) / n for k in range(len(per_rank[0]))]  # type: ignore[misc]


# -- the lane's promise ------------------------------------------------------------------------------


def _promise_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    lane = issue_lane(None, timeout=5.0, where="test-promise")
    p = lane.promise()
    h0: Handle[int] = p.handle(lambda v: v[0], name="first")
    h1: Handle[int] = p.handle(lambda v: v[1])
    # then/future on engine handles (their works have no torch future: the completion thread waits)
    chained = p.handle(lambda v: v[0]).then(lambda x: x + 1)
    fut = p.handle(lambda v: v[1]).future()
    task = lane.submit(lambda: 7).then(lambda x: 2 * x)
    lane.submit(lambda: time.sleep(0.2))
    out["pending"] = not h0.done() and not p.done()
    lane.submit(lambda: p.set([10, 11]))
    out["values"] = [h0.wait(), h1.wait(), chained.wait(), fut.wait(), task.wait()]
    out["done"] = h0.done() and p.done()
    # a promise never settled: a bounded wait
    idle = issue_lane(None, timeout=0.2, where="test-idle")
    try:
        idle.promise().handle(lambda v: v).wait()
        out["timeout"] = False
    except CommTimeoutError:
        out["timeout"] = True
    idle.close()
    # a failed task fails the promise its later task would have settled
    q = lane.promise()
    hq = q.handle(lambda v: v)
    lane.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    lane.submit(lambda: q.set(1))  # skipped: the lane failed
    t0 = time.perf_counter()
    try:
        hq.wait()
        out["failed"] = False
    except LaneError as exc:
        out["failed"] = "boom" in str(exc) and time.perf_counter() - t0 < 4.0
    lane.close()
    return out


def test_promise() -> None:
    for out in run_threads(_promise_checks, 2, timeout=60):
        assert out == {
            "pending": True,
            "values": [10, 11, 11, 11, 14],
            "done": True,
            "timeout": True,
            "failed": True,
        }


# -- the stage: prepare and hand_off -----------------------------------------------------------------


class Copying(Reducer):
    """The average into new tensors (not in place); records what ``prepare`` was given."""

    def __init__(self) -> None:
        self.prepared: list[tuple[list[str], int]] = []

    def prepare(self, units: Sequence[Unit], group: Group) -> None:
        self.prepared.append(([u.key for u in units], group.size))

    def reduce(self, unit: Unit, grads: list[torch.Tensor], ctx: ReduceContext) -> Handle[list[torch.Tensor]]:
        copies = [g.clone() for g in grads]
        return AllreduceReducer().reduce(unit, copies, ctx)


def _hand_off_run() -> dict[str, Any]:
    r, n = lowband.rank(), lowband.size()
    m = _model()
    units = layer_units(parameter_layers(m), parameter_names(m))
    red = Copying()
    stage = GradientStage(units, red)
    out: dict[str, Any] = {"prepared": red.prepared, "timings": red.timings}
    with pytest.raises(InvalidArgumentError, match="a backward pass since"):
        stage.hand_off()
    rounds = []
    for k in range(2):
        m.zero_grad()
        _loss(m, r, k).backward()
        rounds.append(stage.hand_off())  # the next backward may start before this round is waited
    own = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    out["own_kept"] = all(torch.equal(a, b) for a, b in zip(own, _grads(r, 1)))
    flat = [[t for ts in rnd.wait() for t in ts] for rnd in rounds]
    out["steps"] = [rnd.step for rnd in rounds]
    out["averages"] = [
        all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(flat[k], _mean_grads(n, k)))
        for k in range(2)
    ]
    rounds[1].wait(into_grads=True)
    out["into_grads"] = all(
        torch.equal(p.grad, a) for p, a in zip((p for p in m.parameters() if p.grad is not None), flat[1])
    )
    out["rounds"] = stage.rounds
    lw = GradientStage(units, AllreduceReducer(), on_reduced=lambda i: None, check_layout=False)
    with pytest.raises(InvalidArgumentError, match="on_reduced"):
        lw.hand_off()
    stage.remove_hooks()
    lw.remove_hooks()
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_hand_off(n: int) -> None:
    keys = [u.key for u in layer_units(parameter_layers(_model()), parameter_names(_model()))]
    for out in run_threads(_hand_off_run, n, timeout=60):
        assert out == {
            "prepared": [(keys, n)], "timings": None, "own_kept": True, "steps": [0, 1],
            "averages": [True, True], "into_grads": True, "rounds": 2,
        }  # fmt: skip


# -- SlimGC's reducer: per-unit handles, complete with the round ---------------------------------------


def _slimgc_handles(copy_grads: bool) -> dict[str, Any]:
    r, n = lowband.rank(), lowband.size()
    m = _model()
    units = parameter_units(m)
    lane = issue_lane(None, timeout=10.0, where="test-slimgc")
    reducer = SlimGCReducer(
        make_reducer("allreduce", "identity", "residual"), units, lane,
        threshold=float("inf"), pre_steps=0, fuse_bytes=2**30, copy_grads=copy_grads,
    )  # fmt: skip
    _loss(m, r, 0).backward()
    grads = {u.key: [p.grad for p in u.params] for u in units}
    own = {k: [g.clone() for g in v] for k, v in grads.items()}  # type: ignore[union-attr]
    ctx = ReduceContext(current().world.unchecked(), 0)
    handles: dict[str, Handle[list[torch.Tensor]]] = {}
    early = []
    for u in reversed(units):  # the stage's launch order
        handles[u.key] = reducer.reduce(u, grads[u.key], ctx)  # type: ignore[arg-type]
        early.append(handles[u.key].done())
    results = {k: h.wait() for k, h in handles.items()}
    mean = dict(zip([u.key for u in units], _mean_grads(n, 0)))
    lane.close()
    return {
        # every unit is fused into one allreduce launched at the round's end: nothing is done before
        "early_done": any(early[:-1]),
        "averages": all(torch.allclose(results[k][0], mean[k], rtol=0, atol=1e-12) for k in results),
        "in_place": all(results[k][0] is grads[k][0] for k in results),
        "grad_kept": all(torch.equal(grads[k][0], own[k][0]) for k in results),  # type: ignore[arg-type]
        "in_flight": reducer.in_flight(),
    }


@pytest.mark.parametrize("copy_grads", [False, True])
def test_slimgc_handles(copy_grads: bool) -> None:
    for out in run_threads(lambda: _slimgc_handles(copy_grads), 2, timeout=60):
        assert out == {
            "early_done": False, "averages": True, "in_place": not copy_grads, "grad_kept": copy_grads,
            "in_flight": False,
        }  # fmt: skip
