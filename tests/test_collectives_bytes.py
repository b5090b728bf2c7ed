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


def test_alltoall_reduce_scatter_and_send_int16(n: int) -> None:
    """The other ops move int16 as NCCL can (bytes, or widened to int32), the same on gloo."""

    def rank_fn() -> list[str]:
        r, bad = lowband.rank(), []
        for si, rest in enumerate(((), (3,), (2, 2))):
            xs = [_inp(k, (2 * n, *rest), si) for k in range(n)]
            got, splits = lowband.alltoall(xs[r])
            want = torch.cat([x[2 * r : 2 * r + 2] for x in xs])
            if got.dtype != torch.int16 or not torch.equal(got, want) or splits != [2] * n:
                bad.append(f"rank {r} alltoall {rest}: {got} != {want}")
            rs = lowband.reduce_scatter(xs[r], op="sum")
            want_rs = sum(x[2 * r : 2 * r + 2].to(torch.int32) for x in xs)
            if rs.dtype != torch.int16 or not torch.equal(rs, torch.as_tensor(want_rs).to(torch.int16)):
                bad.append(f"rank {r} reduce_scatter {rest}: {rs} != {want_rs}")
        if n > 1:  # one way, rank 0 to rank 1 (a two-way unbatched exchange deadlocks on NCCL)
            if r == 0:
                lowband.send(_inp(0, (5,), 9), 1)
            elif r == 1:
                box = lowband.recv(torch.zeros(5, dtype=torch.int16), 0)
                if box.dtype != torch.int16 or not torch.equal(box, _inp(0, (5,), 9)):
                    bad.append(f"rank 1 recv int16 from 0: {box}")
        return bad

    for bad in run_threads(rank_fn, n):
        assert not bad, "\n".join(bad)
