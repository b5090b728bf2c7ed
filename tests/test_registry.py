"""lowband.registry: one registry mechanism for strategies, schedulers and workloads."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lowband.bench.workloads import WORKLOADS, workload_names
from lowband.compress import COMPRESSORS, MEMORIES, TRANSPORTS
from lowband.errors import InvalidArgumentError
from lowband.localsgd.schedulers import SCHEDULERS, scheduler_names
from lowband.options import Opt, Options
from lowband.registry import Registry
from lowband.strategies.registry import STRATEGIES, describe_strategies, strategy_names
from lowband.topology.names import TOPOLOGIES


def test_register_get_names_descriptions() -> None:
    reg: Registry[Callable[..., int]] = Registry("thing")

    @reg.registering("b", "the b thing", Options({"scale": Opt(int, min=1)}))
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
    assert reg.check_options("b", {"scale": "2"}) == {"scale": 2}  # converted by the schema
    assert reg.options("b").defaults() == {"scale": 1}  # the signature's default
    with pytest.raises(
        InvalidArgumentError, match=r"thing 'b': unknown option\(s\) \['x', 'y'\]; it takes \['scale'\]"
    ):
        reg.check_options("b", {"x": 1, "y": 2})
    with pytest.raises(InvalidArgumentError, match=r"^thing 'b': scale must be an int >= 1, got 0$"):
        reg.check_options("b", {"scale": 0})
    assert reg.check_spec("b:scale=3") == ("b", {"scale": 3})


def test_registration_refuses_options_that_differ_from_the_signature() -> None:
    reg: Registry[Callable[..., int]] = Registry("thing")

    def f(*, a: int = 1, b: int = 2) -> int:
        return a + b

    with pytest.raises(InvalidArgumentError, match=r"register thing 'f'.*undeclared: \['b'\]"):
        reg.register("f", f, "", Options({"a": Opt(int)}))
    with pytest.raises(InvalidArgumentError, match=r"register thing 'f'.*not parameters: \['c'\]"):
        reg.register("f", f, "", Options({"a": Opt(int), "b": Opt(int), "c": Opt(int)}))
    with pytest.raises(InvalidArgumentError, match=r"option a declares default 5, the signature 1"):
        reg.register("f", f, "", Options({"a": Opt(int, 5), "b": Opt(int)}))
    with pytest.raises(InvalidArgumentError, match=r"the default of: b must be an int >= 3, got 2"):
        reg.register("f", f, "", Options({"a": Opt(int), "b": Opt(int, min=3)}))
    with pytest.raises(InvalidArgumentError, match=r"undeclared: \['a', 'b'\]"):
        reg.register("f", f, "")  # options with no schema are refused
    assert "f" not in reg


def test_the_projects_registries_use_it() -> None:
    for reg, names in (
        (STRATEGIES, strategy_names()),
        (SCHEDULERS, scheduler_names()),
        (WORKLOADS, workload_names()),
    ):
        assert isinstance(reg, Registry) and reg.names() == names and names
        assert all(reg.descriptions()[n] for n in names), f"{reg.kind}: every entry is described"
    for reg in (STRATEGIES, SCHEDULERS, WORKLOADS, COMPRESSORS, MEMORIES, TRANSPORTS, TOPOLOGIES):
        for name in reg.names():  # every option declared, documented and defaulted (bound at registration)
            schema = reg.options(name)
            assert all(o.doc for o in schema.opts.values()), f"{reg.kind} {name!r}: an option has no doc"
            assert set(schema.defaults()) == set(schema.names()), f"{reg.kind} {name!r}: a default is missing"
    assert describe_strategies() == STRATEGIES.descriptions()
    assert {"ddp", "localsgd"} <= set(strategy_names())
