"""``dct-topk``: the ``k`` largest DCT coefficients per chunk, the transform DeMo extracts a momentum's
fast components with (Bowen Peng, Jeffrey Quesnelle, Diederik P. Kingma, *DeMo: Decoupled Momentum
Optimization*, arXiv:2411.19870).

The flat unit is cut into chunks as in :mod:`lowband.compress.chunked` (``c = min(chunk, d)`` elements,
the last chunk zero-padded; a unit shorter than ``chunk`` is one chunk of its own length). Each chunk is
transformed by the orthonormal DCT-II of size ``c``: ``X_k = sum_n D[k, n] x_n`` with
``D[k, n] = sqrt(2/c) cos(pi (2n + 1) k / (2c))`` and row 0 scaled by ``1/sqrt(2)``, so ``D`` is
orthogonal and its inverse is ``D^T``. The ``k`` largest ``|X_k|`` of each chunk are kept (ties by the
lowest index; ``k = min(topk, c)``, or ``ceil(ratio * c)``): since ``D`` is orthonormal, the decode is
the best ``k``-term approximation of the chunk in the DCT basis, and its energy is the chunk's minus the
dropped coefficients' (Parseval). The decode scatters the kept coefficients into zeros, applies ``D^T``
and drops the padding.

Wire format: the in-chunk indices of the kept coefficients (``n * k``, chunk after chunk, ascending
within a chunk; ``uint8`` when ``c <= 256``, 16 bits up to 65536, int32 above: see
:mod:`lowband.compress.chunked`), then their values in the input's dtype: ``n * k * (idx + itemsize)``
bytes. Not summable (every rank keeps its own coefficients): the allgather transport carries it.

The basis is computed in float64 on the host (the same on every device) and moved once to the input's
device in the dtype the arithmetic runs in (float32, float64 for a float64 input); a small cache keeps
the last bases per ``(c, device, dtype)``. DeMo's reference implementation transforms a matrix in
two-dimensional blocks whose sides divide the matrix's (no padding) and takes the sign of the averaged
decode in its optimizer; here a compressor sees one flat unit, so the chunks are one-dimensional and
zero-padded (lowband's choice), and what is done with the decode (a sign, a momentum) belongs to the
optimizer or the outer loop, not to the compressor.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.compress.chunked import (
    ChunkCount,
    as_chunks,
    check_parts,
    chunk_topk_indices,
    decode_local,
    encode_local,
    local_index_dtype,
)
from lowband.compress.quantize import _work
from lowband.options import Opt, Options, Rule

Tensor = torch.Tensor


def dct_basis_host(c: int) -> Tensor:
    """The orthonormal DCT-II matrix of size ``c`` (row ``k`` is the ``k``-th basis vector), float64 on
    the CPU."""
    n = torch.arange(c, dtype=torch.float64, device="cpu")
    basis = torch.cos(math.pi * (2 * n + 1).unsqueeze(0) * n.unsqueeze(1) / (2 * c)) * math.sqrt(2.0 / c)
    basis[0] /= math.sqrt(2.0)
    return basis


@functools.lru_cache(maxsize=16)
def dct_basis(c: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """:func:`dct_basis_host` on ``device`` in ``dtype`` (cached; never modify the result)."""
    return dct_basis_host(c).to(device=device, dtype=dtype)


@register_compressor(
    "dct-topk",
    "DeMo's transform: the k largest orthonormal DCT-II coefficients per chunk, indices and values",
    Options(
        {
            "chunk": Opt(
                int, min=1, doc="the elements of a chunk, the DCT's size (a shorter unit is one chunk)"
            ),
            "topk": Opt(int, min=0, doc="the coefficients kept per chunk (default 4)"),
            "ratio": Opt(float, min=0, max=1, doc="the fraction of each chunk's coefficients kept"),
        },
        rules=[
            Rule(
                ("ratio", "topk"),
                "give ratio or topk, not both",
                lambda o: o["ratio"] is None or o["topk"] is None,
            )
        ],
    ),
)
class DCTTopK(Compressor):
    """The ``topk`` largest DCT-II coefficients of each chunk of ``chunk`` values; see the module
    docstring."""

    name = "dct-topk"
    summable = False
    fixed_size = True

    def __init__(self, *, chunk: int = 64, topk: int | None = None, ratio: float | None = None) -> None:
        self.count = ChunkCount(chunk, ratio, 4 if ratio is None and topk is None else topk)

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        d = x.numel()
        c, n, k = self.count.layout(d)
        w = _work(x)
        coef = as_chunks(w, c, n) @ dct_basis(c, w.device, w.dtype).T if n else w.new_zeros(0, 0)
        idx = chunk_topk_indices(coef.abs(), k)
        vals = coef.gather(1, idx).reshape(-1).to(x.dtype)
        return Payload((encode_local(idx, c), vals), d, x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        check_parts(self, payload, 2)
        local, vals = payload.data
        d = payload.numel
        c, n, k = self.count.layout(d)
        if n == 0:
            return torch.zeros(0, dtype=payload.dtype, device=vals.device)
        wd = torch.float64 if payload.dtype == torch.float64 else torch.float32
        coef = torch.zeros(n, c, dtype=wd, device=vals.device)
        if k:
            coef.scatter_(1, decode_local(local).view(n, k), vals.view(n, k).to(wd))
        out = coef @ dct_basis(c, coef.device, wd)
        return out.view(-1)[:d].to(payload.dtype)

    def nbytes(self, d: int, dtype: torch.dtype) -> int:
        """The payload's size for a unit of ``d`` elements of ``dtype``."""
        c, n, k = self.count.layout(d)
        return n * k * (local_index_dtype(c).itemsize + dtype.itemsize)

    def options(self) -> dict[str, Any]:
        how = {"ratio": self.count.ratio} if self.count.ratio is not None else {"topk": self.count.k}
        return {"chunk": self.count.chunk, **how}
