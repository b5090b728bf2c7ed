"""BlueFog's collective and neighbor ops: each blocking op, its ``_nonblocking`` form returning an integer
handle, and (for allreduce and broadcast) the in-place ``_`` forms.

Handles are integers, as in BlueFog; :func:`poll`, :func:`synchronize` and :func:`wait` also accept a
lowband :class:`~lowband.comm.handle.Handle`. Waits are bounded by the runtime's timeout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import lowband
from lowband.compat.bluefog.torch import _timeline as timeline
from lowband.compat.bluefog.torch._errors import as_bluefog_errors
from lowband.compat.bluefog.torch._state import lookup, register
from lowband.decentral import hierarchical as dh
from lowband.decentral import neighbor as dn
from lowband.group import Group

Tensor = torch.Tensor


def _topo_check(enable_topo_check: bool, dynamic: bool) -> bool | None:
    """lowband's ``check_topology`` for BlueFog's ``enable_topo_check``: BlueFog checks only dynamic
    calls (``dst_weights`` given), so a static call follows the runtime's check setting unless the check
    is turned off."""
    if not enable_topo_check:
        return False
    return True if dynamic else None


def _sync(handle: int) -> Tensor:
    out: Tensor = synchronize(handle)
    return out


# ---------------------------------------------------------------- allreduce


def _local(is_hierarchical_local: bool) -> Group | None:
    return lowband.local_group() if is_hierarchical_local else None


def allreduce_nonblocking(
    tensor: Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> int:
    """Nonblocking average (or sum) over all ranks, or over this machine's ranks with
    ``is_hierarchical_local``; the input is not modified."""
    op = "average" if average else "sum"
    return register(lowband.iallreduce(tensor, op, name=name, group=_local(is_hierarchical_local)))


def allreduce(
    tensor: Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> Tensor:
    """Blocking :func:`allreduce_nonblocking`; returns a new tensor."""
    return _sync(allreduce_nonblocking(tensor, average, is_hierarchical_local, name))


def allreduce_nonblocking_(
    tensor: Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> int:
    """In-place :func:`allreduce_nonblocking`: the result is written into ``tensor``."""
    op = "average" if average else "sum"
    h = lowband.iallreduce(tensor, op, inplace=True, name=name, group=_local(is_hierarchical_local))
    return register(h)


def allreduce_(
    tensor: Tensor, average: bool = True, is_hierarchical_local: bool = False, name: str | None = None
) -> Tensor:
    """Blocking in-place allreduce; returns ``tensor``."""
    return _sync(allreduce_nonblocking_(tensor, average, is_hierarchical_local, name))


# ---------------------------------------------------------------- broadcast and allgather


def broadcast_nonblocking(tensor: Tensor, root_rank: int, name: str | None = None) -> int:
    """Nonblocking broadcast of ``root_rank``'s tensor; the input is not modified."""
    return register(lowband.ibroadcast(tensor, root_rank, name=name))


def broadcast(tensor: Tensor, root_rank: int, name: str | None = None) -> Tensor:
    """Blocking broadcast; returns a new tensor."""
    return _sync(broadcast_nonblocking(tensor, root_rank, name))


def broadcast_nonblocking_(tensor: Tensor, root_rank: int, name: str | None = None) -> int:
    """In-place nonblocking broadcast into ``tensor``."""
    return register(lowband.ibroadcast(tensor, root_rank, inplace=True, name=name))


def broadcast_(tensor: Tensor, root_rank: int, name: str | None = None) -> Tensor:
    """Blocking in-place broadcast; returns ``tensor``."""
    return _sync(broadcast_nonblocking_(tensor, root_rank, name))


def allgather_nonblocking(tensor: Tensor, name: str | None = None) -> int:
    """Nonblocking concatenation of every rank's tensor along dimension 0, in rank order (first
    dimensions may differ)."""
    return register(lowband.iallgather(tensor, name=name))


def allgather(tensor: Tensor, name: str | None = None) -> Tensor:
    """Blocking :func:`allgather_nonblocking`."""
    return _sync(allgather_nonblocking(tensor, name))


