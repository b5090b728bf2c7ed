"""DreamDDP's scheduler: Algorithm 2 of the paper (DFS pruned by Properties 1-3) and §3.4 bubble filling.

Algorithm 2 walks the layers in backward order (paper layer L down to 1, forward index ``L - 1`` down to
0) and the local iterations in time order (``h = 0..H-1``; the paper's ``L_1`` is ``sets[0]`` and takes
the latest layers). For layer ``l`` and the current set ``L_h`` (``h0``: its first, latest, layer;
``below``: backward time left after ``h0``, the paper's ``t_BP^{L_{h:H}} - t_BP^{h0}``; ``C(X)``: the
communication time of a set ``X``, the paper's ``t_COMM^X``):

- no layer left: one solution (later sets stay empty);
- last iteration: every remaining layer goes into it (one solution);
- ``L_h`` empty: assign ``l`` to it (Property 3, at-least-one);
- ``below >= C(L_h + {l})``: assign (Property 1, optimal hiding);
- ``below < C(L_h)``: move on to ``h + 1`` (Property 2, delayed CO assignment);
- otherwise search both: assign ``l`` to ``L_h``, or move on to ``h + 1``.

The paper defines ``t_COMM^X`` twice: Eq. 10's text says ``sum of t_COMM^l over X`` (``measure="sum"``),
Eq. 7 defines it with the ``tau`` recurrence as the span from the first averaging's start to the last
one's end, waits for backward included (``measure="span"``). With ``"span"`` the hiding test of
Property 1 is exact under the event model (the set's averagings end before the backward does); with
``"sum"`` a set passes it while its late layers' averagings still spill past the backward. Both are
offered; the default is ``"span"``, the reading under which Algorithm 2 and Eq. 7 agree (see the
benchmark for how far each lands from the optimum).

The published listing's search branch reads ``SolveSubProblem(Psi_+, l-1, L, h, H)`` after assigning in
``Psi_-`` (line 28) and ``SolveSubProblem(Psi_+, l, L, h-1, H)`` (line 30). These are typos: we implement
the evident intent, i.e. recurse on the copy ``Psi_-`` where ``l`` was assigned, and on the untouched
copy ``Psi_+`` with the next iteration ``h + 1``. All solutions are collected (Ω) and the one with the
least event-model period time (``costmodel.period_time``) is returned; ties go to the first in DFS
order (assign branch first).

Speed: the choice at every step depends only on (``h0``, ``l``), so every set closes at one of at most
two layers (after a search's assignment the next layer is always delayed), and a solution's cost is a
sum of per-set costs. Ω is therefore the set of paths of a small DAG over states (first layer of set
``h``, ``h``); ``schedule_dreamddp`` takes the argmin over it by dynamic programming (same Ω, same
argmin, O(H * L^2) worst case) instead of materialising every solution. ``dreamddp_solutions``
enumerates Ω literally, as the listing does, for tests and benchmarks.
"""

from __future__ import annotations

import copy

from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, add_layer, iteration_time, start_state
from lowband.localsgd.intervals import IntervalCosts
from lowband.localsgd.schedule import Schedule, check_period

Sets = tuple[tuple[int, ...], ...]
State = tuple[float, float, int]


class _Measure:
    """``C(X)`` for a set ``X = {top, top-1, ..., i}`` built one layer at a time in backward order, and the
    hiding test ``below >= C(X)`` of Properties 1-2 (``hides``).

    The state is ``(value, queue, last layer)``. Without interference its value is the running sum of
    ``comm`` (``"sum"``) or the end of the averaging chain from the start of backward (``"span"``), both
    computed in one fixed order so every caller gets the same floats. With interference (``kappa`` or
    ``sigma`` non-zero) ``"span"`` runs the cost model's two-resource timeline and a set hides when its
    queue drains no later than the backward left (``queue * (1 + sigma) <= below_last * (1 + kappa)``); ``"sum"`` hides when ``(1 + sigma) * sum(comm) <=
    (1 + kappa) * below`` (both running side by side the whole time)."""

    def __init__(self, profile: CostProfile, measure: str) -> None:
        if measure not in MEASURES:
            raise InvalidArgumentError(
                f"schedule_dreamddp: measure must be one of {MEASURES}, got {measure!r}"
            )
        self.profile = profile
        self.span = measure == "span"
        self.timeline = self.span and profile.interference
        self.comm = [lc.comm for lc in profile.layers]
        self.ends = profile.bwd_ends
        self.below = profile.bwd_below
        self.k1 = 1.0 + profile.kappa
        self.s1 = 1.0 + profile.sigma

    def start(self, top: int) -> State:
        if self.timeline:
            return start_state(self.profile, top)
        return (self.ends[top] + self.comm[top] if self.span else self.comm[top], 0.0, top)

    def add(self, state: State, i: int) -> State:
        if self.timeline:
            return add_layer(self.profile, state, i)
        v = state[0]
        return (max(self.ends[i], v) + self.comm[i] if self.span else v + self.comm[i], 0.0, i)

    def hides(self, state: State, top: int) -> bool:
        """Whether the set's averagings hide behind the backward left after ``top`` (``below >= C(X)``)."""
        if self.timeline:  # the queue drains before the backward left (cost model's ``finish``) ends
            _, q, last = state
            return q * self.s1 <= self.below[last] * self.k1
        if self.span:
            return self.below[top] >= state[0] - self.ends[top]
        if self.profile.interference:
            return self.below[top] * self.k1 >= state[0] * self.s1
        return self.below[top] >= state[0]


