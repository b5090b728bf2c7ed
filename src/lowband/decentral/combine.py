"""How one layer's parameters are combined: the communication types (BlueFog's ``CommunicationType``),
the plan of an iteration, and the launch of one fused nonblocking operation per layer.

Every launcher is out of place: the parameters are read (sent as they are; do not change them until
the operation is waited), and :func:`write_back` copies the combined values in once it completes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.comm.fusion import igrouped_allreduce
from lowband.comm.handle import Handle
from lowband.decentral.hierarchical import ihierarchical_neighbor_allreduce
from lowband.decentral.neighbor import igrouped_neighbor_allreduce
from lowband.group import Group

Tensor = torch.Tensor


class CommunicationType(enum.Enum):
    """How the parameters of a communicating iteration are combined (BlueFog's names and values)."""

    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


@dataclass(frozen=True)
class Plan:
    """The communication of one iteration: the operation, its weight/topology arguments, the group
    (checked or not) and whether the topology check runs."""

    kind: CommunicationType
    kwargs: dict[str, Any]
    group: Group
    check: bool


@dataclass
class Pending:
    """One layer's operation in flight; ``wait()`` returns the combined tensors, in the layer's order."""

    handles: list[Handle[Any]]
    unpack: Callable[[list[Any]], list[Tensor]]

    def wait(self) -> list[Tensor]:
        return self.unpack([h.wait() for h in self.handles])


def _fuse(ts: Sequence[Tensor]) -> tuple[list[Tensor], Callable[[list[Any]], list[Tensor]]]:
    """One flat buffer per dtype, and the function splitting the combined buffers back."""
    order: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        order.setdefault(t.dtype, []).append(i)
    flats = [torch.cat([ts[i].reshape(-1) for i in idx]) for idx in order.values()]

    def unpack(results: list[Any]) -> list[Tensor]:
        out: list[Tensor] = list(ts)
        for idx, flat in zip(order.values(), results):
            pos = 0
            for i in idx:
                n = ts[i].numel()
                out[i] = flat[pos : pos + n].view(ts[i].shape)
                pos += n
        return out

    return flats, unpack


def _neighbor(ts: Sequence[Tensor], plan: Plan, name: str) -> Pending:
    h = igrouped_neighbor_allreduce(ts, **plan.kwargs, check_topology=plan.check, name=name, group=plan.group)
    return Pending([h], lambda r: list(r[0]))


def _hierarchical(ts: Sequence[Tensor], plan: Plan, name: str) -> Pending:
    flats, unpack = _fuse(ts)
    hs = [
        ihierarchical_neighbor_allreduce(f, **plan.kwargs, check_topology=plan.check, name=name)
        for f in flats
    ]
    return Pending(list(hs), unpack)


def _allreduce(ts: Sequence[Tensor], plan: Plan, name: str) -> Pending:
    return Pending([igrouped_allreduce(ts, "average", name=name, group=plan.group)], lambda r: list(r[0]))


#: how each communication type sends one layer (``empty`` sends nothing)
LAUNCHERS: dict[CommunicationType, Callable[[Sequence[Tensor], Plan, str], Pending]] = {
    CommunicationType.neighbor_allreduce: _neighbor,
    CommunicationType.hierarchical_neighbor_allreduce: _hierarchical,
    CommunicationType.allreduce: _allreduce,
}


def launch(plan: Plan, params: Sequence[Tensor], name: str) -> Pending | None:
    """Start combining ``params`` (out of place: they are read, never written) as ``plan`` says."""
    fn = LAUNCHERS.get(plan.kind)
    return None if fn is None else fn([p.detach() for p in params], plan, name)


def write_back(params: Sequence[nn.Parameter], values: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
