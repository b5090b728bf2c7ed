"""The compressed transports (allgather-v, colocated parameter servers, two-stage) at N = 1..4 against
the single-process reference of ``tests/transport_oracle.py``: every rank's result equals the mean of
every rank's local decode (two-stage: the reference with server memory), over several steps of error
feedback, bit for bit and the same on every rank; the identity compressor through every transport
equals lowband's plain allreduce bit for bit; empty payloads of every kind go through.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import WORLD_SIZES
from transport_oracle import Int8Scale, Reference, SharedRandomK, Threshold, flat, grads, units

import lowband
from lowband.compress import Compressor, Payload, make_compressor, make_reducer
from lowband.compress.allgather import split_frames
from lowband.compress.ps import check_layout, contiguous_shards, parameter_shards
from lowband.compress.wire import framed, unframe
from lowband.errors import InvalidArgumentError
from lowband.optim.reducer import AllreduceReducer, ReduceContext, Reducer, Unit
from lowband.testing import run_threads

TRANSPORTS = ("allgather", "ps", "twostage")
STEPS = 3


def compressors() -> list[tuple[str, Compressor]]:
    return [
        ("identity", make_compressor("identity")),
        ("fp16", make_compressor("fp16")),
        ("bf16", make_compressor("bf16")),
        ("int8scale", Int8Scale()),
        ("threshold", Threshold(0.5)),
        ("threshold-bare", Threshold(0.5, bare=True)),
        ("randk", SharedRandomK(0.5)),
        ("dct-topk", make_compressor("dct-topk:chunk=8,topk=2")),
        ("chunktopk", make_compressor("chunktopk:chunk=8,k=3")),
    ]


def reduce_flat(reducer: Reducer, unit: Unit, gs: list[torch.Tensor], step: int) -> torch.Tensor:
    group = lowband.world().unchecked()  # as the gradient stage runs its reducer
    out = reducer.reduce(unit, [g.clone() for g in gs], ReduceContext(group, step)).wait()
    return flat(out)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_equals_mean_of_local_decodes(transport: str, n: int) -> None:
    """Lossy, data-dependent (selecting nothing on rank 1), random and cast compressors, with error
    feedback over three steps: each rank's result is the reference's, exactly."""

    def rank_fn() -> tuple[list[str], list[torch.Tensor]]:
        r, bad, seen = lowband.rank(), [], []
        for cname, comp in compressors():
            reducer = make_reducer(transport, comp, seed=3)
            ref = Reference(transport, comp, n, seed=3)
            for step in range(STEPS):
                for ui, unit in enumerate(units()):
                    per_rank = [grads(q, step, ui, quiet=1) for q in range(n)]
                    want = ref.step(unit, step, per_rank)
                    got = reduce_flat(reducer, unit, per_rank[r], step)
                    seen.append(got)
                    if not (got.dtype == want.dtype and torch.equal(got, want)):
                        bad.append(f"rank {r} {cname} step {step} {unit.key}: {got} != {want}")
        return bad, seen

    out = run_threads(rank_fn, n)
    for bad, _ in out:
        assert not bad, "\n".join(bad[:5])
    for r in range(1, n):
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[r][1], strict=True)), f"rank {r} differs"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_identity_equals_allreduce(n: int) -> None:
    """The identity compressor through every transport equals AllreduceReducer bit for bit. The inputs
    are multiples of 2^-8 below 16 in magnitude, so every partial sum of up to four ranks is exact in
    float32 and the summation order (gloo's ring, the transports' rank order) cannot change a bit; the
    one rounding, the division by n, is the same operation everywhere."""

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        reducers = {t: make_reducer(t, "identity") for t in (*TRANSPORTS, "allreduce")}
        plain = AllreduceReducer()
        for step in range(2):
            for ui, unit in enumerate(units()):
                gs = grads(r, step, ui, exact=True)
                want = reduce_flat(plain, unit, gs, step)
                for t, red in reducers.items():
                    got = reduce_flat(red, unit, gs, step)
                    if not torch.equal(got, want):
                        bad.append(f"rank {r} {t} step {step} {unit.key}: {got} != {want}")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad[:5])


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_empty_payloads(transport: str, n: int) -> None:
    """Selections of nothing on every rank (empty tensors, or no tensor at all) and units of zero
    elements: the result is zeros of the right size, with and without error feedback."""

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        for comp in (Threshold(1e9), Threshold(1e9, bare=True), Int8Scale(), SharedRandomK(0.0)):
            for memory in ("residual", "none"):
                reducer = make_reducer(transport, comp, memory)
                for ui, unit in enumerate(units()):
                    numel = sum(p.numel() for p in unit.params)
                    gs = grads(r, 0, ui)
                    got = reduce_flat(reducer, unit, gs, 0)
                    zero_expected = not isinstance(comp, Int8Scale) or numel == 0
                    if got.shape != (numel,) or (zero_expected and bool(got.any())):
                        bad.append(f"rank {r} {comp.name} {memory} {unit.key}: {got}")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad[:5])


def test_registry_and_options() -> None:
    """Every transport is registered with a description; options are checked by its schema."""
    desc = lowband.compress.TRANSPORTS.descriptions()
    assert {"allreduce", "allgather", "ps", "twostage"} <= set(desc) and all(desc.values())
    red = make_reducer("twostage", "fp16", server_memory=False)
    assert red.server is None  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match=r"unknown option\(s\) \['ratio'\]"):
        make_reducer("ps", "identity", ratio=0.1)
    with pytest.raises(InvalidArgumentError, match="server_memory must be true or false, got 1"):
        make_reducer("twostage", "identity", server_memory=1)
    with pytest.raises(InvalidArgumentError, match="not summable"):
        make_reducer("allreduce", Int8Scale())


# ------------------------------------------------------------------------ pure parts


segments_st = st.lists(st.integers(0, 40), min_size=0, max_size=6).map(
    lambda ms: tuple((f"p{i}", m) for i, m in enumerate(ms))
)


@settings(max_examples=200, deadline=None)
@given(segs=segments_st, n=st.integers(1, 9))
def test_shard_layouts(segs: tuple[tuple[str, int], ...], n: int) -> None:
    """Both layouts cover every element once; contiguous shards differ by at most one element and
    follow torch.tensor_split; a parameter's part in the per-parameter layout depends on the
    parameter and n alone (not on the unit around it)."""
    numel = sum(m for _, m in segs)
    cont, per = contiguous_shards(segs, n), parameter_shards(segs, n)
    assert len(cont) == len(per) == n
    check_layout("contiguous", cont, numel)
    check_layout("per-parameter", per, numel)
    want = [len(t) for t in torch.tensor_split(torch.arange(numel), n)]
    assert [sum(p.numel for p in s) for s in cont] == want
    pos = 0
    for name, m in segs:
        alone = parameter_shards(((name, m),), n)
        for j in range(n):
            mine = [p for p in per[j] if p.name == name]
            assert len(mine) == 1 and mine[0].start - pos == alone[j][0].start
            assert mine[0].numel == alone[j][0].numel
        pos += m


payload_st = st.lists(
    st.tuples(st.sampled_from([torch.uint8, torch.int64, torch.float16, torch.float32]), st.integers(0, 9)),
    max_size=3,
)


@settings(max_examples=100, deadline=None)
@given(layouts=st.lists(payload_st, min_size=1, max_size=4))
def test_split_frames_round_trip(layouts: list[list[tuple[torch.dtype, int]]]) -> None:
    """Framed payloads laid end to end (an allgather-v's result) split back into each payload, empty
    ones (no tensor, or tensors of no elements) included."""
    payloads = [Payload(tuple(torch.arange(k).to(dt) for dt, k in lay), 5, torch.float32) for lay in layouts]
    buf = torch.cat([framed(p) for p in payloads])
    parts = split_frames(buf, len(payloads))
    for p, b in zip(payloads, parts, strict=True):
        q = unframe(b, 5, torch.float32)
        assert len(q.data) == len(p.data)
        assert all(a.dtype == c.dtype and torch.equal(a, c) for a, c in zip(p.data, q.data, strict=True))
    with pytest.raises(InvalidArgumentError):
        split_frames(buf[:-1] if buf.numel() > 8 else buf[:4], len(payloads))
