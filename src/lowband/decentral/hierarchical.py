"""Hierarchical neighbor allreduce (BlueFog paper §V-B, Fig. 7 and 10): partial averaging between
machines, with every rank of a machine ending with the same value.

Machines are ``local_size`` consecutive ranks (``lowband.init(local_size=...)``); the machine topology is
a :class:`Topology` over the ``machine_size`` machines (:func:`lowband.decentral.state.set_machine_topology`,
default ``exponential_two(machine_size)``). Three stages:

1. average within the machine (an allreduce on the machine's local group; made when the op is issued,
   over the fast intra-machine link);
2. local rank 0 of each machine runs a neighbor allreduce of its machine's average over the machine
   topology, among the local-rank-0 ranks (``ctx.machine_group``), with the machine weights (issued at
   once, nonblocking: this is the slow inter-machine stage);
3. at ``wait()``, local rank 0 broadcasts the result inside its machine.

So every rank of machine ``m`` gets ``self_weight * a_m + sum_{m'} src_machine_weights[m'] * s_{m m'} * a_{m'}``
where ``a_m`` is machine ``m``'s average; weights follow :mod:`lowband.decentral.peers` with machine ranks.
Only local rank 0's machine weights are used (every rank validates its own). With one machine the result
is ``self_weight * a_0`` (a plain local average by default). Stage 3 runs in ``wait()``: every rank must
wait its hierarchical handles in the same order, and ``done()`` reports the inter-machine stage only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lowband.comm.base import check_name, checked_tensor, checking, contiguous_flat, make_handle
from lowband.comm.batch import ibatch_p2p
from lowband.comm.collectives import allreduce, broadcast
from lowband.comm.handle import Handle
from lowband.decentral.peers import plan_weights, static_peers
from lowband.decentral.state import check_topology_arg, load_machine_topology
from lowband.decentral.transport import check_flag, check_float, prepare_reduction, route
from lowband.runtime import current
from lowband.topology import Topology

_NAMES = ("self_weight", "src_machine_weights", "dst_machine_weights")


def ihierarchical_neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    machine_topology: Topology | None = None,
    check_topology: bool | None = None,
    inplace: bool = False,
    name: str | None = None,
) -> Handle[torch.Tensor]:
    """Nonblocking hierarchical neighbor allreduce over the world (see the module docstring).

    Machine weights are keyed by machine rank; with none, ``machine_topology`` (else
    :func:`load_machine_topology`) gives them. ``check_topology`` applies to the inter-machine stage.
    Out of place unless ``inplace``; ``wait()`` returns the result.
    """
    op = "hierarchical_neighbor_allreduce"
    ctx = current(op)
    t = checked_tensor(op, ctx, tensor)
    check_float(op, ctx, t)
    name = check_name(op, ctx, name)
    flag = check_flag(op, ctx, "check_topology", check_topology)
    where = f"lowband.{op} on rank {ctx.rank}"
    nm, me = ctx.machine_size, ctx.machine_rank
    peers = plan_weights(
        where, nm, me, self_weight, src_machine_weights, dst_machine_weights, machine_topology, names=_NAMES
    )
    if peers is None:
        topo = (
            load_machine_topology()
            if machine_topology is None
            else check_topology_arg(op, ctx, machine_topology, nm, "machine_topology")
        )
        peers = static_peers(topo, me)
    local = ctx.world if ctx.local_group is None else ctx.local_group
    avg = (
        allreduce(t, "average", group=local)
        if local.size > 1
        else t.clone(memory_format=torch.contiguous_format)
    )
    mg = ctx.machine_group
    world = ctx.world
    if ctx.local_rank != 0 or mg is None:
        # Not a machine's representative, or a single machine: nothing crosses machines.
        scale = peers.self_weight if mg is None else 1.0

        def finish_local() -> torch.Tensor:
            res = avg.mul_(scale) if scale != 1.0 else avg
            if local.size > 1:
                broadcast(res, 0, inplace=True, group=local)
            return _deliver(t, res, inplace)

        return make_handle(ctx, world, op, name, lambda: [], finish_local)
    check = checking(ctx, mg) if flag is None else flag
    rt, _ = route(op, ctx, mg, peers, t.dtype, t.shape, check)
    red = prepare_reduction(ctx, mg, rt, [contiguous_flat(avg)])

    def finish() -> torch.Tensor:
        res = red.finish()[0].to(t.dtype).view(t.shape)
        if local.size > 1:
            broadcast(res, 0, inplace=True, group=local)
        return _deliver(t, res, inplace)

    return ibatch_p2p(op, red.ops, finish, name=name, group=mg, after_post=red.start)


def _deliver(t: torch.Tensor, res: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        t.copy_(res)
        return t
    return res


def hierarchical_neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    machine_topology: Topology | None = None,
    check_topology: bool | None = None,
    inplace: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """Blocking hierarchical neighbor allreduce; see :func:`ihierarchical_neighbor_allreduce`."""
    return ihierarchical_neighbor_allreduce(
        tensor,
        self_weight=self_weight,
        src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights,
        machine_topology=machine_topology,
        check_topology=check_topology,
        inplace=inplace,
        name=name,
    ).wait()
