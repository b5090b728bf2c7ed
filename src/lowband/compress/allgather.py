"""The allgather-v transport: every rank's payload to every rank, each rank decoding all of them.

Each rank puts its payload on the wire as bytes (:mod:`lowband.compress.wire`) and one allgather-v
brings every rank's bytes to every rank; each rank then decodes every rank's payload (with that rank's
:class:`~lowband.compress.base.CompressContext`) and averages the decodes **in rank order**, so every
rank computes the same sums in the same order and holds bit-identical results. It carries any
compressor: sparse selections, packed bits, anything not summable on the wire.

Sizes. A fixed-size compressor's payload layout follows from ``numel`` alone, so every rank knows every
rank's byte count and the allgather needs no size exchange (``sizes=`` given, no header on the wire).
A data-dependent compressor's payloads are framed (:func:`~lowband.compress.wire.framed`: a header of
``8 * (1 + 2k)`` bytes for ``k`` tensors) and the allgather exchanges their sizes first (the comm
layer's signature exchange, which every rank must reach: a dead rank surfaces as a bounded
:class:`~lowband.errors.CommTimeoutError`). Empty payloads (no tensors, or tensors of zero elements)
travel like any other: a framed empty payload is its 8-byte header, a fixed-size empty one is zero bytes
and issues no data op at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lowband.comm.gather import iallgather
from lowband.comm.handle import Handle
from lowband.compress.base import CompressContext, Payload
from lowband.compress.reducer import TRANSPORT_OPTIONS, TRANSPORTS, CompressedReducer
from lowband.compress.wire import DTYPES, framed, from_bytes, header_bytes, payload_device, to_bytes, unframe
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import Unit

Tensor = torch.Tensor


def rank_context(cctx: CompressContext, rank: int, name: str | None = None) -> CompressContext:
    """``cctx`` as rank ``rank`` (optionally for another unit name) saw it: what decodes its payload."""
    return dataclasses.replace(cctx, rank=rank, name=cctx.name if name is None else name)


def average_decodes(
    reducer: CompressedReducer, payloads: Sequence[Payload], ctxs: Sequence[CompressContext]
) -> Tensor:
    """The mean of the payloads' decodes, summed in the given (rank) order and divided once, as an
    allreduce average does (``(d0 + d1 + ...) / n``)."""
    acc: Tensor | None = None
    for pl, c in zip(payloads, ctxs, strict=True):
        d = reducer.decode(pl, c)
        acc = d if acc is None else acc.add_(d)
    if acc is None:
        raise InvalidArgumentError(f"{type(reducer).__name__}: no payloads to average")
    n = len(payloads)
    return acc.div_(n) if n > 1 else acc


def data_device(payload: Payload, unit: Unit) -> torch.device:
    """Where a payload's bytes live: its tensors' device; for a payload of no tensors, the unit's
    parameters' (the device the gradient stage reduces on), else the CPU."""
    if payload.data:
        return payload.data[0].device
    return payload_device(unit.params[:1])


def wire_bytes(payload: Payload, fixed: bool, device: torch.device | None = None) -> Tensor:
    """The payload's bytes as they travel: bare for a fixed-size compressor, framed otherwise; on the
    payload's device (``device`` when it has no tensors)."""
    return to_bytes(payload.data, device) if fixed else framed(payload, device)


def read_payload(buf: Tensor, like: Payload, fixed: bool) -> Payload:
    """Inverse of :func:`wire_bytes`; ``like`` is a payload of the same ``numel`` (for a fixed-size
    compressor, also its layout)."""
    if fixed:
        return Payload(from_bytes(buf, like.data), like.numel, like.dtype)
    return unframe(buf, like.numel, like.dtype)


def split_frames(buf: Tensor, count: int) -> list[Tensor]:
    """``count`` framed payloads laid end to end in ``buf`` (an allgather-v's result), each as its bytes."""
    out: list[Tensor] = []
    pos = 0
    for _ in range(count):
        if buf.numel() < pos + 8:
            raise InvalidArgumentError(
                f"lowband compress wire: {buf.numel()} bytes end inside the header of payload {len(out)}"
            )
        # headers are read on the host: the frame sizes that split the buffer must be known there
        k = int(buf[pos : pos + 8].clone().view(torch.int64)[0])
        hb = header_bytes(k)
        if k < 0 or buf.numel() < pos + hb:
            raise InvalidArgumentError(
                f"lowband compress wire: {buf.numel()} bytes end inside the header of payload {len(out)}"
            )
        head = buf[pos : pos + hb].clone().view(torch.int64).tolist()
        size = hb
        for i in range(k):
            code, count_i = head[1 + 2 * i], head[2 + 2 * i]
            if not 0 <= code < len(DTYPES) or count_i < 0:
                raise InvalidArgumentError(f"lowband compress wire: a corrupt header in payload {len(out)}")
            size += count_i * DTYPES[code].itemsize
        if buf.numel() < pos + size:
            raise InvalidArgumentError(
                f"lowband compress wire: {buf.numel()} bytes end inside payload {len(out)} ({size} bytes at {pos})"
            )
        out.append(buf[pos : pos + size])
        pos += size
    if pos != buf.numel():
        raise InvalidArgumentError(
            f"lowband compress wire: {buf.numel()} bytes for {count} payloads of {pos}"
        )
    return out


@TRANSPORTS.registering(
    "allgather", "allgather-v of every rank's payload; each rank decodes all and averages", TRANSPORT_OPTIONS
)
class AllgatherCompressedReducer(CompressedReducer):
    """Every rank's payload to every rank by one allgather-v; the average of every rank's decode, in
    rank order (bit-identical on every rank). See the module docstring.

    Bytes (sent and received per rank, as lowband's counters model an allgather: each rank's block,
    padded to the largest, to and from each of the ``n - 1`` others): fixed-size compressors
    ``(n - 1) * B`` with ``B`` the payload's :attr:`~lowband.compress.base.Payload.nbytes`;
    data-dependent ones ``(n - 1) * max_r (B_r + 8 * (1 + 2 * k_r))`` (``k_r`` tensors in rank ``r``'s
    payload), plus the size exchange of the argument check (a few store round trips, not counted).
    """

    transport = "allgather"

    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        n = group.size
        fixed = self.compressor.fixed_size
        buf = wire_bytes(payload, fixed, data_device(payload, unit))
        ctxs = [rank_context(cctx, q) for q in range(n)]
        if fixed:
            m = buf.numel()
            h = iallgather(buf, sizes=[m] * n, name=unit.key, group=group)

            def parts(allb: Tensor) -> list[Tensor]:
                return [allb[q * m : (q + 1) * m] for q in range(n)]
        else:
            h = iallgather(buf, name=unit.key, group=group)

            def parts(allb: Tensor) -> list[Tensor]:
                return split_frames(allb, n)

        def finish(allb: Tensor) -> Tensor:
            payloads = [read_payload(b, payload, fixed) for b in parts(allb)]
            return average_decodes(self, payloads, ctxs)

        return h.map(finish)
