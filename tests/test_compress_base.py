"""The compression interfaces: payload framing, spec parsing and typed options, seeded generators,
error-feedback memory (telescoping, keyed by parameter name, re-sharding), and the allreduce transport
against a single-process oracle at world sizes 1-4."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowband
from lowband.compress import (
    AllreduceCompressedReducer,
    CompressContext,
    Payload,
    ResidualMemory,
    make_compressor,
    make_reducer,
    parse_spec,
    reshard_memories,
)
from lowband.compress.wire import framed, from_bytes, header_bytes, to_bytes, unframe
from lowband.errors import InvalidArgumentError
from lowband.optim import ReduceContext, Unit
from lowband.testing import run_threads
from tests.oracle import WORLD_SIZES

DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64)  # fmt: skip


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 17)), max_size=4), st.integers(0, 99))
def test_framed_payload_round_trips(layout: list[tuple[torch.dtype, int]], seed: int) -> None:
    data = tuple(_tensor(dt, n, seed + k) for k, (dt, n) in enumerate(layout))
    p = Payload(data, 11, torch.float32)
    buf = framed(p)
    assert buf.dtype == torch.uint8 and buf.numel() == header_bytes(len(data)) + p.nbytes
    q = unframe(buf, 11, torch.float32)
    assert len(q.data) == len(data)
    for a, b in zip(q.data, data):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # unframed: the same bytes without a header, split by a known layout
    raw = to_bytes(data)
    assert raw.numel() == p.nbytes
    for a, b in zip(from_bytes(raw, data), data):
        assert torch.equal(a, b)


def test_unframe_rejects_a_truncated_buffer() -> None:
    buf = framed(Payload((torch.ones(3),), 3, torch.float32))
    with pytest.raises(InvalidArgumentError, match="bytes"):
        unframe(buf[:-1], 3, torch.float32)


def test_parse_spec() -> None:
    assert parse_spec("topk:ratio=0.01,seed=3") == ("topk", {"ratio": 0.01, "seed": 3})
    assert parse_spec("qsgd:levels=16;bucket=512") == ("qsgd", {"levels": 16, "bucket": 512})
    assert parse_spec("x:a=true,b=inf,c=abc") == ("x", {"a": True, "b": math.inf, "c": "abc"})
    assert parse_spec("fp16") == ("fp16", {})
    for bad in ("", "topk:ratio", "topk:=3"):
        with pytest.raises(InvalidArgumentError):
            parse_spec(bad)


def test_make_compressor_errors_name_the_problem() -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown compressor 'nope'.*known: .*fp16"):
        make_compressor("nope")
    with pytest.raises(InvalidArgumentError, match="unknown option"):
        make_compressor("fp16:ratio=3")
    c = make_compressor("identity")
    assert make_compressor(c) is c
    with pytest.raises(InvalidArgumentError, match="given with a built"):
        make_compressor(c, ratio=1)


def test_generators_are_seeded_by_step_name_and_rank() -> None:
    def draw(name: str = "u", step: int = 3, rank: int = 0, seed: int = 5) -> torch.Tensor:
        ctx = CompressContext(name, step, rank, seed)
        return torch.rand(4, generator=ctx.generator(shared=True))

    base = draw()
    assert torch.equal(base, draw())
    assert torch.equal(base, draw(rank=2))  # shared: every rank draws the same
    for other in (draw(step=4), draw(name="v"), draw(seed=6)):
        assert not torch.equal(base, other)
    ctx0, ctx1 = CompressContext("u", 3, 0, 5), CompressContext("u", 3, 1, 5)
    a = torch.rand(4, generator=ctx0.generator(shared=False))
    b = torch.rand(4, generator=ctx1.generator(shared=False))
    assert not torch.equal(a, b)


def test_compressors_reject_non_finite_and_non_flat_input() -> None:
    c = make_compressor("fp16")
    ctx = CompressContext("layer.weight", 0)
    with pytest.raises(InvalidArgumentError, match=r"non-finite value \(nan at element 2"):
        c.compress(torch.tensor([1.0, 2.0, float("nan")]), ctx)
    with pytest.raises(InvalidArgumentError, match="flat"):
        c.compress(torch.ones(2, 2), ctx)
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        c.compress(torch.ones(3, dtype=torch.int64), ctx)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=12),
    st.sampled_from([torch.float16, torch.float32, torch.float64]),
)
def test_finite_check_is_exact(values: list[float], dtype: torch.dtype) -> None:
    """The CPU check (a finite sum first) refuses exactly the tensors holding a NaN or an infinity,
    large finite values whose sum overflows included."""
    from lowband.compress.finite import check_now

    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    if bool(torch.isfinite(x).all()):
        check_now("t", x)
    else:
        with pytest.raises(InvalidArgumentError, match="non-finite"):
            check_now("t", x)
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)
    check_now("t", big)  # the sum overflows to inf; every element is finite


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(0, 40), st.integers(0, 999))
def test_residual_memory_telescopes(steps: int, n: int, seed: int) -> None:
    """sum of decodes sent + final memory == sum of gradients (fp16 drops bits; the memory keeps them)."""
    c = make_compressor("fp16")
    mem = ResidualMemory()
    segs = (("a", n // 2), ("b", n - n // 2))
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    for s in range(steps):
        x = torch.randn(n, generator=g) * 1e-3 + 1.0
        ctx = CompressContext("u", s)
        p = mem.compensate(segs, x)
        d = c.decompress(c.compress(p, ctx), ctx)
        mem.update(segs, p, d)
        total += x.double()
        sent += d.double()
    final = torch.cat([mem.tensors["a"], mem.tensors["b"]]).double()
    assert torch.allclose(sent + final, total, atol=1e-5 * steps, rtol=0)


def test_memory_is_keyed_by_parameter_name_across_rebucketing() -> None:
    mem = ResidualMemory()
    x = torch.arange(6, dtype=torch.float32)
    mem.update((("a", 2), ("b", 4)), x, torch.zeros(6))
    # the same parameters in another bucketing (b alone, then a with a new c)
    assert torch.equal(mem.compensate((("b", 4),), torch.zeros(4)), x[2:])
    out = mem.compensate((("c", 3), ("a", 2)), torch.ones(5))
    assert torch.equal(out, torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0]))
    with pytest.raises(InvalidArgumentError, match="'a' has 3 elements"):
        mem.compensate((("a", 3),), torch.zeros(3))
    sd = mem.state_dict()
    other = ResidualMemory()
    other.load_state_dict(sd)
    assert sorted(other.tensors) == ["a", "b"] and torch.equal(other.tensors["b"], x[2:])


def test_reshard_memories_preserves_the_sum() -> None:
    states = []
    for r in range(4):
        m = ResidualMemory()
        m.tensors = {"w": torch.full((3,), float(r)), "b": torch.tensor([r * 2.0])}
        states.append(m.state_dict())
    for m_ranks in (1, 2, 3, 5):
        out = reshard_memories(states, m_ranks)
        assert len(out) == m_ranks
        total_w = sum(s["tensors"]["w"] for s in out)
        assert torch.allclose(total_w, torch.full((3,), 6.0))
        assert torch.allclose(sum(s["tensors"]["b"] for s in out), torch.tensor([12.0]))
    with pytest.raises(InvalidArgumentError):
        reshard_memories(states, 0)


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g)]


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("spec", ["identity", "fp16", "bf16"])
def test_allreduce_transport_equals_the_oracle(n: int, spec: str) -> None:
    """Every rank: the mean over ranks of each rank's local decode (with its error feedback), 3 steps."""
    names = ("layer.weight", "layer.bias")

    def rank_fn() -> list[list[torch.Tensor]]:
        r = lowband.rank()
        red = make_reducer("allreduce", spec)
        unit = Unit("layer", names, tuple(torch.zeros_like(t) for t in _grads(0, 0)))
        out = []
        for step in range(3):
            grads = _grads(r, step)
            res = red.reduce(unit, grads, ReduceContext(lowband.world().unchecked(), step)).wait()
            out.append([t.clone() for t in res])
        return out

    results = run_threads(rank_fn, n)
    # oracle: each rank's memory and decode, in one process
    c = make_compressor(spec)
    mems = [ResidualMemory() for _ in range(n)]
    segs = ((names[0], 15), (names[1], 7))
    for step in range(3):
        decodes = []
        for r in range(n):
            flat = torch.cat([t.reshape(-1) for t in _grads(r, step)])
            p = mems[r].compensate(segs, flat)
            ctx = CompressContext("layer", step, r)
            pay = c.compress(p, ctx)
            d = c.decompress(pay, ctx)
            mems[r].update(segs, p, d)
            decodes.append(pay.data[0])
        summed = decodes[0].clone()
        for d in decodes[1:]:
            summed = summed + d  # the wire sums in the payload's dtype; exact for n <= 2, close beyond
        want = summed.to(torch.float32) / n
        for r in range(n):
            got = torch.cat([t.reshape(-1) for t in results[r][step]])
            assert torch.equal(got, torch.cat([t.reshape(-1) for t in results[0][step]]))  # bit-identical
            tol = 0 if n <= 2 or spec == "identity" else 1e-2
            assert torch.allclose(
                got, want, atol=tol * float(want.abs().max()), rtol=1e-6 if spec == "identity" else 0
            )


def test_allreduce_transport_refuses_non_summable() -> None:
    from lowband.compress.base import Compressor

    class NotSummable(Compressor):
        name = "ns"

        def compress(self, x: torch.Tensor, ctx: CompressContext) -> Payload:
            return Payload((x,), x.numel(), x.dtype)

        def decompress(self, payload: Payload, ctx: CompressContext) -> torch.Tensor:
            return payload.data[0]

    with pytest.raises(InvalidArgumentError, match="not summable"):
        AllreduceCompressedReducer(NotSummable())
    with pytest.raises(InvalidArgumentError, match="unknown transport"):
        make_reducer("carrier-pigeon", "identity")
