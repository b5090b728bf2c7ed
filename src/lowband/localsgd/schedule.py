"""A partial-synchronisation schedule: which layers each local iteration of a period averages.

``sets[h]`` (``h = 0..H-1``) holds the FORWARD indices of the layers averaged in local iteration ``h``
of every period, each right after its backward. ``sets[0]`` is the paper's ``L_1``. A layer may appear
in several sets (after bubble filling) but appears in at least one. Global step ``s`` uses
``sets[s % H]`` (``layers_at``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, check_layer_set, iteration_times


def check_period(where: str, H: object) -> int:
    """``H`` (the number of local iterations in a period) as an int >= 1, or an error naming ``where``."""
    if isinstance(H, bool) or not isinstance(H, int) or H < 1:
        raise InvalidArgumentError(f"{where}: H (the period) must be an int >= 1, got {H!r}")
    return H


@dataclass(frozen=True)
class Schedule:
    """Layer sets of one period of ``period`` local iterations, with their predicted times.

    Each set is stored sorted ascending. ``predicted_iterations[h]`` is the event-model time of local
    iteration ``h`` and ``predicted_period`` their sum (seconds)."""

    period: int  # H
    sets: tuple[tuple[int, ...], ...]
    method: str
    predicted_period: float
    predicted_iterations: tuple[float, ...]

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise InvalidArgumentError(f"Schedule: period must be an int >= 1, got {self.period!r}")
        if isinstance(self.sets, (str, bytes)) or not isinstance(self.sets, Sequence):
            raise InvalidArgumentError(f"Schedule: sets must be a sequence of layer sets, got {self.sets!r}")
        if len(self.sets) != self.period:
            raise InvalidArgumentError(
                f"Schedule: sets must hold one set per local iteration ({self.period}), got {len(self.sets)}"
            )
        canon: list[tuple[int, ...]] = []
        for h, s in enumerate(self.sets):
            items = list(s)
            for i in items:
                if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                    raise InvalidArgumentError(
                        f"Schedule: sets[{h}] holds {i!r}, not a layer index (int >= 0)"
                    )
            if len(set(items)) != len(items):
                raise InvalidArgumentError(f"Schedule: sets[{h}] holds a layer twice: {items!r}")
            canon.append(tuple(sorted(items)))
        object.__setattr__(self, "sets", tuple(canon))
        its = tuple(self.predicted_iterations)
        if len(its) != self.period:
            raise InvalidArgumentError(
                f"Schedule: predicted_iterations must hold {self.period} times, got {len(its)}"
            )
        for what, v in (
            ("predicted_period", self.predicted_period),
            *(("predicted_iterations", x) for x in its),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidArgumentError(f"Schedule: {what} must be finite and >= 0, got {v!r}")
        object.__setattr__(self, "predicted_iterations", tuple(float(x) for x in its))
        object.__setattr__(self, "predicted_period", float(self.predicted_period))
        if not isinstance(self.method, str):
            raise InvalidArgumentError(f"Schedule: method must be a str, got {self.method!r}")

    @classmethod
    def from_sets(cls, profile: CostProfile, sets: Sequence[Iterable[int]], method: str) -> Schedule:
        """A validated schedule for ``profile`` with its event-model predictions."""
        if isinstance(sets, (str, bytes)) or not isinstance(sets, Sequence) or not sets:
            raise InvalidArgumentError(f"Schedule.from_sets: sets must be a non-empty sequence, got {sets!r}")
        canon = tuple(check_layer_set(f"Schedule.from_sets({method!r})", profile, s) for s in sets)
        its = iteration_times(profile, canon)
        total = 0.0
        for t in its:
            total += t
        sched = cls(len(canon), canon, method, total, its)
        sched.validate(profile.L)
        return sched

    def layers_at(self, step: int) -> tuple[int, ...]:
        """Forward indices of the layers averaged at global step ``step`` (``sets[step % H]``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"Schedule.layers_at: step must be an int >= 0, got {step!r}")
        return self.sets[step % self.period]

    def sync_counts(self, L: int) -> tuple[int, ...]:
        """How many times each layer is averaged per period (>= 1 for a valid schedule)."""
        counts = [0] * L
        for s in self.sets:
            for i in s:
                if i < L:
                    counts[i] += 1
        return tuple(counts)

    def validate(self, L: int) -> None:
        """Raise ``InvalidArgumentError`` unless every index is in ``range(L)`` and every layer appears."""
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise InvalidArgumentError(f"Schedule.validate: L must be an int >= 1, got {L!r}")
        for h, s in enumerate(self.sets):
            bad = [i for i in s if i >= L]
            if bad:
                raise InvalidArgumentError(
                    f"Schedule.validate ({self.method}): sets[{h}] holds layer(s) {bad} but the model has {L} layers"
                )
        missing = [i for i, c in enumerate(self.sync_counts(L)) if c == 0]
        if missing:
            raise InvalidArgumentError(
                f"Schedule.validate ({self.method}): layer(s) {missing} are never averaged in a period of {self.period}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "period": self.period,
            "sets": [list(s) for s in self.sets],
            "method": self.method,
            "predicted_period": self.predicted_period,
            "predicted_iterations": list(self.predicted_iterations),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Schedule:
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(f"Schedule.from_json: expected a dict, got {d!r}")
        try:
            return cls(
                d["period"],
                tuple(tuple(s) for s in d["sets"]),
                d["method"],
                d["predicted_period"],
                tuple(d["predicted_iterations"]),
            )
        except (KeyError, TypeError) as e:
            raise InvalidArgumentError(f"Schedule.from_json: bad schedule {d!r} ({e!r})") from None
