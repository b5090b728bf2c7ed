"""SlimGC's model backup (Eq. 8): start the next iteration from the last global weights updated with
this rank's own gradient, without waiting for the global aggregate.

For iteration ``i`` every rank holds the global weights ``w(i)`` (the same on every rank) and computes
its gradient ``g(i)`` on its local weights; then

- local (Eq. 8): ``w_loc(i+1) = w(i) - lr_loc * g(i)``: the model's parameters become ``w(i)`` and the
  *local* optimizer steps them with ``g(i)``; iteration ``i+1`` computes on them at once;
- global (Eq. 1): ``w(i+1) = w(i) - step(G(i))`` with ``G(i)`` the average over ranks of the decoded
  gradients: the *global* optimizer steps a copy of the parameters (:attr:`ModelBackup.weights`) when
  ``G(i)`` arrives, during iteration ``i+1``. It replaces the backup at the next local step: the
  staleness is exactly one iteration.

Both updates are torch optimizers (two instances built by the caller's factory: one on the model's
parameters, one on the copies), so SGD, momentum or Adam work unchanged and keep their own state;
``local_lr`` fixes the local optimizer's learning rate (the paper's separate ``loc_lr``); without it the
local step uses the global optimizer's current learning rate, so an LR schedule on the global optimizer
drives both. For plain
SGD with one learning rate this is delayed gradient averaging with delay 1: the local weights follow
``x(t+1) = x(t) - lr*g(t) - lr*(G(t-1) - g(t-1))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ModelBackup:
    """The global weights with the global optimizer, and the local optimizer on the model's parameters
    (the backup); see the module docstring. ``params`` are the model's parameters, in a fixed order."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        make_optimizer: OptimizerFactory,
        *,
        local_lr: float | None = None,
    ) -> None:
        self.params = list(params)
        #: the global weights w(i) (the same on every rank)
        self.weights = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in self.params]
        self.global_optimizer = make_optimizer(self.weights)
        self.local_optimizer = make_optimizer(self.params)
        if local_lr is not None:
            for g in self.local_optimizer.param_groups:
                g["lr"] = float(local_lr)
        self.local_lr = local_lr

    @torch.no_grad()
    def global_step(self, averaged: Sequence[Tensor | None]) -> None:
        """``w <- w - step(G)``: ``averaged[k]`` is G for ``params[k]`` (None: no gradient)."""
        if len(averaged) != len(self.weights):
            raise InvalidArgumentError(
                f"ModelBackup.global_step: {len(averaged)} gradients for {len(self.weights)} parameters"
            )
        for w, g in zip(self.weights, averaged):
            w.grad = None if g is None else g.view_as(w)
        self.global_optimizer.step()
        for w in self.weights:
            w.grad = None

    @torch.no_grad()
    def local_step(self) -> None:
        """Eq. 8: the model's parameters := w, then the local optimizer's step with their ``.grad``
        (this rank's own gradient)."""
        for p, w in zip(self.params, self.weights):
            p.copy_(w)
        if self.local_lr is None:  # the global learning rate, as a schedule has set it
            for lg, gg in zip(self.local_optimizer.param_groups, self.global_optimizer.param_groups):
                lg["lr"] = gg["lr"]
        self.local_optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "weights": [w.detach().clone() for w in self.weights],
            "local_optimizer": self.local_optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        ws = state.get("weights") if isinstance(state, dict) else None
        if (
            not isinstance(ws, list)
            or len(ws) != len(self.weights)
            or any(not isinstance(t, Tensor) or t.shape != w.shape for t, w in zip(ws, self.weights))
        ):
            raise InvalidArgumentError(
                f"ModelBackup.load_state_dict: expected 'weights', {len(self.weights)} tensors of the "
                "parameters' shapes"
            )
        for w, t in zip(self.weights, ws):
            w.copy_(t)
        self.local_optimizer.load_state_dict(state["local_optimizer"])
