"""Handles of nonblocking operations, over torch's ``Work`` objects and their futures.

A :class:`Handle` is what every nonblocking lowband op returns. ``wait()`` is where time is spent:
it waits (bounded) for the underlying torch works, then runs the op's finishing step once (dividing
for an average, unpacking a fusion buffer, trimming padding) and returns the result. ``done()`` polls
without blocking; ``then(fn)`` chains a function that runs as soon as the data is there, on torch's
callback thread, without anyone calling ``wait()``.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from lowband.comm.trace import Event, Tracer
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError, LowbandError

T = TypeVar("T")
U = TypeVar("U")

_UNSET: Any = object()


def check_timeout(where: str, timeout: object) -> float:
    """``timeout`` as seconds: a finite number > 0 (not a bool), else :class:`InvalidArgumentError`."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise InvalidArgumentError(f"{where}: timeout must be a finite number of seconds, got {timeout!r}")
    if timeout <= 0:
        raise InvalidArgumentError(f"{where}: timeout must be > 0 seconds, got {timeout!r}")
    return float(timeout)


def _is_timeout(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "timed out" in msg or "timeout" in msg


def comm_error(where: str, exc: BaseException, timeout: float) -> LowbandError:
    """The lowband error for a failed torch wait: a timeout, or a failure (a peer died)."""
    if _is_timeout(exc):
        return CommTimeoutError(
            f"{where}: no completion within {timeout:g} s (a peer may be dead, slow, or not calling the same op): {exc}"
        )
    return CommFailedError(f"{where} failed (a peer may have died): {exc}")


def _future_of(works: Sequence[Any]) -> Any:
    """One torch Future completing when all ``works`` do, or None if a work has no future."""
    try:
        futs = [w.get_future() for w in works]
    except RuntimeError:  # "Work::getFuture not implemented" (gloo send/recv)
        return None
    return futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)


class _Works:
    """The torch works of one op, shared by a handle and the handles ``then`` derives from it.

    A gloo work may be waited on only once (a second ``wait`` on a completed send/recv blocks until
    its timeout: the completion was consumed), so waiting is serialised here and remembered.
    """

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)
        self.done = not self.works
        self.lock = threading.Lock()


