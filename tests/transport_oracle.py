"""Test-only compressors and the single-process reference of every compressed transport.

The compressors exercise what a transport must carry: a lossy fixed-size format of two dtypes at
unaligned offsets (:class:`Int8Scale`), a data-dependent selection that may select nothing or send no
tensor at all (:class:`Threshold`), and a shared random stream that the sender and the decoder must
agree on (:class:`SharedRandomK`). They are never registered (the registry stays what the library
ships); the reducers take them as instances.

:class:`Reference` rebuilds every rank's state in one process: per rank its error memory (flat, per
unit), per unit the server memory of the two-stage transport (whole per parameter: the concatenation
of every owner's part), and computes each step's result with plain tensor code and its own splits
(``torch.tensor_split``), in the order the transports promise (rank order, divided once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowband.compress import CompressContext, Compressor, Payload
from lowband.optim.reducer import Unit

Tensor = torch.Tensor


class Int8Scale(Compressor):
    """Lossy, fixed size: int8 codes of ``x / max|x|`` then the float32 scale (at an offset of
    ``numel`` bytes: unaligned for the float when ``numel % 4``)."""

    name = "test-int8scale"

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        s = x.abs().max().float() if x.numel() else torch.tensor(0.0)
        s = torch.where(s > 0, s, torch.ones(()))
        codes = torch.round(x.double() / s.double() * 127).to(torch.int8)
        return Payload((codes, s.reshape(1)), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        codes, s = payload.data
        return codes.to(payload.dtype) * (s.to(payload.dtype) / 127)


class Threshold(Compressor):
    """Data-dependent size: the values with ``|x| >= t`` and their int64 indices; with ``bare``, a
    selection of nothing is sent as a payload of no tensors at all."""

    name = "test-threshold"
    fixed_size = False

    def __init__(self, t: float = 0.5, bare: bool = False) -> None:
        self.t, self.bare = t, bare

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        idx = (x.abs() >= self.t).nonzero().reshape(-1)
        if self.bare and idx.numel() == 0:
            return Payload((), x.numel(), x.dtype)
        return Payload((x[idx].contiguous(), idx), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        out = torch.zeros(payload.numel, dtype=payload.dtype)
        if payload.data:
            vals, idx = payload.data
            out[idx] = vals
        return out


class SharedRandomK(Compressor):
    """Fixed size, values only: ``ceil(ratio * numel)`` coordinates drawn from the shared stream of
    the context (so a decode with another context's name puts them in the wrong places)."""

    name = "test-randk"

    def __init__(self, ratio: float = 0.5) -> None:
        self.ratio = ratio

    def _idx(self, numel: int, ctx: CompressContext) -> Tensor:
        k = math.ceil(self.ratio * numel)
        return torch.randperm(numel, generator=ctx.generator(shared=True))[:k]

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        return Payload((x[self._idx(x.numel(), ctx)].contiguous(),), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        out = torch.zeros(payload.numel, dtype=payload.dtype)
        out[self._idx(payload.numel, ctx)] = payload.data[0]
        return out


# ------------------------------------------------------------------------ inputs


#: the units every test reduces: uneven sizes for n = 2, 3, 4; a parameter smaller than n; no elements
LAYOUT: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...] = (
    ("block", (("block.w", (5, 3)), ("block.b", (3,)), ("block.tiny", (1,)))),
    ("head", (("head.w", (7,)),)),
    ("empty", (("empty.w", (0,)),)),
)


def units() -> list[Unit]:
    return [Unit(key, tuple(n for n, _ in ps), tuple(torch.zeros(s) for _, s in ps)) for key, ps in LAYOUT]


def grads(rank: int, step: int, unit: int, *, exact: bool = False, quiet: int | None = None) -> list[Tensor]:
    """Rank ``rank``'s gradients of unit ``unit`` at ``step``: normal floats, or with ``exact``
    multiples of 2^-8 below 16 in magnitude (any sum of four is exact in float32, whatever its order).
    Rank ``quiet`` gets values below 0.01 (a threshold selects nothing there)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * step + 104_729 * unit + 5)
    out = []
    for _, shape in LAYOUT[unit][1]:
        if exact:
            out.append(torch.randint(-4096, 4096, shape, generator=g).float() / 256)
        else:
            t = torch.randn(shape, generator=g)
            out.append(t * 0.001 if rank == quiet else t)
    return out


def flat(ts: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)


# ------------------------------------------------------------------------ the reference


def _ctx(name: str, step: int, rank: int, seed: int) -> CompressContext:
    return CompressContext(name, step, rank, seed)


@dataclass
class Reference:
    """Every rank's reduction in one process; see the module docstring."""

    transport: str
    compressor: Compressor
    n: int
    memory: bool = True
    server_memory: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        #: worker memory per rank per unit key (flat)
        self.worker: list[dict[str, Tensor]] = [{} for _ in range(self.n)]
        #: server memory per parameter name (whole: every owner's part, concatenated)
        self.server: dict[str, Tensor] = {}

    def _send(self, x: Tensor, name: str, step: int, rank: int) -> Tensor:
        """One rank's payload decoded locally (what error feedback and the others see)."""
        c = _ctx(name, step, rank, self.seed)
        return self.compressor.decompress(self.compressor.compress(x, c), c)

    def step(self, unit: Unit, step: int, per_rank: list[list[Tensor]]) -> Tensor:
        """The flat result every rank must hold after reducing ``per_rank[q]`` (rank q's gradients)."""
        key, n = unit.key, self.n
        ps = []
        for q in range(n):
            g = flat(per_rank[q])
            e = self.worker[q].get(key)
            ps.append(g.clone() if e is None else g + e)
        if self.transport in ("allgather", "allreduce"):
            decs = [self._send(ps[q], key, step, q) for q in range(n)]
            out = _mean(decs)
        else:
            numels = [p.numel() for p in unit.params]
            split = _contiguous if self.transport == "ps" else _per_parameter
            index = split(numels, n)  # index[j]: the flat positions of shard j
            decs = [torch.empty_like(ps[q]) for q in range(n)]
            out = torch.empty_like(ps[0])
            for j in range(n):
                parts = [self._send(ps[q][index[j]], f"{key}#shard{j}", step, q) for q in range(n)]
                for q in range(n):
                    decs[q][index[j]] = parts[q]
                avg = _mean(parts)
                if self.transport == "twostage":
                    avg = self._server(unit, j, avg, step)
                out[index[j]] = avg
        if self.memory:
            for q in range(n):
                self.worker[q][key] = ps[q] - decs[q]
        return out

    def _server(self, unit: Unit, j: int, avg: Tensor, step: int) -> Tensor:
        n = self.n
        mine = [torch.tensor_split(torch.arange(p.numel()), n)[j] for p in unit.params]
        e = None
        if any(name in self.server for name in unit.names):
            e = torch.cat(
                [
                    self.server.get(name, torch.zeros(p.numel()))[m]
                    for name, p, m in zip(unit.names, unit.params, mine, strict=True)
                ]
            )
        c = avg.clone() if e is None or not self.server_memory else avg + e
        sc = _ctx(f"{unit.key}#server{j}", step, j, self.seed)
        d = self.compressor.decompress(self.compressor.compress(c, sc), sc)
        if self.server_memory:
            err, pos = c - d, 0
            for name, p, m in zip(unit.names, unit.params, mine, strict=True):
                whole = self.server.setdefault(name, torch.zeros(p.numel()))
                whole[m] = err[pos : pos + m.numel()]
                pos += m.numel()
        return d


def _mean(decs: list[Tensor]) -> Tensor:
    acc = decs[0].clone()
    for d in decs[1:]:
        acc += d
    return acc / len(decs) if len(decs) > 1 else acc


def _contiguous(numels: list[int], n: int) -> list[Tensor]:
    return list(torch.tensor_split(torch.arange(sum(numels)), n))


def _per_parameter(numels: list[int], n: int) -> list[Tensor]:
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    return [
        torch.cat(
            [o + torch.tensor_split(torch.arange(m), n)[j] for o, m in zip(offsets, numels, strict=True)]
        )
        if numels
        else torch.empty(0, dtype=torch.long)
        for j in range(n)
    ]
