"""The one interface every training strategy implements, so ``lowband bench`` can run any of them.

A strategy wraps a model and an optimizer (built by a factory, so the strategy decides which
parameters the optimizer sees) and owns all the communication of data-parallel training. The training
loop is the same for every strategy::

    s = make_strategy("ddp", model, workload.make_optimizer)
    for batch in batches:
        loss = s.train_step(lambda m: workload.loss(m, batch))
    s.synchronize()                     # finish in-flight communication (before eval / checkpoint)
    torch.save(s.state_dict(), path)    # everything needed to resume

Strategies integrate through PyTorch's own extension points (DDP and its comm hooks, torch's model
averagers, optimizer step hooks, post-accumulate-grad hooks); none re-implements an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.group import Group

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module], torch.Tensor]


class Strategy:
    """A data-parallel training strategy on one rank.

    Subclasses set :attr:`name`, build their wrapped module and optimizer in ``__init__`` and
    implement :meth:`backward`/:meth:`step` (the defaults do plain local autograd and an optimizer
    step), and :meth:`in_sync` (whether every rank's replica is identical right now).
    """

    name: str = "strategy"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> None:
        self.local_module = model
        self.optimizer = optimizer
        self.group = group
        self.steps = 0

    # -- what the training loop calls -------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The module to call forward on (a DDP wrapper, or the plain model)."""
        return self.local_module

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self) -> None:
        self.optimizer.step()

    def train_step(self, loss_fn: LossFn) -> float:
        """One iteration: zero grads, forward (``loss_fn(self.module)``), backward, step. Returns the loss."""
        self.zero_grad()
        loss = loss_fn(self.module)
        self.backward(loss)
        self.step()
        self.steps += 1
        return float(loss.detach())

    def synchronize(self) -> None:
        """Finish all in-flight communication (nothing is in flight between steps by default)."""

    def in_sync(self) -> bool:
        """True when, by construction, every rank holds the same parameters after the last step
        (always for synchronous SGD; after an averaging step for periodic averaging)."""
        return True

    # -- reports and checkpoints ------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        """Name and parameters, for reports."""
        return {}

    def report(self) -> dict[str, Any]:
        """Figures the strategy knows about itself, for the bench report: e.g. ``predicted_step_s``
        (a cost model's predicted mean iteration time, compared there with the measured one)."""
        return {}

    def label(self) -> str:
        hp = ", ".join(f"{k}={v}" for k, v in self.hparams().items())
        return f"{self.name}({hp})" if hp else self.name

    def state_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "steps": self.steps,
            "model": self.local_module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: checkpoint is for strategy {state.get('strategy')!r}, "
                f"not {self.name!r}"
            )
        self.steps = int(state["steps"])
        self.local_module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_extra_state(state.get("extra", {}))

    def extra_state(self) -> dict[str, Any]:
        """Strategy state beyond model and optimizer (compression memory, counters, schedules)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`extra_state`."""

    def close(self) -> None:
        """Release hooks and buffers."""
