"""The lossless and near-lossless formats: identity and the 16-bit casts (summable on the wire)."""

from __future__ import annotations

from typing import Any

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor

Tensor = torch.Tensor


@register_compressor("identity", "no compression: the gradient itself (the baseline of every transport)")
class Identity(Compressor):
    name = "identity"
    summable = True

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        return Payload((x.contiguous(),), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        return payload.data[0].clone()


class _Cast(Compressor):
    summable = True
    wire: torch.dtype = torch.float16

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        return Payload((x.to(self.wire),), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        return payload.data[0].to(payload.dtype)

    def options(self) -> dict[str, Any]:
        return {}


@register_compressor("fp16", "IEEE half precision on the wire (as torch's fp16_compress_hook)")
class FP16(_Cast):
    name = "fp16"
    wire = torch.float16


@register_compressor("bf16", "bfloat16 on the wire (fp32's exponent range, 8-bit mantissa)")
class BF16(_Cast):
    name = "bf16"
    wire = torch.bfloat16
