"""The plan: every strategy spec predicted on one profile and one link model, ranked.

Each spec is checked by its strategy's schema (the bench's check, :func:`check_strategy_specs`), its
options completed with the schema's defaults and handed to the registered factory's cost model
(:meth:`lowband.strategies.Strategy.predict`; a factory without one has no model). The default specs
are every registered strategy over its :attr:`~lowband.strategies.Strategy.plan_grid`.

The recommended spec is the fastest prediction whose convergence flags the user accepts
(:class:`Acceptance`: by default every flag); predictions within :data:`TIE` of the fastest are ties,
broken by the fewest bytes sent per step (:func:`recommend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.plan.links import Links
from lowband.plan.prediction import Prediction
from lowband.plan.profile import PlanProfile


@dataclass(frozen=True)
class Acceptance:
    """The largest convergence cost accepted (None: any): local steps H, compression ratio, staleness."""

    max_local_steps: int | None = None
    max_compression: float | None = None
    max_staleness: int | None = None

    def accepts(self, p: Prediction) -> bool:
        return (
            (self.max_local_steps is None or p.local_steps <= self.max_local_steps)
            and (self.max_compression is None or p.compression <= self.max_compression * (1 + 1e-9))
            and (self.max_staleness is None or p.staleness <= self.max_staleness)
        )


@dataclass(frozen=True)
class Entry:
    """One spec of the plan and its prediction (None: the strategy has no model)."""

    spec: str
    prediction: Prediction | None

    def to_json(self) -> dict[str, Any]:
        if self.prediction is None:
            return {"spec": self.spec, "predicted_ms": None, "model": False}
        return {"spec": self.spec, "model": True, **self.prediction.to_json()}


def default_specs() -> list[str]:
    """Every registered strategy over its plan grid (``name`` or ``name:settings``)."""
    from lowband.strategies.registry import STRATEGIES

    out = []
    for name in STRATEGIES.names():
        grid: Sequence[str] = getattr(STRATEGIES.get(name), "plan_grid", ("",))
        out += [f"{name}:{g}" if g else name for g in grid]
    return out


def check_specs(specs: Sequence[str], where: str = "lowband plan") -> None:
    """Every spec registered and its options allowed (nothing is built); no spec twice."""
    from lowband.bench.validate import check_strategy_specs

    if not specs:
        raise InvalidArgumentError(f"{where}: give at least one strategy")
    check_strategy_specs(list(specs), where)
    if len(set(specs)) != len(specs):
        raise InvalidArgumentError(f"{where}: strategies repeat: {list(specs)}")


def predict_spec(
    spec: str, profile: PlanProfile, links: Links, where: str = "lowband plan"
) -> Prediction | None:
    """The prediction of the strategy spec ``spec`` (None: no model)."""
    from lowband.strategies.registry import STRATEGIES, check_strategy_options, parse_strategy_spec

    name, given = parse_strategy_spec(spec)
    factory = STRATEGIES.get(name, where)
    own, common = check_strategy_options(name, given, f"{where}: strategy {name!r}")
    options = {**STRATEGIES.options(name).defaults(), **own}
    predict = getattr(factory, "predict", None)
    if predict is None or common.get("accumulate", 1) != 1:  # the models are of one pass per step
        return None
    out: Prediction | None = predict(profile, links, options)
    return out


def make_plan(specs: Sequence[str], profile: PlanProfile, links: Links) -> list[Entry]:
    """Every spec predicted, ranked (:func:`make_plan_from`)."""
    return make_plan_from([Entry(s, predict_spec(s, profile, links)) for s in specs])


def make_plan_from(entries: Sequence[Entry]) -> list[Entry]:
    """``entries`` ranked by predicted iteration time (those without a model last, in order)."""
    modelled = sorted((e for e in entries if e.prediction), key=lambda e: e.prediction.iteration_s)  # type: ignore[union-attr]
    return modelled + [e for e in entries if e.prediction is None]


#: predictions this close to the fastest are ties: the model's error is larger (README, "Choosing a strategy")
TIE = 0.05


def recommend(entries: Sequence[Entry], accept: Acceptance, tie: float = TIE) -> str | None:
    """The fastest spec whose flags ``accept`` allows (None: none does); among those predicted within
    ``tie`` of it, the one that sends the fewest bytes per step (the first of equals). Sending costs
    processor time the model does not count (copies, the kernel's network stack; on cores the ranks
    share, time taken from computation): measured, BlueFog's every-step neighbor averaging predicted 1-2 %
    faster than local SGD's averaging every 20 steps ran 20-36 % slower."""
    ok = [e.prediction for e in entries if e.prediction is not None and accept.accepts(e.prediction)]
    specs = [e.spec for e in entries if e.prediction is not None and accept.accepts(e.prediction)]
    if not ok:
        return None
    fastest = min(p.iteration_s for p in ok)
    near = [i for i, p in enumerate(ok) if p.iteration_s <= (1 + tie) * fastest]
    return specs[min(near, key=lambda i: (ok[i].bytes_per_step, i))]
