"""Neighbor collectives (BlueFog's partial averaging): neighbor_allreduce, its fused grouped form, and
neighbor_allgather, each with a nonblocking ``i``-form returning a :class:`Handle`.

Weights and their meaning are described in :mod:`lowband.decentral.peers`; the topology check in
:mod:`lowband.decentral.topocheck`. ``check_topology=None`` follows :func:`lowband.comm.base.checking`
(the group's ``unchecked()`` override, else the runtime's ``check``); ``False`` skips the exchange where
it is not needed to discover peers, and a mismatch then surfaces as a bounded :class:`CommTimeoutError`.

Transport (all receives, then all sends, posted at once; why that cannot deadlock; tags): see
:mod:`lowband.decentral.transport`. ``wait()`` waits every message (bounded) and then applies the weights.

The sending side scales a copy (the caller's tensor is sent as is when its scale is 1: do not modify it
until the handle is waited). Results are computed in the tensor's dtype (float16/bfloat16 accumulate in
float32 and round once). Only floating-point tensors can be averaged: integer and bool tensors raise
:class:`InvalidArgumentError` (cast them first); neighbor_allgather takes any dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lowband.comm import validate
from lowband.comm.base import check_name, checked_tensor, checking, contiguous_flat, resolve
from lowband.comm.batch import P2POp, ibatch_p2p, recv_op, send_op
from lowband.comm.fusion import plan_buckets
from lowband.comm.handle import Handle
from lowband.decentral.hierarchical import hierarchical_neighbor_allreduce, ihierarchical_neighbor_allreduce
from lowband.decentral.peers import Peers, plan_ranks, plan_weights, static_peers
from lowband.decentral.state import check_topology_arg, load_topology, next_tag
from lowband.decentral.transport import check_flag, check_float, prepare_reduction, route, where
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import Context
from lowband.topology import Topology

Tensor = torch.Tensor

# The hierarchical op lives in its own module; it is re-exported here, where the API lists it.
__all__ = [
    "grouped_neighbor_allreduce", "hierarchical_neighbor_allreduce", "igrouped_neighbor_allreduce",
    "ihierarchical_neighbor_allreduce", "ineighbor_allgather", "ineighbor_allreduce", "neighbor_allgather",
    "neighbor_allreduce", "plan_allreduce",
]  # fmt: skip


def plan_allreduce(
    op: str,
    ctx: Context,
    g: Group,
    self_weight: float | None,
    src_weights: Mapping[int, float] | None,
    dst_weights: Mapping[int, float] | Sequence[int] | None,
    topology: Topology | None,
) -> Peers:
    """The :class:`Peers` of a neighbor allreduce: explicit weights, else ``topology``, else the group's
    static topology (:func:`lowband.decentral.state.load_topology`)."""
    peers = plan_weights(where(op, ctx), g.size, g.rank, self_weight, src_weights, dst_weights, topology)
    if peers is not None:
        return peers
    topo = load_topology(g) if topology is None else check_topology_arg(op, ctx, topology, g.size, "topology")
    return static_peers(topo, g.rank)


# ---------------------------------------------------------------- neighbor_allreduce


def ineighbor_allreduce(
    tensor: Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool | None = None,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[Tensor]:
    """Nonblocking partial averaging: ``self_weight * x_i + sum_j src_weights[j] * s_ij * x_j``.

    With no weights the static topology (``topology``, else :func:`load_topology`) gives them; with
    weights, see :mod:`lowband.decentral.peers` for pull (self+src), push (self+dst, sources discovered)
    and push-pull (all three). ``dst_weights`` may be a list of ranks (scale 1). Ranks are ranks of
    ``group``. Every rank of the group must call it, with the same dtype and shape. Out of place unless
    ``inplace``; ``wait()`` returns the result.
    """
    op = "neighbor_allreduce"
    ctx, g = resolve(op, group)
    t = checked_tensor(op, ctx, tensor)
    check_float(op, ctx, t)
    name = check_name(op, ctx, name)
    flag = check_flag(op, ctx, "check_topology", check_topology)
    check = checking(ctx, g) if flag is None else flag
    peers = plan_allreduce(op, ctx, g, self_weight, src_weights, dst_weights, topology)
    rt, _ = route(op, ctx, g, peers, t.dtype, t.shape, check)
    red = prepare_reduction(ctx, g, rt, [contiguous_flat(t)])

    def finish() -> Tensor:
        res = red.finish()[0].to(t.dtype).view(t.shape)
        if inplace:
            t.copy_(res)
            return t
        return res

    return ibatch_p2p(op, red.ops, finish, name=name, group=g, after_post=red.start)


def neighbor_allreduce(
    tensor: Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool | None = None,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
) -> Tensor:
    """Blocking partial averaging; see :func:`ineighbor_allreduce`."""
    return ineighbor_allreduce(
        tensor,
        self_weight=self_weight,
        src_weights=src_weights,
        dst_weights=dst_weights,
        topology=topology,
        check_topology=check_topology,
        inplace=inplace,
        name=name,
        group=group,
    ).wait()


# ---------------------------------------------------------------- grouped (fused) neighbor_allreduce


def igrouped_neighbor_allreduce(
    tensors: Sequence[Tensor],
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool | None = None,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
    fusion_threshold: int | None = None,
) -> Handle[list[Tensor]]:
    """Nonblocking neighbor allreduce of many tensors with the same weights, with tensor fusion.

    Tensors are packed in order, by dtype, into flat buffers of at most ``fusion_threshold`` bytes
    (default: the runtime's; 0 disables fusion) with :func:`lowband.comm.fusion.plan_buckets`; each
    buffer is one message per peer, and one topology check covers the whole list. The result of each
    tensor is the one :func:`ineighbor_allreduce` gives it. ``wait()`` returns the list of results.
    """
    op = "grouped_neighbor_allreduce"
    ctx, g = resolve(op, group)
    name = check_name(op, ctx, name)
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise InvalidArgumentError(
            f"{where(op, ctx)}: tensors must be a list of tensors, got {type(tensors).__name__}"
        )
    ts = [checked_tensor(op, ctx, t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, t in enumerate(ts):
        check_float(op, ctx, t, f"tensors[{i}]")
    threshold = ctx.config.fusion_threshold if fusion_threshold is None else fusion_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise InvalidArgumentError(
            f"{where(op, ctx)}: fusion_threshold must be an int >= 0 (bytes), got {threshold!r}"
        )
    flag = check_flag(op, ctx, "check_topology", check_topology)
    check = checking(ctx, g) if flag is None else flag
    peers = plan_allreduce(op, ctx, g, self_weight, src_weights, dst_weights, topology)
    desc = [d for t in ts for d in (validate.DTYPE_CODES[t.dtype], t.dim(), *t.shape)]
    rt, _ = route(op, ctx, g, peers, torch.int64, [len(ts), *desc], check)
    buckets = plan_buckets(ts, threshold)
    flats = [
        contiguous_flat(ts[b[0]]) if len(b) == 1 else torch.cat([ts[i].reshape(-1) for i in b])
        for b in buckets
    ]
    red = prepare_reduction(ctx, g, rt, flats)

    def finish() -> list[Tensor]:
        outs: list[Tensor] = list(ts)
        for b, res in zip(buckets, red.finish()):
            pos = 0
            for i in b:
                n = ts[i].numel()
                piece = res[pos : pos + n].to(ts[i].dtype).view(ts[i].shape)
                pos += n
                if inplace:
                    ts[i].copy_(piece)
                else:
                    outs[i] = piece
        return outs

    return ibatch_p2p(op, red.ops, finish, name=name, group=g, after_post=red.start)


def grouped_neighbor_allreduce(
    tensors: Sequence[Tensor],
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool | None = None,
    inplace: bool = False,
    name: str | None = None,
    group: Group | None = None,
    fusion_threshold: int | None = None,
) -> list[Tensor]:
    """Blocking grouped neighbor allreduce; see :func:`igrouped_neighbor_allreduce`."""
    return igrouped_neighbor_allreduce(
        tensors,
        self_weight=self_weight,
        src_weights=src_weights,
        dst_weights=dst_weights,
        topology=topology,
        check_topology=check_topology,
        inplace=inplace,
        name=name,
        group=group,
        fusion_threshold=fusion_threshold,
    ).wait()


# ---------------------------------------------------------------- neighbor_allgather


def ineighbor_allgather(
    tensor: Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Handle[Tensor]:
    """Nonblocking gather of the in-neighbors' tensors, concatenated along dimension 0 in the order of
    ``src_ranks`` when given (as BlueFog), else in ascending source rank (this rank's own tensor is not
    included; 0-d tensors count as one row).

    Sources and destinations: ``src_ranks`` and/or ``dst_ranks`` (a missing side is discovered, as for
    the weights of :func:`ineighbor_allreduce`), else ``topology``, else the group's static topology.
    First dimensions may differ between ranks; dtypes, the number of dimensions and the other dimensions
    must match. The receivers need the senders' first dimensions, so the exchange of the topology check
    is always made (``check_topology`` cannot turn it off; it is accepted for symmetry).
    """
    op = "neighbor_allgather"
    ctx, g = resolve(op, group)
    t = checked_tensor(op, ctx, tensor)
    name = check_name(op, ctx, name)
    check_flag(op, ctx, "check_topology", check_topology)
    peers = plan_ranks(where(op, ctx), g.size, g.rank, src_ranks, dst_ranks)
    if peers is None:
        topo = (
            load_topology(g)
            if topology is None
            else check_topology_arg(op, ctx, topology, g.size, "topology")
        )
        peers = static_peers(topo, g.rank)
    elif topology is not None:
        raise InvalidArgumentError(
            f"{where(op, ctx)}: pass either a topology or src_ranks/dst_ranks, not both"
        )
    src = t.reshape(1) if t.dim() == 0 else t
    rt, links = route(op, ctx, g, peers, t.dtype, t.shape, True, vary_dim0=True)
    dim0 = links.dim0 if links is not None else [src.shape[0]] * g.size
    rest = tuple(src.shape[1:])
    out = torch.empty((sum(dim0[j] for j, _ in rt.recv), *rest), dtype=t.dtype, device=t.device)
    order = [j for j, _ in rt.recv]
    if peers.recv is not None:  # src_ranks given: their order (the route's sources are the same ranks)
        order = sorted(order, key=list(peers.recv).index)
    views: list[tuple[int, Tensor]] = []
    pos = 0
    for j in order:
        views.append((j, out[pos : pos + dim0[j]].view(-1)))
        pos += dim0[j]
    buf = contiguous_flat(src)
    tag = next_tag(ctx, g)
    ops: list[P2POp] = [recv_op(v, j, tag) for j, v in views if v.numel()]
    if buf.numel():
        ops += [send_op(buf, dst, tag) for dst, _ in rt.send]
    return ibatch_p2p(op, ops, lambda: out, name=name, group=g)


def neighbor_allgather(
    tensor: Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool | None = None,
    name: str | None = None,
    group: Group | None = None,
) -> Tensor:
    """Blocking neighbor allgather; see :func:`ineighbor_allgather`."""
    return ineighbor_allgather(
        tensor,
        src_ranks=src_ranks,
        dst_ranks=dst_ranks,
        topology=topology,
        check_topology=check_topology,
        name=name,
        group=group,
    ).wait()
