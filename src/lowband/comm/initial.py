"""The initial model state every replica starts from: rank 0's parameters and buffers, broadcast when a
strategy or a decentralized optimizer is built, as torch DDP does at construction.

:func:`broadcast_tensors` is the one routine (BlueFog's ``broadcast_parameters`` uses it too);
:func:`broadcast_initial_state` is what constructors call once their arguments are checked (so a bad
argument fails locally, before any communication). Inside :func:`initial_broadcast_once` (a strategy
being built by :func:`lowband.strategies.make_strategy`) only the first such call broadcasts, so a model
is broadcast once however many wrappers its strategy builds; ``make_strategy`` broadcasts after
construction when no constructor did.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lowband.comm.agree import agree, crc
from lowband.comm.collectives import ibroadcast
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.nn.sharding import shard_specs


@dataclasses.dataclass
class _Once:
    enabled: bool
    done: bool = False


_ONCE: contextvars.ContextVar[_Once | None] = contextvars.ContextVar(
    "lowband_initial_broadcast", default=None
)


def broadcast_tensors(
    tensors: Sequence[tuple[str | None, torch.Tensor]], root: int = 0, *, group: Group | None = None
) -> None:
    """Overwrite every tensor with ``root``'s, in place (nonblocking broadcasts, then all waited)."""
    handles = [ibroadcast(t.detach(), root, inplace=True, name=name, group=group) for name, t in tensors]
    for h in handles:
        h.wait()


def claim_initial_broadcast(enabled: bool = True) -> bool:
    """Whether the caller is to broadcast the initial model now: ``enabled``, except inside
    :func:`initial_broadcast_once`, where it is True for the first caller only (and never when that
    context was opened with ``enabled=False``)."""
    once = _ONCE.get()
    if once is None:
        return enabled
    if not enabled or not once.enabled or once.done:
        return False
    once.done = True
    return True


def broadcast_initial_state(
    model: nn.Module, *, group: Group | None, enabled: bool = True, where: str = "lowband"
) -> None:
    """Give every rank of ``group`` rank 0's parameters and buffers (``model.state_dict()`` but its
    sharded parameters, :func:`lowband.nn.sharding.shard_specs`) when
    :func:`claim_initial_broadcast` says so. Collective; one agreement on the model's layout first, so
    a rank with another model fails on every rank, naming the rank."""
    if not isinstance(enabled, bool):
        raise InvalidArgumentError(f"{where}: broadcast_init must be True or False, got {enabled!r}")
    if not claim_initial_broadcast(enabled):
        return
    sharded = shard_specs(model)  # parameters that live on one rank only are not the model's replica
    sd = {k: t for k, t in model.state_dict().items() if k not in sharded}
    desc = [(k, tuple(t.shape), str(t.dtype)) for k, t in sd.items()]
    agree(
        group,
        "the model's parameters and buffers",
        [len(desc), sum(t.numel() for t in sd.values()), crc(desc)],
        fields=("the number of tensors", "the number of elements", "the hash of names, shapes and dtypes"),
        where=f"{where}: the initial broadcast of the model",
    )
    broadcast_tensors([(f"initial-model.{k}", t) for k, t in sd.items()], 0, group=group)


@contextlib.contextmanager
def initial_broadcast_once(enabled: bool) -> Iterator[None]:
    """Within: the model is broadcast at most once (by the first :func:`broadcast_initial_state` or
    :func:`claim_initial_broadcast` caller), or never when ``enabled`` is False."""
    token = _ONCE.set(_Once(enabled))
    try:
        yield
    finally:
        _ONCE.reset(token)
