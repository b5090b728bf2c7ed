"""The distributed mutex of the windows: :func:`win_mutex` and :func:`win_lock`, and the per-window
state machine behind them.

:class:`WindowMutex` is one window's mutex on one rank, pure local bookkeeping (threads and a condition
variable; it does not communicate): the window service (:mod:`lowband.decentral.window_service`) feeds
it the operations and lock requests its receiver threads get from neighbors, and this module's context
managers and :mod:`lowband.decentral.window` the local acquisitions. Waiters are served strictly first
come, first served:

- a *remote lock* (a neighbor's ``win_mutex``) makes that rank the holder until it unlocks; its grant
  is a callback (the service sends the grant message);
- a *local* acquisition (``win_mutex(for_self=True)``, ``require_mutex`` of ``win_update``,
  ``win_lock``) makes this rank's own thread the holder; it is reentrant for the holding thread;
  ``freeze`` (``win_lock``) additionally holds back *every* incoming operation, not only mutexed ones;
- an *operation* (a neighbor's put/accumulate/get) runs at once when it may, else it is queued and run,
  outside the condition lock, by whichever thread makes the mutex free. An operation with
  ``mutexed=True`` holds the mutex while it runs; one from the rank that holds the mutex runs at once.

Operations from one source are never reordered: once one is queued, the later ones from the same source
queue behind it (per-pair FIFO), mutexed or not.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lowband.comm.batch import P2POp
from lowband.decentral.peers import check_rank_list
from lowband.decentral.window_protocol import (
    LOCK,
    UNLOCK,
    check_flag,
    check_neighbors,
    check_statuses,
    request_ops,
)
from lowband.decentral.window_service import WindowRecord, WindowService, lookup, where
from lowband.errors import CommTimeoutError, InvalidArgumentError
from lowband.runtime import Context

Action = Callable[[], None]

#: the ``holder`` value while this rank's own thread holds the mutex
LOCAL = -1


@dataclass(eq=False)
class _Waiter:
    kind: str  # "local", "lock" or "op"
    src: int = LOCAL
    action: Action | None = None
    mutexed: bool = False
    freeze: bool = False
    granted: bool = False


@dataclass(eq=False)
class WindowMutex:
    """FIFO mutex of one window on one rank (see the module docstring)."""

    #: None (free), LOCAL (this rank's thread ``local_thread``) or the rank holding it remotely
    holder: int | None = None
    #: a mutexed operation from this source is running (the mutex is held for it)
    running_src: int | None = None
    frozen: bool = False
    local_thread: int | None = None
    local_depth: int = 0
    queue: collections.deque[_Waiter] = field(default_factory=collections.deque)
    #: queued or running deferred operations per source (keeps each source's operations in order)
    deferred: collections.Counter[int] = field(default_factory=collections.Counter)
    cv: threading.Condition = field(default_factory=threading.Condition)

    # -- state ----------------------------------------------------------------------------------

    def _free(self) -> bool:
        return self.holder is None and self.running_src is None

    def idle(self) -> bool:
        """Nobody holds the mutex and nothing waits for it."""
        with self.cv:
            return self._free() and not self.queue and not self.frozen

    def describe(self) -> str:
        with self.cv:
            who = (
                "free"
                if self.holder is None
                else ("held by this rank" if self.holder == LOCAL else f"held by rank {self.holder}")
            )
            return f"{who}, {len(self.queue)} waiting"

    # -- operations from neighbors (receiver threads) ------------------------------------------

    def submit(self, src: int, action: Action, *, mutexed: bool) -> None:
        """Run ``action`` (an operation from rank ``src``) now if it may run, else queue it."""
        with self.cv:
            behind = self.deferred[src] > 0
            if not behind and self.holder == src and not self.frozen:
                now, hold = True, False  # the sender holds this mutex: its operations run at once
            elif behind or self.frozen or (mutexed and (not self._free() or self.queue)):
                self.deferred[src] += 1
                self.queue.append(_Waiter("op", src, action, mutexed))
                return
            else:
                now, hold = True, mutexed
            if hold:
                self.running_src = src
        if now:
            self._run(action, hold)

    def request(self, src: int, grant: Action) -> None:
        """Rank ``src`` asks for the mutex; ``grant`` runs (once) when it gets it."""
        with self.cv:
            if self._free() and not self.queue and not self.frozen:
                self.holder = src
            else:
                self.queue.append(_Waiter("lock", src, grant))
                return
        grant()

    def unlock(self, src: int) -> bool:
        """Rank ``src`` gives the mutex back; False (and nothing changes) if it does not hold it."""
        with self.cv:
            if self.holder != src:
                return False
            self.holder = None
        self._drain()
        return True

    # -- this rank's own thread -----------------------------------------------------------------

    def acquire_local(self, timeout: float, where: str, *, freeze: bool = False) -> bool:
        """Take the mutex for the calling thread (reentrant), waiting at most ``timeout`` seconds.
        Returns the previous ``frozen`` flag (to give to :meth:`release_local`)."""
        me = threading.get_ident()
        with self.cv:
            was_frozen = self.frozen
            if self.holder == LOCAL and self.local_thread == me:
                self.local_depth += 1
                self.frozen = self.frozen or freeze
                return was_frozen
            if self._free() and not self.queue:
                self._take_local(me, freeze)
                return False
            w = _Waiter("local", freeze=freeze)
            self.queue.append(w)
            deadline = time.monotonic() + timeout
            while not w.granted:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.queue.remove(w)
                    raise CommTimeoutError(
                        f"{where}: the window mutex was not free within {timeout:g} s ({self.describe_locked()})"
                    )
                self.cv.wait(left)
            self._take_local(me, freeze)
            return False

    def describe_locked(self) -> str:
        who = "free" if self.holder is None else f"held by rank {self.holder}"
        return f"{who}, {len(self.queue)} waiting"

    def _take_local(self, me: int, freeze: bool) -> None:
        self.holder = LOCAL
        self.local_thread = me
        self.local_depth = 1
        self.frozen = freeze

    def holds_local(self) -> bool:
        with self.cv:
            return self.holder == LOCAL and self.local_thread == threading.get_ident()

    def release_local(self, was_frozen: bool = False) -> None:
        """Give back one level of the calling thread's hold; the outermost release frees the mutex and
        runs or grants whatever waits."""
        with self.cv:
            if self.holder != LOCAL or self.local_thread != threading.get_ident():
                raise RuntimeError("release_local by a thread that does not hold the window mutex")
            self.local_depth -= 1
            if self.local_depth > 0:
                self.frozen = was_frozen
                return
            self.holder = None
            self.local_thread = None
            self.frozen = False
        self._drain()

    # -- internals ------------------------------------------------------------------------------

    def _run(self, action: Action, hold: bool) -> None:
        try:
            action()
        finally:
            if hold:
                with self.cv:
                    self.running_src = None
                self._drain()

    def _drain(self) -> None:
        """Serve the queue head while the mutex is free (call without holding ``cv``)."""
        while True:
            with self.cv:
                if not self._free() or not self.queue:
                    return
                w = self.queue.popleft()
                if w.kind == "local":
                    w.granted = True
                    self.holder = LOCAL  # taken for the waiter; it sets its thread when it wakes
                    self.local_thread = None
                    self.cv.notify_all()
                    return
                if w.kind == "lock":
                    self.holder = w.src
                elif w.mutexed:
                    self.running_src = w.src
            assert w.action is not None
            if w.kind == "lock":
                w.action()
                return
            try:
                w.action()
            finally:
                with self.cv:
                    self.deferred[w.src] -= 1
                    if w.mutexed:
                        self.running_src = None


# ---------------------------------------------------------------- the user-facing context managers


@contextlib.contextmanager
def own_mutex(
    ctx: Context, rec: WindowRecord, at: str, held: bool = True, freeze: bool = False
) -> Iterator[None]:
    """Hold this rank's own mutex of ``rec`` (reentrant for the calling thread) if ``held``."""
    if not held:
        yield
        return
    was = rec.mutex.acquire_local(ctx.config.timeout, at, freeze=freeze)
    try:
        yield
    finally:
        rec.mutex.release_local(was)


