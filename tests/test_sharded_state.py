"""Sharded parameters in the strategy protocol: training against the dense oracle, in_sync and the
replica spread of the replicated part, per-rank checkpoints (``weights_only=True``), re-sharding to
another world size, and the assembled model for evaluation."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from sharded_model import Net, batch, bench_worker, dense_steps, loss, sgd

import lowband
from lowband.errors import InvalidArgumentError
from lowband.nn import ShardSpec, shard_range, shard_specs
from lowband.nn.sharding import assemble
from lowband.strategies import Strategy, assemble_state_dicts, make_strategy
from lowband.testing import run_processes, run_threads

STEPS = 4


def _save(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _load(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return out


def _train(s: Strategy, steps: range) -> None:
    r = lowband.rank()
    for k in steps:
        b = batch(r, k)
        s.train_step(lambda m, b=b: loss(m, b))


def _dense(n: int, steps: int) -> tuple[Net, torch.optim.Optimizer]:
    m = Net()
    opt = sgd(m.parameters())
    dense_steps(m, opt, n, range(steps))
    return m, opt


def test_shard_range_tiles() -> None:
    for total in range(0, 9):
        for world in range(1, 6):
            parts = [shard_range(total, r, world) for r in range(world)]
            assert sum(length for _, length in parts) == total
            assert all(parts[r][0] + parts[r][1] == parts[r + 1][0] for r in range(world - 1))
            assert max(p[1] for p in parts) - min(p[1] for p in parts) <= 1
    full = torch.arange(30.0).view(5, 6)
    specs = [ShardSpec.even((5, 6), 1, r, 4) for r in range(4)]
    assert torch.equal(assemble([(s.slice(full), s) for s in reversed(specs)]), full)
    with pytest.raises(InvalidArgumentError, match="tile"):
        assemble([(s.slice(full), s) for s in specs[1:]])


def _train_and_report() -> dict[str, Any]:
    s = make_strategy("sharded-test", Net(), sgd)
    _train(s, range(STEPS))
    state = s.state_dict()
    return {
        "shards": dict(s.shards),
        "local": s.local_module.state_dict()["emb.weight"].clone(),
        "average": s.average_state_dict(),
        "model": s.average_model(Net(seed=9)).state_dict(),
        "spread": s.replica_spread(),
        "in_sync": s.in_sync(),
        "ckpt": _save(state),
        "replicated": [n for n, _ in s.replicated_parameters()],
    }


@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_sharded_training_matches_the_dense_model(n: int) -> None:
    dense, _ = _dense(n, STEPS)
    want = dense.state_dict()
    for r, got in enumerate(run_threads(_train_and_report, n, timeout=60)):
        spec = got["shards"]["emb.weight"]
        assert spec == ShardSpec.even((7, 5), 1, r, n)
        assert got["replicated"] == ["head.weight", "head.bias"]
        torch.testing.assert_close(got["local"], spec.slice(want["emb.weight"]), rtol=0, atol=1e-12)
        for key in ("average", "model"):
            assert sorted(got[key]) == sorted(want)
            for k, v in want.items():
                torch.testing.assert_close(got[key][k], v, rtol=0, atol=1e-12)
        assert got["spread"] == 0.0 and got["in_sync"]
        ckpt = _load(got["ckpt"])  # loads with weights_only=True
        assert ckpt["sharding"]["world_size"] == n and ckpt["sharding"]["rank"] == r
        assert ckpt["sharding"]["params"]["emb.weight"] == spec.to_dict()
        assert tuple(ckpt["model"]["emb.weight"].shape) == spec.local_shape


def _phase1(steps: int) -> dict[str, bytes]:
    s = make_strategy("sharded-test", Net(), sgd)
    _train(s, range(steps))
    return {"own": _save(s.state_dict()), "full": _save(s.full_state_dict())}


def _phase2(ckpts: dict[str, Any], first: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("full", "assembled"):
        s = make_strategy("sharded-test", Net(seed=11), sgd)
        s.load_state_dict(_load(ckpts[key]))
        _train(s, range(first, first + steps))
        out[key] = s.average_state_dict()
        out[key + "_momentum"] = s.optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    s = make_strategy("sharded-test", Net(seed=11), sgd)
    with pytest.raises(InvalidArgumentError, match="full checkpoint"):
        s.load_state_dict(_load(ckpts["own"]))
    return out


@pytest.mark.parametrize(("n_from", "n_to"), ((2, 3), (4, 2), (3, 1), (1, 4)))
def test_checkpoint_reshards_to_another_world_size(n_from: int, n_to: int) -> None:
    first, more = 3, 2
    saved = run_threads(_phase1, n_from, first, timeout=60)
    fulls = [_load(p["full"]) for p in saved]
    assembled = assemble_state_dicts([_load(p["own"]) for p in reversed(saved)])
    for k, v in fulls[0]["model"].items():
        assert torch.equal(assembled["model"][k], v)
        assert torch.equal(fulls[-1]["model"][k], v)
    ckpts = {"full": saved[0]["full"], "assembled": _save(assembled), "own": saved[0]["own"]}
    dense, opt = _dense(n_from, first)
    dense_steps(dense, opt, n_to, range(first, first + more))
    want = dense.state_dict()
    momentum = opt.state_dict()["state"][0]["momentum_buffer"]  # the embedding table's
    for r, got in enumerate(run_threads(_phase2, n_to, ckpts, first, more, timeout=60)):
        spec = ShardSpec.even((7, 5), 1, r, n_to)
        for key in ("full", "assembled"):
            for k, v in want.items():
                torch.testing.assert_close(got[key][k], v, rtol=0, atol=1e-12)
            torch.testing.assert_close(got[key + "_momentum"], spec.slice(momentum), rtol=0, atol=1e-12)


def test_undeclared_or_mismatched_layouts_are_refused() -> None:
    def body() -> None:
        s = make_strategy("sharded-test", Net(), sgd)
        state = s.state_dict()
        del state["sharding"]
        with pytest.raises(InvalidArgumentError, match="sharded parameters"):
            s.load_state_dict(state)
        bad = s.full_state_dict()
        bad["sharding"]["params"]["emb.weight"]["dim"] = 0
        with pytest.raises(InvalidArgumentError, match="cut along dim 0"):
            s.load_state_dict(bad)
        assert shard_specs(Net()) == {}

    run_threads(body, 2, timeout=30)


def test_bench_worker_evaluates_the_assembled_model() -> None:
    """The bench trains a sharded strategy next to the compute-only copy and evaluates the assembled
    model: its held-out loss equals the dense oracle's (the dense model on every rank's batches)."""
    from lowband.bench.config import BenchConfig
    from lowband.bench.worker import COMPUTE
    from lowband.bench.workloads import get_workload

    n, bs = 2, 8
    cfg = BenchConfig(
        workload="wordlm", strategies=["sharded-test"], world_size=n, rounds=1, steps_per_round=2,
        warmup_rounds=0, eval_items=64, batch_size=bs,
    )  # fmt: skip
    raw = run_processes(bench_worker, n, cfg, timeout=120)[0]
    wl = get_workload("wordlm")
    dense = wl.build_model(cfg.seed)
    opt = wl.make_optimizer(dense.parameters())
    streams = [wl.batches(r, n, bs, cfg.seed) for r in range(n)]
    for _ in range(cfg.steps_per_round):
        opt.zero_grad()
        (sum(wl.loss(dense, next(it)) for it in streams) / n).backward()  # type: ignore[union-attr]
        opt.step()
    want = wl.evaluate(dense, max_items=cfg.eval_items)
    run = raw["runs"]["sharded-test"]
    assert run["in_sync"] and run["replica_spread"] == 0.0
    assert run["evals"][0]["loss"] == pytest.approx(want.loss, rel=1e-4)
    assert run["evals"][0]["accuracy"] == pytest.approx(want.accuracy, abs=1e-9)
    assert COMPUTE in raw["runs"] and len(raw["runs"][COMPUTE]["segments"]) == 1
