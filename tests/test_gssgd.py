"""The gs-SGD, Sketched-SGD and gTop-k reducers against single-process oracles at P = 1..4 (gTop-k to
6): bit-exact results on integer-valued gradients, the same k indices on every rank, conservation of
error feedback, gTop-k against a serial dict-based reference, the sketch tables' agreement."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lowband
from lowband.compress import make_reducer
from lowband.compress.gssgd import GsSGDReducer, GTopKReducer, SketchedSGDReducer
from lowband.compress.heavymix import candidates, keep_largest
from lowband.compress.sketch import CountSketch
from lowband.compress.tree import tree_schedule
from lowband.errors import InvalidArgumentError
from lowband.optim import ReduceContext, Reducer, Unit
from lowband.testing import RankFailures, run_threads

SHAPES = {"a": (6, 7), "b": (9,)}
D = 51
UNIT = Unit("a..b", tuple(SHAPES), tuple(torch.zeros(s) for s in SHAPES.values()))


def _grads(rank: int, step: int, *, integer: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    if integer:
        return [torch.randint(-9, 10, s, generator=g).to(dtype) for s in SHAPES.values()]
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES.values()]


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _residual(red: Reducer) -> torch.Tensor:
    mem = red.memory  # type: ignore[attr-defined]
    return _flat([mem.tensors[n] for n in SHAPES]) if mem.tensors else torch.zeros(D, dtype=torch.float64)


def _make(kind: str, opts: dict[str, Any]) -> Reducer:
    if kind == "topk-allgather":
        return make_reducer("allgather", f"topk:ratio={opts['density']}", "residual")
    cls = {"gs-sgd": GsSGDReducer, "sketched-sgd": SketchedSGDReducer, "gtopk": GTopKReducer}[kind]
    return cls(**opts)  # type: ignore[no-any-return]


def _steps(
    kind: str, opts: dict[str, Any], steps: int, integer: bool, dtype: torch.dtype
) -> list[dict[str, Any]]:
    r = lowband.rank()
    red = _make(kind, opts)
    group = lowband.world().unchecked()
    out = []
    for step in range(steps):
        before = _residual(red).to(dtype)
        grads = _grads(r, step, integer=integer, dtype=dtype)
        g = _flat(grads)
        res = red.reduce(UNIT, [t.clone() for t in grads], ReduceContext(group, step)).wait()
        idx = getattr(red, "last_indices", {}).get(UNIT.key)
        out.append(
            {"g": g, "before": before, "after": _residual(red).to(dtype), "update": _flat(res), "idx": idx}
        )
    return out


def _oracle_gs(
    n: int, opts: dict[str, Any], steps: int, central: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's update and rank 0's residual, rebuilt in one process from every rank's gradients."""
    ref = (SketchedSGDReducer if central else GsSGDReducer)(**opts)
    e = [torch.zeros(D) for _ in range(n)]
    out = []
    for step in range(steps):
        k = ref.k_for(D, step)  # the warm-up's k while it lasts, with a sketch of its own size
        sk = CountSketch(D, ref.rows, ref.cols_for(D, step), seed=ref.unit_seed(UNIT.key))
        p = [_flat(_grads(r, step, integer=True)) + e[r] for r in range(n)]
        table = sum(sk.sketch(x) for x in p)
        m = candidates(k, ref.oversample, D)
        idx = ref.recover(sk, table, m, UNIT, step)
        vals = sum(x[idx] for x in p)
        if m > k:
            idx, vals = keep_largest(idx, vals, k)
        upd = torch.zeros(D)
        upd[idx] = vals / n if n > 1 else vals
        for r in range(n):
            e[r] = p[r].clone()
            e[r][idx] = 0
        out.append((upd, e[0].clone()))
    return out


