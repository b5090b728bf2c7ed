"""Bytes per rank per step of the gs-SGD, Sketched-SGD and gTop-k reducers equal their byte models
(lowband's counters) at P = 1..5."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lowband
from lowband.compress.gssgd import GsSGDReducer, GTopKReducer, SketchedSGDReducer
from lowband.compress.sparse_costs import gs_sgd_bytes, gtopk_bytes, sketched_sgd_bytes
from lowband.optim import ReduceContext, Reducer, Unit
from lowband.testing import run_threads

D, STEPS = 1000, 3
UNIT = Unit("w", ("w",), (torch.zeros(D),))


def _make(kind: str, opts: dict[str, Any]) -> Reducer:
    cls = {"gs-sgd": GsSGDReducer, "sketched-sgd": SketchedSGDReducer, "gtopk": GTopKReducer}[kind]
    return cls(**opts)  # type: ignore[no-any-return]


def _measure(kind: str, opts: dict[str, Any]) -> tuple[int, int]:
    red = _make(kind, opts)
    g = torch.Generator().manual_seed(lowband.rank())
    group = lowband.world().unchecked()
    red.reduce(UNIT, [torch.randn(D, generator=g)], ReduceContext(group, 0)).wait()  # tables agreed
    lowband.reset_trace()
    for step in range(1, STEPS + 1):
        red.reduce(UNIT, [torch.randn(D, generator=g)], ReduceContext(group, step)).wait()
    c = lowband.counters()
    return sum(v["bytes_sent"] for v in c.values()), sum(v["bytes_received"] for v in c.values())


CASES = [
    ("gs-sgd", {"k": 20, "rows": 5, "cols": 40}),
    ("gs-sgd", {"k": 20, "rows": 3, "cols": 50, "reduce": "allreduce", "oversample": 2.0}),
    ("sketched-sgd", {"k": 20, "rows": 5, "cols": 40, "oversample": 1.5}),
    ("gtopk", {"k": 20}),
]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("kind", "opts"), CASES)
def test_bytes_per_step_equal_the_model(n: int, kind: str, opts: dict[str, Any]) -> None:
    res = run_threads(_measure, n, kind, opts, timeout=60, trace=True)
    for r, (sent, recv) in enumerate(res):
        if kind == "gtopk":
            want = gtopk_bytes(D, n, r, k=opts["k"])
        elif kind == "gs-sgd":
            want = gs_sgd_bytes(D, n, r, **opts)
        else:
            want = sketched_sgd_bytes(D, n, r, **opts)
        assert (sent / STEPS, recv / STEPS) == want, f"rank {r}"
