"""The communication engine: per process group, one ordered queue of communication tasks run by one
worker thread, and per rank one completion thread for handles whose torch works have no future.

Everything lowband does asynchronously goes through here: SlimGC's compression off the training
thread (SlimGC's pipeline), EmbRace's vertical overlap, the
negotiated priority order of EmbRace's 2D schedule (:class:`~lowband.comm.priority.NegotiatedQueue`)
and ``Handle.then``/``future`` of works without a torch future. Each of them is a *lane* of its
group's engine; a lane keeps its own first error, counters and busy time, and the engine's one worker
runs every lane's tasks in the lane's *ordering policy*:

- :class:`IssueOrder`: tasks run in the order they were submitted. Every issue-order lane of a group
  shares one FIFO, so the group's collectives are issued in the same order on every rank when every
  rank submits in the same order. The worker issues a task and goes on to the next without waiting
  for its communication (the task's handle completes later).
- :class:`NegotiatedOrder`: ``n`` keyed tasks per round, run one at a time in the priority order the
  ranks agree on (:mod:`lowband.comm.priority` describes the negotiation). Its negotiations ride the
  group's control process group (CPU gloo), never the data group.

One ordering policy at a time per group: submitting to a negotiated lane while issue-order tasks wait
(or the reverse) would let each rank's timing decide the order of the data group's collectives, so it
is refused with :class:`~lowband.errors.InvalidArgumentError`.

**CUDA.** On a CUDA rank the worker sets the rank's device once; on an NCCL group it runs every task on
its own communication stream (on gloo, whose CUDA collectives use streams of their own and stage through
host memory, tasks run on the default stream, as the submitting thread's work does). A task waits (on the GPU) for the work the submitting thread had queued on its
current stream when it submitted (a CUDA event); when the task ends the engine records an event on the
communication stream, and whoever takes the task's result (``Handle.wait``, :meth:`Lane.drain`,
:meth:`Lane.wait_until`) makes its own current stream wait for it, and marks the result's tensors as
used on its stream (``record_stream``) so the caching allocator does not hand their memory back to the
communication stream early.

Threads: a rank that uses no asynchronous feature starts none. Otherwise it runs one engine worker per
group that has lanes, one completion thread (``then`` of works without a future), and the window
service's receivers (:mod:`lowband.decentral.window_service`). Every wait is bounded by the runtime's
timeout; a failed task fails its handle and every later task of its lane.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lowband.comm.completion import close_completer
from lowband.comm.contract import nccl_semantics
from lowband.comm.control import control_allreduce
from lowband.comm.handle import Handle
from lowband.comm.lane import IssueOrder, Lane, NegotiatedOrder, Order, Task, _as_lowband, _Task
from lowband.errors import InvalidArgumentError, LowbandError
from lowband.group import Group
from lowband.runtime import Context, bind_thread, current
from lowband.teardown import idle

_STATE = "lowband.comm.engine"

__all__ = ["Engine", "IssueOrder", "Lane", "NegotiatedOrder", "close_engines", "engine_for", "issue_lane"]


class Engine:
    """The worker of one process group (module docstring). Made by :func:`engine_for`."""

    def __init__(self, ctx: Context, group: Group) -> None:
        self.ctx, self.group = ctx, group
        self.where = f"the communication engine of group {group.name!r} on rank {ctx.rank}"
        self._cond = threading.Condition()
        self._fifo: collections.deque[_Task] = collections.deque()
        self._negotiated: list[Lane] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        # its own CUDA stream on an NCCL group only: gloo's CUDA collectives already run on streams of
        # their own and stage through host memory, and its tasks run where they ran before the engine
        self.device = ctx.device
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())  # the rank's, not the worker's
        self.cuda = (
            self.device.type == "cuda" and torch.cuda.is_available() and nccl_semantics(group.pg, self.device)
        )
        self._dead: LowbandError | None = None  # why the worker stopped, if it failed
        self.stream: Any = None
        self._last_done: Any = None  # the CUDA event of the last task that ended

    def lane(self, order: Order, *, where: str, timeout: float | None = None) -> Lane:
        lane = Lane(self, order, where=where, timeout=self.ctx.config.timeout if timeout is None else timeout)
        if isinstance(order, NegotiatedOrder):
            with self._cond:
                self._negotiated.append(lane)
        return lane

    def enqueue(self, lane: Lane, fn: Task, key: int | None) -> _Task:
        ready = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        task = _Task(fn, lane, key, ready)
        with self._cond:
            if self._dead is not None:
                raise self._dead
            if self._closed:
                raise InvalidArgumentError(f"{lane.where}: {self.where} is shut down")
            negotiating = [
                x for x in self._negotiated if isinstance(x.order, NegotiatedOrder) and x.order.pending()
            ]
            if isinstance(lane.order, NegotiatedOrder):
                if self._fifo or any(x is not lane for x in negotiating):
                    raise InvalidArgumentError(
                        f"{lane.where}: another lane of group {self.group.name!r} has tasks waiting; one "
                        "ordering policy at a time per group (else each rank's timing would order its collectives)"
                    )
                lane.order.add(key, task)
            else:
                if negotiating:
                    raise InvalidArgumentError(
                        f"{lane.where}: a negotiated round of group {self.group.name!r} is in progress; one "
                        "ordering policy at a time per group (else each rank's timing would order its collectives)"
                    )
                self._fifo.append(task)
            lane.submitted += 1
            self._cond.notify_all()
            if self._thread is None:
                name = f"lowband-engine-{self.group.name}"
                self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                self._thread.start()
        return task

    def forget(self, lane: Lane) -> None:
        """Drop a closed negotiated lane: its tasks not run yet fail."""
        with self._cond:
            if lane in self._negotiated:
                self._negotiated.remove(lane)
        self._fail_lane(lane, InvalidArgumentError(f"{lane.where}: closed before the task ran"), keep=True)

    def consume(self) -> None:
        """Order the calling thread's CUDA stream after every task that has ended (a lane's drain)."""
        if self.cuda and self._last_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_done)

    def close(self, wait: float = 0.0) -> None:
        """Stop the worker once its queue is empty (the task running now ends first), waiting at most
        ``wait`` seconds for it; idempotent. ``lowband.shutdown`` does not wait: a worker stuck in a
        gloo wait is ended by closing the connections (:func:`lowband.teardown.break_connections`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if wait > 0 and t is not None and t is not threading.current_thread():
            t.join(wait)

    # -- the worker ---------------------------------------------------------------------------------
    def _next(self) -> tuple[_Task | None, Lane | None]:
        """The next issue-order task, or a negotiated lane whose round can negotiate (lock held)."""
        if self._fifo:
            return self._fifo.popleft(), None
        for lane in self._negotiated:
            if isinstance(lane.order, NegotiatedOrder) and lane.error is None and lane.order.runnable():
                return None, lane
        return None, None

    def _run(self) -> None:
        bind_thread(self.ctx)
        try:
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.set_device(self.device)  # the thread's allocations on the rank's GPU
            if self.cuda:
                self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._loop()
        except BaseException as exc:  # the worker itself failed: nobody may wait for it in vain
            self._die(exc)
        finally:
            bind_thread(None)

    def _die(self, exc: BaseException) -> None:
        """Fail every task waiting and every later submission with ``exc`` (the worker has stopped)."""
        err = exc if isinstance(exc, LowbandError) else LowbandError(f"{self.where} failed: {exc!r}")
        with self._cond:
            self._dead, self._closed = err, True
            waiting = list(self._fifo)
            self._fifo.clear()
            lanes = list(self._negotiated)
        for task in waiting:
            task.work.error = _as_lowband(task.lane, err)
            task.work.event.set()
            with task.lane._cond:
                task.lane.error = task.lane.error or err
                task.lane._cond.notify_all()
        for lane in lanes:
            self._fail_lane(lane, err)

    def _loop(self) -> None:
        while True:
            with self._cond:
                task, lane = self._next()
                while task is None and lane is None and not self._closed:
                    with idle():  # waiting for work, not for a peer: shutdown need not wait for it
                        self._cond.wait()
                    task, lane = self._next()
                if task is None and lane is None:
                    return
            if task is not None:
                self._execute(task)
            elif lane is not None:
                self._negotiate(lane)

    def _negotiate(self, lane: Lane) -> None:
        order = lane.order
        assert isinstance(order, NegotiatedOrder)
        with self._cond:
            mask = order.mask()
            held = len(order.tasks)
        try:
            where = f"{lane.where}: negotiate on rank {self.group.world_rank}"
            agreed = control_allreduce(self.group, mask, "min", lane.timeout, where)
        except LowbandError as exc:
            self._fail_lane(lane, exc)
            return
        order.negotiations += 1
        keys = agreed.nonzero().flatten().tolist()
        if not keys:
            order.empty_negotiations += 1
            order.seen = held
            return
        order.seen = -1
        k = int(keys[0])

        def finish() -> None:  # before the handle completes: its waiter sees the round's bookkeeping
            with self._cond:
                order.finish(k)

        self._execute(order.tasks[k], finish)

    def _execute(self, task: _Task, before_done: Callable[[], None] | None = None) -> None:
        lane, work = task.lane, task.work
        if lane.error is not None:  # a failed lane skips its later tasks
            work.error = _as_lowband(lane, lane.error)
            work.event.set()
            lane._ended(task, None, 0.0)
            return
        t0 = time.perf_counter()
        exc: BaseException | None = None
        try:
            with torch.no_grad():
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        if task.ready is not None:
                            self.stream.wait_event(task.ready)
                        work.result = task.fn()
                        if lane.order.wait_each and isinstance(work.result, Handle):
                            work.result = work.result.wait(lane.timeout)
                        work.device = self.device
                        work.cuda_done = self._last_done = self.stream.record_event()
                else:
                    work.result = task.fn()
                    if lane.order.wait_each and isinstance(work.result, Handle):
                        work.result = work.result.wait(lane.timeout)
        except BaseException as e:  # surfaced on the thread that waits
            exc = e
            work.error = _as_lowband(lane, e)
        if before_done is not None:
            before_done()
        work.event.set()
        lane._ended(task, exc, time.perf_counter() - t0)
        if exc is not None and isinstance(lane.order, NegotiatedOrder):
            self._fail_lane(lane, work.error or _as_lowband(lane, exc))

    def _fail_lane(self, lane: Lane, exc: LowbandError, keep: bool = False) -> None:
        """Fail ``lane`` (its first error, unless ``keep``) and its negotiated tasks not run yet."""
        with lane._cond:
            if lane.error is None and not keep:
                lane.error = exc
            lane._cond.notify_all()
        if isinstance(lane.order, NegotiatedOrder):
            with self._cond:
                for t in lane.order.tasks.values():
                    if not t.work.event.is_set():
                        t.work.error = _as_lowband(lane, lane.error or exc)
                        t.work.event.set()


def engine_for(group: Group, ctx: Context | None = None) -> Engine:
    """The communication engine of ``group`` on the calling rank (made on first use)."""
    ctx = ctx or current("the communication engine")
    engines: dict[int, Engine] = ctx.state.setdefault(_STATE, {})
    key = id(group.pg)
    eng = engines.get(key)
    if eng is None or eng._closed:
        eng = engines[key] = Engine(ctx, group)
    return eng


def issue_lane(
    group: Group | None, *, where: str, offload: bool = True, timeout: float | None = None
) -> Lane:
    """A lane of ``group``'s engine (default: the world) in issue order; ``offload=False`` runs its tasks
    inline on the submitting thread (the same tasks in the same order: the baseline)."""
    ctx = current(where)
    limit = ctx.config.timeout if timeout is None else timeout
    if not offload:
        return Lane(None, IssueOrder(), where=where, timeout=limit)
    return engine_for(group or ctx.world, ctx).lane(IssueOrder(), where=where, timeout=limit)


def close_engines(ctx: Context) -> None:
    """Stop every engine worker and the completion thread of ``ctx``'s rank (``lowband.shutdown``)."""
    for eng in list(ctx.state.get(_STATE, {}).values()):
        eng.close()
    ctx.state.pop(_STATE, None)
    close_completer(ctx)
