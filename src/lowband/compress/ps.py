"""Colocated parameter servers ("ps"): every rank is the server of one shard of each unit.

This is the pattern of SlimGC (after MXNet's distributed kvstore with one server per worker): each rank
compresses each shard of its compensated gradient separately (one payload per destination), one
all-to-all moves every shard's payloads to the shard's owner, the owner decodes every rank's payload
for its shard and averages them (in rank order), and a full-precision allgather returns the averaged
shards to every rank.

Shards. Rank ``j`` owns the contiguous flat range ``[j*q + min(j, r), (j+1)*q + min(j+1, r))`` of the
unit's flat gradient, ``q, r = divmod(numel, n)``: the first ``r`` shards hold one element more (the
split of ``torch.tensor_split``). A shard is described as :class:`Piece` s, its parts inside each
parameter (named), so state kept per shard can be keyed by parameter name.

What comes back. MXNet's servers apply the update and return weights at full precision; here the owner
returns the *averaged gradient shard* at full precision instead. The bytes are the same (one shard of
the unit's dtype from each owner to every rank) and every rank then holds the averaged gradient, so
any torch optimizer steps on every rank as after an allreduce (nothing re-implements the server's
optimizer, and optimizer state stays where torch keeps it).

Per-shard compression. The error-feedback memory works on the whole flat tensor, but the compressor is
called once per shard, with a :class:`~lowband.compress.base.CompressContext` named
``f"{unit}#shard{j}"`` (so a compressor's per-tensor statistics, a scale or a top-k, are per shard, and
shared random streams agree between the sender and the owner); the local decode that updates the memory
is the shards' decodes put back in place.

Blocking. The first phase (the all-to-all and the owner's decoding) is waited for inside ``reduce``,
bounded by the runtime's timeout; the allgather is what the returned handle waits for. Issuing the
second collective from a completion callback instead would let ranks issue the collectives of
different units in different orders (gloo pairs ops by order), so the first phase is not deferred.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowband.comm.gather import iallgather, ialltoall
from lowband.comm.handle import Handle
from lowband.compress.allgather import average_decodes, data_device, rank_context, read_payload, wire_bytes
from lowband.compress.base import CompressContext, Payload
from lowband.compress.memory import Segments
from lowband.compress.reducer import TRANSPORT_OPTIONS, TRANSPORTS, CompressedReducer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import Unit

Tensor = torch.Tensor


@dataclass(frozen=True)
class Piece:
    """The flat range ``[start, stop)`` of a unit's tensor that lies inside parameter ``name``."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


#: one rank's shard: its pieces in flat order
Shard = tuple[Piece, ...]


def split_sizes(numel: int, n: int) -> list[int]:
    """``numel`` split into ``n`` near-equal parts, the first ``numel % n`` one larger."""
    q, r = divmod(numel, n)
    return [q + (j < r) for j in range(n)]


def _pieces(segs: Segments, start: int, stop: int) -> Shard:
    out = []
    pos = 0
    for name, m in segs:
        a, b = max(start, pos), min(stop, pos + m)
        if a < b:
            out.append(Piece(name, a, b))
        pos += m
    return tuple(out)


def contiguous_shards(segs: Segments, n: int) -> tuple[Shard, ...]:
    """Rank ``j``'s shard: the ``j``-th of ``n`` near-equal contiguous ranges of the flat tensor."""
    out = []
    pos = 0
    for size in split_sizes(sum(m for _, m in segs), n):
        out.append(_pieces(segs, pos, pos + size))
        pos += size
    return tuple(out)


def parameter_shards(segs: Segments, n: int) -> tuple[Shard, ...]:
    """Rank ``j``'s shard: the ``j``-th of ``n`` near-equal parts of *every parameter* (so a
    parameter's part depends on the parameter and ``n`` alone, never on the unit it is in)."""
    out: list[list[Piece]] = [[] for _ in range(n)]
    pos = 0
    for name, m in segs:
        a = pos
        for j, size in enumerate(split_sizes(m, n)):
            out[j].append(Piece(name, a, a + size))
            a += size
        pos += m
    return tuple(tuple(s) for s in out)


def shard_segments(shard: Shard) -> Segments:
    """The shard's ``(parameter name, numel)`` in order (a memory's segments for the shard)."""
    return tuple((p.name, p.numel) for p in shard)


def gather_shard(flat: Tensor, shard: Shard) -> Tensor:
    """The shard's elements of ``flat`` in order (a view when they are adjacent)."""
    if not shard:
        return flat.new_empty(0)
    if all(a.stop == b.start for a, b in itertools.pairwise(shard)):
        return flat[shard[0].start : shard[-1].stop]
    return torch.cat([flat[p.start : p.stop] for p in shard])