# ---------------------------------------------------------------- neighbor ops


def neighbor_allreduce_nonblocking(
    tensor: Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> int:
    """Nonblocking partial averaging ``self_weight * x + sum_j src_weights[j] * dst_weights_j[me] * x_j``.

    No weights: the topology's (uniform over the in-neighbors unless set ``is_weighted``). Otherwise
    ``self_weight`` with ``src_weights`` (pull), ``dst_weights`` (push; a dict or a list of ranks with
    scale 1) or both; see :mod:`lowband.decentral.peers`. ``enable_topo_check`` checks that senders and
    receivers agree (BlueFog does it for dynamic calls only)."""
    with as_bluefog_errors():
        h = dn.ineighbor_allreduce(
            tensor,
            self_weight=self_weight,
            src_weights=src_weights,
            dst_weights=dst_weights,
            check_topology=_topo_check(enable_topo_check, dst_weights is not None),
            name=name,
        )
    return register(h)


def neighbor_allreduce(
    tensor: Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> Tensor:
    """Blocking :func:`neighbor_allreduce_nonblocking`; returns a new tensor."""
    h = neighbor_allreduce_nonblocking(
        tensor,
        self_weight=self_weight,
        src_weights=src_weights,
        dst_weights=dst_weights,
        enable_topo_check=enable_topo_check,
        name=name,
    )
    return _sync(h)


def neighbor_allgather_nonblocking(
    tensor: Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> int:
    """Nonblocking gather of the in-neighbors' tensors (or ``src_ranks``'), concatenated along
    dimension 0 in the order of ``src_ranks`` when given, else in ascending source rank (the order of
    :func:`in_neighbor_ranks`); this rank's own tensor is not included."""
    with as_bluefog_errors():
        h = dn.ineighbor_allgather(
            tensor,
            src_ranks=src_ranks,
            dst_ranks=dst_ranks,
            check_topology=_topo_check(enable_topo_check, dst_ranks is not None),
            name=name,
        )
    return register(h)


def neighbor_allgather(
    tensor: Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> Tensor:
    """Blocking :func:`neighbor_allgather_nonblocking`."""
    h = neighbor_allgather_nonblocking(
        tensor, src_ranks=src_ranks, dst_ranks=dst_ranks, enable_topo_check=enable_topo_check, name=name
    )
    return _sync(h)


def hierarchical_neighbor_allreduce_nonblocking(
    tensor: Tensor,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
) -> int:
    """Nonblocking hierarchical partial averaging: an average inside each machine, then a neighbor
    allreduce between machines (machine weights, or the machine topology's), shared by the machine's
    ranks. Machine ranks index the weights."""
    with as_bluefog_errors():
        h = dh.ihierarchical_neighbor_allreduce(
            tensor,
            self_weight=self_weight,
            src_machine_weights=src_machine_weights,
            dst_machine_weights=dst_machine_weights,
            check_topology=_topo_check(enable_topo_check, dst_machine_weights is not None),
            name=name,
        )
    return register(h)


def hierarchical_neighbor_allreduce(
    tensor: Tensor,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
) -> Tensor:
    """Blocking :func:`hierarchical_neighbor_allreduce_nonblocking`."""
    h = hierarchical_neighbor_allreduce_nonblocking(
        tensor, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, name
    )
    return _sync(h)


# ---------------------------------------------------------------- handles and barrier


def poll(handle: Any) -> bool:
    """Whether the nonblocking op of ``handle`` has finished (never blocks)."""
    return lookup("poll", handle, pop=False).done()


def synchronize(handle: Any) -> Any:
    """Wait (bounded) for the nonblocking op of ``handle`` and return its output; a handle can be
    waited on once."""
    h = lookup("synchronize", handle, pop=True)
    with as_bluefog_errors():
        out = h.wait()
    timeline.flush()
    return out


def wait(handle: Any) -> Any:
    """Alias of :func:`synchronize`."""
    return synchronize(handle)


def barrier() -> None:
    """Block until every rank has called it (bounded by the runtime's timeout)."""
    lowband.barrier()
    timeline.flush(force=True)
