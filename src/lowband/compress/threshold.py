"""The 1-bit and 2-bit threshold quantizers of MXNet's kvstore (the quantizers SlimGC uses), exactly.

MXNet (``src/kvstore/gradient_compression-inl.h``: ``quantize_1bit``, ``dequantize_1bit``,
``quantize_2bit``, ``dequantize_2bit``) keeps a residual ``r`` per gradient element inside the
quantizer and does, per element, in float32:

- **2-bit**, threshold ``t > 0``: ``r += g``; if ``r >= t``: code ``11``, ``r -= t``; else if
  ``r <= -t``: code ``10``, ``r -= -t``; else code ``00`` (``r`` kept). Decodes ``11 -> +t``,
  ``10 -> -t``, anything else ``-> 0``. Four codes per byte, the first in the top bits (masks
  ``0xc0, 0x30, 0x0c, 0x03``).
- **1-bit**, threshold ``t`` (any value; MXNet's tests use -0.5, 0 and 0.5): ``r += g``; if ``r > t``
  (strictly): bit 1, ``r -= 1``; else bit 0, ``r += 1``. Decodes ``1 -> +1``, ``0 -> -1`` whatever
  ``t`` is: the threshold only moves the decision, the levels stay at +-1. Eight bits per byte, the
  first in the top bit (mask ``0x80``).

In both, the residual after the step is exactly ``(r + g) - decode``: that is lowband's error feedback
(:class:`~lowband.compress.memory.ResidualMemory`: ``p = g + e``, send ``Q(p)``, ``e = p - decode``),
so these compressors are the memoryless ``Q`` and a :class:`ResidualMemory` beside them reproduces
MXNet's residual sequence bit for bit (the tests check it). Ties: a value exactly at ``+t`` is sent by
2-bit (``>=``) and not by 1-bit (``>``, so it decodes to -1).

Threshold default. MXNet has one parameter struct for both types (``GradientCompressionParam`` in
``gradient_compression.h``, ``threshold`` defaulting to 0.5); ``GradientCompression::SetParams`` in
``gradient_compression.cc`` passes it to ``SetOneBitCompression`` unchecked and to
``SetTwoBitCompression`` after ``CHECK_GT(threshold, 0)``. So 0.5 is MXNet's default for both, and it is
the value the SlimGC paper uses throughout (its "officially recommended" threshold).

Wire format: the packed codes alone, ``ceil(n / 8)`` bytes (1-bit) or ``ceil(n / 4)`` bytes (2-bit),
no header. MXNet puts no header in its compressed array either: the type and threshold travel once when
compression is set up (``EncodeParams``: ``"type,threshold"``) and the length is the key's shape. MXNet
stores the bytes in a float32 array of ``ceil(n / 32)`` (1-bit) or ``ceil(n / 16)`` (2-bit) elements,
so its array is the same bytes followed by up to 3 zero bytes of padding, which lowband does not send.

Batch scale. MXNet Gluon sums the gradient over the batch (the loss is not averaged; the optimizer
rescales by ``1/B``), so MXNet's thresholds are in units of a batch-summed gradient, where a PyTorch
loss averages. ``scale`` (default 1) quantizes ``scale * p`` and divides the decode by ``scale``: with
``scale=B`` the decisions are MXNet's on a batch-summed gradient and the decode is in averaged units
again. With a power-of-two ``scale`` the memory times ``scale`` is exactly MXNet's residual.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.compress.bits import pack_bits, packed_size, unpack_bits
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options

Tensor = torch.Tensor


def _float32(value: float) -> float:
    """``value`` rounded to float32 (MXNet's thresholds are C floats)."""
    return float(torch.tensor(value, dtype=torch.float32, device="cpu"))  # a host value


_SCALE = Opt(float, gt=0, doc="the batch scale the gradient is multiplied by before the threshold")


class _Threshold(Compressor):
    bits: ClassVar[int] = 1

    def __init__(self, *, threshold: float = 0.5, scale: float = 1.0) -> None:
        self.threshold = _float32(threshold)
        self.scale = float(scale)

    def _scaled(self, x: Tensor) -> Tensor:
        return x * self.scale if self.scale != 1.0 else x

    def _unscale(self, d: Tensor) -> Tensor:
        return d.div_(self.scale) if self.scale != 1.0 else d

    def _payload(self, codes: Tensor, x: Tensor) -> Payload:
        return Payload((pack_bits(codes, self.bits),), x.numel(), x.dtype)

    def _codes(self, payload: Payload) -> Tensor:
        if len(payload.data) != 1:
            raise InvalidArgumentError(
                f"lowband compressor {self.name!r}: a payload of one tensor expected, got {len(payload.data)}"
            )
        return unpack_bits(payload.data[0], payload.numel, self.bits)

    def wire_bytes(self, numel: int) -> int:
        """The payload's size for ``numel`` values (no header)."""
        return packed_size(numel, self.bits)

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "scale": self.scale}


@register_compressor(
    "onebit",
    "MXNet's 1-bit threshold quantizer (+-1 levels, 1 bit per value)",
    Options({"threshold": Opt(float, doc="bit 1 where scale * x > threshold"), "scale": _SCALE}),
)
class OneBit(_Threshold):
    """MXNet's 1-bit quantizer; see the module docstring. ``threshold``: bit 1 where ``scale * p >
    threshold`` (default 0.5, MXNet's and the SlimGC paper's); ``scale``: the batch scale."""

    name = "onebit"
    bits = 1

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        return self._payload(self._scaled(x) > self.threshold, x)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        codes = self._codes(payload)
        out = codes.to(payload.dtype).mul_(2).sub_(1)  # 1 -> +1, 0 -> -1
        return self._unscale(out)


@register_compressor(
    "twobit",
    "MXNet's 2-bit threshold quantizer (+t / 0 / -t, 2 bits per value)",
    Options({"threshold": Opt(float, gt=0, doc="+t where scale * x >= t, -t where <= -t"), "scale": _SCALE}),
)
class TwoBit(_Threshold):
    """MXNet's 2-bit quantizer; see the module docstring. ``threshold`` (> 0, default 0.5): code ``11``
    where ``scale * p >= threshold``, ``10`` where ``<= -threshold``; ``scale``: the batch scale."""

    name = "twobit"
    bits = 2

    #: the codes MXNet writes: ``11`` for +t, ``10`` for -t, ``00`` for 0
    POS: ClassVar[int] = 0b11
    NEG: ClassVar[int] = 0b10

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        y = self._scaled(x)
        t = self.threshold
        codes = (y >= t).to(torch.uint8) * self.POS
        codes |= (y <= -t).to(torch.uint8) * self.NEG  # never both: t > 0
        return self._payload(codes, x)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        c = self._codes(payload).to(torch.int8)
        level = (c >> 1) * ((c & 1) * 2 - 1)  # 11 -> +1, 10 -> -1, 00 and 01 -> 0 (MXNet's dequantize_2bit)
        return self._unscale(level.to(payload.dtype).mul_(self.threshold))