def scatter_shard(out: Tensor, shard: Shard, values: Tensor) -> None:
    """Write the shard's ``values`` (in order) into their places in ``out``."""
    pos = 0
    for p in shard:
        out[p.start : p.stop] = values[pos : pos + p.numel]
        pos += p.numel


@dataclass(frozen=True)
class ShardedPayload(Payload):
    """A payload per shard (``shards[j]`` goes to rank ``j``); ``data`` is all their tensors, in
    order, so :attr:`Payload.nbytes` is the total compressed size."""

    shards: tuple[Payload, ...] = ()
    layout: tuple[Shard, ...] = ()


def shard_context(cctx: CompressContext, j: int, rank: int | None = None) -> CompressContext:
    """The context of shard ``j``'s payload of ``rank`` (default: ``cctx``'s rank)."""
    return rank_context(cctx, cctx.rank if rank is None else rank, f"{cctx.name}#shard{j}")


@TRANSPORTS.registering(
    "ps",
    "colocated parameter servers: shards compressed to their owners, averaged, allgathered",
    TRANSPORT_OPTIONS,
)
class PSCompressedReducer(CompressedReducer):
    """Colocated parameter servers; see the module docstring.

    Bytes per rank ``me`` (lowband's counters): the all-to-all sends ``sum_{j != me} B[me][j]`` and
    receives ``sum_{q != me} B[q][me]``, with ``B[q][j]`` the size of rank ``q``'s payload for shard
    ``j`` (plus ``8 * (1 + 2k)`` header bytes each for a data-dependent compressor); the allgather
    sends and receives ``(n - 1) * ceil(numel / n)`` elements of the unit's dtype (shards padded to the
    largest).
    """

    transport = "ps"

    def layout(self, segs: Segments, n: int) -> tuple[Shard, ...]:
        """Which flat elements each rank owns."""
        return contiguous_shards(segs, n)

    def encode(
        self, p: Tensor, cctx: CompressContext, segs: Segments, group: Group, *, decode: bool
    ) -> tuple[Payload, Tensor | None]:
        layout = self.layout(segs, group.size)
        shards = []
        local = torch.empty_like(p) if decode else None
        for j, shard in enumerate(layout):
            c = shard_context(cctx, j)
            pl = self.compressor.compress(gather_shard(p, shard), c)
            shards.append(pl)
            if local is not None:
                scatter_shard(local, shard, self.compressor.decompress(pl, c))
        data = tuple(t for pl in shards for t in pl.data)
        return ShardedPayload(data, p.numel(), p.dtype, tuple(shards), layout), local

    def sharded(self, payload: Payload) -> ShardedPayload:
        if not isinstance(payload, ShardedPayload):
            raise InvalidArgumentError(
                f"{type(self).__name__}.exchange: expects the per-shard payload of its encode(), got a "
                f"{type(payload).__name__}"
            )
        return payload

    def to_owners(self, sp: ShardedPayload, cctx: CompressContext, unit: Unit, group: Group) -> Tensor:
        """Phase one, waited for: every shard's payloads to its owner; this rank's shard averaged."""
        n, me = group.size, group.rank
        fixed = self.compressor.fixed_size
        dev = data_device(sp, unit)  # a shard's payload of no tensors travels with the others
        bufs = [wire_bytes(pl, fixed, dev) for pl in sp.shards]
        splits = [b.numel() for b in bufs]
        send = torch.cat(bufs)
        recv = [splits[me]] * n if fixed else None
        out, got = ialltoall(send, splits, recv_splits=recv, name=unit.key, group=group).wait()
        payloads, pos = [], 0
        for size in got:
            payloads.append(read_payload(out[pos : pos + size], sp.shards[me], fixed))
            pos += size
        return average_decodes(self, payloads, [shard_context(cctx, me, q) for q in range(n)])

    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        sp = self.sharded(payload)
        mine = self.to_owners(sp, cctx, unit, group)
        sizes = [pl.numel for pl in sp.shards]
        # contiguous shards in rank order: the allgather's result is the flat tensor itself
        return iallgather(mine, sizes=sizes, name=unit.key, group=group)


def check_layout(where: str, layout: Sequence[Shard], numel: int) -> None:
    """Every element of a ``numel``-element tensor in exactly one shard (a consistency check)."""
    covered = sorted((p.start, p.stop) for s in layout for p in s if p.numel)
    pos = 0
    for a, b in covered:
        if a != pos:
            raise InvalidArgumentError(f"{where}: shards leave a gap or overlap at element {pos}")
        pos = b
    if pos != numel:
        raise InvalidArgumentError(f"{where}: shards cover {pos} of {numel} elements")
