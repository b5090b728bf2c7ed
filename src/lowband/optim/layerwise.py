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
- The hooks are a :class:`~lowband.optim.stage.GradientStage` with the layers as units. Given a
  ``reducer`` (e.g. :class:`~lowband.optim.reducer.AllreduceReducer`), a layer's gradients are reduced
  over ``group`` first and the layer is stepped as soon as its own reduction is complete (in backward
  order, on the backward's thread). ``accumulate = J`` sums the gradients of J backward passes and
  steps (after reducing) during the J-th; passes inside :meth:`LayerwiseOptimizer.no_sync` never step.
  With a reducer, an ``on_layer`` that communicates must do so on another group than ``group``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.factory import as_optimizer_factory
from lowband.optim.reducer import Reducer, layer_units
from lowband.optim.stage import GradientStage

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LayerCallback = Callable[[int], None]
T = TypeVar("T")


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


def layer_pre_hooks(
    model: nn.Module,
    layers: Sequence[tuple[str, Sequence[nn.Parameter]]],
    owner: T,
    on_layer: Callable[[T, int], None],
) -> list[RemovableHandle]:
    """Forward pre-hooks on every module of ``model`` owning parameters of ``layers``: before the module
    runs, ``on_layer(owner, i)`` for each layer ``i`` it owns parameters of (ascending), so a layer can
    be completed just before its next forward reads it. The hooks hold ``owner`` weakly (a strong
    reference would make a cycle through the modules' hooks that keeps ``owner`` alive)."""
    index = {id(p): i for i, (_, ps) in enumerate(layers) for p in ps}
    ref = weakref.ref(owner)
    handles = []
    for mod in model.modules():
        mine = sorted({index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index})
        if not mine:
            continue

        def hook(_m: nn.Module, _a: tuple[Any, ...], keys: list[int] = mine) -> None:
            me = ref()
            if me is not None:
                for i in keys:
                    on_layer(me, i)

        handles.append(mod.register_forward_pre_hook(hook))
    return handles


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
        reducer: Reducer | None = None,
        group: Group | None = None,
        accumulate: int = 1,
        names: dict[nn.Parameter, str] | None = None,
    ) -> None:
        if not layers:
            raise InvalidArgumentError("LayerwiseOptimizer: the model has no trainable parameters")
        ids = [id(p) for _, ps in layers for p in ps]
        if len(ids) != len(set(ids)):
            raise InvalidArgumentError("LayerwiseOptimizer: a parameter appears in more than one layer")
        self.layers = [(name, list(ps)) for name, ps in layers]
        make = as_optimizer_factory(
            make_optimizer, "LayerwiseOptimizer", [p for _, ps in self.layers for p in ps]
        )
        self.optimizers = [make(ps) for _, ps in self.layers]
        for (name, _), opt in zip(self.layers, self.optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise InvalidArgumentError(
                    f"LayerwiseOptimizer: the factory returned {type(opt).__name__} for layer {name!r}, "
                    "not a torch.optim.Optimizer"
                )
        self.on_layer = on_layer
        #: layers stepped in backward since the last :meth:`step` (a second step of one is refused)
        self.stepped: set[int] = set()
        #: True (set by the strategies and ATC, which close every iteration with step()): a layer stepped
        #: again before step() raises; False (torch's step-in-backward pattern, step() optional) allows it
        self.refuse_restep = False
        # param_groups of every inner optimizer, the same dict objects (LR schedulers edit them)
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.defaults = dict(self.optimizers[0].defaults)
        #: the backward hooks: layer i's gradients (reduced, with a reducer) -> _step_layer(i)
        self.stage = GradientStage(
            layer_units(self.layers, names),
            reducer,
            group=group,
            accumulate=accumulate,
            on_reduced=self._step_layer,
            where="LayerwiseOptimizer",
        )

    @property
    def enabled(self) -> bool:
        """Whether the backward hooks step layers (when off, :meth:`step` steps what has gradients)."""
        return self.stage.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.stage.enabled = on

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

    # -- per-layer stepping ----------------------------------------------------------------------
    def _step_layer(self, i: int) -> None:
        if i in self.stepped and self.refuse_restep:
            raise InvalidArgumentError(
                f"LayerwiseOptimizer: layer {self.layers[i][0]!r} was already stepped in a backward since the "
                "last step(): layers are stepped during backward, so a second backward before step() would "
                "step them again (gradient accumulation needs accumulate=J or no_sync())"
            )
        self.stepped.add(i)
        opt = self.optimizers[i]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if self.on_layer is not None:
            self.on_layer(i)

    # -- the Optimizer interface ------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every layer that still holds gradients (after a hooked backward: none; after fewer than
        ``accumulate`` passes: the accumulated gradients, reduced first)."""
        if closure is not None:
            raise InvalidArgumentError("LayerwiseOptimizer.step: closures are not supported")
        self.stage.wait()
        self.stepped.clear()
        for _, opt in enumerate(self.optimizers):
            if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
                opt.step()
                opt.zero_grad(set_to_none=True)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        # the stage's counters (and its reducer's state): e.g. ATC's passes towards its next combination
        return {"layers": [opt.state_dict() for opt in self.optimizers], "stage": self.stage.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("layers") if isinstance(state_dict, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            got = len(states) if isinstance(states, list) else type(states).__name__
            raise InvalidArgumentError(
                f"LayerwiseOptimizer.load_state_dict: expected {len(self.optimizers)} layer states, got {got}"
            )
        for opt, st in zip(self.optimizers, states):
            opt.load_state_dict(st)
        # torch's load_state_dict makes new group dicts: the exposed list, in place (a scheduler built
        # before the load reads it through this optimizer), holds them
        self.param_groups[:] = [g for opt in self.optimizers for g in opt.param_groups]
        if "stage" in state_dict:
            self.stage.load_state_dict(state_dict["stage"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InvalidArgumentError("LayerwiseOptimizer.add_param_group: layers are fixed at construction")

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (no reduction, no step)."""
        with self.stage.no_sync():
            yield

    def remove_hooks(self) -> None:
        """Detach from the model (the inner optimizers stay usable)."""
        self.stage.remove_hooks()
