"""Sparsifiers: top-k (the k largest magnitudes, indices and values on the wire) and random-k (k
coordinates drawn from a seed every rank shares, so only values go on the wire).

How many: ``k`` elements, or ``ratio`` of the unit (``ceil(ratio * d)``, a product within 1e-9 of an
integer taken as that integer, at most ``d``). ``k = 0`` and ``d = 0`` give an empty payload that decodes
to zeros.

Top-k picks exactly the ``k`` largest ``|x|``; among equal magnitudes at the boundary the lowest indices
win. Its payload is the indices (ascending; ``int32``, or ``int64`` when ``d >= 2**31``) and the values
in the input's dtype: ``k * (4 + itemsize)`` bytes (8 for int64 indices).

Random-k's coordinates come from :meth:`CompressContext.generator` with ``shared=True``: the same on
every rank for a step and unit, different from step to step. Its payload is the ``k`` values alone
(``k * itemsize`` bytes), and since every rank's values sit on the same coordinates, payloads sum on the
wire (``summable``: the allreduce transport carries it). ``scale=True`` multiplies the decode by
``d / k``, which makes it unbiased (``E[decode] = x`` over the draw of coordinates); without it (the
default, for use with error feedback) the decode keeps the chosen values as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.options import Opt, Options, Rule

Tensor = torch.Tensor

_INT32_LIMIT = 2**31


def count_from_ratio(ratio: float, d: int) -> int:
    """``ceil(ratio * d)`` (a product within 1e-9 of an integer counts as that integer), at most ``d``."""
    x = ratio * d
    r = round(x)
    n = r if abs(x - r) <= 1e-9 * max(1.0, x) else math.ceil(x)
    return min(d, int(n))


def index_dtype(d: int) -> torch.dtype:
    """The dtype of indices into a tensor of ``d`` elements: int32, or int64 from ``2**31`` on."""
    return torch.int32 if d < _INT32_LIMIT else torch.int64


#: a sparsifier's count: ``ratio`` or ``k`` (neither: ratio 0.01)
COUNT_OPTIONS = Options(
    {
        "ratio": Opt(float, min=0, max=1, doc="the fraction of each unit sent (default 0.01)"),
        "k": Opt(int, min=0, doc="the elements of each unit sent"),
    },
    rules=[Rule(("ratio", "k"), "give ratio or k, not both", lambda o: o["ratio"] is None or o["k"] is None)],
)


def topk_indices(a: Tensor, k: int) -> Tensor:
    """Indices (ascending, int64) of the ``k`` largest entries of ``a`` (non-negative, finite); among
    entries equal to the k-th largest value, the lowest indices are taken."""
    d = a.numel()
    if k <= 0 or d == 0:
        return torch.empty(0, dtype=torch.int64, device=a.device)
    if k >= d:
        return torch.arange(d, device=a.device)
    kth = torch.topk(a, k, sorted=False).values.min()
    above = a > kth
    ties = a == kth
    # the first (k - |above|) ties, counted on the device: exactly k selected, so a nonzero of known
    # size (no host synchronisation), already ascending
    # (int32 counts where they fit: int64 reductions over bool cost 3-5x more on CPU)
    acc = torch.int32 if d < 2**31 else torch.int64
    chosen = above | (ties & (ties.cumsum(0, dtype=acc) <= k - above.sum(dtype=acc)))
    return torch.nonzero_static(chosen, size=k).view(-1)


def scatter(values: Tensor, indices: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """A flat tensor of ``numel`` zeros with ``values`` written at ``indices`` (distinct)."""
    out = torch.zeros(numel, dtype=dtype, device=values.device)
    if indices.numel():
        out[indices.long()] = values.to(dtype)
    return out


class _Sparsifier(Compressor):
    def __init__(self, ratio: float | None, k: int | None) -> None:
        self.ratio, self.k = (None if ratio is None else float(ratio)), k

    def count(self, d: int) -> int:
        """How many elements of a unit of ``d`` are sent."""
        if self.k is not None:
            return min(self.k, d)
        assert self.ratio is not None
        return count_from_ratio(self.ratio, d)

    def options(self) -> dict[str, Any]:
        return {"ratio": self.ratio} if self.ratio is not None else {"k": self.k}


@register_compressor(
    "topk", "the k largest magnitudes (ratio= or k=), indices and values on the wire", COUNT_OPTIONS
)
class TopK(_Sparsifier):
    """The ``k`` largest ``|x|``, ties broken by lowest index; see the module docstring."""

    name = "topk"
    summable = False
    fixed_size = True

    def __init__(self, *, ratio: float | None = None, k: int | None = None) -> None:
        super().__init__(0.01 if ratio is None and k is None else ratio, k)

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        d = x.numel()
        idx = topk_indices(x.abs(), self.count(d))
        return Payload((idx.to(index_dtype(d)), x[idx]), d, x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        indices, values = payload.data
        return scatter(values, indices, payload.numel, payload.dtype)

    def nbytes(self, d: int, dtype: torch.dtype) -> int:
        """The payload's size for a unit of ``d`` elements of ``dtype``."""
        return self.count(d) * (index_dtype(d).itemsize + dtype.itemsize)


@register_compressor(
    "randomk",
    "k coordinates from a shared seed (ratio= or k=, scale=): values only",
    COUNT_OPTIONS | Options({"scale": Opt(bool, doc="decode scaled by d / k (unbiased)")}),
)
class RandomK(_Sparsifier):
    """``k`` coordinates drawn without replacement from the shared per-step stream; see the module
    docstring."""

    name = "randomk"
    summable = True
    fixed_size = True

    def __init__(self, *, ratio: float | None = None, k: int | None = None, scale: bool = False) -> None:
        super().__init__(0.01 if ratio is None and k is None else ratio, k)
        self.scale = scale
        self._last: tuple[tuple[int, int, str, int, torch.device], Tensor] | None = None

    def indices(self, d: int, ctx: CompressContext, device: torch.device | str = "cpu") -> Tensor:
        """The step's coordinates for a unit of ``d`` elements (ascending, int64, on ``device``): the
        same on every rank. They are drawn on the CPU and moved once: a CPU generator's stream is the
        same on every machine, so the coordinates do not depend on the device a rank computes on."""
        k = self.count(d)
        dev = torch.device(device)
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=dev)
        key = (ctx.seed, ctx.step, ctx.name, d, dev)
        cached = self._last  # the draw of the last compress, reused by its decompress
        if cached is not None and cached[0] == key:
            return cached[1]
        g = ctx.generator(shared=True)
        idx = torch.randperm(d, generator=g, device="cpu")[:k].sort().values.to(dev)
        self._last = (key, idx)
        return idx

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        return Payload((x[self.indices(x.numel(), ctx, x.device)],), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        (values,) = payload.data
        d = payload.numel
        out = scatter(values, self.indices(d, ctx, values.device), d, payload.dtype)
        k = values.numel()
        if self.scale and k:
            out.mul_(d / k)
        return out

    def nbytes(self, d: int, dtype: torch.dtype) -> int:
        """The payload's size for a unit of ``d`` elements of ``dtype``."""
        return self.count(d) * dtype.itemsize

    def options(self) -> dict[str, Any]:
        return {**super().options(), "scale": self.scale}
