"""Iteration costs of every interval of layers, memoised: what the DP optimum and Algorithm 2's argmin
evaluate (the cost model itself is :mod:`lowband.localsgd.costmodel`)."""

from __future__ import annotations

import math

from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, add_layer, finish, start_state


class IntervalCosts:
    """Cost of one iteration whose set is an interval of layers ``lo..hi`` (forward indices), memoised.

    ``objective="event"``: the event model (bit-identical to ``iteration_time(profile, range(lo, hi + 1))``);
    ``objective="eq8"``: one term of Eq. 8 (bit-identical to ``eq8_set_cost``). Costs of all intervals
    sharing a top layer ``hi`` are computed together in one backward sweep, O(L) per top layer."""

    def __init__(self, profile: CostProfile, objective: str = "event") -> None:
        if objective not in INTERVAL_OBJECTIVES:
            raise InvalidArgumentError(
                f"IntervalCosts: objective must be one of {sorted(INTERVAL_OBJECTIVES)}, got {objective!r}"
            )
        self.profile = profile
        self.objective = objective
        self._rows: dict[int, list[float]] = {}
        p = profile
        self.empty = p.fwd_total + max(p.bwd_total, -math.inf) if objective == "event" else p.bwd_total

    def cost(self, lo: int, hi: int) -> float:
        """Cost of the set ``{lo, ..., hi}`` (``lo > hi``: the empty set)."""
        if lo > hi:
            return self.empty
        row = self._rows.get(hi)
        if row is None:
            row = self._rows[hi] = INTERVAL_OBJECTIVES[self.objective](self.profile, hi)
        return row[lo]


def _event_row(p: CostProfile, hi: int) -> list[float]:
    row = [0.0] * (hi + 1)
    if p.interference:  # the same operations as iteration_time, sharing the timeline's prefix
        state = start_state(p, hi)
        row[hi] = p.fwd_total + max(finish(p, state))
        for i in range(hi - 1, -1, -1):
            state = add_layer(p, state, i)
            row[i] = p.fwd_total + max(finish(p, state))
        return row
    ends = p.bwd_ends
    end = -math.inf
    for i in range(hi, -1, -1):
        end = max(ends[i], end) + p.layers[i].comm
        row[i] = p.fwd_total + max(p.bwd_total, end)
    return row


def _eq8_row(p: CostProfile, hi: int) -> list[float]:
    row = [0.0] * (hi + 1)
    s = 0.0
    for i in range(hi, -1, -1):
        s += p.layers[i].comm
        row[i] = p.bwd_ends[hi] + max(p.bwd_below[hi], s)
    return row


# objective name -> (profile, top layer) -> costs of the intervals lo..top for lo = 0..top
INTERVAL_OBJECTIVES = {"event": _event_row, "eq8": _eq8_row}
