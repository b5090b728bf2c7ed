"""The initial model state every replica starts from: rank 0's parameters and buffers, broadcast when a
strategy or a decentralized optimizer is built, as torch DDP does at construction.

:func:`broadcast_tensors` is the one routine (BlueFog's ``broadcast_parameters`` uses it too);
:func:`broadcast_initial_state` is what constructors call. Inside :func:`initial_state_settled` (a
strategy being built by :func:`lowband.strategies.make_strategy`, which broadcast already) it does
nothing, so a model is broadcast once however many wrappers its strategy builds.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lowband.comm.agree import agree, crc
from lowband.comm.collectives import ibroadcast
from lowband.errors import InvalidArgumentError
from lowband.group import Group

_SETTLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lowband_initial_state_settled", default=False
)


def broadcast_tensors(
    tensors: Sequence[tuple[str | None, torch.Tensor]], root: int = 0, *, group: Group | None = None
) -> None:
    """Overwrite every tensor with ``root``'s, in place (nonblocking broadcasts, then all waited)."""
    handles = [ibroadcast(t.detach(), root, inplace=True, name=name, group=group) for name, t in tensors]
    for h in handles:
        h.wait()


def broadcast_initial_state(
    model: nn.Module, *, group: Group | None, enabled: bool = True, where: str = "lowband"
) -> None:
    """Give every rank of ``group`` rank 0's parameters and buffers (``model.state_dict()``), unless
    ``enabled`` is False or the caller runs inside :func:`initial_state_settled`. Collective."""
    if not isinstance(enabled, bool):
        raise InvalidArgumentError(f"broadcast_init must be True or False, got {enabled!r}")
    if not enabled or _SETTLED.get():
        return
    sd = model.state_dict()
    desc = [(k, tuple(t.shape), str(t.dtype)) for k, t in sd.items()]
    # one agreement first: a rank with another model fails on every rank, naming the rank
    agree(
        group,
        "the model's parameters and buffers",
        [len(desc), sum(t.numel() for t in sd.values()), crc(desc)],
        fields=("the number of tensors", "the number of elements", "the hash of names, shapes and dtypes"),
        where=f"{where}: the initial broadcast of the model",
    )
    broadcast_tensors([(f"initial-model.{k}", t) for k, t in sd.items()], 0, group=group)


@contextlib.contextmanager
def initial_state_settled() -> Iterator[None]:
    """Within: :func:`broadcast_initial_state` does nothing (the model was broadcast, or must not be)."""
    token = _SETTLED.set(True)
    try:
        yield
    finally:
        _SETTLED.reset(token)
