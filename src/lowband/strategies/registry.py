"""Strategy registry: names to factories, so the bench and the CLI never switch on strings."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.runtime import world_group
from lowband.strategies.base import OptimizerFactory, Strategy

StrategyFactory = Callable[..., Strategy]

_REGISTRY: dict[str, tuple[StrategyFactory, str]] = {}


def register_strategy(name: str, description: str) -> Callable[[StrategyFactory], StrategyFactory]:
    """Class/function decorator: ``factory(model, make_optimizer, group, **options) -> Strategy``."""

    def deco(factory: StrategyFactory) -> StrategyFactory:
        if name in _REGISTRY:
            raise InvalidArgumentError(f"register_strategy: {name!r} is already registered")
        _REGISTRY[name] = (factory, description)
        return factory

    return deco


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def describe_strategies() -> dict[str, str]:
    return {k: v[1] for k, v in sorted(_REGISTRY.items())}


def parse_strategy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"localsgd:period=5"`` -> ``("localsgd", {"period": 5})`` (values parsed as int, float or str)."""
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise InvalidArgumentError(f"strategy spec {spec!r}: expected name:key=value,key=value")
        options[key.strip()] = _parse_value(value.strip())
    return name.strip(), options


def _parse_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def make_strategy(
    name: str,
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group | None = None,
    **options: Any,
) -> Strategy:
    """Build the strategy registered as ``name`` on this rank (after :func:`lowband.init`)."""
    if name not in _REGISTRY:
        raise InvalidArgumentError(f"unknown strategy {name!r}; available: {', '.join(strategy_names())}")
    factory = _REGISTRY[name][0]
    accepted = {
        p.name for p in list(inspect.signature(factory).parameters.values())[3:] if p.kind == p.KEYWORD_ONLY
    }
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise InvalidArgumentError(
            f"strategy {name!r}: unknown option(s) {unknown}; it takes {sorted(accepted) or 'no options'}"
        )
    _, g = world_group(group, f"make_strategy({name!r})")
    return factory(model, make_optimizer, g, **options)
