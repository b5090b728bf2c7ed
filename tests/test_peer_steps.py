"""``on_peer_loss=continue`` in the strategies that average at every step (``dreamddp``, ``plsgd-enp``,
``flsgd-overlap``: :mod:`lowband.strategies.peer_steps`): a rank killed with SIGKILL inside its training
loop and the survivors train on, their final parameters equal among themselves and to a single-process
oracle (the averagings of the step the rank died in fail and are put back, the next step is trained alone,
then the survivors average among themselves); a survivor that noticed a step before the others catches
up alone; a replacement joins from a live member. Real processes (a killed thread would not close its
sockets); a fixed schedule, so no profile's timing decides anything.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import CommFailedError, CommTimeoutError, NonFiniteError
from lowband.localsgd.schedule import Schedule
from lowband.strategies import make_strategy
from lowband.strategies.peer_steps import StepwisePeerLoss
from lowband.testing import run_processes

COMM_TIMEOUT = 10.0
LR = 0.1
# layer 0 (the first Linear) at iterations 1 and 2 of each period of 3, layer 1 at iteration 0 and 2
SCHEDULE = Schedule(3, ((1,), (0,), (0, 1)), "test", 3.0, (1.0, 1.0, 1.0))


def _model() -> nn.Sequential:
    g = torch.Generator().manual_seed(7)
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return m


def _loss(m: nn.Module, r: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * r + k)
    x, y = (
        torch.randn(8, 5, generator=g, dtype=torch.float64),
        torch.randn(8, 1, generator=g, dtype=torch.float64),
    )
    out: torch.Tensor = ((m(x) - y) ** 2).mean()
    return out


def _train(
    name: str,
    opts: dict[str, Any],
    steps: int,
    victim: int | None,
    kill: int,
    alarm: int | None,
    out: str,
) -> Any:
    """``steps`` seeded steps of strategy ``name`` (options ``opts``, ``on_peer_loss="continue"``; also the
    decentralized ones' test); ``victim`` kills itself (SIGKILL) before step ``kill``, after its
    communication in flight completed; ``alarm``: that rank takes the others for lost before step ``kill``
    instead."""
    r = lowband.rank()
    s = make_strategy(name, _model(), lambda ps: torch.optim.SGD(ps, lr=LR), on_peer_loss="continue", **opts)
    try:
        for k in range(steps):
            if k == kill and r in (victim, alarm):
                s.synchronize()
                time.sleep(0.5)  # (the others' ends of these operations complete too)
                if r == victim:
                    Path(out, f"killed-{r}").write_text(repr(time.time()))
                    os.kill(os.getpid(), 9)
                assert isinstance(s, StepwisePeerLoss)
                s.notice(CommFailedError("a test's false alarm"), "a test", time.monotonic())
            s.train_step(lambda m, k=k: _loss(m, r, k))  # type: ignore[misc]
    except (CommFailedError, CommTimeoutError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    s.synchronize()
    params = [p.detach().clone() for p in s.local_module.parameters()]
    report = s.report()
    s.close()
    return {"params": params, "report": report, "ranks": s.group.ranks, "steps": s.steps}


def _oracle(n: int, steps: int, dead: set[int], quiet: tuple[int, ...], rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s parameters replayed in one process: every rank's seeded SGD steps (a dead rank's up
    to its kill), and after each step the layers the schedule names averaged over the ranks alive, except
    at the ``quiet`` steps (failed, or trained alone)."""
    models = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    # per unit (layer), per rank: its parameters (weight, bias)
    layers = [[list(m[i].parameters()) for m in models] for i in (0, 2)]
    for t in range(steps):
        alive = [r for r in range(n) if r not in dead or t < quiet[0]]
        for r in alive:
            opts[r].zero_grad()
            _loss(models[r], r, t).backward()  # type: ignore[no-untyped-call]
            opts[r].step()
        if t in quiet:
            continue
        with torch.no_grad():
            for unit in SCHEDULE.sets[t % SCHEDULE.period]:
                per_rank = layers[unit]
                for i in range(2):
                    avg = torch.stack([per_rank[r][i] for r in alive]).sum(0) / len(alive)
                    for r in alive:
                        per_rank[r][i].copy_(avg)
    return [p.detach().clone() for p in models[rank].parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "n", "victim", "kill"), [("dreamddp", 3, 2, 4), ("plsgd-enp", 4, 0, 5)])
