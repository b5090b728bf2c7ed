"""CompressedOptimizer in a plain training loop: with SGD (momentum) and Adam it trains as the
single-process oracle of compressed data parallelism at world sizes 1-4; its state_dict (the wrapped
optimizer's state, the step count, the stage's counter and memories) resumes bit-identically."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import lowband
from lowband.compress import CompressedOptimizer
from lowband.compress.reshard import same
from lowband.errors import InvalidArgumentError
from lowband.testing import run_threads
from tests.compress_fixtures import GatherTransport, Grid, RandomHalf, adam, flat, loss, model, oracle, sgd

STEPS = 4
OPTIMIZERS = {"sgd": sgd, "adam": adam}


def _opt(m: torch.nn.Module, kind: str, fmt: str) -> CompressedOptimizer:
    inner = OPTIMIZERS[kind](m.parameters())
    if fmt == "identity":
        return CompressedOptimizer(m, inner, compressor="identity", bucket_mb=0)
    red = GatherTransport(Grid() if fmt == "grid" else RandomHalf(), "residual", seed=3)
    return CompressedOptimizer(m, inner, reducer=red, bucket_mb=0)


def _train(kind: str, fmt: str) -> torch.Tensor:
    r = lowband.rank()
    m = model()
    opt = _opt(m, kind, fmt)
    for k in range(STEPS):
        opt.zero_grad()
        loss(m, r, k).backward()
        opt.step()
    opt.remove_hooks()
    return flat(m)


@pytest.mark.parametrize("fmt", ["identity", "grid"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_trains_as_the_oracle(n: int, kind: str, fmt: str) -> None:
    res = run_threads(_train, n, kind, fmt, timeout=60)
    ref = oracle(n, STEPS, OPTIMIZERS[kind], Grid() if fmt == "grid" else None, residual=True)
    for r in range(n):
        if fmt == "grid":  # exact decode, averaged in rank order: bit for bit
            assert torch.equal(res[r], ref), f"rank {r}"
        else:  # the allreduce sums in its own order
            assert float((res[r] - ref).abs().max()) < 1e-6, f"rank {r}"
        assert torch.equal(res[r], res[0])


def _resume(kind: str) -> dict[str, Any]:
    r = lowband.rank()
    m = model()
    opt = _opt(m, kind, "randomhalf")
    saved: dict[str, Any] = {}
    for k in range(STEPS + 2):
        if k == 2:
            saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
        opt.zero_grad()
        loss(m, r, k).backward()
        opt.step()
    m2 = model()
    opt2 = _opt(m2, kind, "randomhalf")
    m2.load_state_dict(saved["model"])
    opt2.load_state_dict(copy.deepcopy(saved["opt"]))
    for k in range(2, STEPS + 2):
        opt2.zero_grad()
        loss(m2, r, k).backward()
        opt2.step()
    out = {
        "a": flat(m),
        "b": flat(m2),
        "sa": opt.state_dict(),
        "sb": opt2.state_dict(),
        "saved": saved["opt"],
    }
    opt.remove_hooks()
    opt2.remove_hooks()
    return out


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("n", [1, 3])
def test_state_dict_resumes_bit_identically(n: int, kind: str) -> None:
    for r, out in enumerate(run_threads(_resume, n, kind, timeout=60)):
        assert torch.equal(out["a"], out["b"]), f"rank {r}"
        assert same(out["sa"], out["sb"])
        st = out["saved"]
        assert st["steps"] == 2 and st["stage"]["rounds"] == 2 and st["world_size"] == n
        assert st["stage"]["reducer"]["memory"]["tensors"]  # the memories are in the checkpoint
        assert int(st["stage"]["reducer"]["compressor"]["calls"]) == 2 * 3


def _accumulate() -> list[torch.Tensor]:
    """Two backward passes per step (accumulate=2) equal one pass on the summed loss."""
    r = lowband.rank()
    outs = []
    for acc in (1, 2):
        m = model()
        opt = CompressedOptimizer(m, sgd, compressor="identity", accumulate=acc)
        for k in range(2):
            opt.zero_grad()
            if acc == 2:
                loss(m, r, 2 * k).backward()
                loss(m, r, 2 * k + 1).backward()
            else:
                (loss(m, r, 2 * k) + loss(m, r, 2 * k + 1)).backward()
            opt.step()
        opt.remove_hooks()
        outs.append(flat(m))
    return outs


def test_accumulate_and_factory() -> None:
    for one, two in run_threads(_accumulate, 2, timeout=60):
        assert float((one - two).abs().max()) < 1e-6


def _errors() -> list[str]:
    m = model()
    errs = []
    for kw in (
        {"compressor": "nope"},
        {"reducer": "nope"},
        {"memory": "x"},
        {"bucket_mb": -2},
        {"reducer": GatherTransport(Grid()), "compressor": "fp16"},
    ):
        try:
            CompressedOptimizer(m, sgd, **kw)  # type: ignore[arg-type]
        except InvalidArgumentError as exc:
            errs.append(str(exc))
    other = torch.nn.Linear(2, 2)
    momentum = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # DGC applies the momentum itself
    try:
        CompressedOptimizer(m, momentum, compressor="dgc:ratio=0.1", memory="dgc:momentum=0.9")
    except InvalidArgumentError as exc:
        errs.append(str(exc))
    for bad in (torch.optim.SGD(other.parameters(), lr=0.1), lambda ps: "adam"):
        try:
            CompressedOptimizer(m, bad)  # type: ignore[arg-type]
        except InvalidArgumentError as exc:
            errs.append(str(exc))
    opt = CompressedOptimizer(m, sgd)
    loss(m, 0, 0).backward()
    try:
        opt.zero_grad()
    except InvalidArgumentError as exc:
        errs.append(str(exc))
    opt.step()
    try:
        opt.load_state_dict({**opt.state_dict(), "world_size": 5})
    except InvalidArgumentError as exc:
        errs.append(str(exc))
    return errs


def test_bad_arguments() -> None:
    errs = run_threads(_errors, 1, timeout=60)[0]
    want = [
        "unknown compressor 'nope'",
        "unknown transport 'nope'",
        "'x'",
        "bucket_mb must be a number >= 0, got -2",
        "compressor, memory and seed belong to the built reducer",
        "DGC: the optimizer's parameter group 0 has momentum=0.9",
        "the optimizer steps parameters that are not the model's",
        "optimizer must be a torch.optim.Optimizer or a factory of one, got str",
        "zero_grad() while gradients are being reduced",
        "the state was saved at 5 ranks, this group has 1; re-shard every rank's state first",
    ]
    assert len(errs) == len(want)
    for got, w in zip(errs, want):
        assert w in got, got
        assert got.startswith("lowband.CompressedOptimizer on rank 0: ") or got.startswith("DGC:"), got


def _save_grid() -> dict[str, Any]:
    r = lowband.rank()
    m = model()
    opt = _opt(m, "adam", "grid")
    for k in range(2):
        opt.zero_grad()
        loss(m, r, k).backward()
        opt.step()
    out = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    opt.remove_hooks()
    return out


def _load_grid(states: list[dict[str, Any]], saved_model: dict[str, Any]) -> torch.Tensor:
    r = lowband.rank()
    m = model()
    m.load_state_dict(saved_model)
    opt = _opt(m, "adam", "grid")
    opt.load_state_dict(copy.deepcopy(states[r]))
    for k in range(2, 4):
        opt.zero_grad()
        loss(m, r, k).backward()
        opt.step()
    opt.remove_hooks()
    return flat(m)


def test_reshard_state_dicts_to_another_world_size() -> None:
    saved = run_threads(_save_grid, 2, timeout=60)
    states = CompressedOptimizer.reshard_state_dicts([s["opt"] for s in saved], 3)
    assert [s["world_size"] for s in states] == [3, 3, 3] and all(s["steps"] == 2 for s in states)
    for name, e in saved[0]["opt"]["stage"]["reducer"]["memory"]["tensors"].items():
        total = e + saved[1]["opt"]["stage"]["reducer"]["memory"]["tensors"][name]
        new = sum(s["stage"]["reducer"]["memory"]["tensors"][name] for s in states)
        assert torch.allclose(total, new, atol=1e-6), name  # the memories keep their sum
    res = run_threads(_load_grid, 3, states, saved[0]["model"], timeout=60)
    assert all(torch.equal(p, res[0]) for p in res)
    with pytest.raises(InvalidArgumentError, match="1 states of another world size"):
        CompressedOptimizer.reshard_state_dicts([saved[0]["opt"]], 3)