GS_CASES = [
    ("gs-sgd", {"density": 0.2, "rows": 3, "cols": 8}),
    ("gs-sgd", {"density": 0.2, "rows": 3, "cols": 8, "reduce": "allreduce"}),
    ("gs-sgd", {"k": 7, "recovery": "topk", "oversample": 2.0}),
    ("gs-sgd", {"density": 0.2, "rows": 3, "cols": 8, "recovery": "heavymix"}),  # the paper's recovery
    ("gs-sgd", {"k": 7, "recovery": "heavymix", "oversample": 2.0, "reduce": "allreduce"}),
    ("sketched-sgd", {"density": 0.2, "rows": 3, "cols": 8, "recovery": "heavymix"}),
    ("gs-sgd", {"k": 9, "rows": 1, "cols": 5}),
    ("sketched-sgd", {"density": 0.2, "rows": 3, "cols": 8}),
    ("sketched-sgd", {"k": 7, "oversample": 3.0}),
    ("gs-sgd", {"density": 0.1, "warmup": "0.5/0.3", "warmup_steps": 1}),
    ("sketched-sgd", {"k": 4, "warmup": "0.6", "warmup_steps": 2}),
]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(("kind", "opts"), GS_CASES)
def test_sketched_reducers_against_the_oracle(n: int, kind: str, opts: dict[str, Any]) -> None:
    res = run_threads(_steps, n, kind, opts, 4, True, torch.float32, timeout=60)
    ref = _oracle_gs(n, opts, 4, kind == "sketched-sgd")
    for step, (upd, e0) in enumerate(ref):
        k = _make(kind, opts).k_for(D, step)  # type: ignore[attr-defined]
        assert torch.equal(res[0][step]["after"], e0), f"step {step}: rank 0's residual"
        for r in range(n):
            got = res[r][step]
            assert torch.equal(got["update"], upd), f"step {step} rank {r}"
            idx = got["idx"]
            assert idx.numel() == k == idx.unique().numel(), f"step {step} rank {r}: {idx.tolist()}"
            assert torch.equal(idx, res[0][step]["idx"]), "the ranks applied different coordinates"


CONSERVING = [
    *GS_CASES,
    ("gtopk", {"density": 0.15}),
    ("gtopk", {"k": 5, "momentum": 0.9, "masking": True}),
    ("gs-sgd", {"k": 5, "momentum": 0.5}),
    ("topk-allgather", {"density": 0.15}),
    ("gtopk", {"density": 0.1, "warmup": "paper", "warmup_steps": 1}),
]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(("kind", "opts"), CONSERVING)
def test_error_feedback_conservation(n: int, kind: str, opts: dict[str, Any]) -> None:
    res = run_threads(_steps, n, kind, opts, 4, False, torch.float64, timeout=60)
    for step in range(4):
        before = sum(res[r][step]["before"] for r in range(n))
        after = sum(res[r][step]["after"] for r in range(n))
        g = sum(res[r][step]["g"] for r in range(n))
        if opts.get("momentum"):
            continue  # with worker momentum the residual conserves the momentum's sum, not the gradients'
        upd = res[0][step]["update"]
        torch.testing.assert_close(after + n * upd, before + g, rtol=0, atol=1e-12)
        for r in range(n):
            assert torch.equal(res[r][step]["update"], upd), f"rank {r} applied another update"


def _serial_gtopk(ps: list[torch.Tensor], k: int) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """gTop-k by dicts: local top-k, merges replayed over the tree; what each rank dropped."""

    def top(s: dict[int, float]) -> dict[int, float]:
        return {i: s[i] for i in sorted(s, key=lambda i: (-abs(s[i]), i))[:k]}

    n = len(ps)
    held = [top({i: float(v) for i, v in enumerate(p.tolist())}) for p in ps]
    dropped: list[dict[int, float]] = [{} for _ in range(n)]
    for rnd in tree_schedule(n).reduce:
        for src, dst in rnd:
            s = dict(held[dst])
            for i, v in held[src].items():
                s[i] = s.get(i, 0.0) + v
            held[dst] = top(s)
            for i, v in s.items():
                if i not in held[dst]:
                    dropped[dst][i] = dropped[dst].get(i, 0.0) + v
    final = sorted(held[0])
    return final, [held[0][i] for i in final], dropped


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("feedback", ["exact", "paper"])
def test_gtopk_equals_the_serial_reference(n: int, feedback: str) -> None:
    k = 6
    res = run_threads(_steps, n, "gtopk", {"k": k, "feedback": feedback}, 1, False, torch.float64, timeout=60)
    ps = [res[r][0]["g"] for r in range(n)]
    idx, vals, dropped = _serial_gtopk(ps, k)
    upd = torch.zeros(D, dtype=torch.float64)
    upd[idx] = torch.tensor(vals, dtype=torch.float64) / (n if n > 1 else 1)
    for r in range(n):
        got = res[r][0]
        assert got["idx"].tolist() == idx
        assert torch.equal(got["update"], upd)
        local = sorted(range(D), key=lambda i: (-abs(float(ps[r][i])), i))[:k]
        want = ps[r].clone()
        if feedback == "exact":
            want[local] = 0
            for i, v in dropped[r].items():
                want[i] += v
        else:
            want[idx] = 0
        torch.testing.assert_close(got["after"], want, rtol=0, atol=1e-12)


