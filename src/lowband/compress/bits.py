"""Bit packing: ``k``-bit codes (``k`` = 1, 2, 4, 8) packed ``8 // k`` to a ``uint8``, and back.

Layout: most significant bits first. The first code of a byte sits in its top ``k`` bits, the next
one below it, and so on (for 2-bit codes the byte's fields are masked by ``0xc0, 0x30, 0x0c, 0x03``, as
MXNet lays out its 2-bit gradient codes). Code ``i`` lives in byte ``i // (8 // k)``. A length that is
not a multiple of ``8 // k`` leaves the low bits of the last byte zero; a length of 0 packs to no bytes.

Pure and vectorised: one tensor operation per field of a byte (at most 8), never a Python loop over
elements; works on any device.
"""

from __future__ import annotations

import torch

from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor

#: the code widths a byte holds a whole number of
WIDTHS: tuple[int, ...] = (1, 2, 4, 8)


def _check_bits(where: str, bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in WIDTHS:
        raise InvalidArgumentError(f"lowband {where}: bits must be one of {WIDTHS}, got {bits!r}")
    return bits


def packed_size(numel: int, bits: int) -> int:
    """The number of bytes ``numel`` codes of ``bits`` bits pack into: ``ceil(numel * bits / 8)``."""
    _check_bits("packed_size", bits)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise InvalidArgumentError(f"lowband packed_size: numel must be an int >= 0, got {numel!r}")
    return -(-numel * bits // 8)


def width_for(values: int) -> int:
    """The smallest width in :data:`WIDTHS` whose codes hold ``values`` distinct values."""
    for w in WIDTHS:
        if values <= 1 << w:
            return w
    raise InvalidArgumentError(f"lowband width_for: {values} values do not fit in 8 bits")


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack ``codes`` (any integer dtype, any shape, read flat; each value in ``[0, 2**bits)``) into a
    new 1-D ``uint8`` tensor of :func:`packed_size` bytes. Values outside the range would spill into
    their neighbours' bits: callers build codes that fit (unchecked, this is the hot path)."""
    bits = _check_bits("pack_bits", bits)
    if codes.is_floating_point() or codes.is_complex():
        raise InvalidArgumentError(f"lowband pack_bits: codes must be integers, got {codes.dtype}")
    c = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return c.clone() if codes.dtype == torch.uint8 else c.contiguous()
    per = 8 // bits
    n = c.numel()
    nbytes = -(-n // per)
    if nbytes * per != n:
        c = torch.cat([c, c.new_zeros(nbytes * per - n)])
    fields = c.view(nbytes, per)
    out = fields[:, 0] << (8 - bits)
    for j in range(1, per):
        out |= fields[:, j] << (8 - bits * (j + 1))
    return out


def unpack_bits(packed: Tensor, numel: int, bits: int) -> Tensor:
    """The ``numel`` codes of ``bits`` bits held by ``packed`` (1-D ``uint8`` of :func:`packed_size`
    bytes), as a new 1-D ``uint8`` tensor; inverse of :func:`pack_bits`."""
    bits = _check_bits("unpack_bits", bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise InvalidArgumentError(
            f"lowband unpack_bits: expected a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    want = packed_size(numel, bits)
    if packed.numel() != want:
        raise InvalidArgumentError(
            f"lowband unpack_bits: {numel} codes of {bits} bits take {want} bytes, got {packed.numel()}"
        )
    if bits == 8:
        return packed.clone()
    shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8, device=packed.device)
    fields = (packed.view(-1, 1) >> shifts) & ((1 << bits) - 1)
    return fields.view(-1)[:numel]
