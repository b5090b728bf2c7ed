"""``on_peer_loss=continue`` in the strategy ``winput``: a rank killed with SIGKILL inside its training
loop and the survivors train on, each survivor's final parameters equal to a single-process float64
oracle. winput's combination uses whatever has arrived, so the loop here runs in lockstep (each rank waits
for its puts, then a barrier, before the step; a barrier after it), which makes every combination
``x <- W x - lr g(x)`` exact: the oracle is awc's (:mod:`test_decentral_peer_loss`). The step in which the
rank died is a local step on every survivor; from the next step on they combine over the topology rebuilt
for their number, their windows registered again with every buffer a copy of their own parameter. A false
alarm rebuilds the windows over every rank; a topology object and a replacement are refused under
``continue``. Real processes (a killed thread would not close its sockets).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_decentral_peer_loss import _oracle
from test_peer_steps import COMM_TIMEOUT, LR, _loss, _model

import lowband
from lowband.decentral.window import win_state_dict
from lowband.decentral.winput_strategy import WinPutStrategy
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.runtime import current
from lowband.strategies import make_strategy
from lowband.testing import run_processes, run_threads
from lowband.topology import Topology, exponential_two
from lowband.topology.names import TOPOLOGIES, build_topology


def _lockstep(s: WinPutStrategy) -> None:
    """This rank's puts applied (a failed one is noticed), then a barrier of the members (a failed one is
    noticed; after a notice it is skipped): every put of the step is in its window before anyone combines."""
    s.winput.wait_puts()
    s.side_collective(lambda: lowband.barrier(group=s.group), "a test's barrier", lambda: None)


def _train(
    topology: str, steps: int, victim: int | None, kill: int, alarm: int | None, out: str, first: bool = False
) -> Any:
    """``steps`` seeded steps in lockstep; ``victim`` kills itself (SIGKILL) before step ``kill``, after its
    puts completed (``first``: at once, while the others wait for its death before that step: they meet
    the dead rank at their windows; else after 0.5 s, in which the others' puts to it are applied: they meet it
    at the barrier); ``alarm``: that rank takes the others for lost before step ``kill``."""
    r = lowband.rank()
    s = make_strategy(
        "winput", _model(), lambda ps: torch.optim.SGD(ps, lr=LR), topology=topology, on_peer_loss="continue"
    )
    assert isinstance(s, WinPutStrategy)
    own_buffers = None
    try:
        for k in range(steps):
            if k == kill and first and r != victim:
                while not Path(out, f"killed-{victim}").exists():  # written just before the kill
                    time.sleep(0.01)
                time.sleep(0.3)  # (the victim is dead by now: this rank's receiver from it failed)
            if k == kill and r in (victim, alarm):
                s.synchronize()
                time.sleep(0 if first else 0.5)  # (the others' puts to this rank are applied meanwhile)
                if r == victim:
                    Path(out, f"killed-{r}").write_text(repr(time.time()))
                    os.kill(os.getpid(), 9)
                s.notice(CommFailedError("a test's false alarm"), "a test", time.monotonic())

            def loss_fn(m: torch.nn.Module, k: int = k) -> torch.Tensor:
                loss = _loss(m, r, k)  # the forward put the parameters into the neighbors' windows
                _lockstep(s)
                return loss

            s.train_step(loss_fn)
            if k == kill:  # met after this step: the new windows' buffers, before anyone puts into them
                own_buffers = all(
                    torch.equal(b, p.detach())
                    for w, p in s.winput.windows
                    for b in win_state_dict(w)["buffers"].values()
                )
            s.side_collective(lambda: lowband.barrier(group=s.group), "a test's barrier", lambda: None)
    except (CommFailedError, CommTimeoutError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    s.synchronize()
    params = [p.detach().clone() for p in s.local_module.parameters()]
    report = s.report()
    receivers = sorted(t.name for t in threading.enumerate() if t.name.startswith("lowband-win-"))
    s.close()
    return {
        "params": params, "report": report, "ranks": s.group.ranks, "steps": s.steps, "own": own_buffers,
        "receivers": receivers,
    }  # fmt: skip


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("topology", "n", "victim", "kill", "first"),
    [("exp2", 3, 2, 4, False), ("ring", 4, 0, 5, False), ("full", 4, 1, 3, False), ("ring", 4, 0, 4, True),
     ("exp2", 3, 1, 5, True)],
)  # fmt: skip
def test_survivors_train_on_without_the_killed_rank(
    topology: str, n: int, victim: int, kill: int, first: bool, tmp_path: Path
) -> None:
    steps = 10
    out = run_processes(
        _train, n, topology, steps, victim, kill, None, str(tmp_path), first,
        timeout=80, comm_timeout=COMM_TIMEOUT, allow_exit=(victim,),
    )  # fmt: skip
    topo = build_topology("test", topology, tuple(TOPOLOGIES), n, 1)
    rebuilt = build_topology("test", topology, tuple(TOPOLOGIES), n - 1, 1)
    assert isinstance(topo, Topology) and isinstance(rebuilt, Topology)
    survivors = [r for r in range(n) if r != victim]
    for r in survivors:
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        assert got["ranks"] == tuple(survivors) and got["steps"] == steps and got["own"] is True, got
        (event,) = got["report"]["peer_loss"]
        assert event["lost_ranks"] == [victim] and event["members"] == survivors, event
        # every survivor noticed in step `kill` (a put to the dead rank, the service's record of it, or
        # the barrier before the step), before that step's combination: a local step on every survivor
        assert (event["exchange"], event["step"], event["caught_up_steps"]) == (kill + 1, kill + 1, 0), event
        assert event["noticed_step"] == kill and event["recover_s"] < 10.0, event
        # the old windows' receivers ended: one per neighbor in the rebuilt topology remains
        me = survivors.index(r)
        peers = sorted({*rebuilt.in_neighbors(me), *rebuilt.out_neighbors(me)})
        assert got["receivers"] == sorted(f"lowband-win-r{r}-from{p}" for p in peers), got["receivers"]
        if first and victim in {*topo.in_neighbors(r), *topo.out_neighbors(r)}:
            # its receiver from the dead rank failed while it waited: its first put raised that, noticed
            assert event["noticed_at"].startswith("the window 'winput"), event
        print(f"winput rank {r}: noticed at {event['noticed_at']}, recovered in {event['recover_s']} s")
        want = _oracle("awc", topology, n, steps, victim, (kill,), r)
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.timeout(90)
def test_a_false_alarm_rebuilds_the_windows_over_every_rank(tmp_path: Path) -> None:
    """Rank 1 takes the others for lost before step 4: it gives up its windows (their connections close)
    and steps alone; the others notice in step 4 (a put to rank 1, or the barrier) and step alone too;
    all three meet after step 4 with every rank."""
    n, steps, alarm, kill = 3, 8, 1, 4
    out = run_processes(
        _train, n, "exp2", steps, None, kill, alarm, str(tmp_path), timeout=80, comm_timeout=COMM_TIMEOUT
    )
    for r in range(n):
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        (event,) = got["report"]["peer_loss"]
        assert event["false_alarm"] and event["members"] == [0, 1, 2] and event["step"] == kill + 1, event
        assert got["own"] is True, got
        want = _oracle("awc", "exp2", n, steps, None, (kill,), r)
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _refused() -> str:
    try:
        make_strategy(
            "winput", _model(), lambda ps: torch.optim.SGD(ps, lr=LR), topology=exponential_two(lowband.size()),
            on_peer_loss="continue",
        )  # fmt: skip
    except InvalidArgumentError as exc:
        return str(exc)
    return "built"


@pytest.mark.timeout(60)
def test_a_topology_object_is_refused_under_continue() -> None:
    for said in run_processes(_refused, 2, timeout=50):
        assert "on_peer_loss='continue'" in said and "option 'topology' must be a name" in said, said
        assert "ring, exp2, full" in said, said


def _replacement() -> str:
    current("test").joining = True  # what a replacement's context says (LOWBAND_JOIN=1)
    try:
        make_strategy(
            "winput",
            _model(),
            lambda ps: torch.optim.SGD(ps, lr=LR),
            topology="ring",
            on_peer_loss="continue",
        )
    except InvalidArgumentError as exc:
        return str(exc)
    return "built"


@pytest.mark.timeout(60)
def test_a_replacement_is_refused_under_continue() -> None:
    for said in run_threads(_replacement, 2, timeout=50):
        assert "replaces a lost rank" in said and "'winput' admits no replacement" in said, said
