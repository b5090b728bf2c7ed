"""``dense-priority``: every gradient dense (embedding tables included), allreduced in priority order,
chunked, and overlapped with the next forward: the scheduling of BytePS / ByteScheduler ("A Generic
Communication Scheduler for Distributed DNN Training Acceleration"), without sparsity.

After backward, the gradients are averaged layer by layer in forward (registration) order, the first
layer's first, each layer's gradients cut into chunks of at most ``chunk_mb`` megabytes (views of the
flat gradient) and issued as nonblocking allreduces; the order is fixed, the same on every rank (gloo
runs a group's collectives in issue order, so a layer's chunks complete before the next layer's: the
first layers' parameters are ready first). A layer is stepped (its own torch optimizer, one per
layer: :class:`~lowband.optim.LayerwiseOptimizer`'s inner optimizers, with its hooks off) in the
forward pre-hook of its module, just before the next forward reads it, so the communication of the
later layers overlaps the forward of the earlier ones. :meth:`synchronize` completes and steps every
layer (before evaluation and checkpoints).

A layer's parameters must be read inside its module's forward (the modules are the hooks' points);
a parameter shared by two modules belongs to the first that registers it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.comm.fusion import igrouped_allreduce
from lowband.comm.handle import Handle
from lowband.comm.initial import broadcast_initial_state
from lowband.group import Group
from lowband.optim.layerwise import LayerwiseOptimizer, layer_pre_hooks, parameter_layers
from lowband.options import Opt, Options
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.registry import register_strategy

Tensor = torch.Tensor


def chunk_views(grads: list[Tensor], chunk_bytes: int) -> list[Tensor]:
    """Each gradient's flat view cut into pieces of at most ``chunk_bytes`` (in order)."""
    out: list[Tensor] = []
    for g in grads:
        flat = g.view(-1)
        step = max(1, chunk_bytes // max(1, g.element_size()))
        out.extend(torch.split(flat, step))
    return out


@register_strategy(
    "dense-priority",
    "dense allreduce in forward (priority) order, chunked (chunk_mb), overlapped with the next forward "
    "(BytePS/ByteScheduler's way)",
    Options({"chunk_mb": Opt(float, gt=0, unit="MB", doc="the size of each allreduce chunk")}),
)
class DensePriorityStrategy(Strategy):
    """Module docstring."""

    name = "dense-priority"
    no_skip_reason = "it steps each layer as its reduction arrives, in the next forward"

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, chunk_mb: float = 4.0
    ) -> None:
        self.chunk_mb = float(chunk_mb)
        broadcast_initial_state(model, group=group)  # every replica starts from rank 0's model, as DDP does
        self.fast = group.unchecked()
        self.layers = parameter_layers(model)
        lw = LayerwiseOptimizer(self.layers, make_optimizer)
        lw.enabled = False  # stepped here, not from backward hooks
        lw.remove_hooks()
        self.lw = lw
        self._pending: dict[int, Handle[list[Tensor]]] = {}
        self._hooks = layer_pre_hooks(model, self.layers, self, DensePriorityStrategy._finish)
        super().__init__(model, lw, group)

    def _finish(self, i: int) -> None:
        h = self._pending.pop(i, None)
        if h is None:
            return
        h.wait()
        opt = self.lw.optimizers[i]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def clear_gradients(self) -> None:
        # layers still in flight keep their (averaged) gradients until their pre-hook steps them
        for i, opt in enumerate(self.lw.optimizers):
            if i not in self._pending:
                opt.zero_grad(set_to_none=True)

    def apply_step(self) -> None:
        self.synchronize()  # layers the last forward did not read
        self.check_nonfinite()  # the non-finite policy, before the gradients are sent (Strategy.check_nonfinite)
        chunk = int(self.chunk_mb * 2**20)
        for i, (name, ps) in enumerate(self.layers):
            grads = []
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            views = chunk_views(grads, chunk)
            self._pending[i] = igrouped_allreduce(
                views, "average", inplace=True, name=name, group=self.fast, fusion_threshold=chunk
            )

    def synchronize(self) -> None:
        for i in sorted(self._pending):
            self._finish(i)

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()  # the layers still due are stepped (as their next forward would)
        return super().state_dict()

    def hparams(self) -> dict[str, Any]:
        return {"chunk_mb": self.chunk_mb}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
