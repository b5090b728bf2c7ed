"""Per-chunk sparsification: the flat unit cut into chunks, each chunk keeping its own top ``k``.

This module holds the chunk layout shared by the per-chunk compressors (``chunktopk`` here, ``dct-topk``
in :mod:`lowband.compress.dct`) and ``chunktopk``: top-k per chunk with low-bit values, the recipe of
SparseLoCo (Amir Sarfi, Benjamin Thérien, Joel Lidin, Eugene Belilovsky, *Communication Efficient LLM
Pre-training with SparseLoCo*, arXiv:2508.15706), which sends the error-feedback-compensated
pseudo-gradient of a DiLoCo-style outer loop this way.

Chunks. A unit of ``d`` elements is cut into ``n = ceil(d / c)`` chunks of ``c = min(chunk, d)``
elements, the last one zero-padded; a unit shorter than ``chunk`` is one chunk of its own length (so a
small tensor never costs a whole chunk's payload: lowband's choice). Every chunk keeps the same number
``k`` of entries: ``min(k, c)``, or ``ceil(ratio * c)`` (:func:`~lowband.compress.sparse.count_from_ratio`),
so the payload's size depends on ``d`` alone. Selection: the ``k`` largest magnitudes of the chunk, ties
broken by the lowest index (as ``topk``), in-chunk indices ascending; padding may be selected (it
decodes to positions past ``d``, which are dropped).

In-chunk indices (``0 .. c - 1``) travel as ``uint8`` when ``c <= 256``, as 16 bits when ``c <= 65536``
and as ``int32`` above. The 16-bit indices are unsigned; since the wire carries no ``uint16``, they are
sent in an ``int16`` tensor holding the same 16 bits (two's complement: an index ``i >= 32768`` reads
as ``i - 65536``; the decoder masks with ``0xFFFF``).

``chunktopk`` (options ``chunk=4096``, ``ratio=0.02`` or ``k=``, ``bits=2``): per chunk, the top ``k``
values quantized by a uniform symmetric quantizer whose scale ``s`` is the chunk's largest kept
magnitude: ``2**bits`` levels spread evenly over ``[-s, s]`` (2 bits: ``-s, -s/3, +s/3, +s``), code ``j``
decoding to ``s * (2j - L) / L`` with ``L = 2**bits - 1``, each value rounded to the nearest level (so
the error on a kept value is at most ``s / L``). Wire format, in order: the in-chunk indices
(``n * k``, chunk after chunk), the scales (``n`` float32; float64 input: ``s`` rounded up to the next
float32, so no kept value lies outside ``[-s, s]``) and the codes packed ``8 // bits`` to a byte
(:mod:`lowband.compress.bits`): ``n * k * idx + 4 * n + ceil(n * k * bits / 8)`` bytes. ``bits=32`` is
no quantization: indices, then the kept values in the input's dtype (plain top-k per chunk), no scales.
SparseLoCo's paper gives the recipe (per-chunk top-k, 2-bit values, error feedback); the quantizer's
exact levels, the float32 scale per chunk, the index widths, the short-unit chunk and the byte layout
are lowband's own. The arithmetic runs in float32 (float64 for a float64 input). Not summable: the
allgather transport carries it. Error feedback is the memory's (``residual``), as for every compressor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.compress.bits import pack_bits, packed_size, unpack_bits
from lowband.compress.quantize import _work
from lowband.compress.sparse import count_from_ratio
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options, Rule

Tensor = torch.Tensor
F32 = torch.float32


def chunk_layout(d: int, chunk: int) -> tuple[int, int]:
    """``(c, n)``: the chunk length ``min(chunk, d)`` and the number of chunks ``ceil(d / c)`` (0 for
    an empty unit)."""
    if d == 0:
        return 0, 0
    c = min(chunk, d)
    return c, -(-d // c)


def as_chunks(x: Tensor, c: int, n: int) -> Tensor:
    """``x`` (1-D) as ``n`` rows of ``c`` values, the last row padded with zeros (a new tensor when
    padded, else a view)."""
    pad = n * c - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(n, c)


def local_index_dtype(c: int) -> torch.dtype:
    """The wire dtype of in-chunk indices for chunks of ``c``: uint8 (``c <= 256``), int16 holding 16
    unsigned bits (``c <= 65536``), int32 above."""
    if c <= 256:
        return torch.uint8
    return torch.int16 if c <= 65536 else torch.int32


def encode_local(idx: Tensor, c: int) -> Tensor:
    """In-chunk indices (int64, ``0 .. c - 1``) as a flat tensor of :func:`local_index_dtype`."""
    dt = local_index_dtype(c)
    if dt == torch.int16:
        idx = torch.where(idx >= 32768, idx - 65536, idx)
    return idx.reshape(-1).to(dt)


def decode_local(t: Tensor) -> Tensor:
    """Inverse of :func:`encode_local`: int64 indices."""
    out = t.long()
    return out & 0xFFFF if t.dtype == torch.int16 else out


def chunk_topk_indices(a: Tensor, k: int) -> Tensor:
    """Per row of ``a`` (``n x c``, non-negative, finite) the in-row indices of its ``k`` largest
    entries, ascending, as an ``n x k`` int64 tensor; among entries equal to a row's k-th largest value
    the lowest indices are taken (so the result does not depend on the device's top-k)."""
    n, c = a.shape
    if k <= 0 or n == 0:
        return torch.empty(n, 0, dtype=torch.int64, device=a.device)
    if k >= c:
        return torch.arange(c, device=a.device).expand(n, c).clone()
    kth = torch.topk(a, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = a > kth
    ties = a == kth
    # int32 counts: the default int64 reductions over bool cost 3-5x more on CPU (c < 2**31 always)
    need = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
    chosen = above | (ties & (ties.cumsum(dim=1, dtype=torch.int32) <= need))
    # exactly k per row: a nonzero of known size (no host synchronisation) over the flat rows, so
    # ascending and row after row; less each row's offset
    flat = torch.nonzero_static(chosen.view(-1), size=n * k).view(n, k)
    return flat - torch.arange(0, n * c, c, device=a.device).unsqueeze(1)


def check_parts(c: Compressor, payload: Payload, want: int) -> None:
    if len(payload.data) != want:
        raise InvalidArgumentError(
            f"lowband compressor {c.name!r}: a payload of {want} tensor(s) expected, got {len(payload.data)}"
        )


class ChunkCount:
    """The per-chunk count of a per-chunk compressor: ``k`` entries, or ``ratio`` of each chunk."""

    def __init__(self, chunk: int, ratio: float | None, k: int | None) -> None:
        self.chunk = chunk
        self.ratio, self.k = (None if ratio is None else float(ratio)), k

    def per_chunk(self, c: int) -> int:
        """The entries kept per chunk of ``c`` elements."""
        if self.k is not None:
            return min(self.k, c)
        assert self.ratio is not None
        return count_from_ratio(self.ratio, c)

    def layout(self, d: int) -> tuple[int, int, int]:
        """``(c, n, k)`` for a unit of ``d`` elements: chunk length, chunks, entries kept per chunk."""
        c, n = chunk_layout(d, self.chunk)
        return c, n, self.per_chunk(c)


#: the value widths of ``chunktopk``: 2, 4 or 8-bit codes, or 32 (the values themselves)
BITS = (2, 4, 8, 32)


def _round_up_f32(s: Tensor) -> Tensor:
    """``s`` (float32 or float64) as float32, rounded up where the cast rounded it down."""
    s32 = s.to(F32)
    if s.dtype == F32:
        return s32
    up = torch.nextafter(s32, torch.full_like(s32, math.inf))
    return torch.where(s32.to(s.dtype) < s, up, s32)


@register_compressor(
    "chunktopk",
    "top-k per chunk with low-bit values (SparseLoCo): in-chunk indices, a float32 scale per chunk, codes",
    Options(
        {
            "chunk": Opt(int, min=1, doc="the elements of a chunk (a shorter unit is one chunk)"),
            "ratio": Opt(float, min=0, max=1, doc="the fraction of each chunk sent (default 0.02)"),
            "k": Opt(int, min=0, doc="the elements of each chunk sent"),
            "bits": Opt(int, choices=BITS, doc="the bits per value: 2, 4, 8, or 32 (no quantization)"),
        },
        rules=[
            Rule(("ratio", "k"), "give ratio or k, not both", lambda o: o["ratio"] is None or o["k"] is None)
        ],
    ),
)
class ChunkTopK(Compressor):
    """Top-k per chunk with values quantized to ``bits``; see the module docstring."""

    name = "chunktopk"
    summable = False
    fixed_size = True

    def __init__(
        self, *, chunk: int = 4096, ratio: float | None = None, k: int | None = None, bits: int = 2
    ) -> None:
        self.count = ChunkCount(chunk, 0.02 if ratio is None and k is None else ratio, k)
        self.bits = bits

    @property
    def levels(self) -> int:
        """``L = 2**bits - 1``: the intervals between the quantizer's levels."""
        return (1 << self.bits) - 1

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        d = x.numel()
        c, n, k = self.count.layout(d)
        rows = as_chunks(x, c, n)
        idx = chunk_topk_indices(rows.abs(), k)
        vals = rows.gather(1, idx)
        local = encode_local(idx, c)
        if self.bits == 32:
            return Payload((local, vals.reshape(-1)), d, x.dtype)
        w = _work(vals)
        # the chunk's largest kept magnitude (no kept values: 0, and every code decodes to 0)
        scale = _round_up_f32(w.abs().amax(dim=1)) if k else torch.zeros(n, dtype=F32, device=x.device)
        s = scale.to(w.dtype).unsqueeze(1)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        lv = self.levels
        codes = torch.round((w / safe + 1) * (lv / 2)).clamp_(0, lv).to(torch.uint8)
        return Payload((local, scale, pack_bits(codes, self.bits)), d, x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        d = payload.numel
        c, n, k = self.count.layout(d)
        if self.bits == 32:
            check_parts(self, payload, 2)
            local, vals = payload.data
        else:
            check_parts(self, payload, 3)
            local, scale, packed = payload.data
            wd = torch.float64 if payload.dtype == torch.float64 else F32
            codes = unpack_bits(packed, n * k, self.bits).view(n, k).to(wd)
            lv = self.levels
            vals = codes.mul_(2).sub_(lv).div_(lv).mul_(scale.to(wd).unsqueeze(1))
        out = torch.zeros(n, c, dtype=payload.dtype, device=local.device)
        if k:
            out.scatter_(1, decode_local(local).view(n, k), vals.reshape(n, k).to(payload.dtype))
        return out.view(-1)[:d]

    def nbytes(self, d: int, dtype: torch.dtype) -> int:
        """The payload's size for a unit of ``d`` elements of ``dtype``."""
        c, n, k = self.count.layout(d)
        idx = n * k * local_index_dtype(c).itemsize
        if self.bits == 32:
            return idx + n * k * dtype.itemsize
        return idx + 4 * n + packed_size(n * k, self.bits)

    def options(self) -> dict[str, Any]:
        how = {"ratio": self.count.ratio} if self.count.ratio is not None else {"k": self.count.k}
        return {"chunk": self.count.chunk, **how, "bits": self.bits}
