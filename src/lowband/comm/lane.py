"""Lanes of the communication engine (:mod:`lowband.comm.engine`): a client's tasks, their ordering
policy (:class:`IssueOrder`, :class:`NegotiatedOrder`), first error, counters and busy time, and the
``Work``-like completion of each task that lowband's :class:`~lowband.comm.handle.Handle` waits on.

A :class:`Promise` is a result that a *later* task of the lane delivers than the one submitted for it:
SlimGC submits one task per unit, but a unit's averages exist only when its round's fused operations
are done, so every unit's handle is a handle over its round's promise, which the round's last task
settles. A wait on a promise ends with the lane's first error, so a failed task never leaves it hanging."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lowband.comm.handle import Handle
from lowband.errors import CommTimeoutError, InvalidArgumentError, LowbandError
from lowband.runtime import current

if TYPE_CHECKING:
    from lowband.comm.engine import Engine

Task = Callable[[], Any]
T = TypeVar("T")


class LaneError(LowbandError):
    """A task of a lane failed with a non-lowband exception; the cause is chained."""


class _TaskWork:
    """The torch-``Work``-like completion of one engine task, for :class:`Handle`."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: LowbandError | None = None
        self.result: Any = None
        self.cuda_done: Any = None  # a CUDA event on the engine's stream, recorded when the task ended
        self.device: torch.device | None = None

    def is_completed(self) -> bool:
        return self.event.is_set()

    def get_future(self) -> Any:
        """None to give: :class:`Handle` then waits through the rank's completion thread (``then``,
        ``future``), as for gloo's send/recv."""
        raise RuntimeError("Work::getFuture not implemented for a task of the communication engine")

    def wait(self, timeout: datetime.timedelta) -> bool:
        if not self.event.wait(timeout.total_seconds()):
            raise RuntimeError(f"timed out after {timeout.total_seconds():g} s in the communication engine")
        if self.error is not None:
            raise self.error
        return True


class _PromiseWork(_TaskWork):
    """A :class:`Promise`'s completion: complete when settled, failed with its lane's first error."""

    def __init__(self, lane: Lane) -> None:
        super().__init__()
        self.lane = lane

    def is_completed(self) -> bool:
        return self.event.is_set() or self.lane.error is not None

    def wait(self, timeout: datetime.timedelta) -> bool:
        if not self.event.is_set():
            self.lane.wait_until(self.event.is_set, "a promised result", timeout.total_seconds())
        if self.error is not None:
            raise self.error
        return True


class Promise:
    """A value a later task of ``lane`` delivers with :meth:`set` (module docstring); :meth:`handle`
    gives handles over it. Made by :meth:`Lane.promise`."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self._work = _PromiseWork(lane)

    def set(self, value: Any) -> None:
        """Deliver ``value`` (from a task of the lane: on a CUDA engine, the consumer's stream then
        waits for the work the task has queued so far)."""
        work, eng = self._work, self.lane.engine
        if eng is not None and eng.cuda:
            work.device = eng.device
            work.cuda_done = torch.cuda.current_stream(eng.device).record_event()
        work.result = value
        work.event.set()
        self.lane.notify()

    def done(self) -> bool:
        return self._work.event.is_set()

    def handle(self, pick: Callable[[Any], T], *, name: str | None = None) -> Handle[T]:
        """A handle whose result is ``pick(value)``, complete when the value is delivered (bounded by
        the lane's timeout; the lane's first error if a task of it fails first)."""
        work, lane = self._work, self.lane
        return Handle(
            [work],
            lambda: _take(work, lane.timeout, pick),
            op="engine",
            name=name,
            rank=lane.rank,
            timeout=lane.timeout,
        )


class _Task:
    __slots__ = ("fn", "key", "lane", "ready", "work")

    def __init__(self, fn: Task, lane: Lane, key: int | None, ready: Any) -> None:
        self.fn, self.lane, self.key, self.ready = fn, lane, key, ready
        self.work = _TaskWork()


def _record_use(value: Any, stream: Any) -> None:
    """Mark the CUDA tensors of a task's result as used on ``stream`` (the consumer's)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record_use(v, stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_use(v, stream)


class IssueOrder:
    """Tasks run in submission order (shared by every issue-order lane of the group)."""

    wait_each = False


class NegotiatedOrder:
    """``n`` keyed tasks per round in the priority order agreed with every rank (lowest key first among
    the tasks ready on every rank); one task at a time (:mod:`lowband.comm.priority`)."""

    wait_each = True

    def __init__(self, n: int, where: str) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"{where}: n must be an int >= 1, got {n!r}")
        self.n, self.where = n, where
        self.tasks: dict[int, _Task] = {}
        self.done = [False] * n
        self.seen = -1  # tasks held at the last negotiation that agreed on nothing
        self.negotiations = 0
        self.empty_negotiations = 0
        self.last_order: list[int] = []
        self.order: list[int] = []

    def add(self, key: object, task: _Task) -> None:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < self.n:
            raise InvalidArgumentError(f"{self.where}: key must be an int in [0, {self.n}), got {key!r}")
        if key in self.tasks or self.done[key]:
            raise InvalidArgumentError(f"{self.where}: key {key} submitted twice in one round")
        self.tasks[key] = task

    def pending(self) -> bool:
        return any(not self.done[k] for k in self.tasks)

    def runnable(self) -> bool:
        # after a negotiation that agreed on nothing, wait for a new task here, unless every key of
        # the round is here (with 3+ ranks this rank may hold all while the others hold disjoint ones)
        return self.pending() and not (len(self.tasks) == self.seen and len(self.tasks) < self.n)

    def mask(self) -> torch.Tensor:
        return torch.tensor(
            [1 if (k in self.tasks and not self.done[k]) else 0 for k in range(self.n)],
            dtype=torch.int32,
            device="cpu",
        )

    def finish(self, key: int) -> None:
        self.done[key] = True
        self.order.append(key)
        if all(self.done):
            self.last_order, self.order = self.order, []
            self.done = [False] * self.n
            self.tasks = {}


