"""Compressed reducers as DDP comm hooks (``lowband.compress.ddp_hook``) on thread ranks: the identity
format through every registered transport (and through a reference allgather transport) trains as plain
DDP; fp16 without error feedback trains as torch's ``fp16_compress_hook``; the hook's state (step
counter, memories keyed by parameter name) checkpoints and survives DDP's bucket rebuild; every
registered compressor through DDP's buckets gives each bucket the mean of every rank's local decode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import lowband
from lowband.comm.handle import Handle
from lowband.compress import COMPRESSORS, TRANSPORTS, CompressContext, build_reducer, ddp_hook
from lowband.compress.reshard import same
from lowband.errors import InvalidArgumentError
from lowband.optim import ReduceContext, Reducer, Unit
from lowband.testing import run_threads
from tests.compress_fixtures import GatherTransport, buildable, flat, loss, model, sgd

STEPS = 4


def _torch_group() -> dist.ProcessGroup:
    """A torch ProcessGroup (what DDP takes) over this thread rank's gloo backend."""
    pg = dist.ProcessGroup(lowband.rank(), lowband.size())
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, lowband.world().pg)
    return pg


def _train(hook: str, transport: str | None = None) -> dict[str, Any]:
    r = lowband.rank()
    m = model()
    pg = _torch_group()
    # small buckets: several per iteration (DDP rebuilds them after the first iteration)
    ddp = DistributedDataParallel(m, process_group=pg, bucket_cap_mb_list=[0.0005, 0.001])
    state: Any = None
    if hook == "torch-fp16":
        ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    elif hook == "gather-identity":
        state, fn = lowband.ddp_comm_hook(GatherTransport("identity"), m)
        ddp.register_comm_hook(state, fn)
    elif hook != "default":
        state, fn = ddp_hook(m, compressor=hook, reducer=transport or "auto", memory="none")
        ddp.register_comm_hook(state, fn)
    opt = sgd(ddp.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        loss(ddp, r, k).backward()
        opt.step()
    return {"params": flat(m), "state": None if state is None else state.state_dict()}


def _pair(a: tuple[Any, ...], b: tuple[Any, ...]) -> dict[str, Any]:
    return {"a": _train(*a), "b": _train(*b)}


def _close(res: list[dict[str, Any]], tol: float) -> float:
    worst = 0.0
    for out in res:
        worst = max(worst, float((out["a"]["params"] - out["b"]["params"]).abs().max()))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("transport", TRANSPORTS.names())
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_identity_through_every_transport_equals_ddp(n: int, transport: str) -> None:
    res = run_threads(_pair, n, ("default",), ("identity", transport), timeout=60)
    _close(res, 1e-6)
    for out in res:
        assert out["b"]["state"]["step"] == STEPS


@pytest.mark.parametrize("n", [2, 3])
def test_identity_through_an_allgather_equals_ddp(n: int) -> None:
    _close(run_threads(_pair, n, ("default",), ("gather-identity",), timeout=60), 1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fp16_equals_torch_fp16_compress_hook(n: int) -> None:
    """torch divides by the world size before the cast, lowband after the sum: the same up to fp16
    rounding of the gradients (and not the same as full precision)."""
    res = run_threads(_pair, n, ("torch-fp16",), ("fp16",), timeout=60)
    _close(res, 2e-4)
    if n > 1:
        full = run_threads(_pair, n, ("default",), ("fp16",), timeout=60)
        assert max(float((o["a"]["params"] - o["b"]["params"]).abs().max()) for o in full) > 0


def _checkpointed() -> dict[str, Any]:
    """fp16 with error feedback: the hook's state after 2 steps, loaded into a fresh DDP + hook that
    trains the last 2 steps, equals training all 4 (memories keyed by name across the rebuild)."""
    r = lowband.rank()

    def build(m: torch.nn.Module) -> tuple[Any, Any]:
        ddp = DistributedDataParallel(m, process_group=_torch_group(), bucket_cap_mb_list=[0.0005, 0.001])
        state, fn = ddp_hook(m, compressor="fp16", reducer="allreduce")
        ddp.register_comm_hook(state, fn)
        return ddp, state

    m = model()
    ddp, state = build(m)
    opt = sgd(ddp.parameters())
    saved: dict[str, Any] = {}
    for k in range(STEPS):
        if k == 2:
            saved = {"m": {k: v.clone() for k, v in m.state_dict().items()}, "o": opt.state_dict(),
                     "h": state.state_dict()}  # fmt: skip
            saved = {k: _clone(v) for k, v in saved.items()}
        opt.zero_grad()
        loss(ddp, r, k).backward()
        opt.step()
    m2 = model()
    m2.load_state_dict(saved["m"])
    ddp2, state2 = build(m2)
    opt2 = sgd(ddp2.parameters())
    opt2.load_state_dict(saved["o"])
    state2.load_state_dict(saved["h"])
    for k in range(2, STEPS):
        opt2.zero_grad()
        loss(ddp2, r, k).backward()
        opt2.step()
    return {"a": flat(m), "b": flat(m2), "sa": state.state_dict(), "sb": state2.state_dict(), "h": saved["h"]}


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clone(x) for x in v]
    return v


@pytest.mark.parametrize("n", [1, 3])
def test_hook_state_checkpoints(n: int) -> None:
    """DDP's first iteration after a restart runs in parameter order (its buckets are rebuilt after):
    the memories, keyed by parameter name, still land on their parameters. At 3+ ranks the first
    iteration's fp16 allreduce sums in another bucketing (another ring chunking), so resuming is exact
    up to fp16 rounding of one step's sums."""
    for out in run_threads(_checkpointed, n, timeout=60):
        names = {name for name, _ in model().named_parameters()}
        assert set(out["h"]["reducer"]["memory"]["tensors"]) == names and out["h"]["step"] == 2
        assert out["sb"]["step"] == out["sa"]["step"] == STEPS
        assert float((out["a"] - out["b"]).abs().max()) < 1e-4
        if n == 1:
            assert torch.equal(out["a"], out["b"]) and same(out["sa"], out["sb"])


def test_bad_specs() -> None:
    for kw, msg in (
        ({"compressor": "nope"}, "lowband.compress.ddp_hook: compressor='nope': unknown compressor 'nope'"),
        ({"reducer": "nope"}, "lowband.compress.ddp_hook: reducer='nope': unknown transport 'nope'"),
        ({"memory": "all"}, "lowband.compress.ddp_hook: .*memory.*'all'"),
    ):
        with pytest.raises(InvalidArgumentError, match=msg):
            build_reducer(**kw, where="lowband.compress.ddp_hook")  # type: ignore[arg-type]


class Recorder(Reducer):
    """Delegates to a reducer, recording each unit's key, step, input (flat) and reduced output."""

    def __init__(self, inner: Reducer) -> None:
        self.inner = inner
        self.seen: list[dict[str, Any]] = []

    def reduce(self, unit: Unit, grads: list[torch.Tensor], ctx: ReduceContext) -> Handle[list[torch.Tensor]]:
        rec = {"key": unit.key, "step": ctx.step, "x": torch.cat([g.reshape(-1) for g in grads]).clone()}
        self.seen.append(rec)

        def keep(out: list[torch.Tensor]) -> list[torch.Tensor]:
            rec["y"] = torch.cat([o.reshape(-1) for o in out]).clone()
            return out

        return self.inner.reduce(unit, grads, ctx).map(keep)


def _recorded(compressor: str) -> list[dict[str, Any]]:
    r = lowband.rank()
    m = model()
    ddp = DistributedDataParallel(m, process_group=_torch_group(), bucket_cap_mb_list=[0.0005, 0.001])
    state, fn = ddp_hook(m, compressor=compressor, reducer="allgather", memory="none", seed=11)
    state.reducer = rec = Recorder(state.reducer)
    ddp.register_comm_hook(state, fn)
    opt = sgd(ddp.parameters())
    for k in range(3):
        opt.zero_grad()
        loss(ddp, r, k).backward()
        opt.step()
    return rec.seen


@pytest.mark.parametrize("compressor", COMPRESSORS.names())
def test_every_compressor_as_a_ddp_hook(compressor: str) -> None:
    """Every registered compressor (default options, else the first of the trial options that builds)
    through DDP's buckets: each bucket's result on
    every rank is the mean of every rank's local decode of its own bucket (the allgather transport's
    contract), the compressor seeded by (seed, DDP iteration, the bucket's parameter names)."""
    n = 3
    spec, why = buildable(compressor, "allgather")
    if spec is None:
        pytest.skip(why)
    comp = build_reducer(spec, "allgather").compressor
    res = run_threads(_recorded, n, spec, timeout=60)
    assert len(res[0]) >= 2 * 3 and all(len(x) == len(res[0]) for x in res)
    for i, rec in enumerate(res[0]):
        decs = []
        for r in range(n):
            x = res[r][i]
            assert (x["key"], x["step"]) == (rec["key"], rec["step"])
            ctx = CompressContext(rec["key"], rec["step"], r, 11)
            decs.append(comp.decompress(comp.compress(x["x"], ctx), ctx))
        want = torch.stack(decs).sum(0) / n
        for r in range(n):
            got = res[r][i]["y"]
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (compressor, rec["key"], r)
            assert torch.equal(got, res[0][i]["y"])
