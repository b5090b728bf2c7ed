"""The point-to-point engine of the neighbor ops: resolve a plan into a route (running the topology
check), then post the messages and apply the weights.

All messages of one call are one batch of :mod:`lowband.comm.batch` (traced and counted as the op,
errors translated), posted at once on the group's process group by the calling thread: first every
receive, then every send (to destinations ordered by their distance ``(dst - me) mod n`` from this rank,
the paper's order against congestion). This cannot deadlock: posting a gloo receive or send never blocks
(both are asynchronous works), so every rank posts all its receives and sends without waiting for any
peer, and each send completes once its receiver has posted the matching receive, which that receiver
does unconditionally. Every message of one call (of one fusion
buffer) carries one tag, from a counter advanced identically on every rank by each neighbor op on the
group (:func:`lowband.decentral.state.next_tag`), so calls in flight at the same time never match each
other's messages. ``wait()`` waits every work (each bounded by the runtime's timeout) and then applies the
weights.

The sending side scales a copy (the caller's buffer is sent as is when its scale is 1). Results are
computed in the tensor's dtype; float16/bfloat16 accumulate in float32 and round once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lowband.comm.batch import P2POp, recv_op, send_op
from lowband.decentral.peers import Peers
from lowband.decentral.state import next_tag
from lowband.decentral.topocheck import Links, exchange, make_row
from lowband.decentral.topocheck import resolve as resolve_links
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import Context

Tensor = torch.Tensor


@dataclass(frozen=True)
class Route:
    """One rank's resolved plan: its self weight, ``(destination, scale)`` in sending order and
    ``(source, weight)`` in ascending source order."""

    self_weight: float
    send: list[tuple[int, float]]
    recv: list[tuple[int, float]]


def where(op: str, ctx: Context) -> str:
    """The start of an error message: ``lowband.<op> on rank <world rank>``."""
    return f"lowband.{op} on rank {ctx.rank}"


def check_flag(op: str, ctx: Context, what: str, value: object) -> bool | None:
    """A bool-or-None argument (``check_topology``)."""
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"{where(op, ctx)}: {what} must be a bool or None, got {value!r}")
    return value


def check_float(op: str, ctx: Context, t: Tensor, what: str = "tensor") -> None:
    """Weighted averaging is defined for floating-point tensors only."""
    if not t.dtype.is_floating_point:
        raise InvalidArgumentError(
            f"{where(op, ctx)}: {what} has dtype {t.dtype}; weighted averaging needs a floating-point "
            "tensor (cast it, e.g. tensor.double())"
        )


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt in (torch.float16, torch.bfloat16) else dt


def route(
    op: str,
    ctx: Context,
    g: Group,
    peers: Peers,
    dtype: torch.dtype,
    shape: Sequence[int],
    check: bool,
    *,
    vary_dim0: bool = False,
) -> tuple[Route, Links | None]:
    """Resolve ``peers`` into a :class:`Route`, running the topology check when ``check`` is on or a side
    must be discovered. Returns the resolved links too (None when there was no exchange)."""
    links: Links | None = None
    send, recv = peers.send, peers.recv
    if g.size > 1 and (check or peers.needs_exchange):
        row = make_row(op, dtype, shape, peers, g.size)
        rows = exchange(op, g, row, ctx.config.timeout, vary_dim0=vary_dim0)
        label = f"{where(op, ctx)} (group {g.name!r})"
        links = resolve_links(label, g.ranks, g.rank, rows)
        send = {i: 1.0 if peers.send is None else peers.send[i] for i in links.send}
        recv = {j: 1.0 if peers.recv is None else peers.recv[j] for j in links.recv}
    n, me = g.size, g.rank
    return (
        Route(
            self_weight=peers.self_weight,
            send=sorted((send or {}).items(), key=lambda kv: (kv[0] - me) % n),
            recv=sorted((recv or {}).items()),
        ),
        links,
    )


@dataclass(frozen=True)
class Reduction:
    """A weighted neighbor reduction ready to post: its messages (receives, then sends, in sending order),
    ``start`` (the self term, computed while the messages are on the wire) and ``finish``."""

    ops: list[P2POp]
    start: Callable[[], None]
    finish: Callable[[], list[Tensor]]


#: weights within this of ``1 / (n + 1)`` count as uniform averaging (BlueFog's tolerance)
UNIFORM_TOL = 1e-6


def is_uniform(rt: Route) -> bool:
    """Whether ``rt`` averages this rank and its ``n`` sources uniformly (every weight ``1 / (n + 1)``
    within :data:`UNIFORM_TOL`); such a reduction sums first and divides once, as BlueFog does."""
    if not rt.recv:
        return False
    u = 1.0 / (len(rt.recv) + 1)
    return abs(rt.self_weight - u) <= UNIFORM_TOL and all(abs(w - u) <= UNIFORM_TOL for _, w in rt.recv)


def prepare_reduction(ctx: Context, g: Group, rt: Route, flats: Sequence[Tensor]) -> Reduction:
    """Buffers and messages of a weighted neighbor reduction of the 1-D ``flats`` (one message per flat
    and peer). ``finish`` returns each flat's result in the accumulation dtype:
    ``self_weight * flat + sum(weight_j * received_j)``."""
    tags = [next_tag(ctx, g) for _ in flats]
    outs: list[Tensor] = []
    bufs = [[torch.empty_like(f) for _ in rt.recv] for f in flats]
    ops: list[P2POp] = []
    for f, tag, bs in zip(flats, tags, bufs):
        if f.numel():
            ops += [recv_op(b, src, tag) for (src, _), b in zip(rt.recv, bs)]
    for f, tag in zip(flats, tags):
        if f.numel():
            copies: dict[float, Tensor] = {}
            for dst, s in rt.send:
                if s not in copies:
                    copies[s] = f if s == 1.0 else f.mul(s)
                ops.append(send_op(copies[s], dst, tag))

    uniform = is_uniform(rt)

    def start() -> None:
        if uniform:  # (x + sum_j x_j) / (n + 1): exact on integer-valued data, as BlueFog computes it
            outs.extend(f.to(_acc_dtype(f.dtype), copy=True) for f in flats)
        else:
            outs.extend(f.to(_acc_dtype(f.dtype)).mul(rt.self_weight) for f in flats)

    def finish() -> list[Tensor]:
        for out, bs in zip(outs, bufs):
            for (_, w), b in zip(rt.recv, bs):
                b = b if b.dtype == out.dtype else b.to(out.dtype)
                if uniform:
                    out.add_(b)
                else:
                    out.add_(b, alpha=w)
            if uniform:
                out.div_(len(rt.recv) + 1)
        return outs

    return Reduction(ops, start, finish)
