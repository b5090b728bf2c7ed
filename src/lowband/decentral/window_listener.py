"""The listener of the window service: one thread per rank and window process group that serves every
peer (:mod:`lowband.decentral.window_service` says what it serves and why one thread suffices).

For each peer the listener keeps one posted receive of a request header (tag 0). A header buffer is
filled with :data:`EMPTY` before its receive is posted; no header has that first word (request kinds
are small positive numbers), so a changed first word means the header's bytes are landing. The
listener then waits for that receive (it completes at once: the bytes are there), serves the request,
and posts the peer's next header receive. It never waits for a receive whose bytes have not started
to arrive.

Why the buffer and not the work: in torch 2.13 a gloo send/recv work reports ``is_completed()`` only
after ``wait()`` returned (measured: False with the data already in the buffer), and a timed wait that
expires closes the connection to the peer (:func:`lowband.teardown.break_connections` relies on it).
So the only way to wait for many peers from one thread without closing connections is to watch the
buffers, and to wait on a work only once its data is arriving.

Polling: after a request the listener polls without sleeping (yielding the GIL) for :data:`SPIN_S`,
then sleeps :data:`FIRST_SLEEP_S` between polls until :data:`WARM_S` after the request (a requester's
next request usually comes within that), then doubles its sleep up to :data:`MAX_SLEEP_S` while
nothing arrives. While
it polls it counts as idle for :func:`lowband.teardown.join_threads` (it is blocked in no gloo wait);
while it serves a request it does not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lowband.comm.batch import Channel, recv_op
from lowband.comm.handle import Handle
from lowband.decentral import window_protocol as wp
from lowband.errors import CommFailedError, LowbandError
from lowband.teardown import busy, idle

#: the first word of a header buffer whose receive has not started to fill it
EMPTY = -1
#: after a request, poll without sleeping this long
SPIN_S = 300e-6
#: then sleep this long between polls until WARM_S after the request, then doubling up to MAX_SLEEP_S
FIRST_SLEEP_S = 50e-6
WARM_S = 5e-3
MAX_SLEEP_S = 1e-3


class _Slot:
    """The posted header receive of one peer."""

    __slots__ = ("handle", "hdr", "word")

    def __init__(self, channel: Channel, peer: int) -> None:
        self.hdr = torch.full((wp.HEADER,), EMPTY, dtype=torch.int64, device="cpu")
        self.word: Any = self.hdr.numpy()  # reads the buffer's memory, no copy
        op = recv_op(self.hdr, peer, wp.TAG_HEADER, control=True)
        self.handle: Handle[None] = channel.ibatch("window_service", [op], lambda: None, trace=False)


class Listener:
    """One thread serving the header receives of a set of peers (see the module docstring).

    ``serve(src, header)`` handles a request (it may block, bounded: payload and answer); ``fail``
    records a service failure; ``stopping()`` says that a peer's lost connection is expected."""

    def __init__(
        self,
        rank: int,
        channel: Channel,
        serve: Callable[[int, list[int]], None],
        fail: Callable[[LowbandError], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.rank = rank
        self.channel = channel
        self._serve = serve
        self._fail = fail
        self._stopping = stopping
        self._lock = threading.Lock()
        self._new: list[int] = []
        #: peers whose header receive is posted (they have not sent STOP and were not lost)
        self.open: set[int] = set()
        self._thread: threading.Thread | None = None

    def add(self, peers: list[int]) -> None:
        """Serve ``peers`` too (each once), starting the thread if it is not running."""
        if not peers:
            return
        with self._lock:
            self._new += peers
            self.open.update(peers)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"lowband-win-listener-r{self.rank}", daemon=True
                )
                self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the thread to end; True if it did (or never ran)."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        where = f"lowband window service on rank {self.rank}"
        group = self.channel.group
        slots: dict[int, _Slot] = {}
        sleep = 0.0
        last = time.monotonic()
        with idle():  # while it polls it is in no gloo wait
            while True:
                if self._new or not slots or group.destroyed:
                    with self._lock:
                        new, self._new = self._new, []
                        if (not new and not slots) or group.destroyed:
                            self._thread = None  # an add() from now on starts a new thread
                            self.open.clear()
                            return
                    for p in new:
                        self._post(slots, p, where)
                ready = [p for p, s in slots.items() if s.word[0] != EMPTY]
                if ready:
                    with busy():
                        for p in ready:
                            self._take(slots, p, where)
                    last, sleep = time.monotonic(), 0.0
                    continue
                if sleep <= FIRST_SLEEP_S:  # still near the last request
                    quiet = time.monotonic() - last
                    # a sleep of 0 yields the GIL without a timer
                    sleep = 0.0 if quiet < SPIN_S else FIRST_SLEEP_S if quiet < WARM_S else 2 * FIRST_SLEEP_S
                else:
                    sleep = min(MAX_SLEEP_S, 2 * sleep)
                time.sleep(sleep)

    def _post(self, slots: dict[int, _Slot], p: int, where: str) -> None:
        try:
            slots[p] = _Slot(self.channel, p)
        except LowbandError as exc:
            self._lost(p, exc, where)

    def _lost(self, p: int, exc: LowbandError, where: str) -> None:
        if not self._stopping():
            self._fail(CommFailedError(f"{where}: lost rank {p} (it may have died): {exc}"))
        self._close(p)

    def _close(self, p: int) -> None:
        with self._lock:
            self.open.discard(p)

    def _take(self, slots: dict[int, _Slot], p: int, where: str) -> None:
        """Complete peer ``p``'s arriving header, serve it, and post the next one (not after STOP or
        a failure: that peer is served no longer)."""
        slot = slots.pop(p)
        try:
            slot.handle.wait()  # the bytes are arriving: bounded by the runtime timeout
        except LowbandError as exc:
            self._lost(p, exc, where)
            return
        vals = [int(v) for v in slot.hdr.tolist()]
        if vals[0] == wp.STOP:
            self._close(p)
            return
        try:
            self._serve(p, vals)
        except LowbandError as exc:
            self._fail(exc)
            self._close(p)
            return
        except Exception as exc:
            self._fail(CommFailedError(f"{where}: serving a request from rank {p} failed: {exc!r}"))
            self._close(p)
            return
        self._post(slots, p, where)
