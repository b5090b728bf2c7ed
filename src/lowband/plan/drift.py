"""When ``auto`` re-plans: the measured pace against the pace measured right after the last plan
(pure; :mod:`lowband.strategies.auto` feeds it the ranks' agreed figures).

DreamDDP's ``reprofile_drift`` compares the achieved seconds per byte with the first period after the
last (re)schedule; ``auto`` does the same with the seconds per training step. The first window after a
(re)plan is the baseline: a cost model's absolute error (a few tens of per cent on a shared machine) is
then no drift, only a change of the links or the machine is. A window counts as drifted when its mean
step is ``tolerance`` (a fraction) slower or faster than the baseline; ``windows`` drifted windows in a
row make a re-plan due (one noisy window does not). After a re-plan, :meth:`DriftWatch.reset` starts a
new baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lowband.errors import InvalidArgumentError


@dataclass
class DriftWatch:
    """Baseline and drifted-window count of the mean step time (module doc)."""

    tolerance: float
    windows: int = 2
    baseline: float | None = None
    drifted: int = 0

    def __post_init__(self) -> None:
        if not (
            isinstance(self.tolerance, (int, float)) and math.isfinite(self.tolerance) and self.tolerance > 0
        ):
            raise InvalidArgumentError(f"DriftWatch: tolerance must be a number > 0, got {self.tolerance!r}")
        if isinstance(self.windows, bool) or not isinstance(self.windows, int) or self.windows < 1:
            raise InvalidArgumentError(f"DriftWatch: windows must be an int >= 1, got {self.windows!r}")

    def ratio(self, seconds: float) -> float | None:
        """``seconds`` over the baseline (None before a baseline)."""
        return None if self.baseline is None else seconds / self.baseline

    def observe(self, seconds: float) -> bool:
        """One window's mean step ``seconds``; True when a re-plan is due (module doc)."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise InvalidArgumentError(f"DriftWatch.observe: seconds must be finite and > 0, got {seconds!r}")
        if self.baseline is None:
            self.baseline = seconds
            return False
        off = abs(seconds / self.baseline - 1.0) > self.tolerance
        self.drifted = self.drifted + 1 if off else 0
        return self.drifted >= self.windows

    def reset(self) -> None:
        """A (re)plan happened: the next window is the new baseline."""
        self.baseline, self.drifted = None, 0

    def state(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "drifted": self.drifted}

    def load(self, state: dict[str, Any]) -> None:
        b = state.get("baseline")
        self.baseline = None if b is None else float(b)
        self.drifted = int(state.get("drifted", 0))


def window_steps(every: int, local_steps: int) -> int:
    """Steps per drift window: ``every`` rounded up to a whole number of the chosen strategy's periods
    (``local_steps``), so each window ends at a synchronisation point and holds whole periods."""
    if every < 1 or local_steps < 1:
        raise InvalidArgumentError(
            f"window_steps: every and local_steps must be >= 1, got {every}, {local_steps}"
        )
    return -(-every // local_steps) * local_steps
