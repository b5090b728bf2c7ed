"""The 1-bit and 2-bit threshold quantizers of MXNet's kvstore (the quantizers SlimGC uses): MXNet's
exactly (``threshold_mode="absolute"``), and by default the same codes with thresholds and levels
relative to each tensor's own scale (``threshold_mode="relative"``), so that they fit PyTorch's
mean-reduced gradients.

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
MXNet's residual sequence bit for bit in absolute mode (the tests check it). Ties: a value exactly at
``+t`` is sent by 2-bit (``>=``) and not by 1-bit (``>``, so it decodes to -1).

Threshold default. MXNet has one parameter struct for both types (``GradientCompressionParam`` in
``gradient_compression.h``, ``threshold`` defaulting to 0.5); ``GradientCompression::SetParams`` in
``gradient_compression.cc`` passes it to ``SetOneBitCompression`` unchecked and to
``SetTwoBitCompression`` after ``CHECK_GT(threshold, 0)``. So 0.5 is MXNet's default for both, and it is
the value the SlimGC paper uses throughout (its "officially recommended" threshold).

Units: ``threshold_mode``. MXNet Gluon sums the gradient over the batch (the loss is not averaged; the
optimizer rescales by ``1/B``), so MXNet's thresholds and 1-bit levels are in units of a batch-summed
gradient. A PyTorch loss averages: its gradients are ``B`` times smaller, and MXNet's levels (+-1 for
1-bit; nothing sent below 0.5 for 2-bit) are then hundreds of times the gradient. Error feedback keeps
the sum right, but each step applies an oscillation of the levels' size and training stalls (SlimGC
with 1-bit at ``scale=1`` on the fmnist-cnn workload: training loss 2.30, chance level, against DDP's
0.54; README, "SlimGC").

- ``"relative"`` (default): the unit is the tensor's mean magnitude ``u = mean|p|`` (over the tensor
  compressed: one parameter-server shard, or a unit), computed by the sender from its own tensor and
  sent as one float32 ahead of the codes (4 bytes per tensor; no collective, and the receiver decodes
  with the sender's ``u``, so every rank decodes a payload alike). 1-bit: bit 1 where ``p > threshold *
  u``, decoding to ``+-u`` (at ``threshold=0`` this is EF-signSGD's scaled sign, ``u`` the level that
  minimises the squared error of a sign code); 2-bit: ``t = threshold * u``, code ``11`` where ``p >=
  t``, ``10`` where ``p <= -t``, decoding to ``+-t``. The arithmetic runs in float32 (float64 for a
  float64 gradient), ``threshold * u`` in float32 on both sides. Scale-free: a gradient ``c`` times
  larger is sent as ``c`` times the same codes' decode, so the batch size, the loss's reduction and
  the learning rate do not move the decisions. The default ``threshold=0.5`` keeps MXNet's number in
  these units: the SlimGC bench (1-bit, 2 ranks, two seeds) trains as DDP does with it (and with 0).
- ``"absolute"``: MXNet's, as above, on ``scale * p`` (``scale``, default 1, divides the decode):
  with ``scale=B`` the decisions are MXNet's on a batch-summed gradient and the decode is in averaged
  units again; with a power-of-two ``scale`` the memory times ``scale`` is exactly MXNet's residual.
  ``scale`` belongs to this mode only (refused with ``relative``, which has no units to scale).

Wire format: absolute mode sends the packed codes alone, ``ceil(n / 8)`` bytes (1-bit) or ``ceil(n / 4)``
bytes (2-bit), no header. MXNet puts no header in its compressed array either: the type and threshold
travel once when compression is set up (``EncodeParams``: ``"type,threshold"``) and the length is the
key's shape. MXNet stores the bytes in a float32 array of ``ceil(n / 32)`` (1-bit) or ``ceil(n / 16)``
(2-bit) elements, so its array is the same bytes followed by up to 3 zero bytes of padding, which
lowband does not send. Relative mode sends the float32 unit first, then the same codes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.compress.bits import pack_bits, packed_size, unpack_bits
from lowband.compress.quantize import _work
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options, Rule

Tensor = torch.Tensor


def _float32(value: float) -> float:
    """``value`` rounded to float32 (MXNet's thresholds are C floats)."""
    return float(torch.tensor(value, dtype=torch.float32, device="cpu"))  # a host value


#: ``relative`` (default): thresholds and levels in units of each tensor's ``mean|x|``; ``absolute``: MXNet's
THRESHOLD_MODES = ("relative", "absolute")

_SCALE = Opt(
    float, gt=0, doc="absolute mode: the batch scale the gradient is multiplied by before the threshold"
)
_MODE = Opt(
    str,
    choices=THRESHOLD_MODES,
    doc="relative: threshold and levels in units of each tensor's mean |x| (sent, 4 bytes); absolute: MXNet's",
)
_SCALE_IS_ABSOLUTE = Rule(
    ("scale", "threshold_mode"),
    "scale is the batch scale of MXNet's units: it needs threshold_mode=absolute (relative is scale-free)",
    lambda v: v["threshold_mode"] == "absolute" or v["scale"] == 1.0,
)


class _Threshold(Compressor):
    bits: ClassVar[int] = 1

    def __init__(
        self, *, threshold: float = 0.5, scale: float = 1.0, threshold_mode: str = "relative"
    ) -> None:
        self.threshold = _float32(threshold)
        self.scale = float(scale)
        self.threshold_mode = threshold_mode
        self.relative = threshold_mode == "relative"

    def _unit(self, w: Tensor) -> Tensor:
        """Relative mode's unit ``mean|w|`` as a float32 tensor of one element (what goes on the wire)."""
        return (w.abs().sum() / max(1, w.numel())).to(torch.float32).reshape(1)

    def _level(self, unit: Tensor, dtype: torch.dtype) -> Tensor:
        """``threshold * unit`` in float32, then in ``dtype`` (the sender and the receiver alike)."""
        return (unit * self.threshold).to(dtype)

    def _scaled(self, x: Tensor) -> Tensor:
        return x * self.scale if self.scale != 1.0 else x

    def _unscale(self, d: Tensor) -> Tensor:
        return d.div_(self.scale) if self.scale != 1.0 else d

    def _payload(self, codes: Tensor, x: Tensor, unit: Tensor | None) -> Payload:
        packed = pack_bits(codes, self.bits)
        return Payload((packed,) if unit is None else (unit, packed), x.numel(), x.dtype)

    def _parts(self, payload: Payload) -> tuple[Tensor | None, Tensor]:
        """``(unit, codes)``: relative mode's unit (None in absolute mode) and the unpacked codes."""
        want = 2 if self.relative else 1
        if len(payload.data) != want:
            raise InvalidArgumentError(
                f"lowband compressor {self.name!r} (threshold_mode={self.threshold_mode}): a payload of "
                f"{want} tensor(s) expected, got {len(payload.data)}"
            )
        unit = payload.data[0] if self.relative else None
        return unit, unpack_bits(payload.data[-1], payload.numel, self.bits)

    def wire_bytes(self, numel: int) -> int:
        """The payload's size for ``numel`` values (relative mode: the float32 unit, then the codes)."""
        return (4 if self.relative else 0) + packed_size(numel, self.bits)

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "scale": self.scale, "threshold_mode": self.threshold_mode}


