"""Payloads as bytes: one ``uint8`` buffer per payload, so any mix of dtypes travels in one collective.

:func:`to_bytes` concatenates a payload's tensors viewed as bytes (no header: every rank knows the
layout of a fixed-size compressor's payload from ``numel``); :func:`framed` adds a header for payloads
whose sizes depend on the data (a count, then per tensor its dtype code and element count, int64 each),
read back by :func:`unframe`. Empty payloads (no tensors, or tensors of zero elements) are valid.

Devices: the bytes (header included) are on the payload's tensors' device, so they concatenate and
travel with the data; a payload of no tensors has no device of its own, the caller names it
(``device=``, default the CPU). :func:`unframe` reads the header on the host (the sizes that split the
buffer must be known there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowband.compress.base import Payload
from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor

DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip
_CODE = {d: i for i, d in enumerate(DTYPES)}


def as_bytes(t: Tensor) -> Tensor:
    """A 1-D contiguous tensor's bytes (a view when possible)."""
    t = t.reshape(-1).contiguous()
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def payload_device(data: Sequence[Tensor], device: torch.device | str | None = None) -> torch.device:
    """The device of a payload's tensors (the first one's); ``device`` (default the CPU) when it has none."""
    if data:
        return data[0].device
    return torch.device("cpu" if device is None else device)


def to_bytes(data: Sequence[Tensor], device: torch.device | str | None = None) -> Tensor:
    """The payload tensors' bytes, concatenated (no header); no tensors: no bytes, on ``device``."""
    parts = [as_bytes(t) for t in data]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=payload_device(data, device))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def from_bytes(buf: Tensor, like: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Split ``buf`` into tensors shaped (1-D) and typed as ``like`` (a payload of the same layout)."""
    out = []
    pos = 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(_view(buf[pos : pos + n], t.dtype, t.numel()))
        pos += n
    if pos != buf.numel():
        raise InvalidArgumentError(f"lowband compress wire: {buf.numel()} bytes for a layout of {pos}")
    return tuple(out)


def _view(b: Tensor, dtype: torch.dtype, numel: int) -> Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=b.device)
    if b.storage_offset() % dtype.itemsize or not b.is_contiguous():
        b = b.clone()  # an element boundary of the buffer is not one of ``dtype``
    return b.view(dtype)


def header_bytes(n_tensors: int) -> int:
    """The size of :func:`framed`'s header for ``n_tensors`` tensors."""
    return 8 * (1 + 2 * n_tensors)


def framed(payload: Payload, device: torch.device | str | None = None) -> Tensor:
    """The payload's bytes behind a header describing its tensors (dtype codes and element counts), on
    the payload's device (``device`` for a payload of no tensors; see the module docstring)."""
    head = [len(payload.data)]
    for t in payload.data:
        if t.dtype not in _CODE:
            raise InvalidArgumentError(f"lowband compress wire: dtype {t.dtype} cannot travel in a payload")
        head += [_CODE[t.dtype], t.numel()]
    dev = payload_device(payload.data, device)
    h = torch.tensor(head, dtype=torch.int64, device=dev).view(torch.uint8)
    return torch.cat([h, to_bytes(payload.data, dev)])


def unframe(buf: Tensor, numel: int, dtype: torch.dtype) -> Payload:
    """Inverse of :func:`framed` (``numel``/``dtype``: the encoded tensor's, known to every rank)."""
    if buf.numel() < 8:
        raise InvalidArgumentError(f"lowband compress wire: a framed payload of {buf.numel()} bytes")
    # the header is read on the host: the layout (how to split the buffer) must be known there
    count = int(buf[:8].clone().view(torch.int64)[0])
    hb = header_bytes(count)
    if count < 0 or buf.numel() < hb:
        raise InvalidArgumentError(
            f"lowband compress wire: a framed payload of {buf.numel()} bytes, header {hb}"
        )
    head = buf[:hb].clone().view(torch.int64).tolist()
    layout = []
    for k in range(count):
        code, n = head[1 + 2 * k], head[2 + 2 * k]
        if not 0 <= code < len(DTYPES) or n < 0:
            raise InvalidArgumentError(f"lowband compress wire: a corrupt header {head}")
        layout.append((DTYPES[code], n, n * DTYPES[code].itemsize))
    total = hb + sum(size for _, _, size in layout)
    if total != buf.numel():
        raise InvalidArgumentError(
            f"lowband compress wire: {buf.numel()} bytes for a framed payload of {total}"
        )
    data = []
    pos = hb
    for dt, n, size in layout:
        data.append(_view(buf[pos : pos + size], dt, n))
        pos += size
    return Payload(tuple(data), numel, dtype)
