"""The slimgc strategy at 1-4 ranks against single-process oracles: the threshold decision (which units
are compressed, with error feedback, and which go in full precision, their memory flushed), BestCT the
same on every rank when the ranks measure differently, the asynchronous executor bit-identical to
inline compression, and a checkpoint taken mid-run resuming bit for bit. Plus the executor's order,
error surfacing, bounded waits and shutdown. Nothing here is timed.
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import lowband
from lowband.comm.engine import issue_lane
from lowband.comm.lane import LaneError
from lowband.compress import COMPRESSORS, CompressContext, Compressor, Payload, register_compressor
from lowband.compress.base import check_input
from lowband.compress.slimgc import Samples, build_table
from lowband.errors import CommTimeoutError, InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.strategies.slimgc import SlimGCStrategy
from lowband.testing import RankFailures, run_threads

LR = 0.1
GRID = 256.0
# the model's parameter sizes in bytes (float64): 0.weight 280, 0.bias 56, 2.weight 168, 2.bias 24
THRESHOLD = 100  # the weights are compressed, the biases go in full precision


class Grid(Compressor):
    """Test-only lossy compressor: values rounded to multiples of 1/256, kept in float64, so sums on
    the wire are exact and an oracle can follow it bit for bit."""

    name = "test-grid"
    summable = True

    def compress(self, x: torch.Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        return Payload((torch.round(x * GRID) / GRID,), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> torch.Tensor:
        return payload.data[0].clone()


if "test-grid" not in COMPRESSORS.names():
    register_compressor("test-grid", "test only: rounding to a 1/256 grid")(Grid)


def _model() -> nn.Module:
    g = torch.Generator().manual_seed(5)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return m


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, generator=g, dtype=torch.float64)
    return ((m(x) - y) ** 2).mean()


def _opt(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=LR)


def _state(s: SlimGCStrategy, m: nn.Module) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in m.parameters()]
    if s.backup is not None:
        out += [w.detach().clone() for w in s.backup.weights]
    return out


def _run(opts: dict[str, Any], steps: int) -> list[torch.Tensor]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("slimgc", m, _opt, **opts)
    assert isinstance(s, SlimGCStrategy)
    for k in range(steps):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    out = _state(s, m)
    s.close()
    return out


# -- the threshold decision -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("transport", ["allreduce", "ps"])
def test_threshold_decision_against_oracle(n: int, warmup: bool, transport: str) -> None:
    """Fixed threshold: the weights compressed, the biases in full precision. Warm-up (all 5 steps of
    it): every unit compressed on odd steps and in full precision on even ones, its memory sent along."""
    steps = 5
    threshold: dict[str, Any] = (
        {"comm_threshold": "auto", "pre_steps": 6} if warmup else {"comm_threshold": THRESHOLD}
    )
    opts = {"compressor": "test-grid", "reducer": transport, "backup": False, **threshold}
    res = run_threads(_run, n, opts, steps, timeout=90)
    m = _model()
    x = [p.detach().clone() for p in m.parameters()]
    sizes = [p.numel() * p.element_size() for p in m.parameters()]
    e = [[torch.zeros_like(t) for t in x] for _ in range(n)]
    for t in range(steps):
        mm = _model()
        gs = []
        for r in range(n):
            with torch.no_grad():
                for p, v in zip(mm.parameters(), x):
                    p.copy_(v)
                    p.grad = None
            _loss(mm, r, t).backward()  # type: ignore[no-untyped-call]
            gs.append([p.grad.detach().clone() for p in mm.parameters()])  # type: ignore[union-attr]
        for k in range(len(x)):
            sent = []
            for r in range(n):
                p = gs[r][k] + e[r][k]
                compressed = t % 2 == 1 if warmup else sizes[k] >= THRESHOLD
                q = torch.round(p * GRID) / GRID if compressed else p
                e[r][k] = p - q  # full precision: the memory is sent along and emptied
                sent.append(q)
            x[k] = x[k] - LR * (sum(sent) / n)
    assert [s >= THRESHOLD for s in sizes] == [True, False, True, False]
    for out in res:
        for got, want in zip(out, x):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(out, res[0]):
            assert torch.equal(a, b)


class _SkewedSamples(Samples):
    """Warm-up samples that ignore the measurement: rank r finds compression worth it only for the
    sizes from the r-th smallest on (mod 4), so every rank alone would choose another BestCT."""

    def __init__(self, steps: int, units: int, rank: int, order: list[int]) -> None:
        super().__init__(steps, units)
        self.rank, self.order = rank, order

    def add(self, step: int, unit: int, comm: float, compress: float) -> None:
        q = step % 2 == 1
        cheap = self.order.index(unit) >= self.rank % 4
        super().add(step, unit, (0.2 if cheap else 2.0) if q else 1.0 + 0.1 * self.rank, 0.1 * q)


def _decide(pre_steps: int) -> tuple[float, float, list[dict[str, float]]]:
    r = lowband.rank()
    m = _model()
    s = make_strategy(
        "slimgc", m, _opt, compressor="test-grid", reducer="allreduce", pre_steps=pre_steps, backup=False
    )
    assert isinstance(s, SlimGCStrategy)
    sizes = s.reducer.sizes
    s.reducer.samples = _SkewedSamples(
        pre_steps, len(sizes), r, sorted(range(len(sizes)), key=sizes.__getitem__)
    )
    for k in range(pre_steps + 1):
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    assert s.reducer.threshold is not None
    own = build_table(sizes, s.reducer.samples.comm, s.reducer.samples.compress).best_threshold()
    rep = s.report()["slimgc"]
    s.close()
    return s.reducer.threshold, own, rep["threshold_table"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bestct_agreed_when_ranks_measure_differently(n: int) -> None:
    res = run_threads(_decide, n, 2, timeout=90)
    sizes = sorted(p.numel() * 8 for p in _model().parameters())
    # each rank alone: the r-th smallest size; together (min of communication over ranks): rank 0's
    assert [own for _, own, _ in res] == [float(sizes[r % 4]) for r in range(n)]
    assert [agreed for agreed, _, _ in res] == [float(sizes[0])] * n
    assert all(table == res[0][2] for _, _, table in res)
    assert [row["size"] for row in res[0][2]] == sizes


# -- the executor: asynchronous equals inline ------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(
    "extra",
    [
        {"comm_threshold": THRESHOLD, "backup": True},
        {"comm_threshold": THRESHOLD, "backup": False},
        {"comm_threshold": "auto", "pre_steps": 8, "backup": True},  # the warm-up (probes, both kinds)
    ],
)
@pytest.mark.parametrize(
    ("compressor", "transport"), [("fp16", "allreduce"), ("fp16", "ps"), ("onebit:threshold=0.5", "ps")]
)
def test_offload_is_bit_identical_to_inline(
    n: int, extra: dict[str, Any], compressor: str, transport: str
) -> None:
    base = {"compressor": compressor, "reducer": transport, **extra}
    inline = run_threads(_run, n, {**base, "offload": False}, 6, timeout=90)
    offload = run_threads(_run, n, {**base, "offload": True}, 6, timeout=90)
    for a, b in zip(inline, offload):
        assert len(a) == len(b)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- checkpoints -------------------------------------------------------------------------------------


def _resume(
    opts: dict[str, Any], steps: int, at: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    r = lowband.rank()
    m = _model()
    s = make_strategy("slimgc", m, _opt, **opts)
    assert isinstance(s, SlimGCStrategy)
    buf = io.BytesIO()
    for k in range(steps):
        if k == at:
            torch.save(s.state_dict(), buf)
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()
    whole = _state(s, m)
    s.close()
    m2 = _model()
    s2 = make_strategy("slimgc", m2, _opt, **opts)
    assert isinstance(s2, SlimGCStrategy)
    s2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert s2.reducer.threshold == s.reducer.threshold
    for k in range(at, steps):
        s2.train_step(lambda mod, k=k: _loss(mod, r, k))
    s2.synchronize()
    resumed = _state(s2, m2)
    s2.close()
    assert s.reducer.threshold is not None
    return whole, resumed, s.reducer.threshold


@pytest.mark.parametrize(
    "extra",
    [
        {"comm_threshold": "auto", "pre_steps": 4, "backup": True, "offload": True, "local_lr": 0.05},
        {"comm_threshold": THRESHOLD, "backup": False, "offload": True},
        {"comm_threshold": 0, "backup": True, "offload": False},
        {"compressor": "onebit:threshold=0.5", "reducer": "ps", "pre_steps": 4},  # the defaults otherwise
    ],
)
def test_resume_is_bit_identical(extra: dict[str, Any]) -> None:
    opts = {"compressor": "test-grid", "reducer": "allreduce", **extra}
    res = run_threads(_resume, 2, opts, 10, 6, timeout=120)
    for whole, resumed, _ in res:
        assert len(whole) == len(resumed)
        assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    assert res[0][2] == res[1][2]


def _save_at_two() -> bytes:
    s = make_strategy("slimgc", _model(), _opt, compressor="test-grid", reducer="allreduce", comm_threshold=0)
    s.train_step(lambda mod: _loss(mod, lowband.rank(), 0))
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    s.close()
    return buf.getvalue()


def _load_at_one(ckpt: bytes) -> str:
    s = make_strategy("slimgc", _model(), _opt, compressor="test-grid", reducer="allreduce", comm_threshold=0)
    with pytest.raises(InvalidArgumentError) as info:
        s.load_state_dict(torch.load(io.BytesIO(ckpt), weights_only=True))
    s.close()
    return str(info.value)


def test_another_world_size_is_refused() -> None:
    ckpt = run_threads(_save_at_two, 2, timeout=60)[0]
    msg = run_threads(_load_at_one, 1, ckpt, timeout=60)[0]
    assert "taken at 2 ranks" in msg and "has 1" in msg


# -- arguments -------------------------------------------------------------------------------------


def _bad(opts: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        make_strategy("slimgc", _model(), _opt, **opts)
    return str(info.value)


def test_argument_errors() -> None:
    base = {"compressor": "fp16", "reducer": "allreduce"}
    cases = [
        ({**base, "comm_threshold": "fast"}, "comm_threshold"),
        ({**base, "pre_steps": 1}, "pre_steps"),
        ({**base, "backup": False, "local_lr": 0.1}, "local_lr"),
        ({**base, "local_lr": -1.0}, "local_lr"),
        ({**base, "offload": "yes"}, "offload"),
        ({**base, "fuse_mb": -1}, "fuse_mb"),
        ({**base, "compressor": "no-such-compressor"}, "no-such-compressor"),
    ]
    msgs = run_threads(lambda: [_bad(o) for o, _ in cases], 1, timeout=60)[0]
    for msg, (_, want) in zip(msgs, cases):
        assert want in msg


# -- the executor alone ----------------------------------------------------------------------------


def _executor_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    ex = issue_lane(None, timeout=10.0, where="test-executor")
    seen: list[int] = []
    threads: set[int] = set()

    def task(i: int) -> None:
        seen.append(i)
        threads.add(threading.get_ident())

    for i in range(50):
        ex.submit(lambda i=i: task(i))
    ex.drain()
    out["order"] = seen == list(range(50))
    out["other_thread"] = len(threads) == 1 and threading.get_ident() not in threads
    # the worker acts for this rank: it can communicate on its groups
    got: list[torch.Tensor] = []
    ex.submit(lambda: got.append(lowband.allreduce(torch.ones(3) * (lowband.rank() + 1), "sum")))
    ex.drain()
    out["comm"] = got[0].tolist()
    # a bounded wait
    ex.submit(lambda: time.sleep(0.3))
    try:
        ex.wait_until(lambda: False, "nothing", timeout=0.05)
        out["timeout"] = False
    except CommTimeoutError as exc:
        out["timeout"] = "nothing" in str(exc)
    # an error: raised on this thread, later tasks skipped
    ex.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    ex.submit(lambda: seen.append(-1))
    try:
        ex.drain()
        out["error"] = None
    except LaneError as exc:
        out["error"] = isinstance(exc.__cause__, ValueError) and "boom" in str(exc)
    out["skipped"] = -1 not in seen
    try:
        ex.submit(lambda: None)
        out["error_again"] = False
    except LaneError:
        out["error_again"] = True
    ex.close()
    ex.close()
    # inline: on this thread, errors at once
    inline = issue_lane(None, offload=False, timeout=1.0, where="inline")
    here: list[int] = []
    inline.submit(lambda: here.append(threading.get_ident()))
    out["inline"] = here == [threading.get_ident()]
    with pytest.raises(ValueError, match="bad"):
        inline.submit(lambda: (_ for _ in ()).throw(ValueError("bad")))
    inline.close()
    closed = issue_lane(None, offload=False, timeout=1.0, where="closed")
    closed.close()
    with pytest.raises(InvalidArgumentError, match="after close"):
        closed.submit(lambda: None)
    return out


def test_executor() -> None:
    res = run_threads(_executor_checks, 2, timeout=60)
    for out in res:
        assert out == {
            "order": True, "other_thread": True, "comm": [3.0, 3.0, 3.0], "timeout": True, "error": True,
            "skipped": True, "error_again": True, "inline": True,
        }  # fmt: skip


def _dies(offload: bool) -> None:
    r = lowband.rank()
    m = _model()
    s = make_strategy(
        "slimgc", m, _opt, compressor="fp16", reducer="ps", comm_threshold=THRESHOLD, offload=offload
    )
    for k in range(4):
        if r == 1 and k == 2:
            raise RuntimeError("rank 1 stops training")
        s.train_step(lambda mod, k=k: _loss(mod, r, k))
    s.synchronize()


@pytest.mark.parametrize("offload", [False, True])
def test_a_rank_that_stops_fails_the_others_in_bounded_time(offload: bool) -> None:
    with pytest.raises(RankFailures) as info:
        run_threads(_dies, 2, offload, timeout=60, comm_timeout=2.0)
    errors = info.value.errors
    assert "rank 1 stops training" in errors[1]
    assert "CommTimeoutError" in errors[0] or "CommFailedError" in errors[0], errors[0]
    assert "hard timeout" not in errors[0]
