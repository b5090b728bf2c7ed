"""Work a strategy must do on a step's batch before that step trains, done in the user's own loop too.

Some strategies need one extra pass over the first batch they see before training on it: DDP rebuilds
its gradient buckets after a resume (:mod:`lowband.strategies.ddp`), DreamDDP profiles the model to
schedule its averagings (:mod:`lowband.localsgd.strategy`). ``train_step`` hands them its ``loss_fn``;
in the documented loop (``s.zero_grad(); loss = f(s.module(x)); s.backward(loss); s.step()``) the only
thing a strategy sees before the backward is the forward itself. :class:`ForwardReplay` is a forward
pre-hook (``with_kwargs``) on the module the loop calls: at a training forward (gradients enabled, the
module in training mode) while :attr:`ForwardReplay.wanted` says so, it calls ``run(loss_fn)`` first,
with ``loss_fn(module)`` replaying that forward on its own arguments and reducing the output to a scalar
(:func:`output_loss`: the sum of every floating-point tensor in it that requires a gradient). The
forward it precedes then runs as it would have: nothing of the user's graph exists yet, so ``run`` may
step, restore and average the parameters freely.

What the replayed loss cannot reproduce is the user's loss function itself: a pass on it times and
orders the model's own layers (backward order and per-layer times do not depend on the values of the
output gradient), not the loss computation after the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lowband.errors import InvalidArgumentError

LossFn = Callable[[nn.Module], torch.Tensor]


def output_loss(out: object, where: str) -> torch.Tensor:
    """A scalar whose backward reaches every parameter the forward's output depends on: the sum of the
    floating-point tensors in ``out`` (tensors, and tuples, lists and dicts of them) that require grad."""
    found: list[torch.Tensor] = []

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                found.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(out)
    if not found:
        raise InvalidArgumentError(
            f"{where}: the model's output holds no floating-point tensor that requires a gradient, so its "
            "first forward cannot be replayed; call train_step(loss_fn) for the first step instead"
        )
    total = found[0].float().sum()
    for t in found[1:]:
        total = total + t.float().sum()
    return total


class ForwardReplay:
    """A forward pre-hook on ``module`` calling ``run(loss_fn)`` before a training forward while
    ``wanted()`` (see the module docstring). Re-entrant forwards (``run``'s own) are let through."""

    def __init__(
        self, module: nn.Module, wanted: Callable[[], bool], run: Callable[[LossFn], None], *, where: str
    ) -> None:
        self.wanted, self.run, self.where = wanted, run, where
        self._running = False
        self._handle: RemovableHandle | None = module.register_forward_pre_hook(
            self._before, with_kwargs=True, prepend=True
        )

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._running or not (module.training and torch.is_grad_enabled()) or not self.wanted():
            return
        where = self.where

        def replay(m: nn.Module) -> torch.Tensor:
            return output_loss(m(*args, **kwargs), where)

        self._running = True
        try:
            self.run(replay)
        finally:
            self._running = False

    @property
    def running(self) -> bool:
        """True while ``run`` runs (its forwards are the replayed ones)."""
        return self._running

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
