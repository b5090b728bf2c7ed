"""Seeded per-rank inputs that a single process can rebuild for every rank (the oracle's side)."""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
DTYPES = FLOATS + INTS
SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (5,), (3, 4), (2, 3, 4), (0, 3))
WORLD_SIZES = (1, 2, 3, 4)


def ident(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def data(
    rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0, *, integer: bool = True
) -> torch.Tensor:
    """Rank ``rank``'s input. Integer-valued (small, so that sums over 4 ranks are exact even in
    float16/bfloat16) unless ``integer=False`` (random normal floats)."""
    g = torch.Generator().manual_seed(7919 * rank + 104729 * salt + 17)
    if integer or not dtype.is_floating_point:
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def all_inputs(
    n: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0, **kw: bool
) -> list[torch.Tensor]:
    return [data(r, shape, dtype, salt, **kw) for r in range(n)]


def reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reference reduction, in the tensors' own dtype where the result is exact."""
    if op in ("sum", "average"):
        s = torch.stack([x.double() for x in xs]).sum(0).to(xs[0].dtype)
        return s.div(len(xs)) if op == "average" else s
    if op == "min":
        return torch.stack(xs).amin(0) if xs[0].numel() else xs[0].clone()
    if op == "max":
        return torch.stack(xs).amax(0) if xs[0].numel() else xs[0].clone()
    if op == "product":
        return torch.stack([x.double() for x in xs]).prod(0).to(xs[0].dtype)
    raise ValueError(op)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly equal: dtype, shape and values."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
