"""The loop is the API: every registered strategy trains identically through the documented loop
(``zero_grad``, forward on ``s.module``, ``backward``, ``step``) and through ``train_step``, and a run
saved with ``s.save(folder)`` and resumed with ``s.load(folder)`` in a fresh strategy continues exactly as
the uninterrupted one, whichever way the next steps are taken.

Per strategy and world size, every rank trains on its own seeded batches:

- A: ``train_step`` for STEPS steps;
- B: the loop for STEPS steps (must equal A: parameters, losses, step counters);
- C: the loop for RESUME_AT steps, ``save``; a fresh strategy ``load``s it and loops to STEPS (must
  equal B, and its final ``state_dict`` must equal B's: everything saved was restored);
- D: a fresh strategy loads C's folder and takes the remaining steps with ``train_step`` (must equal B).

Options make each strategy's state move before RESUME_AT (PowerSGD compressing, local SGD averaging, ATC's
global allreduce, ...). DreamDDP's variants schedule from a profile file the first run measures (its
lazy profile in the loop is checked against ``train_step`` below); ``trial_periods=0`` keeps the
predicted best split (a trial chooses by timing). Thread ranks where the strategy runs on them (torch
DDP needs process-wide groups: processes, one launch per world size for the three). Bit for bit except
``winput`` (asynchronous by design) and ATC's two strategies (rare last-bit differences between two
``train_step`` runs already: ROUNDING).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.plan.links import Links
from lowband.strategies import make_strategy, strategy_names
from lowband.strategies.checkpoint import rank_file, read_folder
from lowband.strategies.registry import STRATEGIES
from lowband.testing import RankFailures, run_processes, run_threads

STEPS, RESUME_AT = 6, 3
#: options that make each strategy's state change before RESUME_AT
OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"start_iter": 2, "rank": 1},
    "localsgd": {"period": 2},
    "atc": {"allreduce_every": 2},
    "awc": {"allreduce_every": 2},
    "hierarchical-atc": {"allreduce_every": 2},
    "winput": {"period": 2},
    # the threshold is measured (timings) during pre_steps: 0 compresses every tensor, the same each run
    "slimgc": {"comm_threshold": 0, "pre_steps": 2},
    "gs-sgd": {"density": 0.2},
    "sketched-sgd": {"density": 0.2},
    "gtopk": {"density": 0.2},
    "topk-allgather": {"density": 0.2},
    "compressed": {"compressor": "topk:ratio=0.2"},
    "embrace": {"schedule": "horizontal"},
    "diloco": {"inner_steps": 2},  # outer steps at 2 and 4: the outer momentum moves before RESUME_AT
    # one candidate: the compressor's throughput is measured by every run (not in the saved profile), and
    # compressed and localsgd are predicted within noise of each other (two runs of one CI job chose differently)
    "auto": {"only": "localsgd", "drift": 0.0},  # (profile and links: _options)
}
PARTIAL_SYNC = ("dreamddp", "plsgd-enp", "flsgd-overlap")
#: more configurations of one strategy (``name/variant``): options and the optimizer's momentum
VARIANTS: dict[str, tuple[dict[str, Any], float]] = {
    # Algorithm 1's delayed rows belong to an iteration the strategy advances after every step
    "embrace/vertical": ({"schedule": "vertical", "overlap": True}, 0.0),  # lazy SGD: no momentum
    "atc/period": ({"period": 2, "allreduce_every": 2}, 0.9),
    # streamed fragments, one applied a step late and mixed, compressed with error feedback
    "diloco/streaming": (
        {"inner_steps": 4, "fragments": 2, "delay": 1, "alpha": 0.5, "compressor": "topk:ratio=0.3"},
        0.9,
    ),
}
#: torch DDP runs on process-wide groups only
PROCESS_ONLY = ("ddp", "ddp-sparse", "powersgd")
#: not bit-exact run to run, with the reason; checked for running, finite and counting steps
NOT_BIT_EXACT = {"winput": "asynchronous puts: the combined values depend on arrival times"}
#: equal up to rounding only: two uninterrupted train_step runs of ATC on thread ranks differed in the
#: last bit of a parameter in about 1 of 12 runs (measured 2026-11-27, atc and hierarchical-atc at 2
#: ranks; 0 of 60 on a quiet machine); the source is not found. Compared to 1e-12 relative.
ROUNDING = ("atc", "hierarchical-atc")


class _Model(nn.Module):
    """An embedding table read at ids derived from the inputs, then dense layers: every strategy runs it
    (the embedding ones partition or exchange the table)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.head = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 7).long() % 16
        return self.head(self.emb(ids).mean(1))  # type: ignore[no-any-return]


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(11)
    m = _Model().double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    return ((m(x) - y) ** 2).mean()


def _opt(params: object, momentum: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=momentum)  # type: ignore[arg-type]


