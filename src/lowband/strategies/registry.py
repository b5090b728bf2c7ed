"""Strategy registry: names to factories, so the bench and the CLI never switch on strings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lowband.comm.initial import broadcast_initial_state, initial_broadcast_once
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.factory import as_optimizer_factory
from lowband.optim.nonfinite import POLICIES
from lowband.options import Opt, Options
from lowband.registry import Registry, parse_spec
from lowband.runtime import world_group
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.digest import agree_values, strategy_config

StrategyFactory = Callable[..., Strategy]

#: every strategy: ``factory(model, make_optimizer, group, **options) -> Strategy``
STRATEGIES: Registry[StrategyFactory] = Registry("strategy")


#: options every strategy takes, handled by :func:`make_strategy` itself (not passed to the factory)
COMMON_OPTIONS = Options(
    {
        "on_nonfinite": Opt(
            str, "raise", choices=POLICIES,
            doc="a non-finite gradient raises, skips the step on every rank, or is not checked",
        ),
        "accumulate": Opt(
            int, 1, min=1, unit="passes",
            doc="backward passes per step: gradients accumulated locally, reduced in the last pass",
        ),
    }
)  # fmt: skip


def register_strategy(
    name: str, description: str, options: Options | None = None
) -> Callable[[StrategyFactory], StrategyFactory]:
    """Class/function decorator: ``factory(model, make_optimizer, group, **options) -> Strategy``;
    ``options`` declares every keyword-only parameter of the factory (:mod:`lowband.options`)."""
    return STRATEGIES.registering(name, description, options)


def modelled_as(cls: type[Strategy]) -> Callable[[StrategyFactory], StrategyFactory]:
    """Decorator of a function factory building ``cls``: the factory carries ``cls``'s cost model
    (:meth:`Strategy.predict`, :attr:`Strategy.plan_grid`), which ``lowband plan`` reads from the
    registered factory (a class factory has them itself; a function without them has no model)."""

    def deco(factory: StrategyFactory) -> StrategyFactory:
        setattr(factory, "predict", cls.predict)  # noqa: B010 (a function's attribute, not a class's)
        setattr(factory, "plan_grid", cls.plan_grid)  # noqa: B010
        return factory

    return deco


def check_strategy_options(
    name: str, options: dict[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the factory's options, the common ones)`` of strategy ``name``, checked and converted by
    their schemas (:data:`COMMON_OPTIONS` and the strategy's own); one error prefixed by ``where``,
    which names the strategy."""
    schema = STRATEGIES.options(name, where) | COMMON_OPTIONS
    checked = schema.check(where, options)
    common = set(COMMON_OPTIONS.names())
    return (
        {k: v for k, v in checked.items() if k not in common},
        {k: v for k, v in checked.items() if k in common},
    )


def strategy_names() -> list[str]:
    return STRATEGIES.names()


def describe_strategies() -> dict[str, str]:
    return STRATEGIES.descriptions()


def parse_strategy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"localsgd:period=5"`` -> ``("localsgd", {"period": 5})`` (values parsed as int, float, bool or str)."""
    return parse_spec(spec, "strategy")


def wants_probe(name: str, options: Mapping[str, Any]) -> bool:
    """Whether strategy ``name`` takes a ``probe`` (a loss on one batch, to profile the model: ``auto``)
    that ``options`` does not give, nor a ``profile`` instead."""
    known = STRATEGIES.options(name).names() if name in STRATEGIES else []
    return "probe" in known and options.get("probe") is None and options.get("profile") is None


def check_model_device(where: str, model: nn.Module, device: torch.device) -> None:
    """The model's parameters are on the kind of device this rank computes on (``lowband.device()``): a
    CPU model on a CUDA rank (or the reverse) is refused before any strategy state or hook is made."""
    for pname, p in model.named_parameters():
        if p.device.type in ("cpu", "cuda") and p.device.type != device.type:
            raise InvalidArgumentError(
                f"{where}: parameter {pname!r} is on {p.device} but this rank computes on {device} "
                f"(lowband.device()); move the model first (model.to(lowband.device())), or start lowband on "
                f"{p.device.type} (lowband.init(device={p.device.type!r}), LOWBAND_DEVICE)"
            )


def make_strategy(
    name: str,
    model: nn.Module,
    make_optimizer: OptimizerFactory | torch.optim.Optimizer,
    group: Group | None = None,
    *,
    broadcast_init: bool = True,
    **options: Any,
) -> Strategy:
    """Build the strategy registered as ``name`` on this rank (after :func:`lowband.init`).

    ``make_optimizer`` is a factory (``params -> optimizer``) or a torch optimizer built on
    ``model.parameters()``, rebuilt by the strategy on the parameters it needs with the same class and
    options (:func:`lowband.optim.factory.as_optimizer_factory`). With ``broadcast_init`` (the default)
    every rank starts from rank 0's parameters and buffers, as torch DDP does (broadcast once the
    strategy's arguments are checked); collective. The model must be on this rank's kind of device
    (:func:`check_model_device`). Option ``on_nonfinite`` ("raise", the default, or "skip"), taken by
    every strategy: what a non-finite gradient does (:meth:`Strategy.set_nonfinite`). Option
    ``accumulate`` (default 1), taken by every strategy: backward passes per step
    (:meth:`Strategy.set_accumulate`)."""
    on_nonfinite = options.pop("on_nonfinite", "raise")  # the non-finite policy, common to every strategy
    accumulate = options.pop("accumulate", 1)  # backward passes per step, common to every strategy
    where = f"make_strategy({name!r})"
    ctx, g = world_group(group, where)
    # every rank's configuration agreed before anything else: a differing option, model or name is one
    # error on every rank, naming it (a name or option known on one rank only included)
    known = STRATEGIES.get(name) if name in STRATEGIES else None
    common = {"on_nonfinite": on_nonfinite, "accumulate": accumulate}
    config = strategy_config(name, known, {**options, **common}, model)
    agree_values(
        g, "strategy configurations", config, where=f"{where} on rank {g.rank}",
        fix="give every rank the same strategy, options and model",
    )  # fmt: skip
    factory = STRATEGIES.get(name, where)
    options, common = check_strategy_options(name, {**options, **common}, f"{where} on rank {g.rank}")
    check_model_device(f"{where} on rank {g.rank}", model, ctx.device)
    make = as_optimizer_factory(make_optimizer, where, model.parameters())
    if not isinstance(broadcast_init, bool):  # make_strategy's own argument, not a strategy option
        raise InvalidArgumentError(f"{where}: broadcast_init must be True or False, got {broadcast_init!r}")
    with initial_broadcast_once(broadcast_init):
        # the constructor broadcasts once its arguments are checked; if it did not, it happens here
        strategy = factory(model, make, g, **options)
        broadcast_initial_state(model, group=g, where=f"{where} on rank {g.rank}")
    try:
        strategy.set_nonfinite(common["on_nonfinite"])
        strategy.set_accumulate(common["accumulate"])
    except BaseException:
        strategy.close()  # a refused option leaves the model without the strategy's hooks
        raise
    strategy.agreed_config = config  # saved in its checkpoints, compared when one is loaded
    if ctx.joining:  # a replacement of a lost rank: admitted by the members, with a live member's state
        from lowband.strategies.peer_join import join_if_replacement

        join_if_replacement(strategy, where)
    return strategy
