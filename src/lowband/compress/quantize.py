"""Quantizers: sign, scaled sign, QSGD, TernGrad and 8-bit min-max, with real bit packing.

Every format here is a fixed-size payload (sizes depend on ``numel`` and the options alone) and none is
summable on the wire: transports gather payloads and decode each. Scales and norms travel as float32
whatever the gradient's dtype; the arithmetic runs in float32 (float64 for a float64 gradient) and the
decode is returned in the gradient's dtype. Codes are packed most significant bits first
(:mod:`lowband.compress.bits`).

- ``sign`` (signSGD, "signSGD: Compressed Optimisation for Non-Convex Problems"): one bit per value,
  decoding to +-1. ``sign(0) = +1``: bit 1 means ``x >= 0`` (so -0.0 and +0.0 both decode to +1), the
  convention of the QSGD paper's ``sgn`` and of the common signSGD implementations.
- ``scaledsign`` (EF-signSGD, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes"):
  ``||x||_1 / d`` times the sign, the scale as one float32 ahead of the bits; biased, meant for error
  feedback.
- ``qsgd`` ("QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding"): per bucket of
  ``bucket`` values the L2 norm ``n``; each value to ``sign(x) * n * l / s`` with ``l`` in ``0..s``
  chosen by unbiased stochastic rounding of ``s * |x| / n``. Wire: the float32 norms, then each value's
  ``sign * l + s`` (``2s + 1`` values) packed in the fewest bits of 2, 4, 8 that hold them: ``s = 1`` in
  2 bits, ``s <= 7`` in 4 bits, ``s <= 127`` in 8 bits.
- ``terngrad`` ("TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning"):
  per bucket (``bucket=0``: the whole tensor, the paper's per-layer scaler) ``m = max |x|``; each value
  to ``m * sign(x) * b`` with ``b ~ Bernoulli(|x| / m)``: unbiased. 2 bits per value (``t + 1`` for
  ``t`` in -1, 0, 1), float32 scalers. ``clip > 0`` first clips to ``clip`` standard deviations of the
  bucket (the paper's gradient clipping, 2.5 there): unbiased for the clipped gradient only.
- ``minmax8``: per bucket the float32 minimum ``lo`` and step ``(max - lo) / 255``; each value to the
  nearest of the 256 levels (``stochastic=True``: rounded up with probability equal to the fraction,
  which is unbiased). One byte per value.

Stochastic rounding draws from ``CompressContext.generator(shared=False)``: the same context gives the
same payload, different ranks round independently.
"""

from __future__ import annotations

from typing import Any

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.compress.bits import pack_bits, packed_size, unpack_bits, width_for
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options

Tensor = torch.Tensor
F32 = torch.float32


def _work(x: Tensor) -> Tensor:
    """``x`` in the dtype the maths runs in: float64 stays, anything else becomes float32."""
    return x if x.dtype == torch.float64 else x.to(F32)


