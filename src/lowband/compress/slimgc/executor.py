"""Compression off the training thread: tasks run in submission order on one worker thread.

SlimGC offloads compression from the accelerator to the host so that it does not compete with the
gradient computation. The host analogue here is an :class:`Executor`: the gradient stage's backward
hooks submit each unit (in the stage's fixed launch order, the same on every rank) and return at once;
one worker thread compresses the unit and launches its collective while the backward goes on and
while earlier units communicate. Because one thread runs the tasks in submission order, collectives
are issued in the same order on every rank, as the stage would issue them.

``offload=False`` runs each task at once on the submitting thread (compression inline, on the
critical path: the baseline). Both modes run the same tasks in the same order, so their results are
bit-identical.

Errors: the first exception of a task is kept; the tasks after it are skipped, and it is raised on the
training thread at its next :meth:`Executor.submit` or :meth:`Executor.wait_until`. Every wait is
bounded (``timeout``); :meth:`Executor.close` stops the worker after the tasks already submitted.

The worker thread is bound to the submitting rank's lowband context (:func:`lowband.runtime.bind_thread`),
so it can communicate on that rank's groups. torch's intra-op thread pool is shared by both threads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from lowband.errors import CommTimeoutError, InvalidArgumentError, LowbandError
from lowband.runtime import Context, bind_thread, current
from lowband.teardown import idle

Task = Callable[[], None]


class ExecutorError(LowbandError):
    """A task of the executor failed; raised on the training thread (the cause is chained)."""


class Executor:
    """Runs tasks in submission order: on a worker thread (``offload=True``) or at once; see the module
    docstring. ``timeout`` bounds every wait (seconds)."""

    def __init__(self, *, offload: bool, timeout: float, where: str = "Executor") -> None:
        self.offload = offload
        self.timeout = float(timeout)
        self.where = where
        self._ctx: Context | None = current(where) if offload else None
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._submitted = 0
        self._finished = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        #: seconds the worker spent running tasks (offload) or the submitter ran them (inline)
        self.busy_s = 0.0

    # -- submitting and waiting (training thread) --------------------------------------------------
    def submit(self, task: Task) -> None:
        """Run ``task`` after every task submitted before it."""
        self.raise_error()
        if self._closed:
            raise InvalidArgumentError(f"{self.where}: submit after close()")
        if not self.offload:
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    task()
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                self.busy_s += time.perf_counter() - t0
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"lowband-{self.where}", daemon=True)
            self._thread.start()
        with self._cond:
            self._submitted += 1
        self._queue.put(task)

    def raise_error(self) -> None:
        """Raise the first task error, if any (as :class:`ExecutorError`, or the lowband error itself)."""
        err = self._error
        if err is None:
            return
        if isinstance(err, LowbandError):
            raise err
        raise ExecutorError(f"{self.where}: a task failed: {type(err).__name__}: {err}") from err

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Block until ``ready()`` (checked whenever a task finishes) or a task fails (raised here), at
        most ``timeout`` seconds (default the executor's)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while not ready() and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"{self.where}: {what} not complete within {limit:g} s")
                self._cond.wait(left)
        self.raise_error()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted task has run (or raise the first error)."""
        self.wait_until(lambda: self._finished == self._submitted, "the submitted tasks", timeout)

    def notify(self) -> None:
        """Wake waiters of :meth:`wait_until` (a task changed what they wait for)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the worker once the submitted tasks have run (bounded); idempotent."""
        if self._closed:
            return
        self._closed = True
        t = self._thread
        if t is None:
            return
        self._queue.put(None)
        t.join(self.timeout)
        if t.is_alive():
            raise CommTimeoutError(f"{self.where}: the worker thread did not stop within {self.timeout:g} s")

    # -- the worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        bind_thread(self._ctx)
        try:
            while True:
                with idle():  # waiting for work, not for a peer: shutdown need not wait for it
                    task = self._queue.get()
                if task is None:
                    return
                if self._error is None:
                    t0 = time.perf_counter()
                    try:
                        with torch.no_grad():
                            task()
                    except BaseException as exc:  # surfaced on the training thread
                        self._error = exc
                    self.busy_s += time.perf_counter() - t0
                with self._cond:
                    self._finished += 1
                    self._cond.notify_all()
        finally:
            bind_thread(None)