def test_survivors_train_on_without_the_killed_rank(
    name: str, n: int, victim: int, kill: int, tmp_path: Path
) -> None:
    steps = 11
    out = run_processes(
        _train, n, name, {"schedule": SCHEDULE}, steps, victim, kill, None, str(tmp_path),
        timeout=50, comm_timeout=COMM_TIMEOUT, allow_exit=(victim,),
    )  # fmt: skip
    survivors = [r for r in range(n) if r != victim]
    for r in survivors:
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        assert got["ranks"] == tuple(survivors) and got["steps"] == steps
        (event,) = got["report"]["peer_loss"]
        assert event["lost_ranks"] == [victim] and event["members"] == survivors, event
        # step `kill`'s averagings failed; no step waits for the non-finite agreement (read steps later),
        # so every survivor noticed at step kill + 1's forward, trained it alone and agreed after it
        assert (event["exchange"], event["step"], event["caught_up_steps"]) == (kill + 2, kill + 2, 0), event
        assert event["noticed_step"] == kill + 1 and event["recover_s"] < 10.0, event
        want = _oracle(n, steps, {victim}, (kill, kill + 1), r)
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.timeout(60)
def test_a_survivor_that_noticed_first_catches_up_alone(tmp_path: Path) -> None:
    """Rank 1 takes the others for lost before step 4 (a false alarm): it trains step 4 alone and agrees
    after it; the others' averagings of step 4 fail, they notice at step 5's forward and agree after step 5;
    rank 1 trains step 5 alone too (caught up one step), then all three meet with every rank. (The
    non-finite agreement is read steps later, so it does not change when they notice.)"""
    n, steps, alarm = 3, 10, 1
    out = run_processes(
        _train, n, "dreamddp", {"schedule": SCHEDULE, "on_nonfinite": "off"}, steps, None, 4, alarm,
        str(tmp_path),
        timeout=50, comm_timeout=COMM_TIMEOUT,
    )  # fmt: skip
    for r in range(n):
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        (event,) = got["report"]["peer_loss"]
        assert event["false_alarm"] and event["members"] == [0, 1, 2] and event["step"] == 6, event
        assert (event["exchange"], event["caught_up_steps"]) == ((5, 1) if r == alarm else (6, 0)), event
        # step 4: rank 1 launched nothing, so nobody's averagings completed; step 5: all alone
        want = _oracle(n, steps, set(), (4, 5), r)
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _nan_alone(out: str) -> Any:
    """Rank 1 takes the others for lost before step 3 and its step-3 loss is NaN, while it trains alone."""
    r = lowband.rank()
    s = make_strategy(
        "dreamddp",
        _model(),
        lambda ps: torch.optim.SGD(ps, lr=LR),
        schedule=SCHEDULE,
        on_peer_loss="continue",
    )
    try:
        for k in range(8):
            if k == 3 and r == 1:
                s.synchronize()
                time.sleep(0.5)
                assert isinstance(s, StepwisePeerLoss)
                s.notice(CommFailedError("a test's false alarm"), "a test", time.monotonic())
            bad = k == 3 and r == 1
            s.train_step(lambda m, k=k, bad=bad: _loss(m, r, k) * (float("nan") if bad else 1.0))  # type: ignore[misc]
    except NonFiniteError as exc:
        return {"error": "NonFiniteError", "message": str(exc), "steps": s.steps}
    return {"ranks": s.group.ranks, "steps": s.steps}


@pytest.mark.timeout(60)
def test_a_non_finite_gradient_while_training_alone_raises(tmp_path: Path) -> None:
    """While a survivor trains alone its own guard reads the layers' checks (they were left on the
    group's guard, which zeroed the NaN gradient and never raised); the others go on without it."""
    out = run_processes(_nan_alone, 3, str(tmp_path), timeout=50, comm_timeout=COMM_TIMEOUT)
    assert out[1]["error"] == "NonFiniteError" and out[1]["steps"] == 3, out[1]
    for r in (0, 2):
        assert out[r] == {"ranks": (0, 2), "steps": 8}, out[r]
