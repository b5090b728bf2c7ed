"""PowerSGD: the ``powersgd`` transport equals torch's ``powerSGD_hook`` on the same buckets, options and
seed, bit for bit, over several iterations at world sizes 1-4 (torch's hook is called with a GradBucket-
like object on a torch ProcessGroup over the thread rank's gloo backend), including across a
``state_dict`` round trip mid-run; and its argument checks."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import lowband
from lowband.compress import PowerSGDReducer, make_reducer
from lowband.compress.powersgd import orthogonalize
from lowband.errors import InvalidArgumentError
from lowband.optim import ReduceContext, Unit
from lowband.testing import run_threads

ITERS = 6
#: buckets of (name, shape): same-shaped matrices (batching), biases, a 4-D tensor, a matrix below the
#: compression rate, one narrower than the rank, and a bucket with nothing to compress
BUCKETS: list[list[tuple[str, tuple[int, ...]]]] = [
    [("w1", (16, 12)), ("b1", (16,)), ("w2", (16, 12)), ("conv", (4, 3, 3, 3))],
    [("small", (3, 3)), ("w3", (16, 12)), ("wide", (2, 40))],
    [("b2", (5,))],
]
CONFIGS: dict[str, dict[str, Any]] = {
    "rank1-ef-warm": dict(rank=1, start=2, ef=True, warm=True, eps=0.0, batch=False, rate=2.0, seed=0),
    "rank3-qr-cold-batched": dict(
        rank=3, start=0, ef=False, warm=False, eps=1e-8, batch=True, rate=1.0, seed=5
    ),
    "rank2-ef-warm-batched": dict(rank=2, start=3, ef=True, warm=True, eps=0.0, batch=True, rate=1.5, seed=9),
}
#: torch's hook seeds torch's global generator: serialize its calls across thread ranks
_HOOK_LOCK = threading.Lock()
#: the torch groups and hook states, released on the main thread once the ranks are done (the last
#: reference dropped on gloo's callback thread would destroy the group from its own worker thread)
_KEEP: list[Any] = []


class _Bucket:
    """What powerSGD_hook reads of a dist.GradBucket."""

    def __init__(self, buffer: torch.Tensor, index: int, shapes: list[tuple[int, ...]], last: bool) -> None:
        self._buffer, self._index, self._last = buffer, index, last
        self._grads = []
        pos = 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            self._grads.append(buffer[pos : pos + n].view(s))
            pos += n

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        return self._last


def _torch_group() -> dist.ProcessGroup:
    pg = dist.ProcessGroup(lowband.rank(), lowband.size())  # type: ignore[call-arg]
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, lowband.world().pg)
    return pg


def _grad(rank: int, it: int, b: int) -> torch.Tensor:
    numel = sum(int(torch.Size(s).numel()) for _, s in BUCKETS[b])
    return torch.randn(numel, generator=torch.Generator().manual_seed(10_000 * rank + 100 * it + b))


def _reducer(cfg: dict[str, Any]) -> PowerSGDReducer:
    red = make_reducer(
        "powersgd", "identity", "residual" if cfg["ef"] else "none", seed=cfg["seed"], rank=cfg["rank"],
        start_iter=cfg["start"], min_compression_rate=cfg["rate"], warm_start=cfg["warm"],
        orthogonalization_epsilon=cfg["eps"], batch_same_shape=cfg["batch"],
    )  # fmt: skip
    assert isinstance(red, PowerSGDReducer)
    return red


def _compare(cfg: dict[str, Any]) -> list[tuple[int, int, float]]:
    r = lowband.rank()
    state = PowerSGDState(
        _torch_group(), matrix_approximation_rank=cfg["rank"], start_powerSGD_iter=cfg["start"],
        min_compression_rate=cfg["rate"], use_error_feedback=cfg["ef"], warm_start=cfg["warm"],
        orthogonalization_epsilon=cfg["eps"], random_seed=cfg["seed"], batch_tensors_with_same_shape=cfg["batch"],
    )  # fmt: skip
    _KEEP.append(state)
    red = _reducer(cfg)
    group = lowband.world().unchecked()
    params = {nm: torch.zeros(s) for bucket in BUCKETS for nm, s in bucket}
    diffs = []
    for it in range(ITERS):
        if it == ITERS // 2:  # resume from a checkpoint mid-run
            saved = red.state_dict()
            red = _reducer(cfg)
            red.load_state_dict(saved)
        for b, bucket in enumerate(BUCKETS):
            g = _grad(r, it, b)
            with _HOOK_LOCK:
                fut = powerSGD_hook(
                    state, _Bucket(g.clone(), b, [s for _, s in bucket], b == len(BUCKETS) - 1)
                )  # type: ignore[arg-type]
            want = fut.wait().clone()
            names = tuple(nm for nm, _ in bucket)
            unit = Unit(f"{names[0]}..{names[-1]}", names, tuple(params[nm] for nm in names))
            mine = _Bucket(g.clone(), b, [s for _, s in bucket], False).gradients()
            out = red.reduce(unit, mine, ReduceContext(group, it)).wait()
            got = torch.cat([o.reshape(-1) for o in out])
            diffs.append((it, b, float((got - want).abs().max()) if not torch.equal(got, want) else 0.0))
    return diffs


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_equals_torch_powersgd_hook_bit_for_bit(n: int, config: str) -> None:
    try:
        res = run_threads(_compare, n, CONFIGS[config], timeout=120)
    finally:
        _KEEP.clear()
    for r in range(n):
        bad = [d for d in res[r] if d[2] != 0.0]
        assert not bad, f"rank {r}: (iteration, bucket, max |diff|) {bad}"
        assert len(res[r]) == ITERS * len(BUCKETS)


def _locked_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    with _HOOK_LOCK:
        return powerSGD_hook(state, bucket)


# DDP compares the hook's annotations with the classes themselves (not postponed strings)
_locked_hook.__annotations__ = {
    "state": PowerSGDState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _train(hook: str, cfg: dict[str, Any]) -> torch.Tensor:
    r = lowband.rank()
    g = torch.Generator().manual_seed(3)
    m = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    pg = _torch_group()
    ddp = DistributedDataParallel(m, process_group=pg)  # one bucket: torch's hook never races itself
    if hook == "torch":
        state: Any = PowerSGDState(
            pg, matrix_approximation_rank=cfg["rank"], start_powerSGD_iter=cfg["start"],
            min_compression_rate=cfg["rate"], use_error_feedback=cfg["ef"], warm_start=cfg["warm"],
            random_seed=cfg["seed"], batch_tensors_with_same_shape=cfg["batch"],
        )  # fmt: skip
        ddp.register_comm_hook(state, _locked_hook)
    else:
        state, fn = lowband.ddp_comm_hook(_reducer(cfg), m)
        ddp.register_comm_hook(state, fn)
    _KEEP.extend([state, ddp])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for k in range(ITERS):
        opt.zero_grad()
        data = torch.Generator().manual_seed(1000 * r + k)
        loss = ((ddp(torch.randn(6, 12, generator=data)) - torch.randn(6, 3, generator=data)) ** 2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_as_a_ddp_hook_trains_as_torch_powersgd_hook(n: int) -> None:
    cfg = CONFIGS["rank2-ef-warm-batched"] | {"start": 2, "rate": 1.0}
    try:
        res = run_threads(lambda: {h: _train(h, cfg) for h in ("torch", "lowband")}, n, timeout=120)
    finally:
        _KEEP.clear()
    for r in range(n):
        assert torch.equal(res[r]["torch"], res[r]["lowband"]), f"rank {r}"
        assert torch.equal(res[r]["lowband"], res[0]["lowband"])


def test_state_is_keyed_by_parameter_name() -> None:
    def body() -> dict[str, Any]:
        red = _reducer({**CONFIGS["rank1-ef-warm"], "start": 0})
        group = lowband.world().unchecked()
        names = ("w1", "b1")
        unit = Unit("w1..b1", names, (torch.zeros(16, 12), torch.zeros(16)))
        for it in range(2):
            red.reduce(unit, [torch.randn(16, 12), torch.randn(16)], ReduceContext(group, it)).wait()
        return red.state_dict()

    sds = run_threads(body, 2, timeout=60)
    sd = sds[0]
    assert sorted(sd["memory"]["tensors"]) == ["b1", "w1"]
    assert sorted(sd["powersgd"]["q"]) == ["w1"] and sd["powersgd"]["q"]["w1"].shape == (12, 1)
    assert sd["powersgd"]["iteration"] == 1 and sd["powersgd"]["seen"] == [["w1", "b1"]]
    three = PowerSGDReducer.reshard_states(sds, 3)  # to another world size: memories keep their sum
    for name in ("w1", "b1"):
        total = sds[0]["memory"]["tensors"][name] + sds[1]["memory"]["tensors"][name]
        assert torch.allclose(sum(t["memory"]["tensors"][name] for t in three), total, atol=1e-6)
    assert all(torch.equal(t["powersgd"]["q"]["w1"], sd["powersgd"]["q"]["w1"]) for t in three)
    other = _reducer({**CONFIGS["rank1-ef-warm"], "start": 0})
    other.load_state_dict(three[2])
    assert other.iteration == 1 and torch.equal(other.q["w1"], sd["powersgd"]["q"]["w1"])
    sds[1]["powersgd"]["iteration"] = 7
    with pytest.raises(InvalidArgumentError, match="'powersgd' state differs between rank 0 and rank 1"):
        PowerSGDReducer.reshard_states(sds, 3)


def test_orthogonalize_gives_orthonormal_columns() -> None:
    g = torch.Generator().manual_seed(1)
    for r in (1, 2, 4):
        m = torch.randn(3, 10, r, generator=g, dtype=torch.float64)
        orthogonalize(m)
        eye = torch.eye(r, dtype=torch.float64).expand(3, r, r)
        assert torch.allclose(m.transpose(1, 2) @ m, eye, atol=1e-12)


def test_bad_arguments() -> None:
    for kwargs, msg in [
        ({"rank": 0}, "rank must be an int >= 1, got 0"),
        ({"rank": 1.5}, "rank must be an int >= 1, got 1.5"),
        ({"start_iter": -1}, "start_iter must be an int >= 0, got -1"),
        ({"warm_start": 1}, "warm_start must be true or false, got 1"),
        ({"min_compression_rate": -1.0}, "min_compression_rate must be a number >= 0, got -1.0"),
        ({"seed": -3}, r"seed must be an int in \[0, 4294967296\), got -3"),
    ]:
        with pytest.raises(InvalidArgumentError, match=msg):
            make_reducer("powersgd", "identity", **kwargs)
    with pytest.raises(InvalidArgumentError, match="not summable"):
        make_reducer("powersgd", "topk:k=3")
    with pytest.raises(InvalidArgumentError, match="expects a 'powersgd' entry"):
        PowerSGDReducer().load_state_dict({"memory": {"kind": "residual", "tensors": {}}})
