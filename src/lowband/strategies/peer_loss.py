"""Training on without a dead rank: the ``on_peer_loss`` option of the periodic-averaging strategies.

``on_peer_loss="raise"`` (the default): a dead peer raises :class:`~lowband.errors.CommFailedError` (or
:class:`~lowband.errors.CommTimeoutError`) naming the strategy and the rank, as every strategy does.

``on_peer_loss="continue"`` (``localsgd``; ``diloco`` with ``inner=local``): the survivors go on.

- *Noticed*: at the next exchange (the averaging fails: a dead process's connections close at once), or
  earlier at a read of the asynchronous non-finite agreements of the local steps. A survivor that
  notices closes its own connections of the group (:func:`lowband.teardown.break_group`), so every
  other survivor's pending or next op on it fails at once too instead of waiting for the timeout. Until
  the exchange it trains on alone, checking its own gradients (a non-finite one raises at once, on this
  rank); the non-finite agreements in flight are dropped.
- *Agreed*, at the exchange: each survivor announces itself with the exchange's index in the
  rendezvous store and they settle on one member list (:mod:`lowband.comm.membership`; why they cannot
  disagree: :mod:`lowband.membership`), a quorum of the last membership (a majority, or ``min_ranks``)
  after nobody new announced for ``peer_settle`` seconds; no quorum within the timeout raises on every
  survivor.
- *Rebuilt*: a new gloo group over the members, from the store (:func:`lowband.runtime.open_group`: it
  needs nothing from the dead), made the strategy's group with everything that held the old one (the
  model averager, the outer exchange, the non-finite guard).
- *Redone*: the failed averaging is run again among the members, from their current state, so the lost
  rank's local progress since the last exchange is dropped; it is logged (logger ``lowband.peer_loss``)
  and listed in :meth:`~lowband.strategies.base.Strategy.report` under ``peer_loss``.

The rest of the world (``lowband.world()``, torch's default group) stays broken after a loss: only the
strategy's group (``strategy.group``) is used afterwards.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lowband.comm.membership import agree
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.optim.nonfinite import NonFiniteGuard
from lowband.options import Opt, Options
from lowband.runtime import current, open_group, rendezvous_store
from lowband.strategies.base import Strategy
from lowband.teardown import break_group

log = logging.getLogger("lowband.peer_loss")
T = TypeVar("T")
POLICIES = ("raise", "continue")
LOST = (CommFailedError, CommTimeoutError)
#: how often a rank waiting for an agreement reads whether another member noticed a loss (one store read)
_WATCH_PEERS_S = 0.05

#: the options of the strategies that can go on without a dead rank
PEER_LOSS_OPTIONS = Options(
    {
        "on_peer_loss": Opt(
            str, choices=POLICIES,
            doc="a dead peer raises, or the survivors agree on a new membership and train on without it",
        ),
        "min_ranks": Opt(
            int, min=1, unit="ranks",
            doc="with on_peer_loss=continue: the quorum of survivors to go on with (default: a majority "
            "of the last membership)",
        ),
        "peer_settle": Opt(
            float, gt=0, unit="s",
            doc="with on_peer_loss=continue: how long no new survivor must announce itself before the "
            "membership is settled (a survivor later than that is left out and raises)",
        ),
    }
)  # fmt: skip


class PeerLoss(Strategy):
    """The ``on_peer_loss`` behaviour (module docstring), a base of the strategies that offer it. A
    strategy calls :meth:`init_peer_loss` after ``Strategy.__init__`` and, at its exchange, runs the
    averaging through :meth:`survive`."""

    peer_loss: str = "raise"
    #: when the loss was noticed (monotonic), how long the failing op took to fail, where, the error
    _lost: tuple[float, float, str, str] | None = None

    def init_peer_loss(self, policy: str, min_ranks: int | None, settle: float) -> None:
        where = f"strategy {self.name!r} (on_peer_loss={policy!r}) on rank {self.group.world_rank}"
        if min_ranks is not None and min_ranks > self.group.size:
            raise InvalidArgumentError(
                f"{where}: min_ranks={min_ranks} is more than the group's {self.group.size} ranks"
            )
        self.peer_loss, self.min_ranks, self.peer_settle = policy, min_ranks, float(settle)
        self.peer_losses: list[dict[str, Any]] = []
        self._epochs = 0  # membership agreements started (each under a key of its own)
        self._watched = 0.0  # when _watch_peers last read the store
        if policy == "continue":
            self.no_grad_scaler_reason = "on_peer_loss=continue steps without a grad scaler"
            ctx = current(where)
            counters = ctx.state.setdefault("lowband.peer_loss", itertools.count())
            self._membership_key = f"lowband/membership/{next(counters)}"

    # -- noticing ---------------------------------------------------------------------------------
    def set_nonfinite(self, policy: str) -> None:
        super().set_nonfinite(policy)
        if self.peer_loss == "continue" and self.nonfinite is not None:
            self.nonfinite.watch = self._watch_peers

    def _noticed_key(self) -> str:
        """The store key a survivor sets when it notices a loss in the current membership."""
        return f"{self._membership_key}/epoch{self._epochs + 1}/noticed"

    def _watch_peers(self) -> None:
        """While this rank waits for an agreement that has not arrived: raise once another member has
        noticed a loss (:meth:`notice` says so in the store; checked every ``_WATCH_PEERS_S``). Its
        pending receive from the dead rank may never fail by itself: a killed process's reset can be
        lost on a congested link, leaving the connection open until the timeout."""
        now = time.monotonic()
        if now - self._watched < _WATCH_PEERS_S:
            return
        self._watched = now
        where = f"strategy {self.name!r} (on_peer_loss='continue') on rank {self.group.world_rank}"
        store = rendezvous_store(current(where))
        key = self._noticed_key()
        try:
            if not store.check([key]):
                return
            said = bytes(store.get(key)).decode()
        except (RuntimeError, TimeoutError) as exc:
            raise CommFailedError(f"{where}: the rendezvous store failed: {exc}") from exc
        raise CommFailedError(f"{where}: {said}")

    def check_nonfinite(self) -> bool:
        return self.guarded(super().check_nonfinite, "the non-finite agreement")

    def guarded(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``; under ``continue`` a lost peer met there is noticed and ``fn`` run again alone."""
        if self.peer_loss != "continue" or self._lost is not None:
            return fn()
        began = time.monotonic()
        try:
            return fn()
        except LOST as exc:
            self.notice(exc, what, began)
            return fn()

    def notice(self, exc: BaseException, what: str, began: float) -> None:
        """A peer is lost: close this rank's connections of the group (every survivor's op on it fails
        now) and check gradients alone until the exchange."""
        if self._lost is not None:
            return
        now = time.monotonic()
        self._lost = (now, now - began, what, str(exc).splitlines()[0][:300])
        where = f"strategy {self.name!r} (on_peer_loss='continue') on rank {self.group.world_rank}"
        try:  # tell the members waiting on an op that may never fail by itself (_watch_peers)
            said = f"rank {self.group.world_rank} noticed a lost peer at {what}"
            rendezvous_store(current(where)).compare_set(self._noticed_key(), "", said)
        except (RuntimeError, TimeoutError):
            pass  # the store is gone too: the membership agreement will say so
        break_group(self.group)
        old = self.nonfinite
        if old is not None:
            alone = Group(None, (self.group.world_rank,), 0, "alone")
            guard = NonFiniteGuard(old.policy, alone, where=old.where, step=lambda: self.steps)
            guard.deferred, guard.skipped = old.deferred, old.skipped
            self.nonfinite = guard

    # -- surviving ----------------------------------------------------------------------------------
    def survive(self, exchange: int, average: Callable[[], None], regroup: Callable[[Group], None]) -> None:
        """Run ``average()`` (this exchange's averaging on :attr:`group`); under ``continue``, when a
        peer is lost (now or noticed earlier), agree on the members, ``regroup(new group)`` and run
        ``average()`` again among them. ``average`` must leave the state untouched when it raises."""
        if self.peer_loss != "continue":
            average()
            return
        while True:
            if self._lost is None:
                began = time.monotonic()
                try:
                    average()
                    return
                except LOST as exc:
                    self.notice(exc, f"exchange {exchange}", began)
            assert self._lost is not None
            _noticed, detect, what, error = self._lost
            resumed = time.monotonic()
            old = self.group
            where = f"strategy {self.name!r} (on_peer_loss='continue') on rank {old.world_rank}"
            self._epochs += 1
            epoch = self._epochs
            key = f"{self._membership_key}/epoch{epoch}"
            t0 = time.monotonic()
            members = agree(
                rendezvous_store(current(where)), key, old.ranks, old.world_rank, exchange,
                min_ranks=self.min_ranks, settle=self.peer_settle, timeout=current(where).config.timeout,
                where=f"{where}: membership agreement {epoch} after {what} failed ({error})",
            )  # fmt: skip
            t1 = time.monotonic()
            if members == old.ranks:
                raise CommFailedError(f"{where}: {what} failed ({error}) but every member is alive")
            try:  # (bounded: gloo waits for the members' addresses in the store up to the timeout)
                group = open_group(current(where), members, f"{key}/group", f"{self.name}-members{epoch}")
            except (RuntimeError, TimeoutError) as exc:  # a member died after the agreement
                raise CommFailedError(
                    f"{where}: the group of ranks {list(members)} could not be made: {exc}"
                ) from exc
            self.group = group
            regroup(group)
            if self.nonfinite is not None:
                policy, skipped = self.nonfinite.policy, self.nonfinite.skipped
                self.set_nonfinite(policy)
                assert self.nonfinite is not None
                self.nonfinite.skipped = skipped
            self._lost = None
            event: dict[str, Any] = {
                "lost_ranks": sorted(set(old.ranks) - set(members)),
                "members": list(members),
                "step": self.steps + 1,
                "exchange": exchange,
                "noticed_at": what,
                "error": error,
                "detect_s": round(detect, 4),
                "agree_s": round(t1 - t0, 4),
                "rebuild_s": None,  # the new group and the averaging redone on it
                "recover_s": None,  # from the exchange (or the failure met there) to the averaging redone
            }
            self.peer_losses.append(event)
            try:
                average()
            except LOST as exc:  # another peer lost meanwhile: agree again, among fewer
                self.notice(exc, f"exchange {exchange} (redone)", time.monotonic())
                continue
            done = time.monotonic()
            event.update(rebuild_s=round(done - t1, 4), recover_s=round(done - resumed, 4))
            log.warning(
                "%s: lost rank(s) %s at step %d (exchange %d, noticed at %s); training on with ranks %s; "
                "their local progress since the last exchange is dropped; detected in %.3f s, recovered "
                "in %.3f s",
                where, event["lost_ranks"], event["step"], exchange, what, list(members), detect, event["recover_s"],
            )  # fmt: skip
            return

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.peer_loss == "continue":
            out["peer_loss"] = [dict(e) for e in self.peer_losses]
        return out


__all__ = ["PEER_LOSS_OPTIONS", "POLICIES", "PeerLoss"]
