"""The scheduling side of the partial-synchronisation strategies (:mod:`lowband.localsgd.strategy`):
units and schedule from a profile, lazy profiling on the first batch, re-profiling on bandwidth drift,
and the cross-rank check of every (re)schedule.

- Units and schedule: :func:`~lowband.localsgd.units.choose_split` picks the chunk limit (``split``) and
  schedules the units with the strategy's scheduler; the result is checked across ranks
  (:func:`lowband.comm.agree.agree` on the schedule's hash) so a rank that scheduled differently fails
  on every rank instead of averaging different units.
- Lazy profiling: without a profile or a schedule, the first :meth:`train_step` profiles the model on its
  batch (per-layer updates on, averaging nothing), then puts the parameters and the optimizer state back.
- Online choice (:mod:`lowband.localsgd.trials`): when a profile this run measured predicts several
  candidates within the cost model's error of each other, each runs whole periods of training,
  interleaved, and the fastest measured is kept on every rank; a winner measured more than 15 % off
  its prediction has the links re-measured and the choice made again, once per profile.
- Drift: at each period boundary the ranks agree on the achieved seconds per byte (one 2-float
  allreduce); when it moved by more than ``reprofile_drift`` from the first period after the last
  (re)schedule, the links are re-measured and the schedule rebuilt, identically on every rank.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from lowband.comm.agree import agree, crc
from lowband.comm.base import host_value
from lowband.comm.collectives import allreduce
from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile
from lowband.localsgd.profiler import profile_model, refit_comm
from lowband.localsgd.runtime import LayerAverager
from lowband.localsgd.schedule import Schedule
from lowband.localsgd.trials import MISMATCH, MODEL_ERROR, ScheduleTrial, contender_pair, decide
from lowband.localsgd.units import (
    UnitSpec,
    candidate_splits,
    layer_geometry,
    plan_units,
    specs_from_checkpoint,
    unit_profile,
)
from lowband.optim.layerwise import LayerwiseOptimizer
from lowband.rng import fork_rng
from lowband.strategies.base import LossFn, Strategy


class ScheduledStrategy(Strategy):
    """A strategy whose per-layer averagings follow a schedule built from a cost profile (the state is
    set up by the subclass's constructor; see the module docstring)."""

    _where: str
    _names: list[str]
    averager: LayerAverager
    period: int
    method: str
    split: int | str
    split_bytes: int
    profile: CostProfile | None
    unit_profile: CostProfile | None
    schedule: Schedule | None
    reprofile_drift: float
    reschedules: int
    profile_seconds: float
    _baseline: float | None
    #: periods each contender runs when candidates are measured online (0: trust the prediction)
    trial_periods: int
    #: the scheduled candidates of the last (re)schedule: ``(chunk limit, predicted period s)``
    candidates_predicted: list[tuple[int, float]]
    #: every online decision: candidates' splits, predicted and measured periods, the one kept
    trial_log: list[dict[str, object]]
    _candidates: list[tuple[int, Schedule]]
    _trial: ScheduleTrial | None
    _last_step_end: float | None
    #: the links were re-measured after a trial whose winner's measured period left the prediction's band
    _refitted: bool = False
    divergence_log: list[tuple[int, float]]

    def _planner(self, profile: CostProfile) -> Callable[[int], list[UnitSpec]]:
        """Checks that ``profile`` holds the model's layers; returns ``max_bytes -> units``."""
        names = [lc.name for lc in profile.layers]
        if sorted(names) != sorted(self._names):
            raise InvalidArgumentError(
                f"{self._where}: the profile's layers {names} are not the model's layers {self._names}"
            )
        params = dict(self.averager.layers)
        geo = [layer_geometry(params[n]) for n in names]
        numels, sizes = [g[0] for g in geo], [g[1] for g in geo]
        return lambda max_bytes: plan_units(profile, numels, sizes, max_bytes)

    def _set_units(self, profile: CostProfile, max_bytes: int, plan: Callable[[int], list[UnitSpec]]) -> None:
        specs = plan(max_bytes)
        self.profile, self.split_bytes = profile, max_bytes
        self.unit_profile = unit_profile(profile, specs)
        self.averager.set_units(specs)

    def _schedulecrc(self) -> int:
        s = self.schedule
        return 0 if s is None else crc((s.period, s.sets, [u.name for u in self.averager.specs]))

    def _agree(self, what: str, values: list[int], fields: tuple[str, ...] | None = None) -> None:
        """Raise :class:`CollectiveMismatchError` on every rank unless all ranks passed equal ``values``."""
        agree(self.group, what, values, fields=fields, where=self._where)

    def _reschedule(self, profile: CostProfile, *, agree: bool = True, measure: bool = False) -> None:
        """Units and schedule from ``profile``: every candidate chunk limit
        (:func:`~lowband.localsgd.units.candidate_splits`) is scheduled; the predicted best is used at
        once. With ``measure`` (a profile measured by this run: at the first step, on drift), when others
        are predicted within the model's error of it (:mod:`lowband.localsgd.trials`) they are measured
        online, from this step on, before one is kept (``trial_periods=0``: the predicted best is kept). A
        profile given to the constructor schedules from the prediction alone (repeatable)."""
        plan = self._planner(profile)
        cands = candidate_splits(profile, plan, self.period, self.split, self.method)
        order = contender_pair([c for c, _ in cands], [s.predicted_period for _, s in cands], MODEL_ERROR)
        self._candidates = [cands[i] for i in order]
        self.candidates_predicted = [(c, s.predicted_period) for c, s in cands]
        self._trial = None
        if measure and len(order) > 1 and self.trial_periods > 0 and self.group.size > 1:
            self._trial = ScheduleTrial(len(order), self.period, self.trial_periods)
        self._use_candidate(profile, 0, plan)
        if agree:
            self._agree("the schedule", [self._schedulecrc()])

    def _use_candidate(
        self, profile: CostProfile, k: int, plan: Callable[[int], list[UnitSpec]] | None = None
    ) -> None:
        """Average the units of candidate ``k`` (of :attr:`_candidates`) with its schedule from now on."""
        c, sched = self._candidates[k]
        self.synchronize()  # no averaging of the old units may be in flight
        self._set_units(profile, c, plan or self._planner(profile))
        sched.validate(self.averager.n)
        self.schedule = sched

    def _after_step(self) -> None:
        """After every step (``self.steps`` counts it): the trial's timing and, at a period boundary, its
        next contender or its decision; then the drift check (``reprofile_drift``)."""
        now = time.perf_counter()
        trial, last = self._trial, self._last_step_end
        self._last_step_end = now
        if trial is None:
            if self.averager.timing and self.steps % self.period == 0:
                self._check_drift()
            return
        boundary = self.steps % self.period == 0
        if boundary:
            self.synchronize()  # the period's averagings still in flight: its last step's time
            now = time.perf_counter()
        if last is not None:
            trial.record((self.steps - 1) % self.period, now - last)
        if not boundary:
            return
        assert self.profile is not None
        nxt = trial.advance()
        if nxt is not None:
            if self._candidates[nxt] != (self.split_bytes, self.schedule):
                self._use_candidate(self.profile, nxt)
            self._last_step_end = time.perf_counter()  # the switch's wait is not the next step's
            return
        # the slowest rank's figures, identical on every rank: every rank keeps the same contender
        local = torch.tensor(trial.measured(), dtype=torch.float64, device="cpu")  # host timings
        measured = allreduce(
            host_value(local, self.averager.group), "max", group=self.averager.group
        ).tolist()
        win = decide(measured)
        ratio = measured[win] / max(self._candidates[win][1].predicted_period, 1e-12)
        self.trial_log.append(
            {
                "step": self.steps,
                "splits": [c for c, _ in self._candidates],
                "predicted_s": [s.predicted_period for _, s in self._candidates],
                "measured_s": measured,
                "chosen": self._candidates[win][0],
                "measured_over_predicted": ratio,
            }
        )
        self._trial = None
        if abs(ratio - 1.0) > MISMATCH and not self._refitted:
            # the links may not be what the profile measured (another job, a link that changed): measure
            # them again and choose again, once per profile (the same decision on every rank: the
            # measured figures are agreed)
            self._refitted = True
            tried = [c for c, _ in self._candidates]
            self._reschedule(refit_comm(self.profile, self.group), measure=True)
            self.reschedules += 1
            if self._trial is None or [c for c, _ in self._candidates] != tried:
                self._last_step_end = time.perf_counter()
                return  # a new choice (a trial among other contenders, or one candidate)
            self._trial = None  # the same contenders, measured already: the winner stays
        self._use_candidate(self.profile, win)
        self._agree("the schedule chosen by measurement", [self._schedulecrc()])
        self._last_step_end = time.perf_counter()

    def _profile_now(self, loss_fn: LossFn) -> None:
        """Profile on this batch with the per-layer updates on (their time is part of each layer's
        backward), averaging nothing; then put the parameters and the optimizer state back (a transient
        copy of both, at the first step only)."""
        assert isinstance(self.optimizer, LayerwiseOptimizer)
        params = [p for _, ps in self.averager.layers for p in ps]
        saved = [p.detach().clone() for p in params]
        opt_state = copy.deepcopy(self.optimizer.state_dict())
        self.averager.begin(self.steps, ())
        t0 = time.perf_counter()
        self.optimizer.refuse_restep = False  # the profile's passes step the layers again and again
        cuda = sorted({p.get_device() for p in params if p.is_cuda})
        try:
            with fork_rng(devices=cuda):  # the training run draws what it would without
                prof = profile_model(self.local_module, loss_fn, group=self.group)
        finally:
            self.optimizer.refuse_restep = True
            self.optimizer.stepped.clear()
            with torch.no_grad():
                for p, old in zip(params, saved):
                    p.copy_(old)
            self.optimizer.load_state_dict(opt_state)
            # the profile's passes are not steps: what the non-finite guard flagged in them (their
            # repeated per-layer updates can diverge on a large loss) is not the first step's
            if self.nonfinite is not None:
                self.nonfinite.discard()
        self._refitted = False
        self._reschedule(prof, measure=True)
        self.profile_seconds = time.perf_counter() - t0

    def predicted_step_time(self) -> float | None:
        """The schedule's predicted mean iteration time in seconds (None before the schedule exists)."""
        s = self.schedule
        return None if s is None else s.predicted_period / s.period

    def _check_drift(self) -> None:
        """At a period boundary: agree on the achieved seconds per byte; re-fit and re-schedule on drift."""
        assert self.profile is not None
        self.synchronize()
        samples = self.averager.take_comm_samples()
        local = torch.tensor(
            [sum(t for _, t in samples), float(sum(nb for nb, _ in samples))],
            dtype=torch.float64,
            device="cpu",
        )  # host timings
        tot_s, tot_b = allreduce(
            host_value(local, self.averager.group), "sum", group=self.averager.group
        ).tolist()
        if tot_b <= 0 or tot_s <= 0:
            return
        spb = tot_s / tot_b
        if self._baseline is None:
            self._baseline = spb
        elif abs(spb / self._baseline - 1.0) > self.reprofile_drift:
            self._reschedule(refit_comm(self.profile, self.group), measure=True)
            self.reschedules += 1
            self._baseline = None

    # -- checkpoints --------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        a = self.averager
        return {
            "profile": None if self.profile is None else self.profile.to_json(),
            "schedule": None if self.schedule is None else self.schedule.to_json(),
            "order": [u.name for u in a.specs],
            "units": [[u.name, u.layer, u.start, u.stop, u.nbytes] for u in a.specs],
            "split_bytes": self.split_bytes,
            "launch_counts": list(a.launch_counts),
            "last_sync": list(a.last_sync),
            "max_gap": list(a.max_gap),
            "reschedules": self.reschedules,
            "baseline": self._baseline,
            "divergence_log": list(self.divergence_log),
            "candidates": [[c, s.to_json()] for c, s in self._candidates],
            "trial": None if self._trial is None else self._trial.to_json(),
            "trial_log": list(self.trial_log),
            "refitted": self._refitted,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        where = f"{self._where}.load_state_dict"
        if "schedule" not in state or "order" not in state:
            raise InvalidArgumentError(f"{where}: checkpoint has no partial-synchronisation state")
        specs = specs_from_checkpoint(where, state, self.averager.layers)
        if state["profile"] is not None:
            prof = CostProfile.from_json(state["profile"])
            self._planner(prof)  # checks the profile's layers
            self.profile = prof
            self.unit_profile = unit_profile(prof, specs)
        self.split_bytes = int(state.get("split_bytes", 0))
        self.synchronize()
        self.averager.set_units(specs)
        if state["schedule"] is not None:
            sched = Schedule.from_json(state["schedule"])
            sched.validate(len(specs))
            self.schedule, self.period = sched, sched.period
        a = self.averager
        n = len(specs)
        for key in ("launch_counts", "last_sync", "max_gap"):
            vals = [int(x) for x in state.get(key, getattr(a, key))]
            if len(vals) != n:
                raise InvalidArgumentError(f"{where}: {key} has {len(vals)} entries, the schedule {n} units")
            setattr(a, key, vals)
        self.reschedules = int(state.get("reschedules", 0))
        self._baseline = state.get("baseline")
        self.divergence_log = [(int(s), float(g)) for s, g in state.get("divergence_log", [])]
        self._candidates = [(int(c), Schedule.from_json(d)) for c, d in state.get("candidates", [])]
        self.candidates_predicted = [(c, s.predicted_period) for c, s in self._candidates]
        trial = state.get("trial")
        self._trial = None if trial is None or not self._candidates else ScheduleTrial.from_json(trial)
        self.trial_log = list(state.get("trial_log", []))
        self._refitted = bool(state.get("refitted", False))
        self._last_step_end = None
        self._agree("the restored schedule", [self._schedulecrc(), self.period])
