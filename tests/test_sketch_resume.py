"""Checkpoints of the globally sparse strategies (gs-sgd, sketched-sgd, gtopk, topk-allgather) restore
everything or refuse (issue 29): at another world size, each rank's error-feedback residual (and worker
momentum) is re-sharded by :func:`lowband.strategies.reshard_checkpoints` keeping its sum over ranks; an
un-resharded checkpoint of another world size, or one saved under other options (density), is refused
on every rank with a clear error; ranks loading different saves are a CollectiveMismatchError."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.strategies import make_strategy, reshard_checkpoints
from lowband.testing import RankFailures, run_threads

SAVE, TOTAL = 3, 5
SPECS = {
    "gs-sgd": {"density": 0.1},
    "sketched-sgd": {"density": 0.1, "momentum": 0.9, "masking": True},
    "gtopk": {"density": 0.1},
    "topk-allgather": {"density": 0.1},
}


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(4)
    m = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4)
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = (
        torch.randn(5, 12, generator=g, dtype=torch.float64),
        torch.randn(5, 3, generator=g, dtype=torch.float64),
    )
    out: torch.Tensor = ((m(x) - y) ** 2).mean()
    return out


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    out: dict[str, Any] = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    return out


def _save(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    r = lowband.rank()
    s = make_strategy(name, _model(), _opt, **opts)
    for k in range(SAVE):
        s.train_step(lambda m, k=k: _loss(m, r, k))  # type: ignore[misc]
    s.synchronize()
    st = _roundtrip(s.state_dict())
    s.close()
    return st


def _load(name: str, opts: dict[str, Any], states: list[dict[str, Any]]) -> dict[str, Any]:
    r = lowband.rank()
    s = make_strategy(name, _model(), _opt, **opts)
    try:
        s.load_state_dict(copy.deepcopy(states[r]))
        for k in range(SAVE, TOTAL):
            s.train_step(lambda m, k=k: _loss(m, r, k))  # type: ignore[misc]
        s.synchronize()
        return {"steps": s.steps, "spread": s.replica_spread()}
    finally:
        s.close()


def _per_rank(states: list[dict[str, Any]], field: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for st in states:
        red = st["extra"]["stage"]["reducer"]
        mem = red.get(field)
        out.append({} if mem is None else dict(mem["tensors"]))
    return out


def _sums(tables: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in tables:
        for k, v in t.items():
            out[k] = out[k] + v if k in out else v.clone()
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_reshard_keeps_every_residual_sum(name: str) -> None:
    saved = run_threads(_save, 3, name, SPECS[name], timeout=60)
    states = reshard_checkpoints(saved, 2)
    fields = ["memory", "velocity"] if name == "sketched-sgd" else ["memory"]
    for field in fields:
        before, after = _sums(_per_rank(saved, field)), _sums(_per_rank(states, field))
        assert before and sorted(before) == sorted(after), field
        # rank 2's residual is part of the sum: dropping it would change these
        assert any(float(v.abs().max()) > 0 for v in _per_rank(saved, field)[2].values())
        for k in before:
            assert torch.allclose(before[k], after[k], atol=1e-12), (field, k)
    res = run_threads(_load, 2, name, SPECS[name], states, timeout=60)
    assert [r["steps"] for r in res] == [TOTAL, TOTAL] and all(r["spread"] == 0.0 for r in res)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_another_world_size_unresharded_is_refused(name: str) -> None:
    saved = run_threads(_save, 3, name, SPECS[name], timeout=60)
    with pytest.raises(RankFailures) as info:
        run_threads(_load, 2, name, SPECS[name], saved[:2], timeout=60)
    assert len(info.value.errors) == 2
    for msg in info.value.errors.values():
        assert "InvalidArgumentError" in msg and "taken at 3 ranks" in msg and "reshard_checkpoints" in msg


def test_density_is_part_of_the_checkpoint() -> None:
    saved = run_threads(_save, 2, "gs-sgd", {"density": 0.1}, timeout=60)
    with pytest.raises(RankFailures) as info:
        run_threads(_load, 2, "gs-sgd", {"density": 0.3}, saved, timeout=60)
    assert len(info.value.errors) == 2
    for msg in info.value.errors.values():
        assert InvalidArgumentError.__name__ in msg
        assert "option 'density' was 0.1 when saved, is 0.3 now" in msg


def test_ranks_loading_different_saves_is_a_mismatch() -> None:
    saved = run_threads(_save, 2, "gtopk", {"density": 0.1}, timeout=60)
    late = copy.deepcopy(saved)
    late[1]["steps"] += 1
    with pytest.raises(RankFailures) as info:
        run_threads(_load, 2, "gtopk", {"density": 0.1}, late, timeout=60)
    assert len(info.value.errors) == 2
    for msg in info.value.errors.values():
        assert CollectiveMismatchError.__name__ in msg and "steps is 3 on rank 0 but 4 on rank 1" in msg