def _mismatched_seeds() -> None:
    red = GsSGDReducer(k=3, seed=lowband.rank() % 2)
    red.reduce(UNIT, [torch.zeros(s) for s in SHAPES.values()], ReduceContext(lowband.world().unchecked(), 0))


def test_sketch_tables_agreed_across_ranks() -> None:
    with pytest.raises(RankFailures) as info:
        run_threads(_mismatched_seeds, 3, timeout=60)
    assert sorted(info.value.errors) == [0, 1, 2]
    for tb in info.value.errors.values():
        assert "CollectiveMismatchError" in tb and "CountSketch tables" in tb and "checksum" in tb, tb


def _momentum_masking() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    red = GsSGDReducer(k=4, momentum=0.5, masking=True)
    group = lowband.world().unchecked()
    g0, g1 = _grads(0, 0, integer=True), _grads(0, 1, integer=True)
    red.reduce(UNIT, [t.clone() for t in g0], ReduceContext(group, 0)).wait()
    idx0 = red.last_indices[UNIT.key]
    assert red.velocity is not None
    u0 = _flat([red.velocity.tensors[n] for n in SHAPES])
    red.reduce(UNIT, [t.clone() for t in g1], ReduceContext(group, 1)).wait()
    return idx0, u0, _flat(g0)


def test_momentum_masking() -> None:
    ((idx0, u0, g0),) = run_threads(_momentum_masking, 1, timeout=30)
    want = g0.clone()
    want[idx0] = 0
    assert torch.equal(u0, want)


@pytest.mark.parametrize(
    ("cls", "opts"),
    [
        (GsSGDReducer, {"recovery": "median"}),
        (GsSGDReducer, {"reduce": "ring"}),
        (GsSGDReducer, {"rows": 0}),
        (GsSGDReducer, {"oversample": 0.5}),
        (GsSGDReducer, {"density": 0.0}),
        (GsSGDReducer, {"density": 1.5}),
        (GTopKReducer, {"feedback": "none"}),
        (SketchedSGDReducer, {"momentum": 2.0}),
        (GTopKReducer, {"masking": 1}),
        (GTopKReducer, {"k": -1}),
        (GsSGDReducer, {"warmup": "0.25/x", "warmup_steps": 1}),
        (GsSGDReducer, {"warmup": "0.25/0", "warmup_steps": 1}),
        (GsSGDReducer, {"warmup": "0.25/1.5", "warmup_steps": 1}),
        (GsSGDReducer, {"warmup": "0.25"}),
        (GTopKReducer, {"warmup": "paper", "warmup_steps": -1}),
        (SketchedSGDReducer, {"warmup": 0.25, "warmup_steps": 1}),
    ],
)
def test_bad_options(cls: type, opts: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        cls(**opts)


def test_k_and_default_columns() -> None:
    red = GsSGDReducer(density=0.01)
    assert red.k_for(1000) == 10 and red.k_for(1) == 1 and red.cols_for(100_000) == 10_000
    assert GsSGDReducer(k=50).k_for(20) == 20 and GsSGDReducer(k=50).cols_for(20) == 4
    assert GsSGDReducer(cols=77).cols_for(10**6) == 77


def test_warmup_schedule() -> None:
    red = GsSGDReducer(density=0.001, warmup="paper", warmup_steps=3)
    ks = [red.k_for(100_000, step) for step in range(14)]
    assert ks == [25_000] * 3 + [7_250] * 3 + [1_500] * 3 + [400] * 3 + [100] * 2
    assert red.k_for(100_000) == 100  # no step: the steady state
    assert red.cols_for(100_000, 0) == 20_000 and red.cols_for(100_000, 12) == 1_000  # capped at d / rows
    assert red.densities() == [0.25, 0.0725, 0.015, 0.004, None]
    assert red.options()["warmup"] == "0.25/0.0725/0.015/0.004" and red.options()["warmup_steps"] == 3
    fixed_k = GTopKReducer(k=7, warmup=[0.5], warmup_steps=2)
    assert [fixed_k.k_for(40, s) for s in range(4)] == [20, 20, 7, 7]
    assert "warmup" not in GsSGDReducer().options()
