"""Collectives of dtypes gloo's own ops reject (int16): moved as bytes (broadcast, allgather) or widened
(allreduce), checked against a single-process oracle at N = 1..4, including values that wrap."""

from __future__ import annotations

import pytest
import torch
from oracle import WORLD_SIZES

import lowband
from lowband.testing import run_threads

pytestmark = pytest.mark.parametrize("n", WORLD_SIZES)

SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (5,), (3, 4), (2, 3, 4))


def _inp(rank: int, shape: tuple[int, ...], salt: int, dim0: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * rank + 1009 * salt + 5)
    if dim0 is not None:
        shape = (dim0, *shape[1:])
    return torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int32).to(torch.int16)


def test_broadcast_int16(n: int) -> None:
    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        for si, shape in enumerate(SHAPES):
            for root in range(n):
                want = _inp(root, shape, si)
                got = lowband.broadcast(_inp(r, shape, si), root)
                if got.dtype != torch.int16 or not torch.equal(got, want):
                    bad.append(f"rank {r} broadcast {shape} root {root}: {got} != {want}")
                t = _inp(r, shape, si)
                lowband.ibroadcast(t, root, inplace=True).wait()
                if not torch.equal(t, want):
                    bad.append(f"rank {r} in-place broadcast {shape} root {root}")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad)


def test_allgather_int16_uneven(n: int) -> None:
    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        for si, shape in enumerate(SHAPES[2:]):
            want = torch.cat([_inp(k, shape, si, dim0=k + 1) for k in range(n)])
            got = lowband.allgather(_inp(r, shape, si, dim0=r + 1))
            if got.dtype != torch.int16 or not torch.equal(got, want):
                bad.append(f"rank {r} allgather {shape}: {got} != {want}")
        want0 = torch.stack([_inp(k, (), 0) for k in range(n)])
        if not torch.equal(lowband.allgather(_inp(r, (), 0)), want0):
            bad.append(f"rank {r} allgather of 0-d int16")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad)


def test_allreduce_int16_wraps_like_int16(n: int) -> None:
    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        for si, shape in enumerate(SHAPES):
            xs = [_inp(k, shape, si) for k in range(n)]
            for op in ("sum", "min", "max"):
                want = xs[0].clone()
                for x in xs[1:]:
                    want = (
                        want + x
                        if op == "sum"
                        else (torch.minimum if op == "min" else torch.maximum)(want, x)
                    )
                got = lowband.allreduce(xs[r], op=op)
                if got.dtype != torch.int16 or not torch.equal(got, want):
                    bad.append(f"rank {r} allreduce {op} {shape}: {got} != {want}")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad)
