"""Training on without a dead rank: the ``on_peer_loss`` option of the periodic-averaging strategies.

``on_peer_loss="raise"`` (the default): a dead peer raises :class:`~lowband.errors.CommFailedError` (or
:class:`~lowband.errors.CommTimeoutError`) naming the strategy and the rank, as every strategy does.

``on_peer_loss="continue"`` (``localsgd``; ``diloco`` with ``inner=local``): the survivors go on. (The
strategies that communicate at every step, ``dreamddp`` and its variants, ``atc``, ``awc`` and
``winput``, meet between steps instead of redoing one exchange: :mod:`lowband.strategies.peer_steps`.)

- *Noticed*: by the heartbeat (below) while the survivors compute, at the next exchange (the averaging
  fails: a dead process's connections close at once), or at a read of the asynchronous non-finite
  agreements of the local steps. A survivor that notices closes its own connections of the group
  (:func:`lowband.teardown.break_group`), so every other survivor's pending or next op on it fails at
  once too instead of waiting for the timeout, and its next exchange goes straight to the agreement.
  Until the exchange it trains on alone, checking its own gradients (a non-finite one raises at once, on
  this rank); the non-finite agreements in flight are dropped.
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
strategy's group (``strategy.group``) is used afterwards. A loss noticed and not yet agreed on is in
the report as ``peer_loss_noticed``.

The heartbeat, ``heartbeat=B`` (seconds; 10 by default under ``continue``; 0 = off, the default under
``raise``). A rank stopped, hung or cut off keeps its connections open, so no op fails: without a
heartbeat it is found when an exchange times out (the runtime timeout), and any loss only at the
exchange, which a long period puts far off. With it, each rank beats between its steps, at most every
B/3 seconds: one ``add`` of its counter in the rendezvous store and one ``multi_get`` of the other
members' (two store round trips on the training thread; no thread of its own:
:mod:`lowband.comm.heartbeat`); a member whose counter this rank has watched stand still for more than
B seconds is missing (:mod:`lowband.heartbeat`): found about B + B/3 + a step after its last beat, while
the others compute. Under ``continue`` that is a noticed loss (``noticed_at`` "the heartbeat"; the event
gives ``silent_ranks`` and ``silent_s``, the silence measured); under ``raise`` a
:class:`~lowband.errors.CommFailedError` at that step, naming the silent ranks and the option. A wait
for an op in flight (the non-finite agreements, a streamed exchange) polls it and beats meanwhile.

Not missing: a member that has not beaten yet (first steps differ: data loading, compilation); one
waiting at a collective point of the strategy (an exchange, ``average_model``, ``replica_spread``,
``save``, ``load``) that this rank has not reached, since it waits for this rank; one that finished
(:meth:`Strategy.close` or :func:`lowband.shutdown` mark it done; a rank that exits on an error marks
itself done too, and its closed connections fail the next op on the group instead). An exchange
completed proves every member alive, and this rank's own absence (blocked in an exchange, a long step)
counts at most B/2 per look, so it does not make the others look silent.

Limits. A rank beats between steps only: B must exceed twice the longest step and any pause between
steps of one rank alone (an evaluation, a checkpoint write on rank 0), or the others take it as lost. Such
a false alarm is survived under ``continue`` when that rank reaches the exchange's agreement within
``peer_settle``: every member is alive there and the group is rebuilt with all of them (once per
exchange; a second time raises); a later one is left out and raises. A rank that stops while the others
are blocked in an exchange with it (torch's averaging, which cannot beat) is found by the runtime timeout,
as before. B is not tied to the runtime timeout (the timeout bounds an op, B the silence between ops), so
any B >= 0 is accepted.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lowband.comm.deaths import DeathNotices
from lowband.comm.membership import agree
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.membership import Decision
from lowband.options import Opt, Options
from lowband.runtime import current, open_group, rendezvous_store
from lowband.strategies import peer_join
from lowband.strategies.peer_heartbeat import Heartbeating, Noticed
from lowband.teardown import break_group

log = logging.getLogger("lowband.peer_loss")
T = TypeVar("T")
POLICIES = ("raise", "continue")
LOST = (CommFailedError, CommTimeoutError)
#: how often a rank waiting for an agreement reads whether another member noticed a loss (one store read)
_WATCH_PEERS_S = 0.05
#: the heartbeat bound under on_peer_loss=continue when none is given (s); under raise it is off
DEFAULT_HEARTBEAT_S = 10.0

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
        "heartbeat": Opt(
            float, min=0, unit="s",
            doc="a rank silent for longer between its steps (stopped, hung, cut off) is lost, found while "
            "the others compute; 0: off (default: 10 under on_peer_loss=continue, off under raise); "
            "must exceed twice the longest step or pause between steps",
        ),
    }
)  # fmt: skip


class PeerLoss(Heartbeating):
    """The ``on_peer_loss`` behaviour and the heartbeat (module docstring), a base of the strategies that
    offer them. A strategy calls :meth:`init_peer_loss` after ``Strategy.__init__``, runs its exchange's
    averaging through :meth:`survive` (or, where it never survives a loss, through :meth:`collective`)."""

    #: the exchange of the last step, whose proposed replacements are admitted when the next step begins
    _admit_at: int | None = None

    def init_peer_loss(
        self, policy: str, min_ranks: int | None, settle: float, heartbeat: float | None = None
    ) -> None:
        where = f"strategy {self.name!r} (on_peer_loss={policy!r}) on rank {self.group.world_rank}"
        if min_ranks is not None and min_ranks > self.group.size and not current(where).joining:
            raise InvalidArgumentError(
                f"{where}: min_ranks={min_ranks} is more than the group's {self.group.size} ranks"
            )
        bound = (DEFAULT_HEARTBEAT_S if policy == "continue" else 0.0) if heartbeat is None else heartbeat
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < float("inf"):
            raise InvalidArgumentError(
                f"{where}: heartbeat must be a number of seconds >= 0, got {heartbeat!r}"
            )
        self.peer_loss, self.min_ranks, self.peer_settle = policy, min_ranks, float(settle)
        self.heartbeat_s = float(bound)
        self.peer_losses: list[dict[str, Any]] = []
        self._epochs = 0  # membership agreements started (each under a key of its own)
        self._watched = 0.0  # when _watch_peers last read the store
        self._deaths: DeathNotices | None = None
        ctx = current(where)
        counters = ctx.state.setdefault("lowband.peer_loss", itertools.count())
        self._membership_key = f"lowband/membership/{next(counters)}"
        if policy == "continue":
            self.no_grad_scaler_reason = "on_peer_loss=continue steps without a grad scaler"
        self._start_heartbeat()
        self._watch_deaths()

    # -- noticing ---------------------------------------------------------------------------------
    def peer_watch(self) -> Callable[[], None] | None:
        return self._watch_peers if self.peer_loss == "continue" else None

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
            deaths = [] if self._deaths is None else self._deaths.new()
            said = bytes(store.get(key)).decode() if store.check([key]) else ""
        except (RuntimeError, TimeoutError) as exc:
            raise CommFailedError(f"{where}: the rendezvous store failed: {exc}") from exc
        dead = [(r, c) for r, c in deaths if r in self.group.ranks and r != self.group.world_rank]
        if dead:
            said = ", ".join(f"rank {r} ended with status {c}" for r, c in dead) + " (seen by the launcher)"
        if said:
            raise CommFailedError(f"{where}: {said}")

    def side_collective(self, fn: Callable[[], T], what: str, alone: Callable[[], T]) -> T:
        if self.peer_loss != "continue":
            return fn()
        if self._lost is not None:  # the group is broken: its agreement comes at the next exchange
            return alone()
        began = time.monotonic()
        try:
            return fn()
        except LOST as exc:
            self.notice(exc, what, began)
            return alone()

    def membership_settled(self) -> bool:
        return self._lost is None

    def check_nonfinite(self) -> bool:
        return self.guarded(super().check_nonfinite, "the non-finite agreement")

    def guarded(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``; under ``continue`` a lost peer met there is noticed and ``fn`` run again alone (the
        non-finite guard is this rank's alone once a loss is noticed)."""
        return self.side_collective(fn, what, fn)

    def notice(
        self, exc: BaseException, what: str, began: float, silent: dict[int, float] | None = None
    ) -> None:
        """A peer is lost: close this rank's connections of the group (every survivor's op on it fails
        now) and check gradients alone until the exchange. ``silent``: the ranks the heartbeat found
        silent, and for how long."""
        if self._lost is not None:
            return
        now = time.monotonic()
        error = str(exc).splitlines()[0][:300]
        self._lost = Noticed(now, now - began, what, error, self.steps, dict(silent or {}))
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
            guard = old.moved(alone, step=lambda: self.steps)
            self.nonfinite = guard

    # -- surviving ----------------------------------------------------------------------------------
    def survive(self, exchange: int, average: Callable[[], None]) -> None:
        """Run ``average()`` (this exchange's averaging on :attr:`group`); under ``continue``, when a
        peer is lost (now or noticed earlier), agree on the members, move to their group
        (:meth:`install_group`) and run ``average()`` again among them; and admit the replacements of lost
        ranks that asked to join (:mod:`lowband.strategies.peer_join`). ``average`` must leave the state
        untouched when it raises."""
        if self.peer_loss != "continue":
            self.collective(average)
            return

        def exchange_and_propose() -> None:
            peer_join.propose(self, exchange)  # (before the averaging: module docstring there)
            self._survive(exchange, average)
            self._admit_at = exchange  # read when the next step begins (begin_step)

        self.collective(exchange_and_propose)

    def begin_step(self) -> None:
        # replacements proposed at the last step's exchange join now, where the replacement's own loop
        # begins its first step: whatever the user's loop does after a step (a checkpoint's agreement)
        # the members have done for that step, and the replacement goes on from the next one
        if self._admit_at is not None:
            exchange, self._admit_at = self._admit_at, None
            self.collective(lambda: peer_join.admit(self, exchange))
        super().begin_step()

    def regroup(self, group: Group) -> None:
        """Rebuild what holds the strategy's group (its averager, its exchange) on ``group``."""
        raise NotImplementedError(f"strategy {self.name!r} cannot change its group")

    def install_group(self, group: Group) -> None:
        """Make ``group`` the strategy's group: its own parts (:meth:`regroup`), the non-finite guard and
        the heartbeat."""
        self.group = group
        self.regroup(group)
        if self.nonfinite is not None:
            policy, skipped = self.nonfinite.policy, self.nonfinite.skipped
            self.set_nonfinite(policy)
            assert self.nonfinite is not None
            self.nonfinite.skipped = skipped
        self._lost = None
        self._start_heartbeat()
        self._watch_deaths()

    def _watch_deaths(self) -> None:
        """Under ``continue``: read the deaths the launcher records from now on (:mod:`lowband.comm.deaths`)."""
        if self.peer_loss != "continue":
            return
        where = f"strategy {self.name!r} (on_peer_loss='continue') on rank {self.group.world_rank}"
        try:
            self._deaths = DeathNotices(rendezvous_store(current(where)))
        except (RuntimeError, TimeoutError) as exc:
            raise CommFailedError(f"{where}: the rendezvous store failed: {exc}") from exc

    def _peer_where(self) -> str:
        return f"strategy {self.name!r} (on_peer_loss='continue') on rank {self.group.world_rank}"

    def agree_members(self, exchange: int, *, aligned: bool) -> tuple[Decision, float, float]:
        """A new membership epoch's agreement (:mod:`lowband.comm.membership`), this rank announcing
        ``exchange``; returns the decision and when the agreement began and ended (monotonic)."""
        lost = self._lost
        assert lost is not None
        where = self._peer_where()
        self._epochs += 1
        t0 = time.monotonic()
        decision = agree(
            rendezvous_store(current(where)), f"{self._membership_key}/epoch{self._epochs}", self.group.ranks,
            self.group.world_rank, exchange, min_ranks=self.min_ranks, settle=self.peer_settle,
            timeout=current(where).config.timeout, aligned=aligned,
            where=f"{where}: membership agreement {self._epochs} after {lost.what} failed ({lost.error})",
        )  # fmt: skip
        return decision, t0, time.monotonic()

    def open_members(self, members: tuple[int, ...]) -> Group:
        """The group of ``members`` for the current epoch (every member calls it; gloo waits for the
        members' addresses in the store up to the timeout)."""
        where = self._peer_where()
        key = f"{self._membership_key}/epoch{self._epochs}"
        try:
            return open_group(current(where), members, f"{key}/group", f"{self.name}-members{self._epochs}")
        except (RuntimeError, TimeoutError) as exc:  # a member died after the agreement
            raise CommFailedError(
                f"{where}: the group of ranks {list(members)} could not be made: {exc}"
            ) from exc

    def loss_event(self, old: Group, decision: Decision, exchange: int, agree_s: float) -> dict[str, Any]:
        """The report's entry of a membership change after a loss (times filled in by the caller)."""
        lost = self._lost
        assert lost is not None
        return {
            "lost_ranks": sorted(set(old.ranks) - set(decision.members)),
            "members": list(decision.members),
            "step": self.steps + 1,
            "exchange": exchange,
            "noticed_at": lost.what,
            "noticed_step": lost.step,
            "error": lost.error,
            "detect_s": round(lost.detect, 4),  # the failing op's time, or the silence measured
            "silent_ranks": sorted(lost.silent),
            "silent_s": round(max(lost.silent.values()), 4) if lost.silent else None,
            "agree_s": round(agree_s, 4),
            "rebuild_s": None,
            "recover_s": None,
        }

    def _survive(self, exchange: int, average: Callable[[], None]) -> None:
        alarms = 0  # agreements that found every member alive (a false alarm: the group is rebuilt once)
        while True:
            if self._lost is None:
                began = time.monotonic()
                try:
                    average()
                    return
                except LOST as exc:
                    self.notice(exc, f"exchange {exchange}", began)
            lost = self._lost
            assert lost is not None
            what, error = lost.what, lost.error
            resumed = time.monotonic()
            old = self.group
            decision, t0, t1 = self.agree_members(exchange, aligned=True)
            members = decision.members
            where = self._peer_where()
            if members == old.ranks:
                if alarms:
                    raise CommFailedError(f"{where}: {what} failed ({error}) but every member is alive")
                alarms += 1
                log.warning(
                    "%s: %s failed (%s) but every member reached the agreement: a false alarm; the group is "
                    "rebuilt with all of them", where, what, error,
                )  # fmt: skip
            group = self.open_members(members)
            event = self.loss_event(old, decision, exchange, t1 - t0)
            self.install_group(group)
            # rebuild_s: the new group and the averaging redone on it; recover_s: from the exchange (or the
            # failure met there) to the averaging redone
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
                where, event["lost_ranks"], event["step"], exchange, what, list(members), lost.detect,
                event["recover_s"],
            )  # fmt: skip
            return

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.peer_loss == "continue":
            out["peer_loss"] = [dict(e) for e in self.peer_losses]
            lost = self._lost
            out["peer_loss_noticed"] = None if lost is None else {
                "noticed_at": lost.what, "step": lost.step, "error": lost.error,
                "silent_ranks": sorted(lost.silent),
                "silent_s": round(max(lost.silent.values()), 4) if lost.silent else None,
            }  # fmt: skip
        if self.heartbeat_s > 0:
            out["heartbeat_s"] = self.heartbeat_s
        return out


__all__ = ["DEFAULT_HEARTBEAT_S", "PEER_LOSS_OPTIONS", "POLICIES", "PeerLoss"]