MEASURES = ("span", "sum")


def _next_starts(profile: CostProfile, m: _Measure, top: int) -> tuple[int, ...]:
    """Where set ``h`` may close when it starts (at-least-one) with layer ``top`` and ``h < H - 1``.

    Returns the first layer of set ``h + 1`` for each branch, in DFS order (-1: no layer left). The set
    itself is ``top`` down to that layer + 1."""
    state = m.start(top)
    i = top - 1
    while i >= 0:
        grown = m.add(state, i)
        if m.hides(grown, top):  # Property 1: hidden, assign
            state = grown
            i -= 1
        elif not m.hides(state, top):  # Property 2: delay layer i to the next iteration
            return (i,)
        else:  # search: assign i (then the next layer is necessarily delayed), or delay i
            return (i - 1, i)
    return (-1,)


def dreamddp_solutions(
    profile: CostProfile, H: int, *, measure: str = "span", limit: int = 1_000_000
) -> list[Sets]:
    """Ω: every solution Algorithm 2 collects, in DFS order, by a literal walk of the listing.

    Each solution is ``H`` sorted tuples of forward indices. Raises ``InvalidArgumentError`` when Ω would
    exceed ``limit`` solutions (it has at most 2**(H-1))."""
    check_period("dreamddp_solutions", H)
    L = profile.L
    m = _Measure(profile, measure)
    out: list[Sets] = []
    # explicit stack instead of recursion: (Psi, next layer l, iteration h); Psi's lists keep assignment order
    stack: list[tuple[list[list[int]], int, int]] = [([[] for _ in range(H)], L - 1, 0)]
    while stack:
        psi, layer, h = stack.pop()
        if layer < 0:  # line 9
            out.append(tuple(tuple(sorted(s)) for s in psi))
        elif h == H - 1:  # line 12
            psi[h].extend(range(layer, -1, -1))
            out.append(tuple(tuple(sorted(s)) for s in psi))
        elif not psi[h]:  # line 17, at-least-one
            psi[h].append(layer)
            stack.append((psi, layer - 1, h))
        else:
            h0 = psi[h][0]
            state = m.start(h0)
            for i in psi[h][1:]:
                state = m.add(state, i)
            if m.hides(m.add(state, layer), h0):  # line 20, optimal hiding
                psi[h].append(layer)
                stack.append((psi, layer - 1, h))
            elif not m.hides(state, h0):  # line 23, delayed CO assignment
                stack.append((psi, layer, h + 1))
            else:  # line 25, search (lines 28/30 with their typos fixed)
                psi_minus = copy.deepcopy(psi)
                psi_minus[h].append(layer)
                psi_plus = copy.deepcopy(psi)
                stack.append((psi_plus, layer, h + 1))  # popped second
                stack.append((psi_minus, layer - 1, h))  # popped first: DFS order
        if len(out) > limit:
            raise InvalidArgumentError(
                f"dreamddp_solutions: more than limit={limit} solutions (L={L}, H={H})"
            )
    return out


def _dag(profile: CostProfile, H: int, measure: str) -> list[dict[int, tuple[int, ...]]]:
    """Reachable states per iteration: ``levels[h][top] = next starts`` (top = first layer of set h)."""
    m = _Measure(profile, measure)
    levels: list[dict[int, tuple[int, ...]]] = [{} for _ in range(H)]
    frontier = {profile.L - 1}
    for h in range(H):
        for top in sorted(frontier, reverse=True):
            levels[h][top] = () if top < 0 or h == H - 1 else _next_starts(profile, m, top)
        frontier = {n for nxt in levels[h].values() for n in nxt}
    return levels