def _flat(m: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()


def _plain(x: object) -> object:
    """A state dict as plain lists and numbers (comparable, and safe to return from a process)."""
    if isinstance(x, torch.Tensor):
        return [str(x.dtype), list(x.shape), x.detach().to_dense().reshape(-1).tolist()]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _options(name: str, folder: str) -> dict[str, Any]:
    if name in VARIANTS:
        return dict(VARIANTS[name][0])
    opts = dict(OPTIONS.get(name, {}))
    if name in PARTIAL_SYNC:  # measured by the first run (train_step), read by the others
        opts.update(period=2, trial_periods=0, profile=str(Path(folder) / f"{name}-profile.json"))
    if name == "auto":  # the same: and links given, so every run predicts and chooses alike
        opts.update(profile=str(Path(folder) / "auto-profile.json"), links=Links(lowband.size(), 1e9))
    return opts


def _loop_step(s: Any, r: int, k: int) -> float:
    s.zero_grad()
    loss = _loss(s.module, r, k)
    s.backward(loss)
    s.step()
    return float(loss.detach())


def _run(name: str, folder: str, path: str) -> dict[str, Any]:
    """One way of training (module docstring) on this rank."""
    r = lowband.rank()
    m = _model()
    momentum = VARIANTS[name][1] if name in VARIANTS else 0.9
    s = make_strategy(name.partition("/")[0], m, lambda p: _opt(p, momentum), **_options(name, folder))
    ckpt = Path(folder) / f"{name.replace('/', '-')}-ckpt"
    losses: list[float] = []
    first = 0
    if path in ("C-resumed", "D"):
        s.load(ckpt)
        first = RESUME_AT
        assert s.steps == RESUME_AT
    for k in range(first, STEPS if path != "C" else RESUME_AT):
        if path in ("A", "D"):
            losses.append(s.train_step(lambda mod, k=k: _loss(mod, r, k)))
        else:
            losses.append(_loop_step(s, r, k))
    if path == "C":
        s.save(ckpt)
        assert rank_file(ckpt, lowband.rank(), lowband.size()).is_file()
    s.synchronize()
    out = {"params": _flat(m), "losses": losses, "steps": s.steps, "state": _plain(s.state_dict())}
    s.close()
    return out


def _all_paths(name: str, folder: str) -> dict[str, dict[str, Any]]:
    return {p: _run(name, folder, p) for p in ("A", "B", "C", "C-resumed", "D")}


def _check(name: str, results: list[dict[str, dict[str, Any]]]) -> None:
    for r, res in enumerate(results):
        a, b, c, resumed, d = (res[p] for p in ("A", "B", "C", "C-resumed", "D"))
        assert a["steps"] == b["steps"] == resumed["steps"] == d["steps"] == STEPS, f"{name} rank {r}"
        assert c["steps"] == RESUME_AT
        if name in NOT_BIT_EXACT:
            for x in (a, b, resumed, d):
                assert all(math.isfinite(v) for v in x["params"]) and len(x["params"]) == len(a["params"])
            continue
        where = f"{name} rank {r}"
        if name.partition("/")[0] in ROUNDING:
            for x, y, what in (
                (b, a, "loop vs train_step"),
                (resumed, b, "resumed loop"),
                (d, b, "train_step resumed"),
            ):
                _close(x["params"], y["params"], f"{where}: {what}")
                _close(x["losses"], y["losses"][-len(x["losses"]) :], f"{where}: {what} losses")
            _close(resumed["state"], b["state"], f"{where}: state after the resume")
            continue
        assert b["losses"] == a["losses"], f"{where}: the loop's losses differ from train_step's"
        assert b["params"] == a["params"], f"{where}: the loop trained differently from train_step"
        assert c["losses"] == b["losses"][:RESUME_AT]
        assert resumed["losses"] == b["losses"][RESUME_AT:], f"{where}: the resumed loop differs"
        assert resumed["params"] == b["params"], f"{where}: the resumed loop differs from the uninterrupted"
        assert resumed["state"] == b["state"], f"{where}: state after the resume differs"
        assert d["params"] == b["params"], f"{where}: train_step after a loop checkpoint differs"
        assert d["losses"] == b["losses"][RESUME_AT:]


def _close(x: object, y: object, where: str) -> None:
    """``x`` equals ``y`` up to rounding (floats to 1e-12 relative), structure and everything else exactly."""
    if isinstance(x, float) and isinstance(y, float):
        assert math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-14), f"{where}: {x} != {y}"
    elif isinstance(x, dict) and isinstance(y, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _close(x[k], y[k], where)
    elif isinstance(x, list) and isinstance(y, list):
        assert len(x) == len(y), where
        for u, v in zip(x, y):
            _close(u, v, where)
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


def _own() -> list[str]:
    """lowband's own strategies (test fixtures may register more in this process)."""
    return sorted(n for n in strategy_names() if STRATEGIES.get(n).__module__.startswith("lowband."))


def test_every_strategy_is_covered() -> None:
    assert set(OPTIONS) | set(PARTIAL_SYNC) | set(PROCESS_ONLY) <= set(_own())
    assert len(_own()) >= 20


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", [x for x in _own() if x not in PROCESS_ONLY] + sorted(VARIANTS))
def test_loop_and_train_step_and_resume_agree(name: str, n: int, tmp_path: Path) -> None:
    _check(name, run_threads(_all_paths, n, name, str(tmp_path), timeout=240))


def _ddp_family(folder: str) -> dict[str, dict[str, dict[str, Any]]]:
    return {name: _all_paths(name, folder) for name in PROCESS_ONLY}


_PROCESS_RESULTS: dict[int, list[dict[str, dict[str, dict[str, Any]]]]] = {}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", PROCESS_ONLY)
def test_loop_and_train_step_and_resume_agree_ddp(
    name: str, n: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if n not in _PROCESS_RESULTS:  # one launch per world size for the three
        folder = str(tmp_path_factory.mktemp(f"ddp{n}"))
        _PROCESS_RESULTS[n] = run_processes(_ddp_family, n, folder, timeout=300)
    _check(name, [res[name] for res in _PROCESS_RESULTS[n]])


# -- DreamDDP: the loop's first step profiles as train_step's does ----------------------------------
def _lazy_profile(variant: str) -> dict[str, Any]:
    """The loop without a profile profiles at its first forward; train_step given that profile trains
    the same steps bit for bit (both profile the first batch before training on it)."""
    r = lowband.rank()
    m1, m2 = _model(), _model()
    s1 = make_strategy(variant, m1, _opt, period=2, trial_periods=0)
    assert s1.schedule is None  # type: ignore[attr-defined]
    losses = [_loop_step(s1, r, k) for k in range(STEPS)]
    s1.synchronize()
    profile = s1.profile  # type: ignore[attr-defined]
    assert profile is not None and s1.profile_seconds > 0  # type: ignore[attr-defined]
    s2 = make_strategy(variant, m2, _opt, period=2, trial_periods=0, profile=profile)
    losses2 = [s2.train_step(lambda mod, k=k: _loss(mod, r, k)) for k in range(STEPS)]
    s2.synchronize()
    out = {
        "losses": (losses, losses2),
        "params": (_flat(m1), _flat(m2)),
        "schedules": (s1.schedule.sets, s2.schedule.sets),  # type: ignore[attr-defined]
        "steps": (s1.steps, s2.steps),
    }
    s1.close()
    s2.close()
    return out


@pytest.mark.parametrize("variant", PARTIAL_SYNC)
def test_partial_sync_profiles_in_the_loop_as_in_train_step(variant: str) -> None:
    for res in run_threads(_lazy_profile, 2, variant, timeout=240):
        assert res["schedules"][0] == res["schedules"][1]
        assert res["losses"][0] == res["losses"][1]
        assert res["params"][0] == res["params"][1]
        assert res["steps"] == (STEPS, STEPS)


# -- the checkpoint convention's errors ---------------------------------------------------------------
def _save_stage(folder: str) -> list[str]:
    s = make_strategy("stage", _model(), _opt)
    _loop_step(s, lowband.rank(), 0)
    path = s.save(folder)
    s.close()
    return sorted(p.name for p in path.parent.iterdir())


def _load_stage(folder: str) -> str:
    s = make_strategy("stage", _model(), _opt)
    try:
        s.load(folder)
    except InvalidArgumentError as exc:
        return str(exc)
    finally:
        s.close()
    return f"loaded at step {s.steps}"


def test_save_writes_one_file_per_rank_and_load_names_what_is_missing(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    names = run_threads(_save_stage, 2, folder)
    assert names[0] == names[1] == ["rank0-of-2.pt", "rank1-of-2.pt"]  # no temporary file left behind
    assert [st["steps"] for st in read_folder(folder)] == [1, 1]
    assert run_threads(_load_stage, 2, folder) == ["loaded at step 1"] * 2
    # at another world size: every rank raises, naming its file and the fix
    for r, msg in enumerate(run_threads(_load_stage, 3, folder)):
        assert f"on rank {r}" in msg and f"'rank{r}-of-3.pt'" in msg and "saved at [2] ranks" in msg
    # one rank's file missing: every rank raises, naming it
    (tmp_path / "ckpt" / "rank1-of-2.pt").unlink()
    for msg in run_threads(_load_stage, 2, folder):
        assert "rank 1 failed" in msg or "on rank 1" in msg
        assert "'rank1-of-2.pt'" in msg
    with pytest.raises(InvalidArgumentError, match=r"world ranks \[1\] of 2 are missing"):
        read_folder(folder)
    # a folder nobody can write (a file is in the way): every rank raises, naming the rank
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    with pytest.raises(RankFailures, match="cannot write"):
        run_threads(_save_stage, 2, str(blocked))
