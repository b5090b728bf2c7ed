"""``on_peer_loss=continue``: a rank killed with SIGKILL inside its training loop, and the survivors train
on without it, their final parameters equal among themselves and to a single-process oracle that drops
the dead rank from every average from the failed exchange on; ``raise`` unchanged; a quorum that cannot
be met raises on the survivor. Real processes (a killed thread would not close its sockets).
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
from lowband.errors import CommFailedError, CommTimeoutError
from lowband.strategies import make_strategy
from lowband.testing import run_processes

COMM_TIMEOUT = 10.0
LR = 0.1


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(7)
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return m


def _batch(r: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * r + k)
    return torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(
        8, 1, generator=g, dtype=torch.float64
    )


def _loss(m: nn.Module, r: int, k: int) -> torch.Tensor:
    x, y = _batch(r, k)
    return ((m(x) - y) ** 2).mean()


def _train(
    name: str,
    opts: dict[str, Any],
    steps: int,
    victims: tuple[int, ...],
    kill: int | tuple[int, ...],
    out: str,
) -> Any:
    """Train ``steps`` seeded steps; victim ``victims[i]`` kills itself (SIGKILL) before step ``kill``
    (or ``kill[i]``)."""
    r = lowband.rank()
    kills = dict(zip(victims, kill if isinstance(kill, tuple) else [kill] * len(victims), strict=True))
    s = make_strategy(name, _model(), lambda ps: torch.optim.SGD(ps, lr=LR), **opts)
    recovered_at = None
    try:
        for k in range(steps):
            if kills.get(r) == k:
                Path(out, f"killed-{r}").write_text(repr(time.time()))
                os.kill(os.getpid(), 9)
            s.train_step(lambda m, k=k: _loss(m, r, k))
            if recovered_at is None and s.report().get("peer_loss"):
                recovered_at = time.time()
    except (CommFailedError, CommTimeoutError) as exc:
        return {"error": type(exc).__name__, "message": str(exc), "at": time.time()}
    params = [p.detach().clone() for p in s.local_module.parameters()]
    return {"params": params, "report": s.report(), "recovered_at": recovered_at, "ranks": s.group.ranks}


def _oracle(name: str, n: int, steps: int, period: int, kills: dict[int, int]) -> list[torch.Tensor]:
    """The survivors' parameters, replayed in one process: every rank's seeded local steps, a victim's
    last before its kill step; each average over the ranks alive at it (from the exchange that failed
    on: without the dead)."""
    models = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    glob = _model()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for t in range(steps):
        alive = [r for r in range(n) if t < kills.get(r, steps)]
        for r in alive:
            opts[r].zero_grad()
            _loss(models[r], r, t).backward()
            opts[r].step()
        exchange = t % period == 0 if name == "localsgd" else (t + 1) % period == 0
        if not exchange:
            continue
        with torch.no_grad():
            per_rank = [list(models[r].parameters()) for r in alive]
            if name == "localsgd":
                avg = [sum(ps[i] / len(alive) for ps in per_rank) for i in range(len(per_rank[0]))]
            else:
                for i, gp in enumerate(glob.parameters()):
                    gp.grad = sum((gp - ps[i]) for ps in per_rank) / len(alive)
                outer.step()
                avg = [gp.detach().clone() for gp in glob.parameters()]
            for r in alive:
                for q, a in zip(models[r].parameters(), avg, strict=True):
                    q.copy_(a)
    survivor = next(r for r in range(n) if r not in kills)
    return [p.detach().clone() for p in models[survivor].parameters()]


CASES = [
    ("localsgd", {"period": 3}, 3, 2, 5, 10),
    ("localsgd", {"period": 3}, 4, 0, 4, 10),
    ("diloco", {"inner_steps": 3}, 3, 1, 4, 9),
    ("diloco", {"inner_steps": 3}, 4, 3, 7, 9),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "opts", "n", "victim", "kill", "steps"), CASES)
def test_survivors_train_on_without_the_killed_rank(
    name: str, opts: dict[str, Any], n: int, victim: int, kill: int, steps: int, tmp_path: Path
) -> None:
    spec = {**opts, "on_peer_loss": "continue"}
    out = run_processes(
        _train, n, name, spec, steps, (victim,), kill, str(tmp_path),
        timeout=50, comm_timeout=COMM_TIMEOUT, allow_exit=(victim,),
    )  # fmt: skip
    died = float((tmp_path / f"killed-{victim}").read_text())
    want = _oracle(name, n, steps, next(iter(opts.values())), {victim: kill})
    survivors = [r for r in range(n) if r != victim]
    for r in survivors:
        got = out[r]
        assert "params" in got, f"rank {r}: {got}"
        assert got["ranks"] == tuple(survivors)
        (event,) = got["report"]["peer_loss"]
        assert event["lost_ranks"] == [victim] and event["members"] == survivors, event
        first_exchange = kill if name == "localsgd" else kill + 1
        period = next(iter(opts.values()))
        assert event["step"] == -(-first_exchange // period) * period + (1 if name == "localsgd" else 0), (
            event
        )
        assert event["recover_s"] < 10.0, event
        since_death = got["recovered_at"] - died
        times = {k: event[k] for k in ("noticed_at", "detect_s", "agree_s", "rebuild_s", "recover_s")}
        print(
            f"{name} n={n} rank {r}: from the kill to the redone exchange's step done {since_death:.3f} s; {times}"
        )
        assert since_death < 10.0
        for a, b in zip(got["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        for a, b in zip(got["params"], out[survivors[0]]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.timeout(60)
def test_two_losses_one_after_the_other() -> None:
    """4 ranks: rank 1 dies before step 2, rank 3 before step 6; the second agreement is among the
    first one's members (a quorum of 2 of 3), on the group the first one made."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        got = run_processes(
            _train, 4, "localsgd", {"period": 3, "on_peer_loss": "continue"}, 10, (1, 3), (2, 6), out,
            timeout=50, comm_timeout=COMM_TIMEOUT, allow_exit=(1, 3),
        )  # fmt: skip
    want = _oracle("localsgd", 4, 10, 3, {1: 2, 3: 6})
    for r in (0, 2):
        first, second = got[r]["report"]["peer_loss"]
        assert (first["lost_ranks"], first["members"], first["step"]) == ([1], [0, 2, 3], 4), first
        assert (second["lost_ranks"], second["members"], second["step"]) == ([3], [0, 2], 7), second
        assert got[r]["ranks"] == (0, 2)
        for a, b in zip(got[r]["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.timeout(60)
def test_raise_is_unchanged(tmp_path: Path) -> None:
    """The default: the survivors raise lowband's error naming their rank, as before the option existed
    (the first read of the failed non-finite agreement, or the averaging, raises)."""
    out = run_processes(
        _train, 3, "localsgd", {"period": 3}, 10, (2,), 5, str(tmp_path),
        timeout=40, comm_timeout=5.0, allow_exit=(2,),
    )  # fmt: skip
    died = float((tmp_path / "killed-2").read_text())
    for r in (0, 1):
        assert out[r].get("error") in ("CommFailedError", "CommTimeoutError"), out[r]
        assert f"on rank {r}" in out[r]["message"] and "peer" in out[r]["message"], out[r]
        assert out[r]["at"] - died < 5.0 + 5.0


@pytest.mark.timeout(60)
def test_a_quorum_that_cannot_be_met_raises(tmp_path: Path) -> None:
    """2 of 3 die: the survivor alone is no majority and raises one clear error within the timeout."""
    t0 = time.monotonic()
    out = run_processes(
        _train, 3, "localsgd", {"period": 3, "on_peer_loss": "continue"}, 10, (1, 2), 5, str(tmp_path),
        timeout=40, comm_timeout=5.0, allow_exit=(1, 2),
    )  # fmt: skip
    assert out[0]["error"] == "CommFailedError", out[0]
    msg = out[0]["message"]
    assert (
        "a quorum of 2 of the last membership [0, 1, 2] was not met" in msg
        and "rank(s) [1, 2] did not" in msg
    )
    assert time.monotonic() - t0 < 40


def _refused(name: str, opts: dict[str, Any]) -> str:
    try:
        make_strategy(name, _model(), lambda ps: torch.optim.SGD(ps, lr=LR), **opts)
    except lowband.InvalidArgumentError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    ("name", "opts", "named"),
    [
        ("localsgd", {"on_peer_loss": "maybe"}, "on_peer_loss"),
        ("localsgd", {"on_peer_loss": "continue", "min_ranks": 0}, "min_ranks"),
        ("localsgd", {"on_peer_loss": "continue", "min_ranks": 3}, "min_ranks=3"),
        ("localsgd", {"on_peer_loss": "continue", "peer_settle": -1.0}, "peer_settle"),
        ("diloco", {"on_peer_loss": "continue", "compressor": "topk:ratio=0.1"}, "on_peer_loss"),
        ("diloco", {"on_peer_loss": "continue", "fragments": 2, "delay": 1}, "on_peer_loss"),
        ("ddp", {"on_peer_loss": "continue"}, "on_peer_loss"),
    ],
)
def test_bad_options_are_refused(name: str, opts: dict[str, Any], named: str) -> None:
    from lowband.testing import run_threads

    for msg in run_threads(_refused, 2, name, opts, timeout=30):
        assert named in msg, msg
