"""The ``dreamddp-ls`` scheduler (local search beyond consecutive runs) and the strategies' ``scheduler``
option."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from test_dreamddp import OPTS, H, R, _batch, _check_against_oracle, _loss, _mlp, _profile, _summary

import lowband
from lowband.errors import InvalidArgumentError
from lowband.localsgd import make_schedule
from lowband.localsgd.costmodel import period_time
from lowband.localsgd.search import refine_sets
from lowband.localsgd.strategy import PartialSyncStrategy
from lowband.localsgd.synthetic import random_profile
from lowband.strategies import make_strategy
from lowband.testing import run_threads


@pytest.mark.parametrize("ratio", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("L", [3, 12, 30])
def test_never_worse_than_algorithm2_and_deterministic(ratio: float, L: int) -> None:
    for seed in range(4):
        p = random_profile(L, seed, comm_ratio=ratio)
        a2 = make_schedule("dreamddp", p, 5)
        ls = make_schedule("dreamddp-ls", p, 5)
        assert ls.predicted_period <= a2.predicted_period * (1 + 1e-12)
        assert ls == make_schedule("dreamddp-ls", p, 5)  # same profile, same schedule (every rank)
        ls.validate(L)
        assert ls.predicted_period == pytest.approx(period_time(p, ls.sets))


def test_beats_every_partition_into_runs_somewhere_and_is_near_the_exhaustive_optimum() -> None:
    """Over all H^L assignments of small profiles: local search is within a few % of the best
    assignment, and on some profiles below the best partition into consecutive runs (the paper's space)."""
    H_, L = 3, 6
    beat, gaps = 0, []
    for seed in range(12):
        p = random_profile(L, seed, comm_ratio=4.0)
        runs = make_schedule("optimal", p, H_).predicted_period
        sets = refine_sets(p, tuple(tuple(range(L)) if h == H_ - 1 else () for h in range(H_)))
        ls = period_time(p, sets)
        best = min(
            period_time(p, [tuple(i for i in range(L) if a[i] == h) for h in range(H_)])
            for a in itertools.product(range(H_), repeat=L)
        )
        assert ls >= best * (1 - 1e-12)
        gaps.append(ls / best - 1)
        beat += ls < runs * (1 - 1e-9)
    assert beat >= 1, "local search never left the space of consecutive runs"
    assert sorted(gaps)[len(gaps) // 2] < 0.05  # median gap to the exhaustive optimum


def test_refine_rejects_non_partitions() -> None:
    p = random_profile(4, 0)
    with pytest.raises(InvalidArgumentError, match="layer 1 is in sets 0 and 1"):
        refine_sets(p, ((0, 1), (1, 2, 3)))
    with pytest.raises(InvalidArgumentError, match=r"cover layers 0\.\.3 exactly once"):
        refine_sets(p, ((0,), (1, 2)))
    with pytest.raises(InvalidArgumentError, match="max_passes must be an int >= 0"):
        refine_sets(p, ((0, 1), (2, 3)), max_passes=-1)


@pytest.mark.parametrize("n", [1, 3])
def test_strategy_with_the_local_search_scheduler_matches_algorithm1(n: int) -> None:
    def rank_fn() -> dict[str, Any]:
        m = _mlp()
        s = make_strategy(
            "dreamddp", m, OPTS["sgdm"], period=H, profile=_profile("mlp", 4e-3), scheduler="dreamddp-ls"
        )
        assert isinstance(s, PartialSyncStrategy)
        in_sync = []
        for k in range(R):
            batch = _batch(lowband.rank(), k)
            s.train_step(lambda mod, b=batch: _loss(mod, b))
            in_sync.append(s.in_sync())
        s.synchronize()
        out = _summary(s, m, in_sync)
        out["method"] = s.report()["schedule_method"]
        out["hparams"] = s.hparams()
        return out

    res = run_threads(rank_fn, n, timeout=120)
    _check_against_oracle(res, "mlp", "sgdm", n, R)
    assert res[0]["method"] == "dreamddp-ls" and res[0]["hparams"]["scheduler"] == "dreamddp-ls"
    assert res[0]["sets"] == make_schedule("dreamddp-ls", _profile("mlp", 4e-3), H).sets

    def bad() -> str:
        try:
            make_strategy("dreamddp", _mlp(), OPTS["sgd"], scheduler="nope")
        except InvalidArgumentError as e:
            return str(e)
        return "no error"

    assert "scheduler must be one of" in run_threads(bad, 1)[0]
