"""The heartbeat's talking part: ranks beat and read each other's counters in the rendezvous store.

No thread of its own: the strategy beats between its steps (:meth:`Heartbeat.beat`, which does nothing
until ``bound / 3`` seconds have passed since this rank's last beat) and while it waits for an
asynchronous op (:meth:`Heartbeat.wait`). A beat is two store round trips: one ``add`` of this rank's
counter, one ``multi_get`` of every other member's two counters (keys under ``PREFIX/beat/{rank}`` and
``PREFIX/at/{rank}``; the first beat creates them all with ``add(key, 0)``, so ``multi_get`` never waits
for a key). Both are bounded by the store's own timeout; a failure raises
:class:`~lowband.errors.CommFailedError` naming where. What the counters mean and who is missing:
:mod:`lowband.heartbeat`.

A rank that finishes marks itself done (:meth:`Heartbeat.finish`: ``Strategy.close`` and
:func:`lowband.shutdown` call it, the latter through :func:`finish_heartbeats`), so the ranks still
running their last steps do not take it as lost.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lowband import heartbeat as rule
from lowband.errors import CommFailedError, InvalidArgumentError

if TYPE_CHECKING:
    from lowband.comm.handle import Handle
    from lowband.runtime import Context

T = TypeVar("T")
_STATE = "lowband.comm.heartbeat"
_POLL_S = 0.002  # between two looks at an op in flight (poll)


class Heartbeat:
    """This rank's heartbeat in a group of world ranks ``members`` (``me`` among them), its keys under
    ``prefix`` (unique per group: a new membership gets new keys), ``bound`` seconds of silence
    allowed. ``where`` starts every error message."""

    def __init__(
        self, store: Any, prefix: str, members: Sequence[int], me: int, bound: float, *, where: str
    ) -> None:
        if not bound > 0 or bound == float("inf"):
            raise InvalidArgumentError(
                f"{where}: heartbeat must be a finite number of seconds > 0, got {bound!r}"
            )
        if me not in members:
            raise InvalidArgumentError(f"{where}: rank {me} is not among the members {list(members)}")
        self.store, self.prefix, self.me, self.bound, self.where = store, prefix, me, float(bound), where
        self.members = tuple(members)
        self.others = tuple(r for r in members if r != me)
        self.every, self.cap = self.bound / 3, self.bound / 2
        self.beats = 0  # this rank's counter (as the store last returned it)
        self.at = 0  # this rank's collective points entered
        self.seen: dict[int, rule.Seen] = {}
        self._last_beat: float | None = None  # monotonic
        self._last_look: float | None = None
        self._made = False
        self._keys = [self._key("beat", r) for r in self.others] + [self._key("at", r) for r in self.others]
        self.finished = False

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (RuntimeError, TimeoutError, ValueError) as exc:  # DistStoreError is a RuntimeError
            raise CommFailedError(
                f"{self.where}: the heartbeat's {what} on the rendezvous store failed: {exc}"
            ) from exc

    def _make_keys(self) -> None:
        for key in self._keys:  # (adding 0 creates a key, or leaves it as it is)
            self.store.add(key, 0)

    @property
    def started(self) -> bool:
        """Whether this rank has beaten (it does so first after its first step)."""
        return self.beats > 0

    def due(self, now: float) -> bool:
        return self._last_beat is None or now - self._last_beat >= self.every

    def beat(self, now: float, *, force: bool = False) -> dict[int, float]:
        """Beat if due (or ``force``, once this rank has beaten before) and read the others: the members
        missing now -> their silence in seconds (empty when none, or when no beat was due)."""
        if self.finished or not (self.due(now) or (force and self.started)):
            return {}
        if not self._made:
            self._call("creation of the other members' keys", self._make_keys)
            self._made = True
        self.beats = int(self._call("beat", lambda: self.store.add(self._key("beat", self.me), 1)))
        raw = self._call("read of the other members' counters", lambda: self.store.multi_get(self._keys))
        values = self._call("read of the other members' counters", lambda: [int(bytes(v)) for v in raw])
        n = len(self.others)
        beats, at = (
            dict(zip(self.others, values[:n], strict=True)),
            dict(zip(self.others, values[n:], strict=True)),
        )
        dt = None if self._last_look is None else now - self._last_look
        self.seen = rule.observe(self.seen, beats, at, self.at, dt, self.cap)
        self._last_beat = self._last_look = now
        return rule.missing(self.seen, self.bound)

    def enter(self) -> None:
        """This rank enters a collective point (every member passes the same ones, in the same order)."""
        if not self.finished:
            self.at = int(self._call("collective mark", lambda: self.store.add(self._key("at", self.me), 1)))

    def passed(self, now: float) -> None:
        """A collective point completed: every member was alive there."""
        self.seen = rule.reset(self.seen)
        if self._last_look is not None:
            self._last_look = now

    def finish(self) -> None:
        """Mark this rank done (never missing from now on); idempotent."""
        if not self.finished:
            self.finished = True
            self._call("done mark", lambda: self.store.set(self._key("at", self.me), str(rule.AT_DONE)))


def poll(handle: Handle[T], timeout: float, look: Callable[[], None]) -> T:
    """``handle.wait()`` bounded by ``timeout``, calling ``look()`` between two looks at the op (a beat,
    a read of whether a peer noticed a loss; it may raise, or break the group so that the op fails)."""
    end = time.monotonic() + timeout
    while not handle.done():
        if time.monotonic() >= end:
            break
        look()
        time.sleep(_POLL_S)
    return handle.wait(timeout=max(end - time.monotonic(), 1e-3))


def register(ctx: Context, hb: Heartbeat) -> None:
    """``hb`` is marked done when this rank shuts down (:func:`finish_heartbeats`)."""
    beats: weakref.WeakSet[Heartbeat] = ctx.state.setdefault(_STATE, weakref.WeakSet())
    beats.add(hb)


def finish_heartbeats(ctx: Context) -> None:
    """``lowband.shutdown``: every live heartbeat of this rank marked done (best effort: a store already
    gone is ignored)."""
    for hb in list(ctx.state.pop(_STATE, ())):
        try:
            hb.finish()
        except CommFailedError:
            pass


__all__ = ["Heartbeat", "finish_heartbeats", "poll", "register"]
