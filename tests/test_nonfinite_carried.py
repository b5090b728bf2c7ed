"""The non-finite flag riding the data (lowband.optim.nonfinite): where every checked gradient is averaged
by a plain allreduce (ddp's buckets in its comm hook, the stage and gradient-allreduce strategies' units),
a clean step exchanges no flags at all, and a non-finite average (seen alike by every rank) still raises
on every rank naming the rank whose own gradient held it, or names the overflowed sum when none did.
Strategies whose reducers keep state (compressed, powersgd) keep the exchange on every step."""

from __future__ import annotations

import math
import threading
from functools import partial
from typing import Any

import pytest
import torch

import lowband
import lowband.optim.nonfinite as nf
from lowband.errors import NonFiniteError
from lowband.strategies import make_strategy
from lowband.testing import run_processes, run_threads
from tests import embedding_model as em

STEPS = 4


_REAL = nf.allreduce
_COUNTS: dict[int, int] = {}  # thread -> the guard's flag exchanges it made


def _counting(*args: Any, **kwargs: Any) -> Any:
    tid = threading.get_ident()
    _COUNTS[tid] = _COUNTS.get(tid, 0) + 1
    return _REAL(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nf, "allreduce", _counting)


def _count_exchanges(
    name: str, bad_step: int | None = None, value: float = math.nan, **options: Any
) -> dict[str, Any]:
    """Train STEPS steps of ``name`` counting the guard's flag exchanges (with ``nf.allreduce`` counting:
    the ``counted`` fixture, or set in a process); at ``bad_step`` rank 1's gradient of one bias gets
    ``value``."""
    tid = threading.get_ident()
    before = _COUNTS.get(tid, 0)
    m = em.model(seed=5)
    s = make_strategy(name, m, em.sgd, **options)
    bias = m.mlp[2].bias
    assert isinstance(bias, torch.Tensor) and s.nonfinite is not None
    out: dict[str, Any] = {"rides_data": s.nonfinite.rides_data}
    try:
        for step in range(STEPS):
            v = value if step == bad_step and lowband.rank() == 1 else 0.0
            b = em.batch(lowband.rank(), step)
            s.train_step(lambda mod, b=b, v=v: em.loss(mod, b) + v * bias.sum())
    except NonFiniteError as exc:
        out["error"] = str(exc)
    finally:
        s.close()
    out["exchanges"] = _COUNTS.get(tid, 0) - before
    return out


#: (strategy, options, whether every checked gradient rides the data)
CARRIERS = [
    ("stage", {}, True),
    ("gradient-allreduce", {}, True),
    ("compressed", {}, True),  # identity through the allreduce transport: the payload poisoned
    ("compressed", {"compressor": "fp16", "reducer": "allreduce"}, True),
    ("compressed", {"compressor": "topk:ratio=0.1", "reducer": "allgather"}, False),
    ("compressed", {"compressor": "randomk:ratio=0.5", "reducer": "allreduce", "memory": "none"}, True),
    ("gs-sgd", {}, False),
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(("name", "options", "rides"), CARRIERS)
def test_clean_steps_exchange_flags_only_where_the_data_cannot_carry_them(
    name: str, options: dict[str, Any], rides: bool, n: int, counted: None
) -> None:
    for r, out in enumerate(run_threads(partial(_count_exchanges, name, **options), n, timeout=60)):
        assert out["rides_data"] is rides and "error" not in out, (r, out)
        assert out["exchanges"] == (0 if rides else STEPS), (r, out)


@pytest.mark.parametrize(("name", "options", "rides"), [c for c in CARRIERS if c[2]])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_a_carried_nan_is_still_named_on_every_rank(
    name: str, options: dict[str, Any], rides: bool, kind: str, counted: None
) -> None:
    value = math.nan if kind == "nan" else math.inf
    for r, out in enumerate(run_threads(partial(_count_exchanges, name, 2, value, **options), 3, timeout=60)):
        assert "rank 1 " in out["error"] and "rank 0 " not in out["error"], (r, out["error"])
        assert "at step 2" in out["error"] and out["exchanges"] == 1, (r, out)


def _ddp_cases() -> dict[str, Any]:
    nf.allreduce = _counting  # type: ignore[assignment]  (this process only)
    return {
        "clean": _count_exchanges("ddp"),
        "nan": _count_exchanges("ddp", 1),
        "inf": _count_exchanges("ddp", 1, math.inf),
        "powersgd": _count_exchanges("powersgd"),
        "off_after_raise": _hook_after_off(),
    }


def _hook_after_off() -> dict[str, Any]:
    """ddp's comm hook, registered under on_nonfinite="raise", checks nothing once the policy is "off"."""
    m = em.model(seed=5)
    s = make_strategy("ddp", m, em.sgd)
    s.set_nonfinite("off")
    try:
        for step in range(2):
            s.train_step(em.loss_fn(lowband.rank(), step))
        assert s.nonfinite is not None
        hook = s._checked  # type: ignore[attr-defined]  (registered under "raise", still there)
        return {
            "rides_data": s.nonfinite.rides_data,
            "carried": len(s.nonfinite._carried),
            "hook": hook.guard(),
        }
    finally:
        s.close()


def test_ddp_checks_in_its_comm_hook_and_exchanges_only_on_a_bad_step() -> None:
    for r, out in enumerate(run_processes(_ddp_cases, 2, timeout=120, backend="gloo", device="cpu")):
        assert out["clean"]["rides_data"] and out["clean"]["exchanges"] == 0, (r, out["clean"])
        for kind in ("nan", "inf"):
            err = out[kind]["error"]
            assert "rank 1 (unit 'DDP bucket 0')" in err and "at step 1" in err, (r, kind, err)
            assert out[kind]["exchanges"] == 1, (r, kind, out[kind])
        assert not out["powersgd"]["rides_data"] and out["powersgd"]["exchanges"] == STEPS
        assert out["off_after_raise"] == {"rides_data": False, "carried": 0, "hook": None}, out[
            "off_after_raise"
        ]


def _overflowing_sum() -> list[str]:
    """Both ranks hold finite gradients whose sum overflows float32 (the average is computed as a sum)."""
    guard = nf.NonFiniteGuard("raise", lowband.world(), where="here", step=lambda: 7)
    guard.rides_data = True
    g = torch.tensor([3e38, 1.0])
    guard.check_([g], "unit", carried=True)  # finite on this rank: rides the data
    g.mul_(2.0)  # what a sum over 2 ranks leaves: inf
    try:
        guard.decide([])
    except NonFiniteError as exc:
        return [str(exc)]
    return []


def test_an_overflowed_sum_is_named_as_such() -> None:
    for errors in run_threads(_overflowing_sum, 2):
        assert len(errors) == 1 and "every rank's own gradients were finite" in errors[0], errors
        assert "at step 7" in errors[0]
