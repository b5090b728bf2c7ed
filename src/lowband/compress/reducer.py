"""Compressed reducers: a compressor, an error-feedback memory and a transport, as one
:class:`lowband.optim.Reducer` of the gradient stage (so they also run as DDP comm hooks, through
:func:`lowband.ddp_comm_hook`).

:class:`CompressedReducer` does what every transport shares: the unit's gradients flattened into one
tensor, compensated by the memory (keyed by parameter name), compressed with a
:class:`~lowband.compress.base.CompressContext` naming the unit and the step, the memory updated with
the local decode, and the averaged result written back into the gradients. A transport implements
:meth:`CompressedReducer.exchange`: move this rank's payload, combine every rank's, and return a handle
whose result is the average over ranks of their decodes (a flat tensor).

Timing. :attr:`CompressedReducer.timings` (the reducer protocol's :class:`~lowband.optim.reducer.Timings`)
accumulates the seconds spent compressing (memory included) on the calling thread and decoding (on the waiting thread, or on torch's callback thread for decodes a
transport chains with ``then``; the share on the calling thread is kept apart), so a bench can split
compression from communication (the complaint about GRACE that it cannot).
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from lowband.comm.handle import Handle
from lowband.comm.reduce import iallreduce
from lowband.compress.base import (
    CompressContext,
    Compressor,
    Payload,
    make_compressor,
    parse_spec,
)
from lowband.compress.memory import MEMORIES, Memory, NoMemory, Segments
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.finite import poison_
from lowband.optim.reducer import ReduceContext, Reducer, Timings, Unit
from lowband.optim.scaling import check_scaled_, exact_scale
from lowband.options import Opt, Options
from lowband.registry import Registry

Tensor = torch.Tensor


def flatten(grads: list[Tensor]) -> Tensor:
    """The gradients as one flat tensor (a view when there is one contiguous gradient)."""
    if len(grads) == 1:
        return grads[0].reshape(-1)
    return torch.cat([g.reshape(-1) for g in grads])


def unflatten_into(flat: Tensor, grads: list[Tensor]) -> list[Tensor]:
    """Write ``flat`` back into ``grads`` (in place) and return them."""
    pos = 0
    with torch.no_grad():
        for g in grads:
            n = g.numel()
            g.copy_(flat[pos : pos + n].view_as(g))
            pos += n
    return grads


def segments(unit: Unit, grads: list[Tensor]) -> Segments:
    return tuple((name, g.numel()) for name, g in zip(unit.names, grads))


class CompressedReducer(Reducer):
    """Compressor + memory + transport; see the module docstring.

    ``compressor`` is a :class:`Compressor` or a spec (``"onebit:threshold=0.5"``); ``memory`` defaults
    to error feedback (:class:`ResidualMemory`), ``"none"`` or a :class:`Memory` may be given; ``seed``
    seeds random compressors (with the step and the unit's name).
    """

    #: the transport's name in specs and reports
    transport: str = "transport"
    #: compression and decoding seconds (module docstring)
    timings: Timings

    def __init__(
        self, compressor: Compressor | str, memory: Memory | str | None = "residual", *, seed: int = 0
    ) -> None:
        where = type(self).__name__
        self.compressor = make_compressor(compressor)
        self.memory = make_memory(memory, where)
        self.seed = seed
        self.timings = Timings()
        self._timing_lock = threading.Lock()
        self._caller = threading.get_ident()  # the thread calling reduce (the training thread)
        self.check_compressor(self.compressor)

    def check_compressor(self, compressor: Compressor) -> None:
        """Raise if this transport cannot carry ``compressor``'s payloads (all can, by default)."""

    # -- the shared part --------------------------------------------------------------------------
    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        self._caller = threading.get_ident()
        t0 = time.perf_counter()
        with torch.no_grad():
            flat = flatten(grads)
            segs = segments(unit, grads)
            cctx = CompressContext(unit.key, ctx.step, ctx.group.rank, self.seed)
            p = self.memory.compensate(segs, flat)
            decode = not isinstance(self.memory, NoMemory)
            payload, local = self.encode(p, cctx, segs, ctx.group, decode=decode)
            if local is not None:
                self.memory.update(segs, p, local)
            if ctx.nonfinite is not None:  # this rank's unit held inf/NaN (zeroed): NaN on the wire
                poison_(payload.data[0], ctx.nonfinite)
        self.timings.compress_s += time.perf_counter() - t0
        self.timings.units += 1
        h = self.exchange(payload, cctx, unit, ctx.group)
        return h.map(lambda avg: unflatten_into(avg, grads))

    def encode(
        self, p: Tensor, cctx: CompressContext, segs: Segments, group: Group, *, decode: bool
    ) -> tuple[Payload, Tensor | None]:
        """Compress the compensated flat tensor ``p`` (the unit's parameters ``segs``, to be reduced
        over ``group``): the payload :meth:`exchange` moves, and (when ``decode``) its local decode,
        what the memory is updated with. Default: one payload of the whole tensor; a transport that
        compresses pieces separately (one payload per shard) overrides it."""
        payload = self.compressor.compress(p, cctx)
        return payload, self.compressor.decompress(payload, cctx) if decode else None

    def decode(self, payload: Payload, cctx: CompressContext) -> Tensor:
        """Decompress, timed (for transports)."""
        t0 = time.perf_counter()
        out = self.compressor.decompress(payload, cctx)
        dt = time.perf_counter() - t0
        with self._timing_lock:
            self.timings.decompress_s += dt
            if threading.get_ident() == self._caller:
                self.timings.decompress_inline_s += dt
        return out

    @abc.abstractmethod
    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        """Move ``payload``; the handle's result is the average over ranks of their decodes (flat)."""

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, Mapping) or "memory" not in state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: expects a dict with 'memory', got "
                f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}"
            )
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state.get("compressor", {}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compressor!r}, {self.memory!r})"


