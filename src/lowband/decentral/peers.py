"""Who a neighbor op sends to and receives from, with which weights: the caller's arguments turned into
a :class:`Peers` plan (pure: no communication).

The partial averaging of rank ``i`` (BlueFog paper, Eq. 10-12) is::

    result_i = self_weight * x_i + sum_{j in sources} src_weights[j] * s_ij * x_j

where ``s_ij`` is the scale sender ``j`` applies to the copy it sends to ``i`` (its ``dst_weights[i]``).
The meaningful argument combinations (the paper's footnote 2) and what each one means here:

========================  =====================================  ======================================
given                     this rank receives from (weight)        this rank sends to (scale)
========================  =====================================  ======================================
nothing                   static topology's in-neighbors         static topology's out-neighbors (1)
                          (``W[i, j]``); self weight ``W[i, i]``
self + src (pull)         keys of ``src_weights`` (its values)    whoever lists this rank in its
                                                                  ``src_weights`` (1), discovered
self + dst (push)         whoever sends to this rank (1),         keys of ``dst_weights`` (its values;
                          discovered                              1 for a list of ranks)
self + src + dst          keys of ``src_weights`` (its values)    keys of ``dst_weights`` (its values)
(push-pull)
========================  =====================================  ======================================

Any other combination (``src_weights`` or ``dst_weights`` without ``self_weight``, ``self_weight``
alone, or explicit weights together with ``topology``) is ambiguous and raises
:class:`InvalidArgumentError`. "Discovered" sides are learned from the topology-check exchange, which
such calls therefore always make. Weights are finite real numbers (not bools); ranks are ranks of the
group, never the calling rank itself (its own term is ``self_weight``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lowband.errors import InvalidArgumentError
from lowband.topology import Topology


@dataclass(frozen=True)
class Peers:
    """One rank's plan. ``send``: destination -> scale of the copy sent there; ``recv``: source -> weight
    of what arrives from it. ``None`` means "learn it from the other ranks" (weight/scale 1)."""

    self_weight: float
    send: dict[int, float] | None
    recv: dict[int, float] | None

    @property
    def needs_exchange(self) -> bool:
        """Whether a side must be discovered (the exchange is then made whatever the check setting)."""
        return self.send is None or self.recv is None


def check_weight(where: str, what: str, value: object) -> float:
    """A finite real weight as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{where}: {what} must be a finite real number, got {value!r}")
    w = float(value)
    if not math.isfinite(w):
        raise InvalidArgumentError(f"{where}: {what} must be a finite real number, got {w!r}")
    return w


def check_peer(where: str, what: str, value: object, size: int, me: int) -> int:
    """A rank in ``[0, size)`` other than ``me``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{where}: {what} must be an int rank, got {value!r}")
    r = int(value)
    if not 0 <= r < size:
        raise InvalidArgumentError(f"{where}: {what} {r} is not a rank of the group (size {size})")
    if r == me:
        raise InvalidArgumentError(
            f"{where}: {what} {r} is this rank itself (its own term is self_weight, not a neighbor)"
        )
    return r


def check_weight_map(where: str, what: str, value: object, size: int, me: int) -> dict[int, float]:
    """A ``{rank: weight}`` mapping over other ranks of a group of ``size``."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"{where}: {what} must be a mapping {{rank: weight}}, got {type(value).__name__}"
        )
    out: dict[int, float] = {}
    for k, v in value.items():
        r = check_peer(where, f"{what} key", k, size, me)
        out[r] = check_weight(where, f"{what}[{r}]", v)
    return out


def check_rank_list(where: str, what: str, value: object, size: int, me: int) -> list[int]:
    """A sequence of distinct other ranks of a group of ``size`` (a list, tuple, range or 1-D numpy
    array of ints)."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"{where}: {what} must be a list of ranks, got {type(value).__name__}")
    out: list[int] = []
    for v in value:
        r = check_peer(where, f"{what} entry", v, size, me)
        if r in out:
            raise InvalidArgumentError(f"{where}: {what} lists rank {r} twice")
        out.append(r)
    return out


def check_dst(where: str, what: str, value: object, size: int, me: int) -> dict[int, float]:
    """``dst_weights``: a ``{rank: scale}`` mapping, or a list of ranks (scale 1)."""
    if isinstance(value, Mapping):
        return check_weight_map(where, what, value, size, me)
    return dict.fromkeys(check_rank_list(where, what, value, size, me), 1.0)


def static_peers(topology: Topology, me: int) -> Peers:
    """The plan of a static topology: self ``W[i, i]``, sources ``W[i, :]``, unscaled sends."""
    return Peers(
        self_weight=float(topology.self_weight(me)),
        send={int(i): 1.0 for i in topology.out_neighbors(me)},
        recv={int(j): float(w) for j, w in topology.src_weights(me).items()},
    )


def plan_weights(
    where: str,
    size: int,
    me: int,
    self_weight: object,
    src_weights: object,
    dst_weights: object,
    topology: Topology | None,
    *,
    names: tuple[str, str, str] = ("self_weight", "src_weights", "dst_weights"),
) -> Peers | None:
    """The plan of explicit weights, or None when none is given (then the caller uses a topology).
    ``names`` are the argument names in error messages (the hierarchical op's are ``*_machine_*``)."""
    if self_weight is None and src_weights is None and dst_weights is None:
        return None
    if topology is not None:
        raise InvalidArgumentError(
            f"{where}: pass either a topology or explicit weights ({', '.join(names)}), not both"
        )
    if self_weight is None:
        given = names[1] if src_weights is not None else names[2]
        raise InvalidArgumentError(
            f"{where}: {given} needs {names[0]} (the weight of this rank's own value); the meaningful "
            f"combinations are: none, {names[0]}+{names[1]} (pull), {names[0]}+{names[2]} (push), all three"
        )
    if src_weights is None and dst_weights is None:
        raise InvalidArgumentError(
            f"{where}: {names[0]} alone is ambiguous: give {names[1]} (pull), {names[2]} (push) or both"
        )
    return Peers(
        self_weight=check_weight(where, names[0], self_weight),
        send=None if dst_weights is None else check_dst(where, names[2], dst_weights, size, me),
        recv=None if src_weights is None else check_weight_map(where, names[1], src_weights, size, me),
    )


def plan_ranks(where: str, size: int, me: int, src_ranks: object, dst_ranks: object) -> Peers | None:
    """The plan of an allgather's explicit ranks (weights 1), or None when none is given. A missing side
    is discovered, as for the weights."""
    if src_ranks is None and dst_ranks is None:
        return None
    return Peers(
        self_weight=1.0,
        send=None
        if dst_ranks is None
        else dict.fromkeys(check_rank_list(where, "dst_ranks", dst_ranks, size, me), 1.0),
        recv=None
        if src_ranks is None
        else dict.fromkeys(check_rank_list(where, "src_ranks", src_ranks, size, me), 1.0),
    )