@register_compressor(
    "onebit",
    "MXNet's 1-bit threshold quantizer, 1 bit per value (relative: levels +-mean|x|; absolute: MXNet's +-1)",
    Options(
        {"threshold": Opt(float, doc="bit 1 where x > threshold (times mean|x|, or on scale * x)"),
         "scale": _SCALE, "threshold_mode": _MODE},
        [_SCALE_IS_ABSOLUTE],
    ),
)  # fmt: skip
class OneBit(_Threshold):
    """MXNet's 1-bit quantizer; see the module docstring. ``threshold`` (default 0.5, MXNet's and the
    SlimGC paper's); ``threshold_mode="relative"`` (default): bit 1 where ``p > threshold * mean|p|``,
    decoding to ``+-mean|p|``; ``"absolute"`` (MXNet's): bit 1 where ``scale * p > threshold``, decoding
    to ``+-1 / scale``; ``scale``: the absolute mode's batch scale."""

    name = "onebit"
    bits = 1

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        if not self.relative:
            return self._payload(self._scaled(x) > self.threshold, x, None)
        w = _work(x)
        unit = self._unit(w)
        return self._payload(w > self._level(unit, w.dtype), x, unit)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        unit, codes = self._parts(payload)
        out = codes.to(payload.dtype).mul_(2).sub_(1)  # 1 -> +1, 0 -> -1
        return self._unscale(out) if unit is None else out.mul_(unit.to(payload.dtype))


@register_compressor(
    "twobit",
    "MXNet's 2-bit threshold quantizer, +t / 0 / -t, 2 bits per value (relative: t = threshold * mean|x|)",
    Options(
        {"threshold": Opt(float, gt=0, doc="+t where x >= t, -t where <= -t (t = threshold times mean|x|, or on scale * x)"),
         "scale": _SCALE, "threshold_mode": _MODE},
        [_SCALE_IS_ABSOLUTE],
    ),
)  # fmt: skip
class TwoBit(_Threshold):
    """MXNet's 2-bit quantizer; see the module docstring. ``threshold`` (> 0, default 0.5);
    ``threshold_mode="relative"`` (default): ``t = threshold * mean|p|``, code ``11`` where ``p >= t``,
    ``10`` where ``p <= -t``, decoding to ``+-t``; ``"absolute"`` (MXNet's): ``t = threshold`` on
    ``scale * p``, decoding to ``+-t / scale``; ``scale``: the absolute mode's batch scale."""

    name = "twobit"
    bits = 2

    #: the codes MXNet writes: ``11`` for +t, ``10`` for -t, ``00`` for 0
    POS: ClassVar[int] = 0b11
    NEG: ClassVar[int] = 0b10

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        unit: Tensor | None = None
        if self.relative:
            y = _work(x)
            unit = self._unit(y)
            t: Tensor | float = self._level(unit, y.dtype)
        else:
            y, t = self._scaled(x), self.threshold
        codes = (y >= t).to(torch.uint8) * self.POS
        codes |= (y <= -t).to(torch.uint8) * self.NEG  # never both while t > 0 (t = 0: every value is 0)
        return self._payload(codes, x, unit)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        unit, codes = self._parts(payload)
        c = codes.to(torch.int8)
        level = (c >> 1) * ((c & 1) * 2 - 1)  # 11 -> +1, 10 -> -1, 00 and 01 -> 0 (MXNet's dequantize_2bit)
        if unit is None:
            return self._unscale(level.to(payload.dtype).mul_(self.threshold))
        return level.to(payload.dtype).mul_(self._level(unit, payload.dtype))