class Handle(Generic[T]):
    """Result of a nonblocking op. ``wait()`` returns the op's result (raising its error, if any)."""

    def __init__(
        self,
        works: Sequence[Any] | _Works,
        finish: Callable[[], T],
        *,
        op: str,
        name: str | None,
        rank: int,
        timeout: float,
        tracer: Tracer | None = None,
        event: Event | None = None,
    ) -> None:
        self._w = works if isinstance(works, _Works) else _Works(works)
        self._works = self._w.works
        self._finish = finish
        self.op = op
        self.name = name
        self.rank = rank
        self._timeout = timeout
        self._lock = threading.Lock()
        self._result: Any = _UNSET
        self._error: LowbandError | None = None
        self._tracer = tracer
        self._event = event
        self._traced = False
        if event is not None and tracer is not None:
            if not self._works:
                self._trace_end()
            else:
                fut = _future_of(self._works)
                if fut is not None:  # else the end is recorded when the handle is waited on
                    fut.then(lambda _f: self._trace_end())

    def _trace_end(self) -> None:
        if self._event is not None and self._tracer is not None and not self._traced:
            self._traced = True
            self._tracer.end(self._event)

    def _where(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"lowband.{self.op}{label} on rank {self.rank}"

    def done(self) -> bool:
        """True once the communication has finished (successfully or not); never blocks."""
        return (
            self._result is not _UNSET
            or self._error is not None
            or self._w.done
            or all(w.is_completed() for w in self._works)
        )

    def _wait_works(self, timeout: float) -> None:
        w = self._w
        if w.done:
            return
        if not w.lock.acquire(timeout=timeout):
            raise CommTimeoutError(
                f"{self._where()}: no completion within {timeout:g} s (another thread is waiting on it)"
            )
        try:
            if w.done:
                return
            td = datetime.timedelta(seconds=timeout)
            for work in w.works:
                try:
                    work.wait(td)
                except LowbandError:  # a lowband work raised its own (an argument mismatch, a refused send)
                    raise
                except RuntimeError as exc:
                    if _is_timeout(exc):  # lowband's timeout passed: an NCCL communicator is torn down
                        for stuck in w.works:
                            abort = getattr(stuck, "abort", None)
                            if abort is not None:
                                abort()
                    raise comm_error(self._where(), exc, timeout) from exc
            w.done = True
        finally:
            w.lock.release()

    def _fail(self, exc: LowbandError) -> LowbandError:
        with self._lock:
            if self._error is None and self._result is _UNSET:
                self._error = exc
            return self._error if self._error is not None else exc

    def _complete(self, timeout: float | None) -> T:
        if self._error is not None:
            raise self._error
        if self._result is _UNSET:
            # Wait for the works without holding the lock: torch may run a completion callback
            # (``then``) that needs this lock before it marks the work complete.
            try:
                self._wait_works(self._timeout if timeout is None else timeout)
            except LowbandError as exc:
                raise self._fail(exc) from exc.__cause__
            self._trace_end()
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._result is _UNSET:
                    try:
                        self._result = self._finish()
                    except LowbandError as exc:
                        self._error = exc
                        raise
                    except Exception as exc:
                        self._error = CommFailedError(f"{self._where()} failed: {exc}")
                        raise self._error from exc
        result: T = self._result
        return result

    def drain(self, timeout: float) -> bool:
        """Block until the op's works have ended, successfully or not, at most ``timeout`` seconds; never
        raises; returns whether they ended. For a caller that gave up on the op (its wait failed, or it
        stopped polling) and must know nothing writes into its buffers any more before it reuses them
        (an op still in flight after a failed wait goes on under gloo)."""
        end = time.monotonic() + timeout
        while not (self._w.done or all(w.is_completed() for w in self._works)):
            if self._error is not None and _future_of(self._works) is None:
                return self._end_works(end)
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)
        return True

    def _end_works(self, end: float) -> bool:
        """:meth:`drain` of a failed op whose works have no future (gloo's send/recv): such a work says it
        ended only once waited, and the wait that failed stopped at its first failed work, so the others
        are waited here (each at most once: a second wait of a gloo work blocks), until ``end``."""
        w = self._w
        if not w.lock.acquire(timeout=max(end - time.monotonic(), 0.0)):
            return False
        try:
            for work in w.works:
                left = end - time.monotonic()
                if work.is_completed() or left <= 0:
                    continue
                try:
                    work.wait(datetime.timedelta(seconds=left))
                except RuntimeError:
                    pass  # ended, unsuccessfully: what a drain waits for
            return all(work.is_completed() for work in w.works)
        finally:
            w.lock.release()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the op is complete (at most ``timeout`` seconds, default the runtime's timeout)
        and return its result."""
        if timeout is not None:
            timeout = check_timeout(f"{self._where()}: Handle.wait", timeout)
        return self._complete(timeout)

    def then(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle whose result is ``fn(result)``. ``fn`` runs as soon as the op completes, on torch's
        callback thread (the rank's completion thread for ops whose torch works have no future, such as
        send/recv: :mod:`lowband.comm.engine`; at once if it is already complete); its exception surfaces in ``wait()``."""
        child: Handle[U] = Handle(
            self._w,
            lambda: fn(self._complete(None)),
            op=self.op,
            name=self.name,
            rank=self.rank,
            timeout=self._timeout,
        )

        def run() -> None:
            if self._error is not None:
                child._fail(self._error)
                return
            try:
                child._complete(None)
            except BaseException:
                pass

        self._when_complete(run)
        return child

    def future(self) -> torch.futures.Future[T]:
        """A torch Future completed with this op's result (or its error, as the lowband exception), on
        torch's callback thread, without anyone calling ``wait()``: the bridge to code built on torch
        futures (DDP comm hooks, ``torch.futures.collect_all``)."""
        fut: torch.futures.Future[T] = torch.futures.Future()

        def settle() -> None:
            try:
                value = self._complete(None)
            except BaseException as exc:
                fut.set_exception(exc)  # type: ignore[arg-type]  # (torch's stub types it as the result)
                return
            fut.set_result(value)

        self._when_complete(settle)
        return fut

    def _when_complete(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the works are complete (their waits then return at once) or failed
        (``self._error`` set), on torch's callback thread or the completion thread, or now if already so."""

        def run(fut: Any = None) -> None:
            # Runs on torch's callback thread once the works' futures are complete. Calling
            # ``Work.wait`` from here can deadlock, so take the future's outcome instead.
            if fut is not None:
                try:
                    value = fut.value()
                    inner = value if isinstance(value, list) else []
                    for f in inner:
                        if hasattr(f, "value"):
                            f.value()
                except Exception as exc:
                    self._fail(CommFailedError(f"{self._where()} failed (a peer may have died): {exc}"))
                    callback()
                    return
                self._w.done = True
            callback()

        if not self._works or self._result is not _UNSET or self._error is not None:
            run()
            return
        fut = _future_of(self._works)
        if fut is not None:
            fut.then(run)
        else:
            # Works without futures (gloo send/recv, engine tasks): the rank's completion thread waits
            # (bounded) in their place, in order (lowband.comm.engine); no thread per call.
            from lowband.comm.completion import watch

            def waited() -> None:
                try:
                    self._wait_works(self._timeout)
                except LowbandError as exc:
                    self._fail(exc)
                run()

            watch(waited)

    def map(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle over the same communication whose result is ``fn(result)``, computed by the thread
        that waits (unlike :meth:`then`, nothing runs on torch's callback thread: for ``fn`` that must
        run where autograd records, or only when someone waits)."""
        return Handle(
            self._w,
            lambda: fn(self._complete(None)),
            op=self.op,
            name=self.name,
            rank=self.rank,
            timeout=self._timeout,
        )

    def __repr__(self) -> str:
        return f"<Handle {self._where()} done={self.done()}>"


def completed(value: T, *, op: str, name: str | None, rank: int) -> Handle[T]:
    """A handle that is already complete (nothing to communicate)."""
    return Handle([], lambda: value, op=op, name=name, rank=rank, timeout=1.0)


def wait_all(handles: Sequence[Handle[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every handle, in order; returns their results."""
    return [h.wait(timeout) for h in handles]