def _buckets(x: Tensor, bucket: int, fill: str) -> Tensor:
    """``x`` as rows of ``bucket`` values (``bucket=0``: one row); the last row padded with zeros
    (``fill="zero"``) or with copies of the last value (``fill="last"``, which keeps min and max)."""
    n = x.numel()
    size = n if bucket == 0 else bucket
    rows = -(-n // size) if size else 0
    pad = rows * size - n
    if pad:
        tail = x.new_zeros(pad) if fill == "zero" else x[-1:].expand(pad)
        x = torch.cat([x, tail])
    return x.reshape(rows, size)


def _rows(numel: int, bucket: int) -> int:
    return (1 if numel else 0) if bucket == 0 else -(-numel // bucket)


def _rowed(flat: Tensor, numel: int, bucket: int, dtype: torch.dtype) -> Tensor:
    """The inverse layout of :func:`_buckets`: ``flat`` (``numel`` codes) converted to ``dtype`` in rows
    of ``bucket``, the padding zero."""
    size = numel if bucket == 0 else bucket
    out = torch.empty(_rows(numel, bucket), size, dtype=dtype, device=flat.device)
    view = out.view(-1)
    view[:numel].copy_(flat)
    view[numel:].zero_()
    return out


def _flat(rows: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """Rows back to a flat tensor of ``numel`` values of ``dtype`` (a new tensor)."""
    flat = rows.reshape(-1)[:numel]
    return flat.to(dtype) if flat.dtype != dtype else flat.clone()


def _l2_norms(rows: Tensor) -> Tensor:
    """The L2 norm of each row, without overflow or underflow of the squares: rows whose plain norm is
    not finite or tiny are measured again scaled by their largest magnitude."""
    norms: Tensor = torch.linalg.vector_norm(rows, dim=1)
    if not rows.numel():
        return norms
    ok = (torch.isfinite(norms) & (norms > 1e-15)).all()
    if rows.device.type == "cpu" and bool(ok):  # a host read, free on the CPU: skip the second pass
        return norms
    big = rows.abs().amax(dim=1, keepdim=True)
    safe = torch.where(big > 0, big, torch.ones_like(big))
    scaled = torch.linalg.vector_norm(rows / safe, dim=1) * big.view(-1)
    # on a device both are computed and chosen there (no synchronisation); the same result as the CPU's
    return torch.where(ok, norms, scaled)


def _check_parts(c: Compressor, payload: Payload, count: int) -> None:
    if len(payload.data) != count:
        raise InvalidArgumentError(
            f"lowband compressor {c.name!r}: a payload of {count} tensors expected, got {len(payload.data)}"
        )


def _uniform(like: Tensor, ctx: CompressContext) -> Tensor:
    """Uniform [0, 1) draws shaped as ``like``, from this rank's stream for the context."""
    g = ctx.generator(shared=False, device=like.device)
    return torch.rand(like.shape, generator=g, dtype=like.dtype, device=like.device)


@register_compressor("sign", "signSGD: the sign, 1 bit per value (decodes to +-1; sign(0) = +1)")
class Sign(Compressor):
    """The sign of each value, packed 8 to a byte; decodes to +1 (``x >= 0``) or -1."""

    name = "sign"

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        return Payload((pack_bits(x >= 0, 1),), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        _check_parts(self, payload, 1)
        return unpack_bits(payload.data[0], payload.numel, 1).to(payload.dtype).mul_(2).sub_(1)

    def wire_bytes(self, numel: int) -> int:
        return packed_size(numel, 1)


@register_compressor(
    "scaledsign", "EF-signSGD: ||x||_1/d times the sign (one float32 scale + 1 bit per value)"
)
class ScaledSign(Compressor):
    """``||x||_1 / d * sign(x)``: a float32 scale, then the signs packed 8 to a byte."""

    name = "scaledsign"

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        w = _work(x)
        scale = (w.abs().sum() / x.numel()).to(F32).reshape(1) if x.numel() else x.new_zeros(1, dtype=F32)
        return Payload((scale, pack_bits(x >= 0, 1)), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        _check_parts(self, payload, 2)
        scale, packed = payload.data
        signs = unpack_bits(packed, payload.numel, 1).to(payload.dtype).mul_(2).sub_(1)
        return signs.mul_(scale.to(payload.dtype))

    def wire_bytes(self, numel: int) -> int:
        return 4 + packed_size(numel, 1)


def _bucket(what: str) -> Opt:
    return Opt(int, min=0, unit="values", doc=f"values per {what} (0: one per tensor)")


@register_compressor(
    "qsgd",
    "QSGD: s levels per bucket L2 norm, stochastic rounding (options levels, bucket)",
    Options({"levels": Opt(int, min=1, max=127, doc="s, the levels per sign"), "bucket": _bucket("L2 norm")}),
)
class QSGD(Compressor):
    """QSGD with ``levels`` (``s``, 1..127) levels and an L2 norm per ``bucket`` values (``bucket=0``:
    one norm for the tensor); see the module docstring for the wire format."""

    name = "qsgd"

    def __init__(self, *, levels: int = 7, bucket: int = 512) -> None:
        self.levels, self.bucket = levels, bucket
        self.bits = width_for(2 * self.levels + 1)

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        n, s = x.numel(), self.levels
        rows = _buckets(_work(x), self.bucket, "zero")
        norms = _l2_norms(rows).to(F32)
        norm = norms.to(rows.dtype).unsqueeze(1)
        a = (rows.abs() / torch.where(norm > 0, norm, torch.ones_like(norm)) * s).clamp_(max=s)
        level = a.floor()
        level += _uniform(rows, ctx) < (a - level)  # up with probability a - floor(a): E[level] = a
        codes = torch.where(rows < 0, -level, level).add_(s).to(torch.uint8)  # sign * l + s in 0..2s
        return Payload((norms, pack_bits(codes.view(-1)[:n], self.bits)), n, x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        _check_parts(self, payload, 2)
        norms, packed = payload.data
        n, s = payload.numel, self.levels
        work = torch.float64 if payload.dtype == torch.float64 else F32
        rows = _rowed(unpack_bits(packed, n, self.bits), n, self.bucket, work)
        rows.sub_(s).mul_(norms.to(work).unsqueeze(1)).div_(s)
        return _flat(rows, n, payload.dtype)

    def wire_bytes(self, numel: int) -> int:
        return 4 * _rows(numel, self.bucket) + packed_size(numel, self.bits)

    def options(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket": self.bucket}


@register_compressor(
    "terngrad",
    "TernGrad: max|x| per bucket times a stochastic ternary, 2 bits per value",
    Options(
        {
            "bucket": _bucket("max-abs scaler"),
            "clip": Opt(float, min=0, doc="clip to clip standard deviations first (0: off; the paper's 2.5)"),
        }
    ),
)
class TernGrad(Compressor):
    """TernGrad with a max-abs scaler per ``bucket`` values (0: per tensor, the paper's per-layer) and
    optional clipping to ``clip`` standard deviations (0: off; the paper's value is 2.5)."""

    name = "terngrad"

    def __init__(self, *, bucket: int = 0, clip: float = 0.0) -> None:
        self.bucket = bucket
        self.clip = float(clip)

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        n = x.numel()
        rows = _buckets(_work(x), self.bucket, "zero")
        if self.clip > 0 and n:
            counts = torch.full(
                (rows.shape[0], 1), float(rows.shape[1]), dtype=rows.dtype, device=rows.device
            )
            if self.bucket and n % self.bucket:
                counts[-1] = n % self.bucket  # the padded last bucket
            big = rows.abs().amax(dim=1, keepdim=True)  # standardised by it: no overflow or underflow
            z = rows / torch.where(big > 0, big, torch.ones_like(big))
            mean = z.sum(dim=1, keepdim=True) / counts
            var = (z.square().sum(dim=1, keepdim=True) / counts - mean.square()).clamp_(min=0)
            bound = self.clip * var.sqrt() * big
            rows = torch.maximum(torch.minimum(rows, bound), -bound)  # padding stays 0
        scales = rows.abs().amax(dim=1).to(F32) if rows.numel() else rows.new_zeros(rows.shape[0], dtype=F32)
        m = scales.to(rows.dtype).unsqueeze(1)
        keep = _uniform(rows, ctx) < rows.abs() / torch.where(
            m > 0, m, torch.ones_like(m)
        )  # Bernoulli(|x|/m)
        codes = (rows.sign() * keep).add_(1).to(torch.uint8)  # t + 1 for t in -1, 0, 1
        return Payload((scales, pack_bits(codes.view(-1)[:n], 2)), n, x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        _check_parts(self, payload, 2)
        scales, packed = payload.data
        n = payload.numel
        work = torch.float64 if payload.dtype == torch.float64 else F32
        rows = _rowed(unpack_bits(packed, n, 2), n, self.bucket, work)
        rows.sub_(1).mul_(scales.to(work).unsqueeze(1))
        return _flat(rows, n, payload.dtype)

    def wire_bytes(self, numel: int) -> int:
        return 4 * _rows(numel, self.bucket) + packed_size(numel, 2)

    def options(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "clip": self.clip}


@register_compressor(
    "minmax8",
    "8-bit min-max uniform quantization per bucket (float32 min and step)",
    Options(
        {"bucket": _bucket("minimum and step"), "stochastic": Opt(bool, doc="unbiased stochastic rounding")}
    ),
)
class MinMax8(Compressor):
    """256 uniform levels between each bucket's minimum and maximum; nearest level, or unbiased
    stochastic rounding with ``stochastic=True``."""

    name = "minmax8"

    def __init__(self, *, bucket: int = 512, stochastic: bool = False) -> None:
        self.bucket = bucket
        self.stochastic = stochastic

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        n = x.numel()
        w = _work(x)
        if not n:
            empty = x.new_zeros(0, dtype=F32)
            return Payload((empty, empty.clone(), x.new_zeros(0, dtype=torch.uint8)), 0, x.dtype)
        rows = _buckets(w, self.bucket, "last")
        lo32 = rows.amin(dim=1).to(F32)
        lo = lo32.to(w.dtype).unsqueeze(1)
        step32 = ((rows.amax(dim=1, keepdim=True) - lo) / 255).to(F32).view(-1)
        step = step32.to(w.dtype).unsqueeze(1)
        v = ((rows - lo) / torch.where(step > 0, step, torch.ones_like(step))).clamp_(0, 255)
        if self.stochastic:
            code = v.floor()
            code += _uniform(v, ctx) < (v - code)  # up with probability v - floor(v): E[code] = v
        else:
            code = v.round()
        codes = code.clamp_(0, 255).to(torch.uint8).view(-1)[:n].clone()
        return Payload((lo32, step32, codes), n, x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        _check_parts(self, payload, 3)
        lo32, step32, codes = payload.data
        n = payload.numel
        work = torch.float64 if payload.dtype == torch.float64 else F32
        rows = _rowed(codes, n, self.bucket, work)
        rows.mul_(step32.to(work).unsqueeze(1)).add_(lo32.to(work).unsqueeze(1))
        return _flat(rows, n, payload.dtype)

    def wire_bytes(self, numel: int) -> int:
        return 8 * _rows(numel, self.bucket) + numel

    def options(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "stochastic": self.stochastic}