@contextlib.contextmanager
def win_lock(name: str) -> Iterator[None]:
    """Hold this rank's window mutex and hold back every incoming operation on the window until the
    block exits (they are applied then, in order)."""
    ctx, _, rec = lookup("win_lock", name)
    with own_mutex(ctx, rec, where("win_lock", ctx, name), freeze=True):
        yield


@contextlib.contextmanager
def win_mutex(name: str, *, for_self: bool = False, ranks: Sequence[int] | None = None) -> Iterator[None]:
    """Hold the window mutex of ``ranks`` (default: every out-neighbor; acquired in ascending rank
    order) or, with ``for_self``, of this rank's own window. Operations with ``require_mutex`` and other
    ranks' ``win_mutex`` wait meanwhile; this rank's own operations to them are applied at once."""
    op = "win_mutex"
    ctx, svc, rec = lookup(op, name)
    at = where(op, ctx, name)
    if check_flag(at, "for_self", for_self):
        if ranks is not None:
            raise InvalidArgumentError(f"{at}: give for_self=True or ranks, not both (got ranks={ranks!r})")
        with own_mutex(ctx, rec, at):
            yield
        return
    targets = (
        list(rec.out_nbrs) if ranks is None else check_rank_list(at, "ranks", ranks, svc.group.size, rec.me)
    )
    check_neighbors(at, "ranks", targets, rec.peers, "neighbor")
    again = sorted(set(targets) & rec.held)
    if again:
        raise InvalidArgumentError(
            f"{at}: this rank already holds the mutex of rank {again[0]} (not reentrant)"
        )
    got: list[int] = []
    try:
        for r in sorted(targets):  # ascending: two ranks wanting the same mutexes cannot deadlock
            _remote(svc, rec, at, LOCK, [r])
            got.append(r)
            rec.held.add(r)
        yield
    finally:
        for r in got:
            rec.held.discard(r)
        if got:
            _remote(svc, rec, at, UNLOCK, got)


def _remote(svc: WindowService, rec: WindowRecord, at: str, kind: int, ranks: list[int]) -> None:
    """Send LOCK or UNLOCK to ``ranks`` and wait (bounded) for their answers."""
    ops: list[P2POp] = []
    statuses: list[torch.Tensor] = []
    for r in ranks:
        ms, st = request_ops(r, kind, rec.wid, svc.next_tag())
        ops += ms
        statuses.append(st)
    svc.post("win_mutex", ops, lambda: True, rec.name).wait()
    check_statuses(at, "lock" if kind == LOCK else "unlock", ranks, statuses, svc.group)
