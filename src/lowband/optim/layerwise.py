"""Step a model layer by layer during backward: each layer's parameters are updated by the wrapped
torch optimizer as soon as that layer's gradients are complete.

This is PyTorch's "optimizer step in backward" pattern (``register_post_accumulate_grad_hook`` with
one optimizer per parameter group, as in torch's tutorial), packaged so that strategies can act on a
layer the moment it is updated: DreamDDP averages a layer's *parameters* in place while the backward
of earlier layers still runs; BlueFog's Adapt-Then-Combine starts a layer's neighbor averaging there.

- A *layer* is a parameter-owning module (its own parameters, ``recurse=False``); a parameter shared
  by several modules (tied embeddings) belongs to the first one that registers it.
- One inner optimizer per layer, built by the caller's factory on that layer's parameters only, so
  any torch optimizer (SGD with momentum, Adam, ...) works unchanged and keeps its per-parameter state.
  Nothing is re-implemented; the extra memory is nil (the states are the same tensors a single
  optimizer would hold).
- The inner optimizers' ``param_groups`` dicts are exposed as one list, so LR schedulers and code that
  sets ``group["lr"]`` keep working.
- After a layer is stepped its gradients are set to ``None``. A layer whose parameters did not all get
  a gradient in a backward (an unused branch) is stepped on what it has when the backward ends (a
  callback queued on the autograd engine, as DDP does), and ``on_layer`` is still called for it, so a
  strategy sees every layer exactly once per backward.
- Gradient accumulation over several backwards before a step is not supported: every backward steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lowband.errors import InvalidArgumentError

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LayerCallback = Callable[[int], None]


def parameter_layers(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """The model's layers: ``(module name, its trainable parameters)`` for every module that owns
    parameters directly, in registration (usually forward) order. Shared parameters are listed once."""
    seen: set[int] = set()
    layers: list[tuple[str, list[nn.Parameter]]] = []
    for name, mod in model.named_modules():
        params = []
        for p in mod.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if params:
            layers.append((name or "<root>", params))
    return layers


class LayerwiseOptimizer(torch.optim.Optimizer):
    """A torch optimizer per layer, each stepped from backward hooks as soon as its layer is ready.

    ``on_layer(i)`` runs right after layer ``i`` (an index into :attr:`layers`) is stepped, on the
    thread running the backward. :meth:`step` steps whatever still has gradients (nothing, after a
    normal backward), so a usual ``loss.backward(); opt.step()`` loop is correct as is.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, Sequence[nn.Parameter]]],
        make_optimizer: OptimizerFactory,
        *,
        on_layer: LayerCallback | None = None,
    ) -> None:
        if not layers:
            raise InvalidArgumentError("LayerwiseOptimizer: the model has no trainable parameters")
        ids = [id(p) for _, ps in layers for p in ps]
        if len(ids) != len(set(ids)):
            raise InvalidArgumentError("LayerwiseOptimizer: a parameter appears in more than one layer")
        self.layers = [(name, list(ps)) for name, ps in layers]
        self.optimizers = [make_optimizer(ps) for _, ps in self.layers]
        for (name, _), opt in zip(self.layers, self.optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise InvalidArgumentError(
                    f"LayerwiseOptimizer: the factory returned {type(opt).__name__} for layer {name!r}, "
                    "not a torch.optim.Optimizer"
                )
        self.on_layer = on_layer
        # param_groups of every inner optimizer, the same dict objects (LR schedulers edit them)
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.defaults = dict(self.optimizers[0].defaults)
        self._layer_of = {id(p): i for i, (_, ps) in enumerate(self.layers) for p in ps}
        self._ready = [0] * len(self.layers)
        self._stepped = [False] * len(self.layers)
        self._in_backward = False
        # The hooks hold the optimizer weakly: a tensor hook that referenced it strongly would make a
        # cycle (parameter -> hook -> optimizer -> parameter) that Python's collector cannot see
        # through, keeping the optimizer and the process groups of whatever uses it alive forever.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            me = ref()
            if me is not None:
                me._on_grad(p)

        self._handles = [
            p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
            for _, ps in self.layers
            for p in ps
        ]
        self.enabled = True

    # torch.optim.Optimizer's own __init__ is not called (as torch's PostLocalSGDOptimizer does): the
    # state lives in the inner optimizers.
    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        merged: dict[Any, Any] = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    def __repr__(self) -> str:
        inner = type(self.optimizers[0]).__name__
        return f"LayerwiseOptimizer({len(self.layers)} layers of {inner})"

    # -- backward hooks ---------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)  # type: ignore[attr-defined]
        i = self._layer_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.layers[i][1]):
            self._step_layer(i)

    def _step_layer(self, i: int) -> None:
        opt = self.optimizers[i]
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._stepped[i] = True
        if self.on_layer is not None:
            self.on_layer(i)

    def _end_backward(self) -> None:
        """Runs once when the backward finishes: step the layers that got only some gradients (or none),
        in reverse registration order (the order a backward would have reached them)."""
        try:
            for i in reversed(range(len(self.layers))):
                if not self._stepped[i]:
                    self._step_layer(i)
        finally:
            self._ready = [0] * len(self.layers)
            self._stepped = [False] * len(self.layers)
            self._in_backward = False

    # -- the Optimizer interface ------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every layer that still holds gradients (after a hooked backward: none)."""
        if closure is not None:
            raise InvalidArgumentError("LayerwiseOptimizer.step: closures are not supported")
        for _, opt in enumerate(self.optimizers):
            if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
                opt.step()
                opt.zero_grad(set_to_none=True)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("layers") if isinstance(state_dict, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            got = len(states) if isinstance(states, list) else type(states).__name__
            raise InvalidArgumentError(
                f"LayerwiseOptimizer.load_state_dict: expected {len(self.optimizers)} layer states, got {got}"
            )
        for opt, st in zip(self.optimizers, states):
            opt.load_state_dict(st)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InvalidArgumentError("LayerwiseOptimizer.add_param_group: layers are fixed at construction")

    def remove_hooks(self) -> None:
        """Detach from the model (the inner optimizers stay usable)."""
        for h in self._handles:
            h.remove()
        self._handles = []
