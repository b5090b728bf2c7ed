"""Local SGD with full synchronization every H steps (FLSGD), as PyTorch ships it.

torch's ``PeriodicModelAverager`` averages all parameters (one flattened allreduce) after every
``period``-th optimizer step, and ``PostLocalSGDOptimizer`` runs it right after the wrapped optimizer's
``step()``. Between averagings each rank trains on its own shard only: no communication at all.

``on_peer_loss=continue`` (:mod:`lowband.strategies.peer_loss`): at the averaging that finds a peer dead
the survivors agree on the members, a new averager is built on their group (same step count) and the
averaging is redone among them; its heartbeat (``heartbeat=``, 10 s by default there) finds a stopped or
hung peer between averagings. There the averaging is torch's own arithmetic (:func:`_average_polled`:
the same flattened copy, divided, then summed by one allreduce) on a nonblocking allreduce whose wait
polls: a peer whose connection stays open after its death (its reset lost on a congested link) costs
the poll's look at the store (every 50 ms), not the runtime timeout, as torch's blocking averager would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import get_params_to_average
from torch.distributed.optim import PostLocalSGDOptimizer

from lowband.comm.reduce import iallreduce
from lowband.group import Group
from lowband.options import Opt, Options
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.peer_loss import PEER_LOSS_OPTIONS, PeerLoss
from lowband.strategies.registry import register_strategy
from lowband.strategies.torchcomm import comm_errors

if TYPE_CHECKING:
    from lowband.plan.links import Links
    from lowband.plan.prediction import Prediction
    from lowband.plan.profile import PlanProfile


@register_strategy(
    "localsgd",
    "FLSGD: local SGD, all parameters averaged every H steps (torch PostLocalSGD)",
    Options({"period": Opt(int, min=1, unit="steps", doc="H: local steps between two averagings")})
    | PEER_LOSS_OPTIONS,
)
class LocalSGDStrategy(PeerLoss):
    """fp16: the local gradients are unscaled at the step and the ranks agree on inf/NaN first, so a
    skipped step (no averaging either) is skipped on every rank and torch's averager counts alike."""

    name = "localsgd"
    local_steps = True
    no_grad_scaler_reason = None

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        period: int = 5,
        on_peer_loss: str = "raise",
        min_ranks: int | None = None,
        peer_settle: float = 1.0,
        heartbeat: float | None = None,
    ) -> None:
        self.period = period
        # no warm-up: torch's warm-up expects DDP's post_localSGD_hook to allreduce meanwhile
        self.averager = PeriodicModelAverager(period=period, warmup_steps=0, process_group=group.pg)
        inner = make_optimizer(model.parameters())
        # PostLocalSGDOptimizer.step() = inner.step() + averager.average_parameters(params)
        self.post = PostLocalSGDOptimizer(inner, self.averager)
        super().__init__(model, self.post, group)
        self.init_peer_loss(on_peer_loss, min_ranks, peer_settle, heartbeat)

    plan_grid = ("period=5", "period=20")

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models

        return models.localsgd(profile, links, options)

    def hparams(self) -> dict[str, Any]:
        return {"H": self.period}

    def apply_step(self) -> None:
        if self.peer_loss == "continue":
            self._apply_surviving()
            return
        with comm_errors(self.name, "step (model averaging)", self.group):
            if self.averager.step % self.period == 0:  # the averaging is due: a collective point
                self.collective(super().apply_step)
            else:
                super().apply_step()

    def _apply_surviving(self) -> None:
        """:meth:`apply_step` under ``on_peer_loss=continue``: the local step, then the averaging (when
        due) through :meth:`PeerLoss.survive`; a failed averaging left the parameters untouched (torch
        averages a flattened copy) and did not count, so it is redone on the new averager."""
        if self.nonfinite is not None and self.averager.step % self.period == 0:
            # the agreements in flight on the old group are read before the averaging, so a loss met there
            # is handled at this exchange (the guard is read at each call: noticing a loss replaces it)
            self.guarded(
                lambda: self.nonfinite.settle() if self.nonfinite else None, "the non-finite agreement"
            )
        if not self.check_nonfinite():
            return
        self.post.optim.step()
        groups = self.optimizer.param_groups

        def average() -> None:
            with comm_errors(self.name, "step (model averaging)", self.group):
                self._average_polled(get_params_to_average(groups))

        if self.averager.step % self.period != 0:
            self.averager.step += 1  # no averaging at this step
            return
        self.survive(self.averager.step // self.period, average)

    def _average_polled(self, params: list[nn.Parameter]) -> None:
        """torch's ``average_parameters`` (a flattened copy divided by the group's size, summed by one
        allreduce, copied back) with a nonblocking allreduce waited by :meth:`wait_beating`; the
        parameters are untouched when it fails. Counts the averager's step, as torch's does."""
        if params:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            flat /= self.group.size
            out = self.wait_beating(iallreduce(flat, "sum", inplace=True, group=self.group.unchecked()))
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(out[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.averager.step += 1

    def regroup(self, group: Group) -> None:
        count = self.averager.step
        self.averager = PeriodicModelAverager(period=self.period, warmup_steps=0, process_group=group.pg)
        self.averager.step = count
        self.post.averager = self.averager

    def in_sync(self) -> bool:
        # torch's averager counts its calls from 0 and averages when count % period == 0,
        # i.e. after steps 1, 1 + H, 1 + 2H, ...
        return self.averager.step >= 1 and (self.averager.step - 1) % self.period == 0
