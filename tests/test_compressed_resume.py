"""Checkpoints of the ``compressed`` strategy: a checkpoint taken mid-run resumes bit-identically for
every registered compressor through every registered transport that carries it (memories, counters,
compressor and transport state, seeds), and every rank's checkpoint re-shards onto another world size
keeping the sum of the error-feedback memories."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

import lowband
from lowband.compress import COMPRESSORS, TRANSPORTS
from lowband.compress.reshard import same
from lowband.errors import InvalidArgumentError
from lowband.strategies import CompressedStrategy, make_strategy, reshard_checkpoints
from lowband.testing import run_threads
from tests.compress_fixtures import GatherTransport, Grid, RandomHalf, buildable, flat, loss, model, sgd

SAVE, TOTAL = 2, 5
PAIRS = [(c, t) for c in COMPRESSORS.names() for t in TRANSPORTS.names()]


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # type: ignore[no-any-return]


def _resume(build: Any) -> dict[str, Any]:
    r = lowband.rank()
    a = build()
    ckpt: dict[str, Any] = {}
    for k in range(TOTAL):
        if k == SAVE:
            ckpt = _roundtrip(a.state_dict())
        a.train_step(lambda m, k=k: loss(m, r, k))
    b = build()
    b.load_state_dict(ckpt)
    for k in range(SAVE, TOTAL):
        b.train_step(lambda m, k=k: loss(m, r, k))
    out = {"a": flat(a.local_module), "b": flat(b.local_module), "sa": a.state_dict(), "sb": b.state_dict()}
    a.close()
    b.close()
    return out


def _check_resumed(res: list[dict[str, Any]]) -> None:
    for r, out in enumerate(res):
        assert torch.equal(out["a"], out["b"]), f"rank {r}"
        assert same(out["sa"], out["sb"]), f"rank {r}: the state after resuming differs"
        assert out["sb"]["extra"]["stage"]["rounds"] == TOTAL


def _registered(compressor: str, transport: str) -> CompressedStrategy:
    return make_strategy(  # type: ignore[return-value]
        "compressed", model(), sgd, compressor=compressor, reducer=transport, bucket_mb=0.0005, seed=7
    )


@pytest.mark.parametrize("compressor,transport", PAIRS, ids=[f"{c}-{t}" for c, t in PAIRS])
def test_every_registered_pair_resumes_bit_identically(compressor: str, transport: str) -> None:
    spec, why = buildable(compressor, transport)
    if spec is None:
        pytest.skip(f"not a combination: {why}")
    res = run_threads(_resume, 2, lambda: _registered(spec, transport), timeout=60)
    _check_resumed(res)


def _stateful() -> CompressedStrategy:
    red = GatherTransport(RandomHalf(), "residual", seed=5)
    return CompressedStrategy(model(), sgd, lowband.world(), red, bucket_mb=0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_seeded_stateful_compressor_resumes_bit_identically(n: int) -> None:
    """Shared random masks drawn from (seed, step, unit), a compressor counter and residual memories:
    all continue exactly after loading."""
    res = run_threads(_resume, n, _stateful, timeout=60)
    _check_resumed(res)
    calls = res[0]["sb"]["extra"]["stage"]["reducer"]["compressor"]["calls"]
    assert int(calls) == TOTAL * 3  # three layers, one call each per step (resumed from the checkpoint)


# -- another world size -----------------------------------------------------------------------------------


def _grid() -> CompressedStrategy:
    return CompressedStrategy(model(), sgd, lowband.world(), GatherTransport(Grid(), "residual"), bucket_mb=0)


def _save() -> dict[str, Any]:
    r = lowband.rank()
    s = _grid()
    for k in range(SAVE):
        s.train_step(lambda m, k=k: loss(m, r, k))
    st = _roundtrip(s.state_dict())
    s.close()
    return st


def _load(states: list[dict[str, Any]]) -> dict[str, Any]:
    r = lowband.rank()
    s = _grid()
    s.load_state_dict(copy.deepcopy(states[r]))  # torch's optimizer keeps the loaded tensors: no aliasing
    loaded = copy.deepcopy(s.state_dict())
    for k in range(SAVE, TOTAL):
        s.train_step(lambda m, k=k: loss(m, r, k))
    s.close()
    return {"loaded": loaded, "params": flat(s.local_module), "steps": s.steps, "in_sync": s.replica_spread()}


def _memory_sum(states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for st in states:
        for k, v in st["extra"]["stage"]["reducer"]["memory"]["tensors"].items():
            out[k] = out[k] + v if k in out else v.clone()
    return out


@pytest.mark.parametrize("n,m", [(2, 3), (4, 2), (3, 3)])
def test_reshard_to_another_world_size(n: int, m: int) -> None:
    saved = run_threads(_save, n, timeout=60)
    states = reshard_checkpoints(saved, m)
    assert len(states) == m
    before, after = _memory_sum(saved), _memory_sum(states)
    assert sorted(before) == sorted(after) and before  # every parameter's memory, summed over ranks, kept
    for k in before:
        assert torch.allclose(before[k], after[k], atol=1e-6), k
    if n == m:
        assert all(same(a, b) for a, b in zip(saved, states))  # same world size: exactly as saved
    res = run_threads(_load, m, states, timeout=60)
    for r, out in enumerate(res):
        assert same(out["loaded"], states[r]), f"rank {r} loaded something else"
        assert out["steps"] == TOTAL and out["in_sync"] == 0.0
        assert torch.equal(out["params"], res[0]["params"])


def _save_registered(transport: str) -> dict[str, Any]:
    r = lowband.rank()
    s = _registered("fp16", transport)
    for k in range(SAVE):
        s.train_step(lambda m, k=k: loss(m, r, k))
    st = _roundtrip(s.state_dict())
    s.close()
    return st


def _load_registered(transport: str, states: list[dict[str, Any]]) -> dict[str, Any]:
    r = lowband.rank()
    s = _registered("fp16", transport)
    s.load_state_dict(copy.deepcopy(states[r]))
    loaded = copy.deepcopy(s.state_dict())
    for k in range(SAVE, TOTAL):
        s.train_step(lambda m, k=k: loss(m, r, k))
    s.close()
    return {"loaded": loaded, "params": flat(s.local_module)}


@pytest.mark.parametrize("transport", TRANSPORTS.names())
def test_every_transport_reshards(transport: str) -> None:
    """fp16 with error feedback through each registered transport, 2 ranks re-sharded onto 3 (the
    two-stage transport's server memory re-cut by its own function): loaded as given, replicas equal."""
    saved = run_threads(_save_registered, 2, transport, timeout=60)
    states = reshard_checkpoints(saved, 3)
    res = run_threads(_load_registered, 3, transport, states, timeout=60)
    for r, out in enumerate(res):
        assert same(out["loaded"], states[r]), f"rank {r}"
        assert torch.equal(out["params"], res[0]["params"])
    if "server" in saved[0]["extra"]["stage"]["reducer"]:
        for name in saved[0]["extra"]["stage"]["reducer"]["server"]["memory"]["tensors"]:
            old = torch.cat(
                [s["extra"]["stage"]["reducer"]["server"]["memory"]["tensors"][name] for s in saved]
            )
            new = torch.cat(
                [s["extra"]["stage"]["reducer"]["server"]["memory"]["tensors"][name] for s in states]
            )
            assert torch.equal(old, new), name  # the server's parts re-cut, not averaged


def _load_unresharded(states: list[dict[str, Any]]) -> str:
    s = _grid()
    try:
        s.load_state_dict(states[lowband.rank()])
    except InvalidArgumentError as exc:
        return str(exc)
    finally:
        s.close()
    return "loaded"


def test_another_world_size_without_resharding_is_refused() -> None:
    saved = run_threads(_save, 2, timeout=60)
    for msg in run_threads(_load_unresharded, 3, saved + saved[:1], timeout=60):
        assert "taken at 2 ranks, this group has 3" in msg and "reshard_checkpoints" in msg


def test_reshard_refusals() -> None:
    saved = run_threads(_save, 2, timeout=60)
    odd = copy.deepcopy(saved)
    odd[1]["extra"]["stage"]["reducer"]["compressor"] = {"calls": torch.tensor(3)}
    with pytest.raises(InvalidArgumentError, match="compressor's state differs between rank 0 and rank 1"):
        reshard_checkpoints(odd, 3)
    server = copy.deepcopy(saved)
    for st in server:
        st["extra"]["stage"]["reducer"]["server"] = {"x": torch.zeros(2)}
    with pytest.raises(InvalidArgumentError, match=r"keeps per-rank state \['server'\]"):
        reshard_checkpoints(server, 3)
    with pytest.raises(InvalidArgumentError, match="taken at 2 ranks, 1 checkpoints given"):
        reshard_checkpoints(saved[:1], 3)
    late = copy.deepcopy(saved)
    late[1]["steps"] += 1
    with pytest.raises(InvalidArgumentError, match="rank 1's checkpoint has steps=3, rank 0's 2"):
        reshard_checkpoints(late, 3)
    with pytest.raises(InvalidArgumentError, match="world_size must be an int >= 1"):
        reshard_checkpoints(saved, 0)
