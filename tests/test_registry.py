"""lowband.registry: one registry mechanism for strategies, schedulers and workloads."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lowband.bench.workloads import WORKLOADS, workload_names
from lowband.errors import InvalidArgumentError
from lowband.localsgd.schedulers import SCHEDULERS, scheduler_names
from lowband.registry import Registry
from lowband.strategies.registry import STRATEGIES, describe_strategies, strategy_names


def test_register_get_names_descriptions() -> None:
    reg: Registry[Callable[..., int]] = Registry("thing")

    @reg.registering("b", "the b thing")
    def b(x: int, *, scale: int = 1) -> int:
        return x * scale

    reg.register("a", lambda x: x + 1, "the a thing")
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"] and len(reg) == 2
    assert "a" in reg and "c" not in reg
    assert reg.descriptions() == {"a": "the a thing", "b": "the b thing"}
    assert reg.get("b")(3, scale=2) == 6
    with pytest.raises(InvalidArgumentError, match=r"^use: unknown thing 'c'; known: a, b$"):
        reg.get("c", "use")
    with pytest.raises(InvalidArgumentError, match=r"unknown thing 3"):
        reg.get(3)
    with pytest.raises(InvalidArgumentError, match=r"'a' is already registered"):
        reg.register("a", b)
    reg.check_options("b", {"scale": 2})
    with pytest.raises(
        InvalidArgumentError, match=r"thing 'b': unknown option\(s\) \['x', 'y'\]; it takes \['scale'\]"
    ):
        reg.check_options("b", {"x": 1, "y": 2})


def test_the_projects_registries_use_it() -> None:
    for reg, names in (
        (STRATEGIES, strategy_names()),
        (SCHEDULERS, scheduler_names()),
        (WORKLOADS, workload_names()),
    ):
        assert isinstance(reg, Registry) and reg.names() == names and names
        assert all(reg.descriptions()[n] for n in names), f"{reg.kind}: every entry is described"
    assert describe_strategies() == STRATEGIES.descriptions()
    assert {"ddp", "localsgd"} <= set(strategy_names())
