"""A priority queue of communications whose order every rank agrees on, run by one communication thread.

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
timing. A negotiation costs one small allreduce (latency, not bandwidth).

Errors: a failed or timed-out task (a dead peer) fails its handle and every later one; every wait is
bounded by ``timeout``.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch

from lowband.comm.handle import Handle
from lowband.comm.reduce import allreduce
from lowband.errors import CommTimeoutError, InvalidArgumentError, LowbandError
from lowband.group import Group
from lowband.runtime import bind_thread, current
from lowband.teardown import idle

Task = Callable[[], Handle[Any]]


class _TaskWork:
    """A torch-``Work``-like completion of one queued task, for :class:`~lowband.comm.handle.Handle`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: LowbandError | None = None
        self.result: Any = None

    def is_completed(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: datetime.timedelta) -> bool:
        if not self.event.wait(timeout.total_seconds()):
            raise RuntimeError(f"timed out after {timeout.total_seconds():g} s in the priority queue")
        if self.error is not None:
            raise self.error
        return True


class NegotiatedQueue:
    """``n`` keyed tasks per round, run on one thread in priority order agreed with every rank of
    ``group`` (module docstring). Collectives of ``group`` must be issued by this queue only while it
    runs (its negotiations use the group too)."""

    def __init__(self, n: int, *, group: Group, timeout: float, where: str = "NegotiatedQueue") -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"{where}: n must be an int >= 1, got {n!r}")
        self.n, self.group, self.timeout, self.where = n, group, float(timeout), where
        self._ctx = current(where)
        self._cond = threading.Condition()
        self._tasks: dict[int, tuple[Task, _TaskWork]] = {}
        self._done = [False] * n
        self._error: LowbandError | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        #: negotiations run, and those that found no task ready on every rank
        self.negotiations = 0
        self.empty_negotiations = 0
        #: keys in the order they ran, for the last completed round (same on every rank)
        self.last_order: list[int] = []
        self._order: list[int] = []

    def submit(self, key: int, task: Task, *, name: str | None = None) -> Handle[Any]:
        """Queue ``task`` (issues a communication, returns its handle) as key ``key`` of the current round;
        the returned handle completes with the task's result once it has run and its handle completed."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise InvalidArgumentError(f"{self.where}: submit after close()")
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < self.n:
            raise InvalidArgumentError(f"{self.where}: key must be an int in [0, {self.n}), got {key!r}")
        work = _TaskWork()
        with self._cond:
            if key in self._tasks or self._done[key]:
                raise InvalidArgumentError(f"{self.where}: key {key} submitted twice in one round")
            self._tasks[key] = (task, work)
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"lowband-{self.where}", daemon=True)
            self._thread.start()
        return Handle(
            [work],
            lambda: work.result,
            op="priority-queue",
            name=name,
            rank=self._ctx.rank,
            timeout=self.timeout,
        )

    def close(self) -> None:
        """Stop the thread (after the task running now); idempotent and bounded."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is not None:
            t.join(self.timeout)
            if t.is_alive():
                raise CommTimeoutError(f"{self.where}: the thread did not stop within {self.timeout:g} s")

    # -- the thread ---------------------------------------------------------------------------------
    def _ready_mask(self) -> torch.Tensor:
        return torch.tensor(
            [1 if (k in self._tasks and not self._done[k]) else 0 for k in range(self.n)],
            dtype=torch.int32,
            device="cpu",  # a control value: on a cpu:gloo,cuda:nccl group it goes through gloo
        )

    def _run(self) -> None:
        bind_thread(self._ctx)
        seen = -1  # submissions seen at the last negotiation that agreed on nothing
        try:
            while True:
                with self._cond:
                    # after a negotiation that agreed on nothing, wait for a new task here, unless
                    # every key of the round is here (with 3+ ranks, this rank may hold all while the
                    # others hold disjoint ones: it must join their next negotiation)
                    while not self._closed and (
                        not any(not self._done[k] for k in self._tasks)
                        or (len(self._tasks) == seen and len(self._tasks) < self.n)
                    ):
                        with idle():  # waiting for work, not for a peer: shutdown need not wait for it
                            self._cond.wait()
                    if self._closed:
                        return
                    mask = self._ready_mask()
                    submitted = len(self._tasks)
                agreed = allreduce(mask, "min", name=f"{self.where}:negotiate", group=self.group)
                self.negotiations += 1
                keys = agreed.nonzero().flatten().tolist()
                if not keys:  # nothing ready everywhere yet: renegotiate after a new task here (above)
                    self.empty_negotiations += 1
                    seen = submitted
                    continue
                seen = -1
                k = int(keys[0])
                task, work = self._tasks[k]
                try:
                    work.result = task().wait(self.timeout)
                except LowbandError as exc:
                    work.error = exc
                    self._error = exc
                    work.event.set()
                    raise
                work.event.set()
                with self._cond:
                    self._done[k] = True
                    self._order.append(k)
                    if all(self._done):
                        self.last_order, self._order = self._order, []
                        self._done = [False] * self.n
                        self._tasks = {}
        except LowbandError as exc:
            self._fail_all(exc)
        except BaseException as exc:  # an unexpected error: fail every waiter with it
            self._fail_all(InvalidArgumentError(f"{self.where}: {type(exc).__name__}: {exc}"))
        finally:
            bind_thread(None)

    def _fail_all(self, exc: LowbandError) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            for _, work in self._tasks.values():
                if not work.event.is_set():
                    work.error = self._error
                    work.event.set()
