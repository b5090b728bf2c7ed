"""How one layer's parameters are combined: the communication types (BlueFog's ``CommunicationType``),
the plan of an iteration, and the launch of one fused nonblocking operation per layer.

Every launcher is out of place: the parameters are read (sent as they are; do not change them until
the operation is waited), and :func:`write_back` copies the combined values in once it completes. So a
combination that fails leaves the parameters as they were: :class:`Guarded` (``on_peer_loss="continue"``)
tells the strategy, waits until the operation has ended and gives nothing to write.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowband.comm.fusion import igrouped_allreduce
from lowband.comm.handle import Handle
from lowband.decentral.hierarchical import ihierarchical_neighbor_allreduce
from lowband.decentral.neighbor import igrouped_neighbor_allreduce
from lowband.errors import CommFailedError, CommTimeoutError
from lowband.group import Group
from lowband.optim.pending import Survival

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

    def drain(self, timeout: float) -> None:
        """Block until every operation has ended, successfully or not (at most ``timeout`` s each)."""
        for h in self.handles:
            h.drain(timeout)


def _nothing(_result: object) -> None:
    pass


class Guarded:
    """Layer ``layer``'s combination in flight under ``survival`` (``on_peer_loss="continue"``): waiting
    never raises a lost peer. A failed wait tells ``survival.lost`` (the strategy notices the loss and
    breaks its group), drains the operation (nothing reads the parameters it sends any more) and gives
    None: nothing is written, the layer keeps the parameters it had (the combination is out of place)."""

    def __init__(self, pending: Pending, layer: int, survival: Survival) -> None:
        self.pending, self.layer, self.survival = pending, layer, survival
        self.launched = time.monotonic()
        # gloo's send/recv works say nothing of their end until waited, so a polling wait would never see
        # it: the rank's completion thread waits them meanwhile (Handle.then), which ends the poll
        for h in pending.handles:
            h.then(_nothing)

    def wait(self) -> list[Tensor] | None:
        try:
            results = [self.survival.wait(h) for h in self.pending.handles]
        except (CommFailedError, CommTimeoutError) as exc:
            self.survival.lost(exc, self.layer, self.launched)
            self.drain()
            return None
        return self.pending.unpack(results)

    def drain(self) -> None:
        self.pending.drain(self.survival.drain_s)


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
