"""Handles of nonblocking operations, over torch's ``Work`` objects and their futures.

A :class:`Handle` is what every nonblocking lowband op returns. ``wait()`` is where time is spent:
it waits (bounded) for the underlying torch works, then runs the op's finishing step once (dividing
for an average, unpacking a fusion buffer, trimming padding) and returns the result. ``done()`` polls
without blocking; ``then(fn)`` chains a function that runs as soon as the data is there, on torch's
callback thread, without anyone calling ``wait()``.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from lowband.comm.trace import Event, Tracer
from lowband.errors import CommFailedError, CommTimeoutError, LowbandError

T = TypeVar("T")
U = TypeVar("U")

_UNSET: Any = object()


def _is_timeout(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "timed out" in msg or "timeout" in msg


class Handle(Generic[T]):
    """Result of a nonblocking op. ``wait()`` returns the op's result (raising its error, if any)."""

    def __init__(
        self,
        works: Sequence[Any],
        finish: Callable[[], T],
        *,
        op: str,
        name: str | None,
        rank: int,
        timeout: float,
        tracer: Tracer | None = None,
        event: Event | None = None,
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self.op = op
        self.name = name
        self.rank = rank
        self._timeout = timeout
        self._lock = threading.Lock()
        self._result: Any = _UNSET
        self._error: BaseException | None = None
        self._tracer = tracer
        self._event = event
        if event is not None and tracer is not None:
            if self._works:
                futs = [w.get_future() for w in self._works]
                fut = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
                fut.then(lambda _f: tracer.end(event))
            else:
                tracer.end(event)

    def _where(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"lowband.{self.op}{label} on rank {self.rank}"

    def done(self) -> bool:
        """True once the communication has finished (successfully or not); never blocks."""
        return self._result is not _UNSET or self._error is not None or all(w.is_completed() for w in self._works)

    def _wait_works(self, timeout: float) -> None:
        td = datetime.timedelta(seconds=timeout)
        for w in self._works:
            try:
                w.wait(td)
            except RuntimeError as exc:
                if _is_timeout(exc):
                    raise CommTimeoutError(
                        f"{self._where()}: no completion within {timeout:g} s (a peer may be dead, "
                        f"slow, or not calling the same op): {exc}"
                    ) from exc
                raise CommFailedError(f"{self._where()} failed (a peer may have died): {exc}") from exc

    def _complete(self, timeout: float | None) -> T:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._result is _UNSET:
                try:
                    self._wait_works(self._timeout if timeout is None else timeout)
                    self._result = self._finish()
                except LowbandError as exc:
                    self._error = exc
                    raise
                except Exception as exc:
                    self._error = CommFailedError(f"{self._where()} failed: {exc}")
                    raise self._error from exc
            result: T = self._result
            return result

    def wait(self, timeout: float | None = None) -> T:
        """Block until the op is complete (at most ``timeout`` seconds, default the runtime's timeout)
        and return its result."""
        return self._complete(timeout)

    def then(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle whose result is ``fn(result)``. ``fn`` runs as soon as the op completes, on torch's
        callback thread (or at once if it is already complete); its exception surfaces in ``wait()``."""
        child: Handle[U] = Handle(
            self._works, lambda: fn(self._complete(None)), op=self.op, name=self.name, rank=self.rank,
            timeout=self._timeout,
        )

        def run(_f: Any = None) -> None:
            try:
                child._complete(None)
            except BaseException:  # noqa: S110 - kept in child._error, raised by child.wait()
                pass

        if not self._works or self.done():
            run()
        else:
            futs = [w.get_future() for w in self._works]
            fut = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
            fut.then(run)
        return child

    def __repr__(self) -> str:
        return f"<Handle {self._where()} done={self.done()}>"


def completed(value: T, *, op: str, name: str | None, rank: int) -> Handle[T]:
    """A handle that is already complete (nothing to communicate)."""
    return Handle([], lambda: value, op=op, name=name, rank=rank, timeout=1.0)


def wait_all(handles: Sequence[Handle[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every handle, in order; returns their results."""
    return [h.wait(timeout) for h in handles]
