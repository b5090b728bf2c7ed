"""BlueFog's smaller calls: ``suspend``/``resume`` and ``pair_gossip`` (blocking and nonblocking)."""

from __future__ import annotations

import torch

from lowband.compat.bluefog.torch._errors import as_bluefog_errors
from lowband.compat.bluefog.torch._ops import synchronize
from lowband.compat.bluefog.torch._state import MOD, compat_state, register
from lowband.decentral import neighbor as dn
from lowband.decentral.peers import check_peer, check_weight
from lowband.errors import InvalidArgumentError
from lowband.runtime import current

Tensor = torch.Tensor


def suspend() -> None:
    """BlueFog pauses its background communication thread (for interactive sessions). lowband has no
    such thread: every op runs on the caller's thread when called, so there is nothing to pause; the
    call records the state (see :func:`resume`) and returns."""
    compat_state(op="suspend").suspended = True


def resume() -> None:
    """Undo :func:`suspend`."""
    compat_state(op="resume").suspended = False


def pair_gossip_nonblocking(
    tensor: Tensor,
    target_rank: int,
    self_weight: float | None = None,
    pair_weight: float | None = None,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`pair_gossip`; returns a handle for ``synchronize``/``wait``/``poll``."""
    op = "pair_gossip"
    ctx = current(op)
    at = f"{MOD}.{op} on rank {ctx.rank}"
    peer = check_peer(at, "target_rank", target_rank, ctx.size, ctx.rank)
    if (self_weight is None) != (pair_weight is None):
        raise InvalidArgumentError(
            f"{at}: self_weight and pair_weight must be given together (or neither, for the average)"
        )
    sw = 0.5 if self_weight is None else check_weight(at, "self_weight", self_weight)
    pw = 0.5 if pair_weight is None else check_weight(at, "pair_weight", pair_weight)
    with as_bluefog_errors():
        h = dn.ineighbor_allreduce(
            tensor,
            self_weight=sw,
            src_weights={peer: pw},
            dst_weights=[peer],
            check_topology=False,
            name=name,
        )
    return register(h)


def pair_gossip(
    tensor: Tensor,
    target_rank: int,
    self_weight: float | None = None,
    pair_weight: float | None = None,
    name: str | None = None,
) -> Tensor:
    """``self_weight * tensor + pair_weight * tensor_of(target_rank)`` (both 0.5 by default: the pair's
    average); ``target_rank`` must call it at the same time with this rank as its target. The input is
    not modified."""
    out: Tensor = synchronize(pair_gossip_nonblocking(tensor, target_rank, self_weight, pair_weight, name))
    return out
