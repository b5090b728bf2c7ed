"""Test-only compressors and a transport (never registered: the registries hold the library's own), a
tiny model with seeded per-rank losses, and the single-process oracle of compressed training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import lowband
from lowband.comm.handle import Handle
from lowband.compress import CompressContext, CompressedReducer, Compressor, Payload, build_reducer
from lowband.compress.base import check_input
from lowband.compress.wire import framed, unframe
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim import Unit

Tensor = torch.Tensor


class Grid(Compressor):
    """Rounds to multiples of ``1/scale`` (coarse: error feedback matters), int16 codes; its decode is
    exact in float32, so the oracle replays it exactly. Not summable (an allgather carries it)."""

    name = "grid"
    summable = False

    def __init__(self, scale: float = 8.0) -> None:
        self.scale = scale

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        codes = torch.round(x * self.scale).clamp(-32767, 32767).to(torch.int16)
        return Payload((codes,), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        return payload.data[0].to(payload.dtype) / self.scale


class RandomHalf(Compressor):
    """Keeps a random half of the coordinates (shared seed: the same on every rank) scaled by 2, and
    counts its calls in its state (to test that compressor state and seeds resume)."""

    name = "randomhalf"
    summable = False

    def __init__(self) -> None:
        self.calls = torch.zeros((), dtype=torch.int64)

    def _mask(self, n: int, ctx: CompressContext) -> Tensor:
        return torch.rand(n, generator=ctx.generator(shared=True)) < 0.5

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        self.calls += 1
        return Payload((x[self._mask(x.numel(), ctx)] * 2,), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        out = torch.zeros(payload.numel, dtype=payload.dtype)
        out[self._mask(payload.numel, ctx)] = payload.data[0]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls.clone()}

    def load_state_dict(self, state: Any) -> None:
        self.calls = state["calls"].clone()


class GatherTransport(CompressedReducer):
    """Every rank's framed payload to every rank (sizes exchanged first), decoded and averaged in rank
    order on the waiting thread: the reference transport for non-summable formats."""

    transport = "gather-test"

    def exchange(self, payload: Payload, cctx: CompressContext, unit: Unit, group: Group) -> Handle[Tensor]:
        buf = framed(payload)
        sizes = [int(s) for s in lowband.allgather(torch.tensor([buf.numel()]), group=group).tolist()]
        h = lowband.iallgather(buf, sizes=sizes, group=group)

        def finish(flat: Tensor) -> Tensor:
            outs, pos = [], 0
            for r, n in enumerate(sizes):
                p = unframe(flat[pos : pos + n], payload.numel, payload.dtype)
                outs.append(self.decode(p, CompressContext(cctx.name, cctx.step, r, cctx.seed)))
                pos += n
            return torch.stack(outs).sum(0) / len(outs)

        return h.map(finish)


def model() -> nn.Module:
    g = torch.Generator().manual_seed(3)
    m = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
    return m


def loss(m: nn.Module, rank: int, step: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return ((m(torch.randn(5, 6, generator=g)) - torch.randn(5, 3, generator=g)) ** 2).mean()


def flat(m: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def adam(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=0.01)


def oracle(
    n: int,
    steps: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    compressor: Compressor | None,
    *,
    residual: bool,
) -> Tensor:
    """Single-process compressed training of every rank: per layer (``bucket_mb=0``), each rank's
    gradient compensated by its own memory, compressed, decoded; the average of the decodes in rank
    order steps the optimizer. ``compressor=None``: the plain average of the gradients."""
    ref = model()
    opt = make_opt(ref.parameters())
    layers = [
        list(mod.parameters(recurse=False)) for mod in ref.modules() if list(mod.parameters(recurse=False))
    ]
    mem: list[list[Tensor | None]] = [[None] * len(layers) for _ in range(n)]
    for k in range(steps):
        grads = []
        for r in range(n):
            ref.zero_grad()
            loss(ref, r, k).backward()
            grads.append([torch.cat([p.grad.reshape(-1) for p in ps]) for ps in layers])  # type: ignore[union-attr]
        for i, ps in enumerate(layers):
            if compressor is None:
                avg = torch.stack([grads[r][i] for r in range(n)]).sum(0) / n
            else:
                decs = []
                for r in range(n):
                    e = mem[r][i]
                    p = grads[r][i] + e if e is not None else grads[r][i].clone()
                    ctx = CompressContext("unit", k, r, 0)
                    d = compressor.decompress(compressor.compress(p, ctx), ctx)
                    if residual:
                        mem[r][i] = p - d
                    decs.append(d)
                avg = torch.stack(decs).sum(0) / n
            pos = 0
            for p in ps:
                p.grad = avg[pos : pos + p.numel()].view_as(p).clone()
                pos += p.numel()
        opt.step()
    return flat(ref)


#: options tried, in order, for a registered compressor whose defaults do not build (sparsifiers take
#: exactly one of ``ratio`` and ``k``): the registries' tests cover them without knowing each one
TRIAL_OPTIONS = ("", ":ratio=0.25", ":k=4", ":rank=1")


def buildable(compressor: str, transport: str) -> tuple[str | None, str]:
    """``(spec, "")``: the first spec of ``compressor`` (with :data:`TRIAL_OPTIONS`) that ``transport``
    carries, or ``(None, why)``."""
    why = ""
    for opts in TRIAL_OPTIONS:
        try:
            build_reducer(compressor + opts, transport)
        except InvalidArgumentError as exc:
            why = why or str(exc)  # the defaults' reason
            continue
        return compressor + opts, ""
    return None, why
