"""Local search beyond DreamDDP's search space (lowband's extension; scheduler ``"dreamddp-ls"``).

Algorithm 2 and the exact optimum (``schedule_optimal``) search partitions of the layers into H
*consecutive* runs in backward order. That space is the paper's, and it is optimal for Eq. 8, but not
for the event model: a layer near the input can only hide its averaging behind the backward of the few
layers below it and the next forward up to it, so a schedule that gives every iteration some of the
early layers next to some late ones can hide more than any partition into runs. ``dreamddp-ls``
starts from Algorithm 2's partition and improves it by steepest descent over two kinds of moves, each
judged by the event model over the two iterations it touches:

- move one layer (or chunk) from one iteration's set to another's;
- swap two layers between two iterations' sets.

It stops when no move shortens the predicted period by more than a relative ``1e-9``, or after
``max_passes`` passes over all moves, then fills bubbles (Eq. 12) as DreamDDP does. Every step is a
strict improvement, so its period is never longer than Algorithm 2's. It is deterministic (no clock,
no randomness): every rank computes the same schedule from the same profile. Cost: a pass evaluates
O(L H + L^2) two-iteration changes (swaps are tried only while L <= ``SWAP_MAX_L``), each O(L).
"""

from __future__ import annotations

from lowband.errors import InvalidArgumentError
from lowband.localsgd.algorithm2 import Sets, dreamddp_sets, fill_bubbles
from lowband.localsgd.costmodel import CostProfile, iteration_time
from lowband.localsgd.schedule import Schedule, check_period

#: swaps are tried only for at most this many layers (their number grows as L^2)
SWAP_MAX_L = 64
REL_TOL = 1e-9


def refine_sets(profile: CostProfile, sets: Sets, *, max_passes: int = 50) -> Sets:
    """Steepest-descent local search (module doc) from the partition ``sets`` (each layer in exactly
    one set); returns a partition whose event-model period is never longer."""
    if isinstance(max_passes, bool) or not isinstance(max_passes, int) or max_passes < 0:
        raise InvalidArgumentError(f"refine_sets: max_passes must be an int >= 0, got {max_passes!r}")
    H = len(sets)
    owner: dict[int, int] = {}
    for h, s in enumerate(sets):
        for i in s:
            if i in owner:
                raise InvalidArgumentError(
                    f"refine_sets: layer {i} is in sets {owner[i]} and {h}; give a partition"
                )
            owner[i] = h
    if sorted(owner) != list(range(profile.L)):
        raise InvalidArgumentError(f"refine_sets: sets must cover layers 0..{profile.L - 1} exactly once")
    cur = [set(s) for s in sets]
    cost = [iteration_time(profile, s) for s in cur]
    L = profile.L
    for _ in range(max_passes):
        best_gain, best_move = 0.0, None
        total = sum(cost)
        tol = REL_TOL * total
        for i in range(L):
            a = owner[i]
            ca = iteration_time(profile, cur[a] - {i})
            for b in range(H):
                if b == a:
                    continue
                cb = iteration_time(profile, cur[b] | {i})
                gain = cost[a] + cost[b] - ca - cb
                if gain > best_gain + tol:
                    best_gain, best_move = gain, (i, a, b, -1, ca, cb)
        if L <= SWAP_MAX_L:
            for i in range(L):
                for j in range(i + 1, L):
                    a, b = owner[i], owner[j]
                    if a == b:
                        continue
                    ca = iteration_time(profile, (cur[a] - {i}) | {j})
                    cb = iteration_time(profile, (cur[b] - {j}) | {i})
                    gain = cost[a] + cost[b] - ca - cb
                    if gain > best_gain + tol:
                        best_gain, best_move = gain, (i, a, b, j, ca, cb)
        if best_move is None:
            break
        i, a, b, j, ca, cb = best_move
        cur[a].discard(i)
        cur[b].add(i)
        owner[i] = b
        if j >= 0:
            cur[b].discard(j)
            cur[a].add(j)
            owner[j] = a
        cost[a], cost[b] = ca, cb
    return tuple(tuple(sorted(s)) for s in cur)


def schedule_dreamddp_ls(
    profile: CostProfile, H: int, *, fill: bool = True, max_passes: int = 50
) -> Schedule:
    """Algorithm 2's partition, improved by :func:`refine_sets`, then bubble filling (``fill``)."""
    check_period("schedule_dreamddp_ls", H)
    sets = refine_sets(profile, dreamddp_sets(profile, H), max_passes=max_passes)
    sched = Schedule.from_sets(profile, sets, "dreamddp-ls")
    return fill_bubbles(profile, sched) if fill else sched
