"""Local SGD with partial synchronisation as lowband strategies: DreamDDP, PLSGD-ENP, FLSGD overlapped.

Algorithm 1 of the paper, per rank: every step updates each layer as soon as its gradient is ready (a
:class:`~lowband.optim.LayerwiseOptimizer`: any torch optimizer, stepped layer by layer from backward
hooks), and the layers the schedule names for this local iteration (``schedule.layers_at(step)``) are
then averaged in place across ranks, overlapped with the backward of earlier layers
(:class:`~lowband.localsgd.runtime.LayerAverager`). Before a layer's next forward its averaging is done.

- ``dreamddp``: the schedule of DreamDDP's Algorithm 2 with bubble filling; ``plsgd-enp``: equal-number
  partition; ``flsgd-overlap``: every layer averaged in local iteration H, still overlapped with that
  iteration's backward (the non-overlapped FLSGD baseline is the ``localsgd`` strategy).
- The schedule comes from, in order: ``schedule=`` (a :class:`Schedule`, forward indices into the
  profile's layers, or into ``parameter_layers`` order when no profile is given); ``profile=`` (a saved
  profile's JSON path, or a :class:`CostProfile`), scheduled at construction; ``profile=PATH`` of a file
  that does not exist yet profiles lazily (below) and rank 0 saves the profile there, so every later run
  with the same PATH (visible to every rank) schedules from it; else the model is profiled
  lazily at the first step, on its batch, before training on it (``train_step`` profiles its
  ``loss_fn``; the documented loop's first training forward through ``s.module`` profiles a replay of
  itself, :mod:`lowband.strategies.replay`): ``profile_model`` runs a few extra forward/backward passes
  and leaves the model unchanged, so training is exactly as if that profile had been given. Lazy
  profiling also measures the compute/communication interference (``kappa``/``sigma``,
  ``profile_model(interference=True)``) the schedulers then account for; ``report()`` shows both. Profiles are reduced across ranks, so every
  rank builds the same schedule; each (re)schedule is checked across ranks (one small allgather).
- ``reprofile_drift > 0``: the per-layer averagings are timed in flight; at each period boundary the
  ranks agree (one 2-float allreduce) on the seconds per byte they achieved, the first period after a
  (re)schedule being the baseline. When it moved by more than that fraction, the links are re-measured
  (``refit_comm``), and the schedule rebuilt, identically on all ranks, from the next period on.
  Scheduling, lazy profiling and drift: :mod:`lowband.localsgd.rescheduling`.
- ``scheduler``: any :func:`~lowband.localsgd.make_schedule` method. DreamDDP's default is
  ``"dreamddp"`` (Algorithm 2 + bubble filling as published); ``"dreamddp-ls"`` adds a local search
  beyond consecutive runs (:mod:`lowband.localsgd.search`; measured no faster here, see the README).
- ``split``: the unit of synchronisation (:mod:`lowband.localsgd.units`). ``0`` schedules whole layers
  (the paper); ``N`` cuts layers larger than ``N`` bytes into chunks scheduled on their own; ``"auto"``
  (DreamDDP's default) schedules whole layers and chunks of total/(kH) bytes (k = 1, 2, 4); from a
  profile this run measured, those predicted within the cost model's error (25 %) of the best are run
  for ``trial_periods`` periods each, interleaved, and the fastest measured is kept
  (:mod:`lowband.localsgd.trials`; ``trial_periods=0`` keeps the predicted best); from a given profile
  the predicted best. PLSGD-ENP and FLSGD-overlap default to whole layers.
- ``divergence_every > 0``: log Gamma (the model divergence) every that many steps (``divergence_log``).
- Repeatable runs: the split (``split="auto"``) and the schedule follow from the profile alone, and the
  profile is measured (timing): two runs that profile separately may choose differently. With
  ``profile=PATH`` they schedule from the same saved profile; a checkpoint holds the profile, the units
  and the schedule, so a resumed run keeps them. ``reprofile_drift > 0`` re-schedules on measured
  timings and so is not repeatable.
- ``on_peer_loss="continue"``: the survivors of a lost rank train on without it
  (:mod:`lowband.strategies.peer_steps`: a failed averaging puts its unit back, the survivors agree on
  the members after the step, catch up alone to the latest member's step count and meet on a new group;
  the heartbeat, 10 s by default there, finds a stopped peer between steps); replacements join at the
  first averaging step of a period (:mod:`lowband.strategies.peer_join`). A trial of candidate splits in
  progress is ended at a membership change (every member keeps the predicted best).
- Buffers (BatchNorm statistics) are not averaged; the initial parameters and buffers are rank 0's
  (broadcast at construction; ``make_strategy(..., broadcast_init=False)`` keeps each rank's), as
  Algorithm 1 starts from one ``w_0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowband.comm.agree import crc
from lowband.comm.initial import broadcast_initial_state
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.localsgd.costmodel import CostProfile
from lowband.localsgd.divergence import model_divergence
from lowband.localsgd.profiler import resolve_profile, save_profile_atomic
from lowband.localsgd.rescheduling import ScheduledStrategy
from lowband.localsgd.runtime import LayerAverager
from lowband.localsgd.schedule import Schedule
from lowband.localsgd.schedulers import scheduler_names
from lowband.localsgd.trials import DEFAULT_TRIAL_PERIODS
from lowband.optim.layerwise import LayerwiseOptimizer, parameter_layers
from lowband.optim.pending import Survival
from lowband.options import Opt, Options, Rule
from lowband.runtime import current
from lowband.strategies.base import LossFn, OptimizerFactory
from lowband.strategies.peer_loss import PEER_LOSS_OPTIONS
from lowband.strategies.peer_steps import StepwisePeerLoss
from lowband.strategies.registry import register_strategy
from lowband.strategies.replay import ForwardReplay

if TYPE_CHECKING:
    from lowband.plan.links import Links
    from lowband.plan.prediction import Prediction
    from lowband.plan.profile import PlanProfile

DEFAULT_PERIOD = 5

#: the options of ``dreamddp``, ``plsgd-enp`` and ``flsgd-overlap`` (module docstring)
PARTIAL_SYNC_OPTIONS = Options(
    {
        "period": Opt(int, min=1, unit="steps", doc="H: local iterations per period (None: the schedule's, else 5)"),
        "profile": Opt(
            str, objects=(Path, CostProfile), what="a JSON path",
            doc="a saved profile (a missing file: measured at the first step and saved there)",
        ),
        "schedule": Opt(None, objects=(Schedule,), doc="a fixed schedule (Python only)"),
        "reprofile_drift": Opt(float, min=0, doc="re-measure and re-schedule when the links drift by this fraction"),
        "divergence_every": Opt(int, min=0, unit="steps", doc="log the model divergence every that many steps"),
        "split": Opt(
            int, min=0, words=("auto",), what="a chunk size in bytes",
            doc="chunk size of the synchronisation units (0: whole layers; auto: chosen; None: the variant's)",
        ),
        "scheduler": Opt(str, choices=scheduler_names, doc="the make_schedule method (None: the variant's)"),
        "trial_periods": Opt(int, min=0, doc="periods each near-best split is tried for (0: the predicted best)"),
    },
    rules=[
        Rule(
            ("period", "schedule"), "period must be the schedule's period",
            lambda o: o["schedule"] is None or o["period"] is None or o["schedule"].period == o["period"],
        ),
    ],
) | PEER_LOSS_OPTIONS  # fmt: skip


@register_strategy(
    "dreamddp",
    "DreamDDP: partial-sync local SGD, layers averaged in place during backward, bubble filling",
    PARTIAL_SYNC_OPTIONS,
)
class PartialSyncStrategy(ScheduledStrategy, StepwisePeerLoss):
    name = "dreamddp"
    steps_in_backward = True
    local_steps = True  # applies only without gradient stages (NonFiniteGuard.deferred)
    #: the default scheduler (``lowband.localsgd.make_schedule`` method) of this variant
    method = "dreamddp"
    #: ``split`` when none is given: DreamDDP chooses chunks; the paper's baselines keep whole layers
    default_split: int | str = "auto"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        period: int | None = None,
        profile: str | Path | CostProfile | None = None,
        schedule: Schedule | None = None,
        reprofile_drift: float = 0.0,
        divergence_every: int = 0,
        split: int | str | None = None,
        scheduler: str | None = None,
        trial_periods: int = DEFAULT_TRIAL_PERIODS,
        on_peer_loss: str = "raise",
        min_ranks: int | None = None,
        peer_settle: float = 1.0,
        heartbeat: float | None = None,
    ) -> None:
        where = f"{type(self).__name__} on rank {group.world_rank}"
        self._where = where
        # the options were checked by PARTIAL_SYNC_OPTIONS (make_strategy); None: this variant's default
        if period is None:
            period = schedule.period if schedule is not None else DEFAULT_PERIOD
        self.method = type(self).method if scheduler is None else scheduler
        if split is None:
            split = self.default_split
        self.trial_periods = trial_periods
        self.candidates_predicted = []
        self.trial_log = []
        self._candidates = []
        self._trial = None
        self._last_step_end = None
        #: where the profile measured at the first step is saved (``profile=PATH`` of a missing file)
        self.profile_path: Path | None
        profile, self.profile_path = resolve_profile(profile, where)
        if reprofile_drift > 0 and schedule is not None and profile is None:
            raise InvalidArgumentError(
                f"{where}: reprofile_drift={reprofile_drift} re-schedules from a profile; give profile= "
                "with a fixed schedule, or no schedule"
            )
        layers = parameter_layers(model)
        if not layers:
            raise InvalidArgumentError(f"{where}: the model has no trainable parameters")
        broadcast_initial_state(model, group=group, where=where)  # Algorithm 1 starts from one w_0
        self.period = period
        self.reprofile_drift = float(reprofile_drift)
        self.divergence_every = divergence_every
        self.profile: CostProfile | None = None
        self.schedule: Schedule | None = None
        self.reschedules = 0
        self.divergence_log: list[tuple[int, float]] = []
        self._baseline: float | None = None  # seconds per byte achieved in the first timed period
        self._names = [n for n, _ in layers]
        self.split: int | str = split
        #: the chunk limit in use (bytes; 0: whole layers), chosen by ``split="auto"`` at each (re)schedule
        self.split_bytes = 0
        self.unit_profile: CostProfile | None = None
        #: seconds the lazy profile at the first step took (one-time set-up; 0 when a profile was given)
        self.profile_seconds = 0.0
        self.averager = LayerAverager(layers, group.unchecked())
        self.averager.timing = self.reprofile_drift > 0 and group.size > 1
        lw = LayerwiseOptimizer(layers, make_optimizer, on_layer=self.averager.on_layer)
        lw.refuse_restep = True  # every iteration ends with step(): a second backward before it is an error
        super().__init__(model, lw, group)
        self.init_peer_loss(on_peer_loss, min_ranks, peer_settle, heartbeat)
        if on_peer_loss == "continue":
            self.averager.survival = Survival(
                self.wait_beating, self._averaging_lost, current(where).config.timeout
            )
        self.averager.attach(model, lw.optimizers)
        # without a schedule, the first training forward (train_step's or the user's loop's) profiles first
        self._profiling = False
        self._replay = ForwardReplay(
            model, lambda: self.schedule is None and not self._profiling, self._profile_first, where=where
        )
        try:
            if schedule is not None:
                if profile is not None:
                    self._set_units(profile, split if isinstance(split, int) else 0, self._planner(profile))
                schedule.validate(self.averager.n)
                self.schedule = schedule
            elif profile is not None:
                self._reschedule(profile, agree=False)
            # one allgather: same layers (names, shapes, dtypes), period, variant and schedule everywhere
            layout = [(n, [(tuple(p.shape), str(p.dtype)) for p in ps]) for n, ps in layers]
            self._agree(
                "the model's layers, the period, the variant and the schedule",
                [len(layers), crc(layout), period, crc(self.method), self._schedulecrc()],
                (
                    "the number of layers",
                    "the layout hash",
                    "the period",
                    "the variant hash",
                    "the schedule hash",
                ),
            )
        except BaseException:
            self.close()  # leave the model without our hooks
            raise

    # -- training ---------------------------------------------------------------------------------
    def run_backward(self, loss: torch.Tensor) -> None:
        if self.schedule is None:
            raise InvalidArgumentError(
                f"{self._where}: no schedule yet; the first training forward through s.module profiles the "
                "model on its batch (or call train_step, or give profile= or schedule=)"
            )
        if not self.syncing:  # an accumulating pass (accumulate=J): no layer stepped, nothing averaged
            loss.backward()  # type: ignore[no-untyped-call]
            return
        units = self.schedule.layers_at(self.steps)
        if self.peer_loss == "continue" and units and self.steps % self.period == self._join_phase():
            self.propose_joins(self.steps // self.period)  # (an exchange: peer_steps)
        # noticed a lost peer: train alone until the members meet (peer_steps)
        self.averager.begin(self.steps, units if self.membership_settled() else ())
        loss.backward()  # type: ignore[no-untyped-call]
        self.averager.flush()

    def train_step(self, loss_fn: LossFn) -> float:
        """One local iteration (see the module doc); without a schedule, profiles on ``loss_fn`` first
        (the loop's first forward profiles on a replay of itself instead: ``_profile_first``)."""
        if self.schedule is None:
            self._profile_first(loss_fn)
        return super().train_step(loss_fn)

    def _profile_first(self, loss_fn: LossFn) -> None:
        """Profile on this batch and schedule (module doc: lazy profiling); rank 0 saves the profile to
        ``profile=PATH`` when that file did not exist."""
        self._profiling = True  # its passes' forwards are not the first step's
        try:
            self._profile_now(loss_fn)
        finally:
            self._profiling = False
        if self.profile_path is not None and self.group.rank == 0 and self.profile is not None:
            save_profile_atomic(self.profile, self.profile_path)

    def after_step(self) -> None:
        self.side_collective(self._after_step, "the schedule's period boundary", lambda: None)
        if self.divergence_every and self.steps % self.divergence_every == 0:
            self.synchronize()
            layers = [ps for _, ps in self.averager.layers]
            gamma = self.side_collective(
                lambda: model_divergence(layers, group=self.averager.group), "the divergence", lambda: None
            )
            if gamma is not None:
                self.divergence_log.append((self.steps, gamma))
        super().after_step()  # the heartbeat
        self.recover()  # under on_peer_loss=continue, after a loss: the members agree and meet

    # -- a lost peer (on_peer_loss="continue", lowband.strategies.peer_steps) ---------------------
    def _averaging_lost(self, exc: BaseException, unit: int, launched: float) -> None:
        self.notice(exc, f"the averaging of {self.averager.specs[unit].name!r}", launched)

    def _join_phase(self) -> int:
        """The step of each period at which replacements are proposed: its first that averages."""
        assert self.schedule is not None
        return next(h for h, units in enumerate(self.schedule.sets) if units)

    def regroup(self, group: Group) -> None:
        self.averager.group = group.unchecked()

    def after_meeting(self) -> None:
        # a trial of candidate splits may have advanced on some members only (a side collective that
        # failed): every member keeps the predicted best, and the drift baseline starts again
        if self._trial is not None and self.profile is not None:
            self._trial = None
            self._use_candidate(self.profile, 0)
        self._baseline = None
        self._last_step_end = None
        self._agree(
            "the schedule and the step count after a membership change",
            [self._schedulecrc(), self.period, self.steps],
            ("the schedule hash", "the period", "the step count"),
        )

    def synchronize(self) -> None:
        """Wait for every in-flight averaging, then read the non-finite agreements still in flight."""
        self.averager.wait_all()
        super().synchronize()

    def in_sync(self) -> bool:
        """True when the last step averaged every layer (H = 1, or ``full`` at the end of a period)."""
        s = self.schedule
        return s is not None and self.steps > 0 and len(s.layers_at(self.steps - 1)) == self.averager.n

    plan_grid = ("period=5", "period=20")

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models

        return models.dreamddp(
            profile, links, options, method=cls.method, split=cls.default_split, period=DEFAULT_PERIOD
        )

    # -- reports and checkpoints ------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        hp: dict[str, Any] = {"H": self.period}
        if self.split != self.default_split:
            hp["split"] = self.split
        if self.method != type(self).method:
            hp["scheduler"] = self.method
        if self.reprofile_drift:
            hp["drift"] = self.reprofile_drift
        return hp

    def report(self) -> dict[str, Any]:
        s = self.schedule
        out: dict[str, Any] = {
            "predicted_step_s": self.predicted_step_time(),
            "schedule_method": None if s is None else s.method,
            "schedule": None if s is None else [list(x) for x in s.sets],
            "layers": [u.name for u in self.averager.specs],
            "units": [[u.layer, u.start, u.stop] for u in self.averager.specs],
            "split_bytes": self.split_bytes,
            "averagings": list(self.averager.launch_counts),
            "max_gap": list(self.averager.max_gap),
            "reschedules": self.reschedules,
            "profile_s": self.profile_seconds,
            # the profile's measured interference (None before profiling), see localsgd.costmodel
            "kappa": None if self.profile is None else self.profile.kappa,
            "sigma": None if self.profile is None else self.profile.sigma,
            # every candidate chunk limit with its predicted period, and the online decisions among them
            "candidates": [[c, p] for c, p in self.candidates_predicted],
            "trials": list(self.trial_log),
        }
        if self.divergence_log:
            out["divergence"] = self.divergence_log[-1][1]
        return {**super().report(), **out}

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint (every rank at once: the restored schedule is checked across ranks)."""
        self.synchronize()
        super().load_state_dict(state)

    def close(self) -> None:
        self._replay.remove()
        self.averager.detach()
        assert isinstance(self.optimizer, LayerwiseOptimizer)
        self.optimizer.remove_hooks()
        super().close()  # (marks this rank done for the heartbeat)


@register_strategy(
    "plsgd-enp",
    "PLSGD-ENP: partial-sync local SGD, equal-number partition of the layers over H iterations",
    PARTIAL_SYNC_OPTIONS,
)
class PLSGDENPStrategy(PartialSyncStrategy):
    name = "plsgd-enp"
    method = "enp"
    default_split = 0


@register_strategy(
    "flsgd-overlap",
    "FLSGD with every layer averaged in iteration H, overlapped with its backward",
    PARTIAL_SYNC_OPTIONS,
)
class FLSGDOverlapStrategy(PartialSyncStrategy):
    name = "flsgd-overlap"
    method = "full"
    default_split = 0