def make_memory(memory: Memory | str | None, where: str) -> Memory:
    """A :class:`Memory` as is, ``None`` (no memory), or a spec from :data:`MEMORIES` (``"residual"``,
    ``"none"``, ``"dgc:momentum=0.9"``)."""
    if isinstance(memory, Memory):
        return memory
    if memory is None:
        return NoMemory()
    if not isinstance(memory, str):
        raise InvalidArgumentError(
            f"{where}: memory must be a spec such as 'residual' or a Memory, got {memory!r}"
        )
    name, opts = parse_spec(memory, "memory")
    factory = MEMORIES.get(name, f"{where}: memory")
    return factory(**MEMORIES.check_options(name, opts, f"{where}: memory {name!r}"))


#: every transport: ``cls(compressor, memory, *, seed=..., **options) -> CompressedReducer``
TRANSPORTS: Registry[type[CompressedReducer]] = Registry("transport")

#: the options every transport takes (a transport registers ``TRANSPORT_OPTIONS | its own``)
TRANSPORT_OPTIONS = Options({"seed": Opt(int, doc="seeds random compressors (with the step and the unit)")})


def make_reducer(
    transport: str,
    compressor: Compressor | str,
    memory: Memory | str | None = "residual",
    *,
    seed: int = 0,
    **options: Any,
) -> CompressedReducer:
    """The compressed reducer ``transport`` ("allreduce", "allgather", "ps", "twostage", ...) carrying
    ``compressor`` with ``memory``; ``options`` go to the transport's constructor."""
    cls = TRANSPORTS.get(transport, "make_reducer")
    got = TRANSPORTS.check_options(
        transport, {**options, "seed": seed}, f"make_reducer: transport {transport!r}"
    )
    return cls(compressor, memory, **got)


@TRANSPORTS.registering(
    "allreduce", "payloads summed on the wire (summable formats: casts)", TRANSPORT_OPTIONS
)
class AllreduceCompressedReducer(CompressedReducer):
    """Payloads summed on the wire by one allreduce per payload tensor (summable formats: casts), then
    decoded once and divided by the group size."""

    transport = "allreduce"
    # a summable payload carries a rank's NaN to every rank's sum; the memory never sees it
    carries_nonfinite = "poison"

    def check_compressor(self, compressor: Compressor) -> None:
        if not compressor.summable:
            raise InvalidArgumentError(
                f"{type(self).__name__}: compressor {compressor.name!r} is not summable on the wire; "
                "use the allgather, ps or two-stage transport"
            )

    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        n = group.size
        if len(payload.data) != 1:
            raise InvalidArgumentError(
                f"{type(self).__name__}: a summable payload must be one tensor, got {len(payload.data)}"
            )
        h = iallreduce(payload.data[0], "sum", inplace=True, name=unit.key, group=group)

        def finish(summed: Tensor) -> Tensor:
            out = self.decode(Payload((summed,), payload.numel, payload.dtype), cctx)
            if self.average_tells(n) and out.numel():
                # the division by n (exact) checks the average in the same pass: its first element made
                # NaN when any is not finite, so the non-finite guard reads one element, not all
                poison_(out, check_scaled_([out], 1.0 / n))
                return out
            return out.div_(n) if n > 1 else out

        return h.map(finish)

    def average_tells(self, size: int) -> bool:
        return exact_scale(size) and size > 1
