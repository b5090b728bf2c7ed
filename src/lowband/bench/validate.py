"""Checking a bench's strategy specs before anything starts, constructing nothing.

A spec (``name:key=value,...``) is refused when the name is not registered, when a key is not one of the
factory's keyword-only options, or when a value's type cannot be what the option's annotation says (a
word where an ``int`` is wanted, ``period=2.5``, ``1`` for a ``bool``). Values the command line gives are
ints, floats, bools or strings (:func:`lowband.registry.parse_value`); an option annotated with a type a
command line cannot give (a ``Schedule``, a ``Topology`` object) takes its string form when the
annotation admits ``str``, and is otherwise left to the factory. Range checks (``period=0``) stay with the
factories, which run on the ranks.

Workloads: a registered name, or a user's ``module:factory`` / ``file.py:factory`` that loads.
"""

from __future__ import annotations

import inspect
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.registry import Registry

#: annotation words -> the command-line value types they accept
_ACCEPTS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "None": (),
}


def _type_name(v: object) -> str:
    return {bool: "a bool", int: "an int", float: "a float", str: "a word"}.get(type(v), type(v).__name__)


def check_value(where: str, key: str, annotation: Any, value: object) -> None:
    """Raise unless ``value`` (as parsed from a command line) can be of the type ``annotation`` names."""
    if annotation is inspect.Parameter.empty:
        return
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    words = [w.strip() for w in text.split("|")]
    if not all(w in _ACCEPTS for w in words):
        return  # a type a command line cannot name: the factory decides
    accepted = tuple(t for w in words for t in _ACCEPTS[w])
    ok = isinstance(value, accepted) and not (isinstance(value, bool) and bool not in accepted)
    if not ok:
        raise InvalidArgumentError(f"{where}: option {key}={value!r} is {_type_name(value)}; it takes {text}")


def options_of(factory: Any) -> dict[str, inspect.Parameter]:
    """A factory's keyword-only parameters (its options), by name."""
    params = inspect.signature(factory).parameters.values()
    return {p.name: p for p in params if p.kind == p.KEYWORD_ONLY}


def describe_options(factory: Any) -> str:
    """``key=default, ...`` for ``--list``."""
    return ", ".join(f"{p.name}={p.default}" for p in options_of(factory).values())


def check_spec(registry: Registry[Any], name: str, options: dict[str, Any], where: str) -> None:
    """Raise :class:`InvalidArgumentError` for an unknown name, unknown options or wrongly typed values."""
    factory = registry.get(name, where)
    registry.check_options(name, options, f"{where}: {registry.kind} {name!r}")
    params = options_of(factory)
    for key, value in options.items():
        check_value(f"{where}: {registry.kind} {name!r}", key, params[key].annotation, value)


def check_strategy_specs(specs: list[str], where: str = "lowband bench") -> None:
    """Every spec of ``-s``, checked as :func:`check_spec` says."""
    from lowband.optim.nonfinite import POLICIES
    from lowband.strategies import parse_strategy_spec
    from lowband.strategies.registry import STRATEGIES

    for spec in specs:
        name, options = parse_strategy_spec(spec)
        policy = options.pop("on_nonfinite", "raise")  # common to every strategy (make_strategy)
        if policy not in POLICIES:
            raise InvalidArgumentError(
                f"{where}: strategy {name!r}: on_nonfinite={policy!r}; use one of {', '.join(POLICIES)}"
            )
        check_spec(STRATEGIES, name, options, where)


def check_workload(name: str, where: str = "lowband bench") -> None:
    """A registered workload name, or a user's (``module:factory``, ``file.py:factory``) that loads: the
    module imports and the factory returns a workload (its model is not built here)."""
    from lowband.bench.workloads import WORKLOADS
    from lowband.bench.workloads.loader import is_spec, load_workload

    if isinstance(name, str) and is_spec(name):
        load_workload(name)
        return
    WORKLOADS.get(name, where)
