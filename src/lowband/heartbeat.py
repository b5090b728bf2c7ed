"""Who is missing: the pure decision part of the heartbeat of the ``on_peer_loss`` strategies.

Each rank of a strategy's group keeps two counters in the rendezvous store (:mod:`lowband.comm.heartbeat`
does the talking): ``beats``, raised by one between its steps at most every ``bound / 3`` seconds, and
``at``, the number of the strategy's collective points (exchanges, consensus, checkpoints) it has
entered, :data:`AT_DONE` once it has finished. When a rank beats it reads every other member's pair and
updates, with :func:`observe`, how long it has watched each one's counter stand still; :func:`missing`
names those silent for more than ``bound`` seconds.

What does not count as silence, so that a live rank is not taken as lost:

- a member that has not beaten yet (counter 0): ranks take their first step at different times (data
  loading, a first compilation), so judging starts at a member's first beat;
- a member *ahead* of this one in the collective points (``at`` larger than this rank's own): it is
  blocked there waiting for this rank, which is late, not it; a finished member (``AT_DONE``) is ahead
  for good;
- this rank's own absence: each interval between two of its observations counts at most ``cap``
  (``bound / 2``), so a long pause of this rank (an exchange it was blocked in, a slow step, an
  evaluation of every rank) does not make the others look silent; a dead member is then found after
  a few observations instead of after ``bound`` seconds. A collective point completed by this rank proves
  every member alive there (:func:`reset`).

Everything is measured on this rank's monotonic clock: no two ranks' clocks are ever compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lowband.errors import InvalidArgumentError

#: the ``at`` counter of a member that finished (``Strategy.close``, ``lowband.shutdown``): ahead for good
AT_DONE = 1 << 62


@dataclass(frozen=True)
class Seen:
    """What this rank knows of one member: its beat counter when last read, and for how long (seconds
    of this rank's watching) that counter has stood still."""

    beats: int
    silent: float = 0.0


def observe(
    seen: Mapping[int, Seen],
    beats: Mapping[int, int],
    at: Mapping[int, int],
    mine: int,
    dt: float | None,
    cap: float,
) -> dict[int, Seen]:
    """The members' :class:`Seen` after one observation: ``beats`` and ``at`` are the counters just read
    (world rank -> value), ``mine`` this rank's own ``at``, ``dt`` the seconds since its previous
    observation (None: the first one), ``cap`` the most one interval counts (module docstring). A member
    whose counter moved, that has not beaten yet, or that is ahead of this rank starts again from 0;
    any other adds ``min(dt, cap)`` to its silence."""
    if not cap > 0:
        raise InvalidArgumentError(f"heartbeat: cap must be > 0 seconds, got {cap!r}")
    step = 0.0 if dt is None else min(max(dt, 0.0), cap)
    out: dict[int, Seen] = {}
    for rank, count in beats.items():
        old = seen.get(rank)
        if old is None or dt is None or count != old.beats or count == 0 or at.get(rank, 0) > mine:
            out[rank] = Seen(count, 0.0)
        else:
            out[rank] = Seen(count, old.silent + step)
    return out


def missing(seen: Mapping[int, Seen], bound: float) -> dict[int, float]:
    """The members silent for more than ``bound`` seconds -> their silence, by rank."""
    if not bound > 0:
        raise InvalidArgumentError(f"heartbeat: bound must be > 0 seconds, got {bound!r}")
    return {r: s.silent for r, s in sorted(seen.items()) if s.silent > bound}


def reset(seen: Mapping[int, Seen]) -> dict[int, Seen]:
    """Every member's silence back to 0: all of them just completed a collective with this rank."""
    return {r: Seen(s.beats, 0.0) for r, s in seen.items()}


__all__ = ["AT_DONE", "Seen", "missing", "observe", "reset"]
