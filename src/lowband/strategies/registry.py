"""Strategy registry: names to factories, so the bench and the CLI never switch on strings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lowband.group import Group
from lowband.registry import Registry, parse_spec
from lowband.runtime import world_group
from lowband.strategies.base import OptimizerFactory, Strategy

StrategyFactory = Callable[..., Strategy]

#: every strategy: ``factory(model, make_optimizer, group, **options) -> Strategy``
STRATEGIES: Registry[StrategyFactory] = Registry("strategy")


def register_strategy(name: str, description: str) -> Callable[[StrategyFactory], StrategyFactory]:
    """Class/function decorator: ``factory(model, make_optimizer, group, **options) -> Strategy``."""
    return STRATEGIES.registering(name, description)


def strategy_names() -> list[str]:
    return STRATEGIES.names()


def describe_strategies() -> dict[str, str]:
    return STRATEGIES.descriptions()


def parse_strategy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"localsgd:period=5"`` -> ``("localsgd", {"period": 5})`` (values parsed as int, float, bool or str)."""
    return parse_spec(spec, "strategy")


def make_strategy(
    name: str,
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group | None = None,
    **options: Any,
) -> Strategy:
    """Build the strategy registered as ``name`` on this rank (after :func:`lowband.init`)."""
    factory = STRATEGIES.get(name)
    STRATEGIES.check_options(name, options)
    _, g = world_group(group, f"make_strategy({name!r})")
    return factory(model, make_optimizer, g, **options)
