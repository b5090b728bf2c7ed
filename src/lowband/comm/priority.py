"""A priority queue of communications whose order every rank agrees on, run by the group's communication
engine (:mod:`lowband.comm.engine`, its :class:`~lowband.comm.engine.NegotiatedOrder` policy).

Scheduling communications by priority (the layer the next forward needs first goes first: P3,
ByteScheduler, EmbRace's block-level horizontal scheduling) reorders them by when each becomes ready,
and readiness depends on each rank's timing. Collectives of one group must be issued in the same order
on every rank, so the ranks have to agree on the order: the thread does what Horovod's background
thread does, with priorities. In each cycle it waits until this rank has a task ready, then allreduces
(min) a mask of the round's tasks ready here over the group, so every rank learns the same set of tasks
ready on every rank, and runs the one of highest priority (lowest key): issues its communication and
waits for it (bounded), then the next cycle. One task at a time: a task submitted later with a higher
priority overtakes every task not started yet. A negotiation that agrees on nothing (the ranks hold
disjoint tasks) is repeated once a new task arrives here, or at once when every task of the round is
here (with three ranks or more, the one holding all must join the others' next negotiation).

A *round* is keys ``0 .. n-1`` (priority order), each submitted once (:meth:`NegotiatedQueue.submit`,
e.g. from backward hooks, in any order); the next round begins when all ``n`` have run. Each rank's
thread takes part in the same sequence of negotiations (the decisions are the allreduced masks, equal
everywhere), so the group's collectives are issued in the same order on every rank whatever each rank's
timing. A negotiation costs one small allreduce (latency, not bandwidth) on the group's control process
group (CPU gloo), never on the data group.

Errors: a failed or timed-out task (a dead peer) fails its handle and every later one; every wait is
bounded by ``timeout``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowband.comm.engine import NegotiatedOrder, engine_for
from lowband.comm.handle import Handle
from lowband.group import Group

Task = Callable[[], Handle[Any]]


class NegotiatedQueue:
    """``n`` keyed tasks per round, run on ``group``'s engine in the priority order agreed with every
    rank of ``group`` (module docstring): a negotiated lane of the engine."""

    def __init__(self, n: int, *, group: Group, timeout: float, where: str = "NegotiatedQueue") -> None:
        self.where = where
        self.order = NegotiatedOrder(n, where)
        self.n = n
        self.lane = engine_for(group).lane(self.order, where=where, timeout=timeout)

    def submit(self, key: int, task: Task, *, name: str | None = None) -> Handle[Any]:
        """Queue ``task`` (issues a communication, returns its handle) as key ``key`` of the current round;
        the returned handle completes with the task's result once it has run and its handle completed."""
        return self.lane.submit(task, key=key, name=name)

    def close(self) -> None:
        """Stop taking tasks (a round left incomplete never runs); idempotent."""
        self.lane.close()

    @property
    def negotiations(self) -> int:
        """Negotiations run so far."""
        return self.order.negotiations

    @property
    def empty_negotiations(self) -> int:
        """Negotiations that found no task ready on every rank."""
        return self.order.empty_negotiations

    @property
    def last_order(self) -> list[int]:
        """Keys in the order they ran, for the last completed round (the same on every rank)."""
        return self.order.last_order
