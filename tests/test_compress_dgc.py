"""Deep Gradient Compression: momentum correction and factor masking against a per-element reference
recurrence, the sampled threshold's guarantees, the authors' sample plan, warm-up densities, declared
wire size, sizes and non-finite input, state and resharding, memory specs, the optimizer check, and
DGC with its memory over the allgather transport at world sizes 1-4 against every rank's local decodes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowband
from lowband.compress import CompressContext, DGCMemory, make_compressor, make_reducer, reshard_memories
from lowband.compress.dgc import DGC, check_optimizer, sample_plan
from lowband.compress.specs import build_reducer, describe_reducer
from lowband.errors import InvalidArgumentError
from lowband.optim import ReduceContext, Unit
from lowband.testing import run_threads

SEGS = (("w", 5), ("b", 3))


def _reference(
    grads: list[list[float]], m: float, k: int, *, nesterov: bool, masking: bool, clip: float | None
):
    """Per-element DGC recurrence with an exact top-k (ties by lowest index); returns the decodes sent
    at every step and the final (u, v)."""
    d = len(grads[0])
    u, v = [0.0] * d, [0.0] * d
    sent_all = []
    for g in grads:
        if clip is not None:
            norm = math.sqrt(sum(x * x for x in g))
            coef = clip / (norm + 1e-6)
            g = [x * coef for x in g] if coef < 1 else g
        for i in range(d):
            if nesterov:
                u[i] = (u[i] + g[i]) * m
                v[i] = v[i] + u[i] + g[i]
            else:
                u[i] = m * u[i] + g[i]
                v[i] = v[i] + u[i]
        chosen = sorted(sorted(range(d), key=lambda i: (-abs(v[i]), i))[:k])
        sent = [0.0] * d
        for i in chosen:
            sent[i] = v[i]
            v[i] = 0.0
            if masking:
                u[i] = 0.0
        sent_all.append(sent)
    return sent_all, u, v


@pytest.mark.parametrize(
    ("nesterov", "masking", "clip"),
    [(False, True, None), (True, True, None), (False, False, None), (False, True, 2.0)],
)
def test_momentum_correction_and_masking_equal_the_reference_recurrence(
    nesterov: bool, masking: bool, clip: float | None
) -> None:
    # 8 elements at density 0.25: at most 2 / 0.25 elements, so the threshold is the exact top-2
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(8, generator=gen, dtype=torch.float64) for _ in range(10)]
    c = DGC(ratio=0.25)
    mem = DGCMemory(momentum=0.9, nesterov=nesterov, masking=masking, clip_norm=clip)
    got = []
    for step, g in enumerate(grads):
        ctx = CompressContext("w..b", step)
        p = mem.compensate(SEGS, g)
        d = c.decompress(c.compress(p, ctx), ctx)
        mem.update(SEGS, p, d)
        got.append(d)
    sent, u, v = _reference(
        [g.tolist() for g in grads], 0.9, 2, nesterov=nesterov, masking=masking, clip=clip
    )
    for step in range(10):
        assert torch.allclose(got[step], torch.tensor(sent[step], dtype=torch.float64), atol=1e-12), step
    assert sorted(mem.momenta) == ["b", "w"] and sorted(mem.velocities) == ["b", "w"]
    assert torch.allclose(
        torch.cat([mem.momenta["w"], mem.momenta["b"]]), torch.tensor(u, dtype=torch.float64)
    )
    assert torch.allclose(
        torch.cat([mem.velocities["w"], mem.velocities["b"]]), torch.tensor(v, dtype=torch.float64)
    )


def test_without_momentum_error_feedback_telescopes() -> None:
    gen = torch.Generator().manual_seed(2)
    c, mem = DGC(ratio=0.2), DGCMemory(momentum=0.0)
    total, sent = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    for step in range(9):
        g = torch.randn(8, generator=gen, dtype=torch.float64)
        total += g
        ctx = CompressContext("u", step)
        p = mem.compensate(SEGS, g)
        d = c.decompress(c.compress(p, ctx), ctx)
        mem.update(SEGS, p, d)
        sent += d
    assert torch.allclose(sent + torch.cat([mem.velocities["w"], mem.velocities["b"]]), total, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([2000, 5003, 20000]), st.booleans(), st.booleans())
def test_sampled_threshold_selects_at_most_k_of_the_largest(
    seed: int, d: int, strided: bool, resample: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen) * torch.rand(d, generator=gen) ** 3
    c = DGC(ratio=0.01, strided=strided, resample=resample)
    p = c.compress(x, CompressContext("u", seed % 97, rank=1))
    idx, vals = p.data
    k = math.ceil(0.01 * d)
    assert idx.dtype == torch.int32 and len(set(idx.tolist())) == idx.numel() <= k
    assert idx.numel() >= 1
    assert torch.equal(vals, x[idx.long()])
    assert p.nbytes == c.nbytes(idx.numel(), d, x.dtype) == idx.numel() * 8
    # every selected magnitude is at least the floor(upper * k)-th largest: the threshold selected at most
    # upper * k elements, or the exact top-k of the selection was taken
    bound = x.abs().sort(descending=True).values[math.floor(1.3 * k) - 1]
    assert float(x[idx.long()].abs().min()) >= float(bound)
    again = c.compress(x, CompressContext("u", seed % 97, rank=1))
    assert torch.equal(again.data[0], idx), "the sample is seeded by (seed, step, unit, rank)"


def test_sample_plan_is_the_authors() -> None:
    # d = 100000 at density 0.001: at least max(1000, 2000) samples, stride 65 -> 57 -> 49
    assert sample_plan(100_000, 0.001, 0.01) == (49, 2040)
    assert sample_plan(1500, 0.001, 0.01) == (1, 1500)  # at most 2 / density: no sampling
    assert sample_plan(5000, 0.5, 1.0) == (1, 5000)
    stride, n = sample_plan(1_000_000, 0.01, 0.01)
    assert n == 1_000_000 // stride >= 10_000 and stride % 8 == 1


def test_warmup_densities() -> None:
    c = DGC(ratio=0.001, warmup_epochs=4, epoch_steps=10)
    coeff = 0.001 ** (1 / 5)
    for step in range(50):
        e = step // 10
        want = coeff ** (e + 1) if e < 4 else 0.001
        assert c.density(step) == pytest.approx(want, rel=1e-12)
    assert [round(c.density(10 * e), 4) for e in range(5)] == [0.2512, 0.0631, 0.0158, 0.004, 0.001]
    paper = DGC(ratio=0.001, warmup_epochs=4, warmup_coeff=0.25)
    assert [paper.density(e) for e in range(6)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert DGC(ratio=0.01).density(0) == 0.01
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for step in range(6):  # the count sent follows the schedule
        p = paper.compress(x, CompressContext("u", step))
        k = math.ceil(paper.density(step) * 1000 - 1e-9)
        assert 0.8 * k <= p.data[0].numel() <= k


@pytest.mark.parametrize("d", [0, 1, 7, 8, 9, 15, 16, 17, 301])
def test_sizes(d: int) -> None:
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    for ratio in (0.0, 0.01, 0.5, 1.0):
        c = DGC(ratio=ratio)
        p = c.compress(x, CompressContext("u", 0))
        out = c.decompress(p, CompressContext("u", 0))
        assert out.shape == (d,) and p.nbytes == c.nbytes(p.data[0].numel(), d, x.dtype)
        if ratio == 0.0 or d == 0:
            assert p.nbytes == 0 and torch.equal(out, torch.zeros(d))
        if ratio == 1.0:
            assert torch.equal(out, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_a_clear_error(bad: float) -> None:
    x = torch.zeros(9)
    x[2] = bad
    with pytest.raises(InvalidArgumentError, match=r"'dgc' on unit 'u' \(rank 3\).*non-finite"):
        make_compressor("dgc:ratio=0.1").compress(x, CompressContext("u", 0, rank=3))


def test_state_dict_round_trip_and_resharding() -> None:
    mem = DGCMemory(momentum=0.5)
    c = DGC(ratio=0.25)
    for step in range(3):
        g = torch.arange(8.0) - step
        p = mem.compensate(SEGS, g)
        mem.update(
            SEGS, p, c.decompress(c.compress(p, CompressContext("u", step)), CompressContext("u", step))
        )
    sd = mem.state_dict()
    other = DGCMemory(momentum=0.5)
    other.load_state_dict(sd)
    assert all(torch.equal(other.momenta[k], mem.momenta[k]) for k in mem.momenta)
    assert all(torch.equal(other.velocities[k], mem.velocities[k]) for k in mem.velocities)
    two = reshard_memories([sd, sd, sd], 2)
    assert torch.allclose(two[0]["momenta"]["w"], 1.5 * mem.momenta["w"])
    assert torch.allclose(two[1]["tensors"]["b"], 1.5 * mem.velocities["b"])
    with pytest.raises(InvalidArgumentError, match="expected a 'dgc' memory"):
        other.load_state_dict({"kind": "residual", "tensors": {}})


def test_bad_options_and_transports() -> None:
    for spec, msg in [
        ("dgc:ratio=2", r"ratio must be a number in \[0, 1\]"),
        ("dgc:lower=1.5", r"lower must be a number in \(0, 1\]"),
        ("dgc:upper=0.5", "upper must be a number >= 1, got 0.5"),
        ("dgc:warmup_epochs=-1", "warmup_epochs must be an int >= 0"),
        ("dgc:epoch_steps=0", "epoch_steps must be an int >= 1"),
    ]:
        with pytest.raises(InvalidArgumentError, match=msg):
            make_compressor(spec)
    with pytest.raises(
        InvalidArgumentError, match=r"memory 'dgc': momentum must be a number in \[0, 1\], got 1.5"
    ):
        make_reducer("allgather", "dgc:ratio=0.01", "dgc:momentum=1.5")
    with pytest.raises(InvalidArgumentError, match="not summable"):
        make_reducer("allreduce", "dgc:ratio=0.01", DGCMemory())
    assert repr(make_compressor("dgc:ratio=0.01")) == "DGC(ratio=0.01, sample_ratio=0.01, strided=True)"


def test_check_optimizer_refuses_momentum() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    check_optimizer(torch.optim.SGD([w], lr=0.1))
    for opt in (
        torch.optim.SGD([w], lr=0.1, momentum=0.9),
        torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True),
    ):
        with pytest.raises(InvalidArgumentError, match=r"momentum=0\.9.*must run without"):
            check_optimizer(opt)


def test_memory_from_a_spec() -> None:
    red = make_reducer("allreduce", "randomk:k=2", "dgc:momentum=0.5,masking=false,clip_norm=3")
    assert isinstance(red.memory, DGCMemory)
    assert (red.memory.momentum, red.memory.masking, red.memory.clip_norm) == (0.5, False, 3.0)
    assert (
        repr(make_reducer("allreduce", "identity", "residual:beta=0.5").memory) == "ResidualMemory(beta=0.5)"
    )
    for spec, msg in [
        ("dgc:momentum=yes", r"memory 'dgc': momentum must be a number in \[0, 1\], got 'yes'"),
        ("dgc:lr=0.1", "unknown option"),
        ("momentum", "unknown memory 'momentum'; known: dgc, none, residual"),
    ]:
        with pytest.raises(InvalidArgumentError, match=msg):
            make_reducer("allreduce", "identity", spec)


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(6, 5, generator=g), torch.randn(5, generator=g)]


def _dgc_over_allgather() -> list[torch.Tensor]:
    red = make_reducer("allgather", "dgc:ratio=0.1", "dgc:momentum=0.9", seed=3)
    unit = Unit("w..b", ("w", "b"), (torch.zeros(6, 5), torch.zeros(5)))
    group = lowband.world().unchecked()
    outs = []
    for step in range(4):
        out = red.reduce(unit, _grads(lowband.rank(), step), ReduceContext(group, step)).wait()
        outs.append(torch.cat([o.reshape(-1) for o in out]).clone())
    return outs


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_dgc_over_the_allgather_transport_equals_the_mean_of_local_decodes(n: int) -> None:
    res = run_threads(_dgc_over_allgather, n, timeout=60)
    segs = (("w", 30), ("b", 5))
    mems = [DGCMemory(momentum=0.9) for _ in range(n)]
    c = DGC(ratio=0.1)
    for step in range(4):
        decodes = []
        for r in range(n):
            p = mems[r].compensate(segs, torch.cat([g.reshape(-1) for g in _grads(r, step)]))
            ctx = CompressContext("w..b", step, rank=r, seed=3)
            d = c.decompress(c.compress(p, ctx), ctx)
            mems[r].update(segs, p, d)
            decodes.append(d)
        want = torch.stack(decodes).sum(0) / n
        for r in range(n):
            assert torch.allclose(res[r][step], want, atol=1e-6), f"rank {r} step {step}"
            assert torch.equal(res[r][step], res[0][step])


def test_through_the_user_facing_specs() -> None:
    red = build_reducer("dgc:ratio=0.01;warmup_epochs=4", "auto", "dgc:momentum=0.5;clip_norm=2")
    assert red.transport == "allgather" and isinstance(red.memory, DGCMemory) and red.memory.momentum == 0.5
    assert describe_reducer(red)["memory"] == "dgc"
    with pytest.raises(InvalidArgumentError, match="unknown memory 'dgcx'; known: dgc, none, residual"):
        build_reducer("dgc", "auto", "dgcx")
