"""The completion thread: one per rank, for ``Handle.then``/``future`` of works without a torch future
(gloo send/recv, engine tasks), so that no call starts a thread of its own."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from lowband.errors import LowbandError
from lowband.runtime import Context, bind_thread, current
from lowband.teardown import idle

_COMPLETER = "lowband.comm.completion"


class Completer:
    """One thread per rank that waits, in order, for handles whose torch works have no future (gloo
    send/recv, engine tasks) and then runs their ``then`` callbacks. Waiting never blocks issuing, so
    the order of the waits cannot deadlock a peer; a callback that blocks delays the later ones."""

    def __init__(self, ctx: Context | None) -> None:
        self.ctx = ctx
        self._q: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._q.append(fn)
            self._cond.notify_all()
            if self._thread is None or not self._thread.is_alive():
                self._closed = False
                self._thread = threading.Thread(target=self._run, name="lowband-completion", daemon=True)
                self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        bind_thread(self.ctx)
        try:
            while True:
                with self._cond:
                    while not self._q and not self._closed:
                        with idle():
                            self._cond.wait()
                    if not self._q:
                        return
                    fn = self._q.popleft()
                fn()  # bounded: a watch waits at most the handle's timeout
        finally:
            bind_thread(None)


_fallback = Completer(None)


def watch(fn: Callable[[], None]) -> None:
    """Run ``fn`` (a bounded wait, then callbacks) on the calling rank's completion thread."""
    try:
        ctx: Context | None = current("Handle.then")
    except LowbandError:
        ctx = None
    comp = _fallback if ctx is None else ctx.state.setdefault(_COMPLETER, Completer(ctx))
    comp.watch(fn)


def close_completer(ctx: Context) -> None:
    """End ``ctx``'s completion thread once its queue is empty (``lowband.shutdown``)."""
    comp = ctx.state.pop(_COMPLETER, None)
    if comp is not None:
        comp.close()
