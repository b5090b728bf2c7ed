"""The strategy ``winput``: BlueFog's asynchronous win-put optimizer (:class:`WinPutOptimizer`) over a
static topology given by name (``ring``, ``exp2``: the default, ``full``) or as a :class:`Topology`;
``period = H``: put and combine every H-th step.

``on_peer_loss="continue"`` (options :data:`~lowband.strategies.peer_loss.PEER_LOSS_OPTIONS`): the
survivors of a lost rank train on without it, the stepwise way (:mod:`lowband.strategies.peer_steps`):

- *Noticed*: a put that fails (its wait polls: the heartbeat beats, another member's notice is seen), a
  window call meeting the window service's record of a lost neighbor (its receiver's receive failed), the
  per-step non-finite agreement, the heartbeat. Nothing raises into the forward or the step.
- *Given up*: at the notice this rank gives up its windows alone (:meth:`WinPutOptimizer.abandon`,
  :func:`~lowband.decentral.window.win_abandon`: ``win_free`` is collective and would wait for the dead
  rank). Its window connections close, so every survivor's next put toward it, and its receivers for this
  rank, fail at once: they notice too. From the notice on this rank puts and combines nothing: the
  communication of the step in which it noticed is dropped (if it was not combined yet) and its steps
  until the meeting are local steps.
- What is dropped: whatever a survivor's windows held, the dead rank's last puts included. A survivor
  combined, before it noticed, whatever had arrived (as winput always does: a combination waits for no
  neighbor); those combinations stay. A rank killed between two steps whose puts all completed is noticed
  by every survivor at the non-finite agreement of the next step (an allreduce after the backward, before
  that step's combination): that step is a local step on every survivor.
- *Agreed and met* after the step (a member behind the latest step count catches up alone): the topology
  is rebuilt from its name over the members, in the order of their world ranks, and every window is
  registered again over the members' group (:meth:`WinPutOptimizer.regroup`), each in-neighbor's buffer a
  copy of the member's own parameter as it is then (as at construction): a neighbor's share of a
  combination is the member's own value until that neighbor's first put arrives. The members check their
  step counts, forward counts and topology. So ``continue`` needs a topology name: a :class:`Topology` is
  over a fixed number of ranks and is refused.
- Replacements (:mod:`lowband.strategies.peer_join`) are refused: winput has no step at which the members
  are in sync (every combination uses whatever has arrived), so none can carry a join's proposal and its
  state. A process started as a replacement raises :class:`InvalidArgumentError` at construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from lowband.comm.agree import agree, crc
from lowband.decentral.strategies import (
    PERIOD,
    TopologyArg,
    WrapperStrategy,
    check_survivable_topology,
)
from lowband.decentral.winput import WinPutOptimizer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.pending import Survival
from lowband.options import Options
from lowband.runtime import current
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.peer_loss import PEER_LOSS_OPTIONS
from lowband.strategies.peer_steps import StepwisePeerLoss
from lowband.strategies.registry import register_strategy
from lowband.topology import Topology
from lowband.topology.names import STATIC_TOPOLOGIES, build_topology, topology_label, topology_option

if TYPE_CHECKING:
    from lowband.plan import Links, PlanProfile, Prediction


@register_strategy(
    "winput",
    "BlueFog asynchronous win_put: put to neighbors in forward, combine arrivals, local step",
    Options({"topology": topology_option(STATIC_TOPOLOGIES, dynamic=False), "period": PERIOD})
    | PEER_LOSS_OPTIONS,
)
class WinPutStrategy(WrapperStrategy, StepwisePeerLoss):
    name = "winput"

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models_peers

        return models_peers.winput(profile, links, options)

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, topology: TopologyArg = "exp2",
        period: int = 1, on_peer_loss: str = "raise", min_ranks: int | None = None, peer_settle: float = 1.0,
        heartbeat: float | None = None,
    ) -> None:  # fmt: skip
        where = f"{type(self).__name__} on rank {group.world_rank}"
        h = period
        ctx = current(where)
        if on_peer_loss == "continue":
            check_survivable_topology(where, topology, STATIC_TOPOLOGIES)
            if ctx.joining:  # (before the windows' collective creation, which the members never join)
                raise InvalidArgumentError(
                    f"{where}: this process replaces a lost rank, but strategy 'winput' admits no replacement "
                    "(its members are never in sync at a step: there is no state to hand over): restart the run "
                    "from a checkpoint to grow it"
                )
        topo = build_topology(where, topology, STATIC_TOPOLOGIES, group.size, 1, dynamic=False)
        assert isinstance(topo, Topology)
        opt = WinPutOptimizer(
            model, make_optimizer, topology=topo, num_steps_per_communication=h, group=group
        )
        super().__init__(model, opt, group)
        self.topology_name, self.period = topology_label(topology), h
        self.winput = opt
        self.init_peer_loss(on_peer_loss, min_ranks, peer_settle, heartbeat)
        if on_peer_loss == "continue":
            opt.survival = Survival(self.wait_beating, self._put_lost, ctx.config.timeout)

    def in_sync(self) -> bool:
        return self.group.size == 1

    def hparams(self) -> dict[str, Any]:
        return {"topology": self.topology_name, "period": self.period}

    def close(self) -> None:
        """Mark this rank done for the heartbeat (:meth:`Heartbeating.close`, which the wrapper's close
        comes before), then free the windows (collective; after a lost peer not yet met, local)."""
        if self._heartbeat is not None:
            self._heartbeat.finish()
        self.winput.close()

    # -- a lost peer (on_peer_loss="continue": module docstring, lowband.strategies.peer_steps) -----
    def after_step(self) -> None:
        super().after_step()
        if self.peer_loss == "continue" and not self.membership_settled():
            self.recover()  # the members agree (and, once caught up, meet on their group)

    def notice(
        self, exc: BaseException, what: str, began: float, silent: dict[int, float] | None = None
    ) -> None:
        if self._lost is None:
            super().notice(exc, what, began, silent)
            self.winput.abandon()  # the windows given up on this rank alone; nothing put or combined

    def _put_lost(self, exc: BaseException, window: int, launched: float) -> None:
        self.notice(exc, f"the window {self.winput.windows[window][0]!r}", launched)

    def regroup(self, group: Group) -> None:
        where = f"{type(self).__name__} on rank {group.world_rank}"
        topo = build_topology(where, self.topology_name, STATIC_TOPOLOGIES, group.size, 1, dynamic=False)
        assert isinstance(topo, Topology)
        self.winput.regroup(group, topo)

    def after_meeting(self) -> None:
        opt = self.winput
        agree(
            self.group, "the step counts and the topology after a membership change",
            [self.steps, opt.steps, opt.forwards, crc(self.topology_name), self.group.size],
            fields=("the strategy's steps", "the optimizer's steps", "the optimizer's forwards",
                    "the topology hash", "the group size"),
            where=f"{type(self).__name__} on rank {self.group.world_rank}",
        )  # fmt: skip


__all__ = ["WinPutStrategy"]