def count_dreamddp_solutions(profile: CostProfile, H: int, *, measure: str = "span") -> int:
    """``len(dreamddp_solutions(profile, H, measure=measure))``, counted on the DAG without enumerating."""
    check_period("count_dreamddp_solutions", H)
    levels = _dag(profile, H, measure)
    counts: dict[int, int] = {}
    for h in range(H - 1, -1, -1):
        counts = {top: 1 if not nxt else sum(counts[n] for n in nxt) for top, nxt in levels[h].items()}
    return counts[profile.L - 1]


def dreamddp_sets(profile: CostProfile, H: int, *, measure: str = "span") -> Sets:
    """The argmin over Ω by the event model (Algorithm 2 line 2), before bubble filling."""
    check_period("dreamddp_sets", H)
    costs = IntervalCosts(profile, "event")
    levels = _dag(profile, H, measure)
    # best[h][top] = (cost of sets h..H-1, first start of set h + 1 on the best path)
    best: list[dict[int, tuple[float, int]]] = [{} for _ in range(H)]
    for h in range(H - 1, -1, -1):
        for top, nxt in levels[h].items():
            if top < 0:  # no layer left: this and every later set is empty
                tail = 0.0
                for _ in range(h, H):
                    tail += costs.empty
                best[h][top] = (tail, -1)
            elif not nxt:  # last iteration takes every remaining layer
                best[h][top] = (costs.cost(0, top), -1)
            else:
                choice: tuple[float, int] | None = None
                for n in nxt:  # DFS order; strict < keeps the first of equal costs
                    c = costs.cost(n + 1, top) + best[h + 1][n][0]
                    if choice is None or c < choice[0]:
                        choice = (c, n)
                assert choice is not None
                best[h][top] = choice
    sets: list[tuple[int, ...]] = []
    top = profile.L - 1
    for h in range(H):
        nxt_top = best[h][top][1] if top >= 0 and levels[h][top] else -1
        sets.append(tuple(range(nxt_top + 1, top + 1)) if top >= 0 else ())
        top = nxt_top
    return tuple(sets)


def fill_bubbles(profile: CostProfile, schedule: Schedule) -> Schedule:
    """§3.4 / Eq. 12: add to each set the longest run of latest layers ``{L-1, ..., l}`` (forward indices)
    that is disjoint from the set and keeps the iteration's event-model time from increasing.

    Adding a layer never shortens an iteration (averagings only queue up), so the time is monotone in
    the run's length and the longest run is found by bisection. Predicted times are unchanged (with
    interference, to rounding: the timeline is monotone in exact arithmetic, not at the last ulp)."""
    schedule.validate(profile.L)
    L = profile.L
    new_sets: list[tuple[int, ...]] = []
    for s in schedule.sets:
        members = set(s)
        base = iteration_time(profile, s)
        kmax = 0  # the run may take layers L-1 .. L-kmax, none of them already in the set
        while kmax < L and (L - 1 - kmax) not in members:
            kmax += 1
        lo, hi = 0, kmax  # invariant: a run of lo layers fits; a run of more than hi does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if iteration_time(profile, members.union(range(L - mid, L))) <= base:
                lo = mid
            else:
                hi = mid - 1
        new_sets.append(tuple(sorted(members.union(range(L - lo, L)))))
    return Schedule.from_sets(profile, new_sets, schedule.method)


def schedule_dreamddp(
    profile: CostProfile,
    H: int,
    *,
    fill_bubbles: bool = True,
    measure: str = "span",
) -> Schedule:
    """DreamDDP's schedule: Algorithm 2 (argmin over Ω by the event model), then bubble filling (§3.4).

    ``measure``: how Algorithm 2's tests measure a set's communication (``"span"``: Eq. 7's ``tau``
    recurrence, ``"sum"``: Eq. 10's sum; see the module docstring)."""
    check_period("schedule_dreamddp", H)
    sched = Schedule.from_sets(profile, dreamddp_sets(profile, H, measure=measure), "dreamddp")
    return _fill(profile, sched) if fill_bubbles else sched


_fill = fill_bubbles  # the keyword argument of schedule_dreamddp shadows the function's name
