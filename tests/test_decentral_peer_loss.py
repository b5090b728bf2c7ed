"""``on_peer_loss=continue`` in the decentralized strategies ``atc`` and ``awc``: a rank killed with
SIGKILL inside its training loop and the survivors train on, each survivor's final parameters equal to a
single-process float64 oracle (the combinations of the step the rank died in are dropped: that step is a
local step on every survivor; from the next step on the survivors combine over the topology rebuilt for
their number, from its first round); a survivor that noticed a step before the others catches up alone;
a topology object is refused under ``continue``. Real processes (a killed thread would not close its
sockets).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_peer_steps import COMM_TIMEOUT, LR, _loss, _model, _train

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import run_processes
from lowband.topology import DynamicTopology, Topology
from lowband.topology.names import TOPOLOGIES, build_topology


def _mix(topo: Topology, values: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """One neighbor averaging over group ranks: ``W[i, i] x_i + sum_j W[i, j] x_j`` (sends unscaled)."""
    out = []
    for i, mine in enumerate(values):
        src = topo.src_weights(i)
        out.append(
            [
                topo.self_weight(i) * x + sum((w * values[j][k] for j, w in src.items()), torch.zeros_like(x))
                for k, x in enumerate(mine)
            ]
        )
    return out


def _oracle(
    name: str, topology: str, n: int, steps: int, victim: int | None, quiet: tuple[int, ...], rank: int
) -> list[torch.Tensor]:
    """Rank ``rank``'s parameters replayed in one process: every rank's seeded SGD steps (the victim's up
    to its kill, before step ``quiet[0]``), combined after the step (atc) or before it, the gradient taken
    at the uncombined parameters (awc), except at the ``quiet`` steps (dropped, or trained alone); after
    them the topology is rebuilt over the members, from its round 0."""
    models = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    alive = list(range(n))
    rounds = 0
    built = build_topology("oracle", topology, tuple(TOPOLOGIES), n, 1)
    for t in range(steps):
        if t == quiet[0]:
            alive = [r for r in alive if r != victim]
        if t == quiet[-1] + 1:
            built, rounds = build_topology("oracle", topology, tuple(TOPOLOGIES), len(alive), 1), 0
        combine = t not in quiet
        topo = built.at(rounds) if isinstance(built, DynamicTopology) else built
        params = [list(models[r].parameters()) for r in alive]
        for r in alive:
            opts[r].zero_grad()
            _loss(models[r], r, t).backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            if name == "awc" and combine:
                for ps, new in zip(
                    params, _mix(topo, [[p.clone() for p in ps] for ps in params]), strict=True
                ):
                    for p, v in zip(ps, new, strict=True):
                        p.copy_(v)
        for r in alive:
            opts[r].step()
        with torch.no_grad():
            if name == "atc" and combine:
                for ps, new in zip(
                    params, _mix(topo, [[p.clone() for p in ps] for ps in params]), strict=True
                ):
                    for p, v in zip(ps, new, strict=True):
                        p.copy_(v)
        rounds += combine
    return [p.detach().clone() for p in models[rank].parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "topology", "n", "victim", "kill"),
    [
        ("atc", "dynamic-exp2", 3, 2, 4),
        ("atc", "ring", 4, 0, 5),
        ("awc", "exp2", 3, 1, 4),
        ("awc", "dynamic-exp2", 4, 0, 5),
    ],
)
def test_survivors_train_on_without_the_killed_rank(
    name: str, topology: str, n: int, victim: int, kill: int, tmp_path: Path
) -> None:
    steps = 11
    out = run_processes(
        _train, n, name, {"topology": topology}, steps, victim, kill, None, str(tmp_path),
        timeout=50, comm_timeout=COMM_TIMEOUT, allow_exit=(victim,),
    )  # fmt: skip
    survivors = [r for r in range(n) if r != victim]
    for r in survivors:
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        assert got["ranks"] == tuple(survivors) and got["steps"] == steps
        (event,) = got["report"]["peer_loss"]
        assert event["lost_ranks"] == [victim] and event["members"] == survivors, event
        # every survivor noticed at step `kill`'s non-finite agreement (a small allreduce after the
        # backward, before any combination of that step is written), and dropped that step's combinations
        assert (event["exchange"], event["step"], event["caught_up_steps"]) == (kill + 1, kill + 1, 0), event
        assert event["noticed_step"] == kill and event["recover_s"] < 10.0, event
        print(f"{name} rank {r}: recovered in {event['recover_s']} s (detected in {event['detect_s']} s)")
        want = _oracle(name, topology, n, steps, victim, (kill,), r)
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "quiet"), [("atc", (4, 5)), ("awc", (4,))])
def test_a_survivor_that_noticed_first(name: str, quiet: tuple[int, ...], tmp_path: Path) -> None:
    """Rank 1 takes the others for lost before step 4 (a false alarm) and trains step 4 alone, sending
    nothing; over the full graph every other rank's combination of step 4 needs rank 1's, so it fails.
    atc waits for it at step 5's forward: the others notice there and train step 5 alone, and rank 1 trains
    step 5 alone too (caught up one step). awc waits for it in step 4's own step: all agree after step 4.
    Then all three meet with every rank. (No non-finite agreement: its allreduce after every backward
    would make all notice at step 4.)"""
    n, steps, alarm = 3, 10, 1
    out = run_processes(
        _train, n, name, {"topology": "full", "on_nonfinite": "off"}, steps, None, 4, alarm, str(tmp_path),
        timeout=50, comm_timeout=COMM_TIMEOUT,
    )  # fmt: skip
    last = quiet[-1] + 1
    for r in range(n):
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        (event,) = got["report"]["peer_loss"]
        assert event["false_alarm"] and event["members"] == [0, 1, 2] and event["step"] == last, event
        behind = len(quiet) - 1 if r == alarm else 0
        assert (event["exchange"], event["caught_up_steps"]) == (last - behind, behind), event
        want = _oracle(name, "full", n, steps, None, quiet, r)
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _refused(name: str) -> str:
    topo = build_topology("test", "ring", tuple(TOPOLOGIES), lowband.size(), 1)
    try:
        make_strategy(
            name, _model(), lambda ps: torch.optim.SGD(ps, lr=LR), topology=topo, on_peer_loss="continue"
        )
    except InvalidArgumentError as exc:
        return str(exc)
    return "built"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["atc", "awc"])
def test_a_topology_object_is_refused_under_continue(name: str) -> None:
    for said in run_processes(_refused, 2, name, timeout=50):
        assert "on_peer_loss='continue'" in said and "option 'topology' must be a name" in said, said
