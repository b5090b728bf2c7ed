"""Optimizer factories from what a user has at hand: a factory (``params -> optimizer``) as is, or a
built torch optimizer, from which a factory is made that rebuilds its class with its hyperparameters.

Strategies and wrappers decide which parameters an optimizer sees (one per layer for per-layer stepping,
one over the local model for DDP), so they take a factory. A given optimizer instance is not stepped
itself: :func:`as_optimizer_factory` builds, for any subset of its parameters, a new optimizer of its
class whose groups carry the options (``lr``, ``momentum``, ``weight_decay``, ...) of the groups those
parameters came from. The new optimizers start with a fresh state (momentum buffers, moments); the
instance's own state, if it was stepped, is not carried over (load it with the strategy's
``load_state_dict`` instead). The instance must hold every parameter the strategy will give it and
nothing else: an optimizer over other parameters would silently train nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lowband.errors import InvalidArgumentError

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def instance_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory building, for any of ``optimizer``'s parameters, a new optimizer of its class whose
    groups carry the options of the groups those parameters came from (parameters it does not hold get
    its ``defaults``). The given optimizer itself is left untouched."""
    cls = type(optimizer)
    defaults = _constructor_options(cls, optimizer.defaults)
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        buckets: dict[int, list[nn.Parameter]] = {}
        for p in params:
            buckets.setdefault(group_of.get(id(p), -1), []).append(p)
        groups = [{"params": ps, **(options[i] if i >= 0 else {})} for i, ps in buckets.items()]
        return cls(groups, **defaults)

    return make


def _constructor_options(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` less the keys ``cls``'s constructor does not take: an optimizer's ``defaults`` may hold
    more (torch's AdamW records ``decoupled_weight_decay``, which its constructor fixes and refuses)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def as_optimizer_factory(
    make_optimizer: object, where: str, params: Iterable[nn.Parameter]
) -> OptimizerFactory:
    """``make_optimizer`` if it is a factory; if it is a torch optimizer, a factory rebuilding it
    (:func:`instance_factory`) after checking that it holds exactly the trainable ``params`` (else
    :class:`InvalidArgumentError` naming ``where``)."""
    if isinstance(make_optimizer, torch.optim.Optimizer):
        wanted = {id(p): p for p in params if p.requires_grad}
        held = [p for g in make_optimizer.param_groups for p in g["params"]]
        foreign = [p for p in held if id(p) not in wanted and p.requires_grad]
        missing = len(wanted) - len({id(p) for p in held if id(p) in wanted})
        if foreign or missing:
            raise InvalidArgumentError(
                f"{where}: the {type(make_optimizer).__name__} given holds {len(foreign)} parameter(s) that are "
                f"not the model's and misses {missing} of the model's {len(wanted)} trainable parameter(s); "
                "build it on model.parameters() of the model given here (or pass a factory: "
                "lambda params: torch.optim.SGD(params, lr=...))"
            )
        return instance_factory(make_optimizer)
    if not callable(make_optimizer):
        raise InvalidArgumentError(
            f"{where}: the optimizer must be a torch.optim.Optimizer or a factory params -> optimizer, "
            f"got {type(make_optimizer).__name__}"
        )
    factory: OptimizerFactory = make_optimizer
    return factory