Order = IssueOrder | NegotiatedOrder


class Lane:
    """One client's view of its group's engine (module docstring): its tasks, its first error, its
    counters. ``offload=False`` runs every task at once on the submitting thread (the inline baseline:
    the same tasks in the same order)."""

    def __init__(self, engine: Engine | None, order: Order, *, where: str, timeout: float) -> None:
        self.engine, self.order, self.where, self.timeout = engine, order, where, float(timeout)
        self.rank = engine.ctx.rank if engine is not None else _rank_or(-1)
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.submitted = 0
        self.finished = 0
        self.closed = False
        #: seconds the worker (or, inline, the submitter) spent running this lane's tasks
        self.busy_s = 0.0

    @property
    def offload(self) -> bool:
        """Whether tasks run on the engine's worker (else inline, on the submitting thread)."""
        return self.engine is not None

    # -- submitting and waiting ---------------------------------------------------------------------
    def submit(self, fn: Task, *, key: int | None = None, name: str | None = None) -> Handle[Any]:
        """Run ``fn`` on the engine in this lane's order; the handle completes with ``fn``'s result (or,
        when ``fn`` returns a :class:`Handle`, with that handle's result)."""
        self.raise_error()
        if self.closed:
            raise InvalidArgumentError(f"{self.where}: submit after close()")
        eng = self.engine
        if eng is None:  # inline
            task = _Task(fn, self, key, None)
            with self._cond:
                self.submitted += 1
            run_inline(task)
        else:
            task = eng.enqueue(self, fn, key)
        work = task.work
        return Handle(
            [work],
            lambda: _take(work, self.timeout),
            op="engine",
            name=name,
            rank=self.rank,
            timeout=self.timeout,
        )

    def promise(self) -> Promise:
        """A result a later task of this lane delivers (:class:`Promise`)."""
        return Promise(self)

    def raise_error(self) -> None:
        """Raise the lane's first task error, if any (the lowband error itself, else :class:`LaneError`)."""
        err = self.error
        if err is None:
            return
        if isinstance(err, LowbandError):
            raise err
        raise LaneError(f"{self.where}: a task failed: {type(err).__name__}: {err}") from err

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Block until ``ready()`` (checked whenever a task of this lane ends, or :meth:`notify`) or a task
        fails (raised here), at most ``timeout`` seconds (default the lane's)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while not ready() and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"{self.where}: {what} not complete within {limit:g} s")
                self._cond.wait(left)
        self.raise_error()
        if self.engine is not None:
            self.engine.consume()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted task has run (or raise the first error)."""
        self.wait_until(lambda: self.finished == self.submitted, "the submitted tasks", timeout)

    def notify(self) -> None:
        """Wake waiters of :meth:`wait_until` (a task changed what they wait for)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Wait for the submitted tasks (bounded, errors not raised) and refuse new ones; idempotent.
        The engine's worker stays for the group's other lanes (it ends at ``lowband.shutdown``)."""
        if self.closed:
            return
        self.closed = True
        if isinstance(self.order, NegotiatedOrder) and self.engine is not None:
            self.engine.forget(self)  # a round left incomplete never runs
            return
        if self.engine is not None:
            try:
                self.wait_until(lambda: self.finished == self.submitted, "the submitted tasks")
            except CommTimeoutError as exc:
                raise CommTimeoutError(
                    f"{self.where}: the tasks did not end within {self.timeout:g} s"
                ) from exc
            except LowbandError:
                pass

    def _ended(self, task: _Task, exc: BaseException | None, seconds: float) -> None:
        with self._cond:
            if exc is not None and self.error is None:
                self.error = exc
            self.busy_s += seconds
            self.finished += 1
            self._cond.notify_all()


def _rank_or(default: int) -> int:
    try:
        return current().rank
    except LowbandError:
        return default


def _take(work: _TaskWork, timeout: float, pick: Callable[[Any], Any] | None = None) -> Any:
    """A finished task's result (or ``pick`` of it) for the thread taking it: an inner handle waited,
    CUDA ordered."""
    value = work.result
    if isinstance(value, Handle):
        value = value.wait(timeout)
    if pick is not None:
        value = pick(value)
    if work.cuda_done is not None:
        stream = torch.cuda.current_stream(work.device)
        stream.wait_event(work.cuda_done)
        _record_use(value, stream)
    return value


def _as_lowband(lane: Lane, exc: BaseException) -> LowbandError:
    if isinstance(exc, LowbandError):
        return exc
    err = LaneError(f"{lane.where}: a task failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def run_inline(task: _Task) -> None:
    """Run ``task`` now on the calling thread (a lane without an engine); its error is raised."""
    lane = task.lane
    t0 = time.perf_counter()
    exc: BaseException | None = None
    try:
        with torch.no_grad():
            task.work.result = task.fn()
    except BaseException as e:
        exc = e
        task.work.error = _as_lowband(lane, e)
    task.work.event.set()
    lane._ended(task, exc, time.perf_counter() - t0)
    if exc is not None:
        raise exc
