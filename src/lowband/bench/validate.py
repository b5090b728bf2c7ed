"""Checking a bench's strategy specs before anything starts, constructing nothing.

A spec (``name:key=value,...``) is refused when the name is not registered or when an option is not
what the strategy's schema (:mod:`lowband.options`, declared with its registration) allows: an unknown
key, a value of the wrong type (a word where an int is wanted, ``period=2.5``, ``1`` for a bool), out of
range (``period=0``), not one of the choices (``embrace:schedule=diagonal``), a nested spec's bad value
(``compressed:compressor=qsgd:levels=0``) or a broken cross-option rule. The same schemas check
``make_strategy``'s options on the ranks, so what passes here is what the ranks accept.

Workloads: a registered name, or a user's ``module:factory`` / ``file.py:factory`` that loads.
"""

from __future__ import annotations

from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.registry import Registry


def describe_options(registry: Registry[Any], name: str) -> str:
    """``key=default, ...`` of the item registered as ``name`` (one line; empty without options)."""
    return registry.options(name).describe()


def help_options(registry: Registry[Any], name: str) -> list[str]:
    """One line per option of the item ``name`` (default, what is allowed, the doc), for ``--list``."""
    return registry.options(name).help()


def check_strategy_specs(specs: list[str], where: str = "lowband bench") -> None:
    """Every spec of ``-s`` checked by its strategy's schema and the options common to every strategy
    (:func:`lowband.strategies.registry.check_strategy_options`)."""
    from lowband.strategies import parse_strategy_spec
    from lowband.strategies.registry import STRATEGIES, check_strategy_options

    for spec in specs:
        name, options = parse_strategy_spec(spec)
        STRATEGIES.get(name, where)
        check_strategy_options(name, options, f"{where}: strategy {name!r}")


def check_fixed_steps(specs: list[str], where: str = "lowband bench") -> None:
    """Strategies the bench's loop (the same number of steps on every rank) cannot run: ``diloco`` with
    ``inner_steps=auto`` gives the machines different steps per period."""
    from lowband.strategies import parse_strategy_spec

    for spec in specs:
        name, options = parse_strategy_spec(spec)
        if name == "diloco" and str(options.get("inner_steps")) == "auto":
            raise InvalidArgumentError(
                f"{where}: strategy 'diloco' with inner_steps=auto gives the machines different numbers of "
                "steps per period, and the bench runs one number of steps on every rank (not supported yet; "
                "run it from a loop over periods of s.period_steps steps each, or give inner_steps=H)"
            )


def check_workload(name: str, where: str = "lowband bench") -> None:
    """A registered workload name, or a user's (``module:factory``, ``file.py:factory``) that loads: the
    module imports and the factory returns a workload (its model is not built here)."""
    from lowband.bench.workloads import WORKLOADS
    from lowband.bench.workloads.loader import is_spec, load_workload

    if isinstance(name, str) and is_spec(name):
        load_workload(name)
        return
    WORKLOADS.get(name, where)
