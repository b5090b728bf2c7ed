"""The quantizers through every compressed transport (allgather-v, colocated parameter servers,
two-stage) at N = 1..4: each rank's result equals the single-process reference of
``tests/transport_oracle.py`` (the mean of every rank's local decode, with error feedback; two-stage:
with server memory) bit for bit, the same on every rank. Real packed payloads and per-rank stochastic
rounding travel through the transports' framing."""

from __future__ import annotations

import pytest
import torch
from oracle import WORLD_SIZES
from transport_oracle import Reference, flat, grads, units

import lowband
from lowband.compress import make_compressor, make_reducer
from lowband.optim.reducer import ReduceContext
from lowband.testing import run_threads

SPECS = (
    "onebit",
    "twobit:threshold=0.25",
    "sign",
    "scaledsign",
    "qsgd:levels=3,bucket=7",
    "terngrad",
    "minmax8:stochastic=true",
)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("transport", ["allgather", "ps", "twostage"])
def test_quantizers_through_transports_equal_the_reference(transport: str, n: int) -> None:
    def rank_fn() -> tuple[list[str], list[torch.Tensor]]:
        r, bad, seen = lowband.rank(), [], []
        group = lowband.world().unchecked()
        for spec in SPECS:
            comp = make_compressor(spec)
            reducer = make_reducer(transport, comp, seed=5)
            ref = Reference(transport, comp, n, seed=5)
            for step in range(2):
                for ui, unit in enumerate(units()):
                    per_rank = [grads(q, step, ui) for q in range(n)]
                    want = ref.step(unit, step, per_rank)
                    out = reducer.reduce(
                        unit, [g.clone() for g in per_rank[r]], ReduceContext(group, step)
                    ).wait()
                    got = flat(out)
                    seen.append(got)
                    if not (got.dtype == want.dtype and torch.equal(got, want)):
                        bad.append(f"rank {r} {spec} step {step} {unit.key}: {got} != {want}")
        return bad, seen

    out = run_threads(rank_fn, n)
    for bad, _ in out:
        assert not bad, "\n".join(bad[:5])
    for r in range(1, n):
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[r][1], strict=True)), f"rank {r} differs"
