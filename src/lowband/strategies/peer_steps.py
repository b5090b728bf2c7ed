"""Training on without a dead rank in strategies that average at every step (``dreamddp``, ``plsgd-enp``,
``flsgd-overlap``): the members meet between two steps, not inside one exchange.

:mod:`lowband.strategies.peer_loss` redoes one failed exchange among the survivors; that needs every
survivor to have lost the peer at the same exchange. A strategy whose averagings are spread over every
step (a layer here, another there, overlapped with backward) cannot ask that: an averaging can complete on
some survivors and fail on others (the dead rank sent its last bytes to some of them), and a survivor
whose averagings of step s all completed only fails at step s+1 (or later, at a step with nothing to
average). So here:

- *Noticed*: a failed averaging (its wait polls, so a lost reset is seen through the store as well), the
  heartbeat, or a failed side collective. The averaging's unit is put back as it was before it
  (:class:`~lowband.localsgd.runtime.LayerAverager`), this rank's connections of the group are closed
  (every other survivor's next averaging fails at once), and it trains alone: its later steps average
  nothing.
- *Agreed*, after the step in which it noticed: each survivor announces the number of steps it has
  done; the one decision of the epoch (:mod:`lowband.membership`) names the members and every member's
  count. A member behind the latest count trains alone until it reaches it
  (:func:`lowband.membership.catch_up`): a survivor ahead completed a step the others did not and cannot
  undo it, and the others can add steps alone. Then every member has done the same number of steps (the
  same schedule position, the same steps left in the user's loop).
- *Met*: the members open their group (one blocks there until the last has caught up, within the
  runtime timeout), install it (:meth:`PeerLoss.install_group`) and check that they agree on what they
  will average next (:meth:`StepwisePeerLoss.after_meeting`). Nothing is redone: what each survivor
  averaged before the loss stays (a unit's last averaging may have included the lost rank, or may have
  failed on this rank and stays local until its next turn in the schedule, as in any period).
- Replacements (:mod:`lowband.strategies.peer_join`) are proposed at the first step of each period that
  averages something, before its averagings, and admitted when the next step begins, after this rank's
  averagings of that step completed (so every member proposed before anyone reads the proposal).

A survivor that announces after the others settled (it was more than ``peer_settle`` behind) is left out
and raises, as in :mod:`lowband.strategies.peer_loss`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lowband.membership import Decision, catch_up
from lowband.strategies import peer_join
from lowband.strategies.peer_loss import PeerLoss

log = logging.getLogger("lowband.peer_loss")


class StepwisePeerLoss(PeerLoss):
    """:class:`PeerLoss` for strategies that average at every step (module docstring). The strategy calls
    :meth:`recover` at the end of every step, averages nothing while :meth:`membership_settled` is False,
    calls :meth:`propose_joins` before the averagings of the steps it names as exchanges, and implements
    :meth:`regroup` and :meth:`after_meeting`."""

    #: the decision adopted and not yet met: (decision, this rank's step count when it announced, when
    #: the agreement began and ended)
    _met: tuple[Decision, int, float, float] | None = None

    def propose_joins(self, exchange: int) -> None:
        """Before the averagings of exchange ``exchange``: propose the replacements that asked to join;
        they are admitted when the next step begins (:meth:`PeerLoss.begin_step`)."""
        if self.peer_loss == "continue" and self._lost is None:
            peer_join.propose(self, exchange)
            self._admit_at = exchange

    def begin_step(self) -> None:
        if self._lost is not None:
            self._admit_at = None  # a loss noticed since the proposal: the agreement comes first
        super().begin_step()

    def recover(self) -> None:
        """After every step under ``continue``: agree on the members once a loss was noticed, train alone
        until the latest member's step count, then meet the members on their group."""
        if self.peer_loss != "continue" or self._lost is None:
            return
        if self._met is None:
            self.synchronize()  # nothing of the old group in flight (failed averagings are put back)
            decision, t0, t1 = self.collective(lambda: self.agree_members(self.steps, aligned=False))
            self._met = (decision, self.steps, t0, t1)
        decision, announced, t0, t1 = self._met
        if self.steps < catch_up(decision):
            return  # train alone up to the latest member's count
        self.collective(lambda: self._meet(decision, announced, t0, t1))

    def _meet(self, decision: Decision, announced: int, t0: float, t1: float) -> None:
        lost = self._lost
        assert lost is not None
        old, where = self.group, self._peer_where()
        if decision.members == old.ranks:  # the heartbeat took a slow member for lost
            log.warning(
                "%s: %s failed (%s) but every member reached the agreement: a false alarm; the group is "
                "rebuilt with all of them", where, lost.what, lost.error,
            )  # fmt: skip
        group = self.open_members(decision.members)
        event = self.loss_event(old, decision, announced, t1 - t0)
        event.update(step=self.steps, caught_up_steps=self.steps - announced,
                     false_alarm=decision.members == old.ranks)  # fmt: skip
        self._met = None
        self.install_group(group)
        self.after_meeting()
        done = time.monotonic()
        event.update(rebuild_s=round(done - t1, 4), recover_s=round(done - lost.at, 4))
        self.peer_losses.append(event)
        log.warning(
            "%s: lost rank(s) %s (noticed at %s, step %d); training on with ranks %s from step %d (caught up "
            "%d step(s) alone); detected in %.3f s, recovered %.3f s after noticing",
            where, event["lost_ranks"], lost.what, lost.step, list(decision.members), self.steps,
            event["caught_up_steps"], lost.detect, event["recover_s"],
        )  # fmt: skip

    def after_meeting(self) -> None:
        """Once the members met on their new group: make what the strategy averages next the same on
        every member and check it (a collective on the new group)."""
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.peer_loss == "continue" and self._met is not None:
            decision, announced, _, _ = self._met
            out["peer_loss_catching_up"] = {
                "members": list(decision.members),
                "announced": announced,
                "to": catch_up(decision),
            }
        return out


__all__ = ["StepwisePeerLoss"]
