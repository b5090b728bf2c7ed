"""Schedulers for partial synchronisation and their registry.

Search space shared by ``schedule_optimal``, ``schedule_bruteforce`` and DreamDDP's Algorithm 2: the
layers, taken in backward order (forward index ``L - 1`` down to 0), are cut into ``H`` consecutive,
possibly empty, intervals; interval ``h`` is averaged in local iteration ``h`` (``sets[0]`` holds the
latest layers, as the paper's ``L_1``).

Objectives (both additive over the iterations of a period):

- ``"event"`` (default): the event-model period time ``costmodel.period_time`` (Eq. 7 with its waits,
  and with the profile's measured interference ``kappa``/``sigma`` when non-zero);
- ``"eq8"``: the paper's Eq. 8 objective ``costmodel.objective_eq8`` (interval approximation).

Whatever the objective, a ``Schedule``'s ``predicted_*`` fields are event-model times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.localsgd.algorithm2 import MEASURES, Sets, schedule_dreamddp
from lowband.localsgd.costmodel import CostProfile, eq8_set_cost, iteration_time
from lowband.localsgd.intervals import INTERVAL_OBJECTIVES, IntervalCosts
from lowband.localsgd.schedule import Schedule, check_period
from lowband.localsgd.search import schedule_dreamddp_ls
from lowband.options import Opt, Options
from lowband.registry import Registry

SetCost = Callable[[CostProfile, Iterable[int]], float]
SET_COSTS: dict[str, SetCost] = {"event": iteration_time, "eq8": eq8_set_cost}


def _check_objective(where: str, objective: object) -> str:
    if not isinstance(objective, str) or objective not in INTERVAL_OBJECTIVES:
        raise InvalidArgumentError(
            f"{where}: objective must be one of {sorted(INTERVAL_OBJECTIVES)}, got {objective!r}"
        )
    return objective


TIE_RTOL = 1e-12  # costs this close (relative) are ties: summation order alone moves them by ulps


def _better(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """``a = (cost, empty sets)`` beats ``b``: clearly cheaper, or tied in cost with fewer empty sets."""
    tol = TIE_RTOL * abs(b[0]) if math.isfinite(b[0]) else 0.0
    return a[0] < b[0] - tol or (a[0] <= b[0] + tol and a[1] < b[1])


def _method(base: str, objective: str) -> str:
    return base if objective == "event" else f"{base}-{objective}"


def _sets_from_cuts(L: int, cuts: Iterable[int]) -> Sets:
    """Backward-order cut positions ``0 <= c_1 <= ... <= c_{H-1} <= L`` -> sets of forward indices.

    Set ``h`` holds the layers at backward positions ``c_h .. c_{h+1} - 1``, i.e. forward indices
    ``L - c_{h+1} .. L - 1 - c_h``."""
    bounds = [0, *cuts, L]
    return tuple(tuple(range(L - bounds[h + 1], L - bounds[h])) for h in range(len(bounds) - 1))


def schedule_optimal(profile: CostProfile, H: int, *, objective: str = "event") -> Schedule:
    """The exact optimum over the search space (consecutive, possibly empty intervals in backward order)
    of ``objective`` (default: the event-model period time), by dynamic programming in O(H * L^2).

    ``f[k][c]``: least cost of putting the latest ``c`` layers into the first ``k`` sets;
    ``f[k][c] = min_{c' <= c} f[k-1][c'] + cost(layers at backward positions c'..c-1)``.
    Costs within ``TIE_RTOL`` (relative) are ties; they go to fewer empty sets, then to the smallest cut
    (empty sets are harmless, but the runtime has less to do with them). Splitting a set never costs more under the event model, so with
    ``L >= H`` some optimum has no empty set."""
    check_period("schedule_optimal", H)
    objective = _check_objective("schedule_optimal", objective)
    L = profile.L
    costs = IntervalCosts(profile, objective)
    # f[c] = (cost, number of empty sets): ties in cost go to fewer empty sets, then to the smallest cut
    f = [(0.0 + costs.cost(L - c, L - 1), int(c == 0)) for c in range(L + 1)]  # one set: latest c layers
    arg: list[list[int]] = []  # arg[k-2][c]: the best c' for k sets and c layers
    for k in range(2, H + 1):
        g = [(math.inf, 0)] * (L + 1)
        a = [0] * (L + 1)
        for c in range(L + 1) if k < H else (L,):
            best, best_cp = (math.inf, 0), 0
            lo = L - c
            for cp in range(c + 1):
                v = (f[cp][0] + costs.cost(lo, L - 1 - cp), f[cp][1] + (cp == c))
                if _better(v, best):
                    best, best_cp = v, cp
            g[c], a[c] = best, best_cp
        f = g
        arg.append(a)
    cuts = [L]
    for a in reversed(arg):
        cuts.append(a[cuts[-1]])
    sets = _sets_from_cuts(L, reversed(cuts[1:]))
    return Schedule.from_sets(profile, sets, _method("optimal", objective))


def schedule_bruteforce(
    profile: CostProfile,
    H: int,
    *,
    objective: str = "event",
    max_candidates: int = 2_000_000,
) -> Schedule:
    """The optimum of ``objective`` by enumerating all C(L+H-1, H-1) cut vectors (ties as in
    ``schedule_optimal``: fewer empty sets, then the first found).

    For validating ``schedule_optimal`` on small ``L``; raises ``InvalidArgumentError`` when there are
    more than ``max_candidates`` candidates. Per-set costs come straight from ``iteration_time`` (or
    ``eq8_set_cost``), cached per interval."""
    check_period("schedule_bruteforce", H)
    objective = _check_objective("schedule_bruteforce", objective)
    L = profile.L
    n = math.comb(L + H - 1, H - 1)
    if n > max_candidates:
        raise InvalidArgumentError(
            f"schedule_bruteforce: L={L}, H={H} gives {n} candidates, more than max_candidates={max_candidates}"
        )
    set_cost = SET_COSTS[objective]
    cache: dict[tuple[int, ...], float] = {}
    best_sets: Sets | None = None
    best = (math.inf, 0)
    for cuts in itertools.combinations_with_replacement(range(L + 1), H - 1):
        sets = _sets_from_cuts(L, cuts)
        total = 0.0
        for s in sets:
            c = cache.get(s)
            if c is None:
                c = cache[s] = set_cost(profile, s)
            total += c
        key = (total, sum(1 for s in sets if not s))
        if _better(key, best):
            best, best_sets = key, sets
    assert best_sets is not None
    return Schedule.from_sets(profile, best_sets, _method("bruteforce", objective))


def schedule_enp(profile: CostProfile, H: int) -> Schedule:
    """Equal-number partition (Example 1): ``L`` layers cut into ``H`` runs of ``L // H`` or ``L // H + 1``
    layers in backward order, the longer runs first; ``sets[0]`` takes the latest layers (empty sets
    at the end when ``L < H``)."""
    check_period("schedule_enp", H)
    q, r = divmod(profile.L, H)
    cuts = list(itertools.accumulate(q + (1 if h < r else 0) for h in range(H - 1)))
    return Schedule.from_sets(profile, _sets_from_cuts(profile.L, cuts), "enp")


def schedule_full(profile: CostProfile, H: int) -> Schedule:
    """Every layer averaged in the last local iteration (FLSGD's one averaging per period).

    Its predicted time is the event model's, i.e. averaging overlapped with that iteration's backward;
    ``costmodel.flsgd_period_time`` gives classic FLSGD's time with no overlap."""
    check_period("schedule_full", H)
    sets = ((),) * (H - 1) + (tuple(range(profile.L)),)
    return Schedule.from_sets(profile, sets, "full")


Scheduler = Callable[..., Schedule]

#: name -> scheduler(profile, H, **keyword options)
SCHEDULERS: Registry[Scheduler] = Registry("scheduler")
_OBJECTIVE = Opt(str, choices=sorted(INTERVAL_OBJECTIVES), doc="what the intervals minimise")
_FILL = Opt(bool, doc="bubble filling after the partition")
SCHEDULERS.register(
    "dreamddp", schedule_dreamddp, "DreamDDP's Algorithm 2, with bubble filling",
    Options({"fill_bubbles": _FILL, "measure": Opt(str, choices=MEASURES, doc="Eq. 7's span or Eq. 10's sum")}),
)  # fmt: skip
SCHEDULERS.register(
    "optimal",
    schedule_optimal,
    "the exact optimum over consecutive intervals",
    Options({"objective": _OBJECTIVE}),
)
SCHEDULERS.register(
    "bruteforce", schedule_bruteforce, "every cut enumerated (a check of optimal)",
    Options({"objective": _OBJECTIVE, "max_candidates": Opt(int, min=1, doc="refuse more cut vectors")}),
)  # fmt: skip
SCHEDULERS.register("enp", schedule_enp, "equal numbers of layers per iteration")
SCHEDULERS.register("full", schedule_full, "every layer in the last iteration (FLSGD's one averaging)")
SCHEDULERS.register(
    "dreamddp-ls", schedule_dreamddp_ls, "Algorithm 2 refined by local search, then bubble filling",
    Options({"fill": _FILL, "max_passes": Opt(int, min=0, doc="local-search passes at most")}),
)  # fmt: skip


def scheduler_names() -> list[str]:
    return SCHEDULERS.names()


def make_schedule(method: str, profile: CostProfile, H: int, **kw: Any) -> Schedule:
    """The schedule of the registered scheduler ``method`` (``SCHEDULERS``) for ``profile`` and period ``H``."""
    fn = SCHEDULERS.get(method, "make_schedule")
    return fn(profile, H, **SCHEDULERS.check_options(method, kw, f"make_schedule({method!r})"))
