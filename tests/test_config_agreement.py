"""Ranks agree on their strategy's configuration when it is built: a differing option (nested compressor,
transport and memory options and defaults included) or a differing model layout (names, shapes, dtypes,
tied parameters) raises :class:`CollectiveMismatchError` on every rank, naming the option and each
rank's value, before any data moves (issue 29: some of these cases aborted the process inside gloo).

The cases of the issue run on real processes: were one to reach gloo again, the child's crash is
reported instead of aborting the test process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.errors import CollectiveMismatchError
from lowband.strategies import make_strategy
from lowband.testing import RankFailures, run_processes, run_threads


class _Emb(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(12, 4)
        self.hidden = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 12, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        if tied:
            self.dec.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dec(torch.tanh(self.hidden(self.emb(ids).mean(1))))
        return out


def _mlp() -> nn.Module:
    g = torch.Generator().manual_seed(1)
    m = nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _loss(m: nn.Module, rank: int, step: int, emb: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    if emb:
        ids = torch.randint(0, 12, (4, 3), generator=g)
        out: torch.Tensor = torch.nn.functional.cross_entropy(m(ids), torch.randint(0, 12, (4,), generator=g))
        return out
    x, y = torch.randn(6, 40, generator=g), torch.randn(6, 3, generator=g)
    mse: torch.Tensor = ((m(x) - y) ** 2).mean()
    return mse


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


# the issue's cases: strategy, rank 0's options, rank 1's options, the option the error must name
CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("compressed", {"compressor": "qsgd:levels=7"}, {"compressor": "qsgd:levels=5"}, "compressor"),
    ("compressed", {"compressor": "onebit", "reducer": "ps"}, {"compressor": "sign", "reducer": "ps"}, "compressor"),
    ("compressed", {"compressor": "onebit"}, {"compressor": "twobit"}, "compressor"),
    ("slimgc", {"compressor": "onebit:threshold=0.5"}, {"compressor": "onebit:threshold=0.1"}, "compressor"),
    ("slimgc", {"comm_threshold": 0}, {"comm_threshold": float("inf")}, "comm_threshold"),
    ("gs-sgd", {"density": 0.1}, {"density": 0.3}, "density"),
    ("embrace", {"schedule": "2d"}, {"schedule": "hybrid"}, "schedule"),
]  # fmt: skip


def _each_case() -> list[str]:
    """Every case on this rank: the error's message, or what happened instead."""
    r = lowband.rank()
    out = []
    for name, opts0, opts1, _ in CASES:
        emb = name == "embrace"
        m = _Emb() if emb else _mlp()
        try:
            s = make_strategy(name, m, _opt, **(opts0 if r == 0 else opts1))
        except CollectiveMismatchError as exc:
            out.append(str(exc))
            continue
        try:
            for k in range(4):
                s.train_step(lambda mod, k=k, e=emb: _loss(mod, r, k, e))  # type: ignore[misc]
            s.synchronize()
            out.append(f"no error; replica spread {s.replica_spread():.3g}")
        except Exception as exc:  # reported as what happened instead
            out.append(f"{type(exc).__name__}: {exc}")
        finally:
            s.close()
    return out


def test_the_issues_option_mismatches_raise_on_every_rank() -> None:
    res = run_processes(_each_case, 2, timeout=120, comm_timeout=20)
    for (name, opts0, opts1, option), msg0, msg1 in zip(CASES, res[0], res[1]):
        for r, msg in enumerate((msg0, msg1)):
            assert f"option {option!r}" in msg, f"{name} {opts0} vs {opts1}, rank {r}: {msg}"
            assert "rank 0" in msg and "rank 1" in msg, msg
            v0, v1 = str(opts0[option]), str(opts1[option])
            assert v0.split(":")[-1] in msg and v1.split(":")[-1] in msg, msg
        assert msg0.split(": ", 1)[1] == msg1.split(": ", 1)[1]  # the same verdict on every rank


def _build(per_rank: list[dict[str, Any]], name: str = "compressed", tied: list[bool] | None = None) -> str:
    r = lowband.rank()
    m = _Emb(tied=tied[r]) if tied is not None else _mlp()
    s = make_strategy(name, m, _opt, **per_rank[r])
    emb = tied is not None
    try:
        for k in range(2):
            s.train_step(lambda mod, k=k: _loss(mod, r, k, emb))  # type: ignore[misc]
        return f"{s.replica_spread():.3g}"
    finally:
        s.close()


def test_equal_options_spelled_differently_agree() -> None:
    """Defaults written out, ints for floats, options in another order: the same configuration."""
    per_rank = [
        {"compressor": "qsgd", "reducer": "auto"},
        {"compressor": "qsgd:bucket=512;levels=7", "memory": "residual:beta=1"},
        {"compressor": "qsgd:levels=7", "bucket_mb": 25},
    ]
    assert run_threads(_build, 3, per_rank, timeout=60) == ["0", "0", "0"]


def test_three_ranks_name_each_value() -> None:
    per_rank = [{"density": 0.1}, {"density": 0.1}, {"density": 0.3}]
    with pytest.raises(RankFailures) as info:
        run_threads(_build, 3, per_rank, "gs-sgd", timeout=60)
    assert len(info.value.errors) == 3
    for msg in info.value.errors.values():
        assert "CollectiveMismatchError" in msg and "option 'density'" in msg
        assert "0.3 on rank 2" in msg and "0.1 on ranks [0, 1]" in msg


def test_tied_structure_is_agreed() -> None:
    with pytest.raises(RankFailures) as info:
        run_threads(_build, 2, [{}, {}], "stage", [True, False], timeout=60)
    assert len(info.value.errors) == 2
    for msg in info.value.errors.values():
        assert "CollectiveMismatchError" in msg and "tied parameters" in msg and "emb.weight" in msg


def test_another_strategy_name_is_named() -> None:
    with pytest.raises(RankFailures) as info:
        run_threads(
            lambda: make_strategy(["stage", "ddp-sparse"][lowband.rank()], _mlp(), _opt), 2, timeout=60
        )
    for msg in info.value.errors.values():
        assert (
            "CollectiveMismatchError" in msg
            and "'stage' on rank 0" in msg
            and "'ddp-sparse' on rank 1" in msg
        )


def test_config_is_pure_and_complete() -> None:
    """Every option with its default, nested specs canonical; the model's layout with its ties."""
    from lowband.strategies.digest import model_layout, strategy_config
    from lowband.strategies.registry import STRATEGIES

    cfg = strategy_config("slimgc", STRATEGIES.get("slimgc"), {"comm_threshold": 0}, _mlp())
    assert cfg["strategy"] == "'slimgc'"
    assert cfg["option 'compressor'"] == "onebit:scale=1.0;threshold=0.5;threshold_mode='relative'"
    assert cfg["option 'comm_threshold'"] == "0" and cfg["option 'pre_steps'"] == "10"
    lay = model_layout(_Emb(tied=True))
    assert lay["tied parameters"] == "dec.weight = emb.weight"
    assert lay["parameter 'emb.weight'"] == "(12, 4) torch.float32"
    assert "parameter 'dec.weight'" not in lay
