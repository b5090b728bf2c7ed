"""``auto``: the strategy and its settings chosen from the measured model and links (``lowband plan``'s
cost models), and chosen again when the links change.

At construction (collective, every rank of the group):

1. rank 0's model goes to every rank (the initial broadcast, so every rank profiles the same model);
2. the model is profiled: ``probe=loss_fn`` (Python: ``loss_fn(module)`` on one batch; ``lowband bench``
   gives its workload's first batch) times every layer on every rank and keeps the slowest rank's
   figures (:func:`lowband.plan.profile.profile_module`), or ``profile=`` a ``plan.json`` that
   ``lowband plan`` wrote (or a :class:`~lowband.plan.profile.PlanProfile`) is used as it is;
3. the links are measured on the group (:func:`lowband.plan.measure.measure_links`; ``links=`` gives them);
4. rank 0 predicts every candidate (every registered strategy over its ``plan_grid``, or those named by
   ``only=a|b|c``) and recommends the fastest whose convergence flags the options accept
   (``max_local_steps``, ``max_compression``, ``max_staleness``: :class:`~lowband.plan.planner.Acceptance`);
   every rank takes rank 0's choice (one exchange of its text), logs why (logger ``lowband.auto``) and
   builds it with :func:`~lowband.strategies.make_strategy` on the same model and optimizer factory.

Training then runs the chosen strategy unchanged: every call is forwarded to it. With ``drift > 0`` each
step's time (from the step's ``zero_grad`` to the end of its ``step``) is recorded; every
``check_every`` steps (rounded up to whole periods of the choice) the ranks agree on the window's mean
(the slowest rank's: one 8-byte allreduce) and :class:`~lowband.plan.drift.DriftWatch` compares it with
the baseline window after the last (re)plan. Two windows in a row off by more than ``drift`` re-measure
the links and re-plan; a different choice predicted at least ``min_gain`` faster than the current one on
the new links replaces it there (:mod:`lowband.strategies.auto_switch`: consensus model and optimizer
state carried over, step count kept). ``state_dict`` holds the current choice and its state, the drift
watch and the history, so a resumed run continues with the same choice.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowband.comm import collectives as comm
from lowband.comm.agree import agree
from lowband.comm.initial import broadcast_initial_state
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.options import Opt, Options
from lowband.plan.drift import DriftWatch, window_steps
from lowband.plan.links import Links
from lowband.plan.planner import Acceptance
from lowband.plan.profile import PlanProfile
from lowband.strategies import auto_switch
from lowband.strategies.base import LossFn, OptimizerFactory, Strategy
from lowband.strategies.registry import STRATEGIES, register_strategy

log = logging.getLogger("lowband.auto")


def _check_only(value: str) -> None:
    names = [n.strip() for n in value.split("|")]
    unknown = [n for n in names if n not in STRATEGIES or n == "auto"]
    if not names or unknown:
        raise ValueError(f"unknown strategies {unknown}")


AUTO_OPTIONS = Options(
    {
        "max_local_steps": Opt(int, min=1, unit="steps", doc="choose nothing with more local steps (H)"),
        "max_compression": Opt(float, min=1, doc="choose nothing that compresses the gradient more"),
        "max_staleness": Opt(int, min=0, unit="steps", doc="choose nothing whose updates arrive later"),
        "only": Opt(
            str, parse=_check_only, what="strategy names separated by '|'",
            doc="choose among these strategies (over their plan grids) only (None: every modelled one)",
        ),
        "profile": Opt(
            str, objects=(Path, PlanProfile), what="a plan.json path",
            doc="the model's profile: lowband plan's plan.json (a missing file: measured at the first step "
            "and saved there; None: measured at the first step)",
        ),
        "probe": Opt(None, objects=(Callable,), doc="loss_fn(module) on one batch, to profile the model (Python)"),  # type: ignore[arg-type]
        "links": Opt(None, objects=(Links,), doc="the links (Python; None: measured on the group)"),
        "drift": Opt(float, min=0, doc="re-plan when the mean step moves this fraction from its baseline (0: never)"),
        "check_every": Opt(int, min=1, unit="steps", doc="steps per drift window (rounded up to whole periods)"),
        "min_gain": Opt(float, min=0, lt=1, doc="switch only to a choice predicted this fraction faster"),
    }
)  # fmt: skip


@register_strategy(
    "auto", "the strategy and settings lowband plan predicts fastest on the measured model and links; "
    "re-planned when the links drift", AUTO_OPTIONS,
)  # fmt: skip
class AutoStrategy(Strategy):
    """See the module docstring; :attr:`inner` is the chosen strategy, :attr:`spec` its spec."""

    name = "auto"
    plan_grid = ()  # not a candidate of a plan (it is the plan)

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        max_local_steps: int | None = None,
        max_compression: float | None = None,
        max_staleness: int | None = None,
        only: str | None = None,
        profile: str | Path | PlanProfile | None = None,
        probe: Callable[[nn.Module], torch.Tensor] | None = None,
        links: Links | None = None,
        drift: float = 0.25,
        check_every: int = 50,
        min_gain: float = 0.1,
    ) -> None:
        where = f"make_strategy('auto') on rank {group.rank}"
        if profile is not None and probe is not None:
            raise InvalidArgumentError(f"{where}: give profile= or probe=, not both")
        if links is not None and links.world != group.size:
            raise InvalidArgumentError(
                f"{where}: links= describes {links.world} ranks but the group has {group.size} "
                "(Links.at(n) gives the same links over n ranks)"
            )
        self._where, self._make = where, make_optimizer
        self.accept = Acceptance(max_local_steps, max_compression, max_staleness)
        self.candidates = auto_switch.candidate_specs(only)
        self.min_gain = min_gain
        self._links_given = links
        self._nonfinite, self._accumulate = "raise", 1
        self._scaler: torch.amp.GradScaler | None = None
        # until the choice is made (at the first training forward without profile= or probe=), a
        # provisional optimizer stands for the chosen strategy's
        super().__init__(model, make_optimizer(model.parameters()), group)
        self.watch = DriftWatch(drift) if drift > 0 else None
        self.check_every = check_every
        self._window: list[float] = []
        self._since = 0  # steps since the last (re)build
        self._t0: float | None = None
        self.inner: Strategy | None = None
        self.spec: str | None = None
        self.plan_profile: PlanProfile | None = None
        self.links: Links | None = None
        self.history: list[dict[str, Any]] = []
        self._first = auto_switch.FirstForward(self)
        #: where the profile measured here is saved (profile=PATH of a missing file), as dreamddp does
        self.profile_path: Path | None = None
        if isinstance(profile, (str, Path)):
            exists = Path(profile).exists()
            agree(
                group,
                "whether the profile file exists",
                [int(exists)],
                where=f"{where}: profile={str(profile)!r}",
            )
            if not exists:
                self.profile_path = Path(profile)
                profile = None
        #: seconds the choice took (profile, links, plan, build)
        self.set_up_s = 0.0
        broadcast_initial_state(model, group=group, where=where)  # every rank profiles rank 0's model
        if profile is not None or probe is not None:
            self._choose_first(profile, probe)

    def _choose_first(
        self, profile: str | Path | PlanProfile | None, probe: Callable[[nn.Module], torch.Tensor] | None
    ) -> Strategy:
        """Profile (or read the profile), measure the links, choose and build (collective; module doc)."""
        t0 = time.perf_counter()
        g = self.group
        self.plan_profile = auto_switch.resolve_profile(
            profile, probe, self.local_module, self._make, g, self._where
        )
        self.links = self._links_given if self._links_given is not None else auto_switch.measure(g)
        if self.profile_path is not None and g.rank == 0:
            auto_switch.save_profile(self.plan_profile, self.profile_path)
        decision = auto_switch.choose(self, self.links, None, "start")
        self.history = [{**decision, "step": self.steps}]
        log.info("auto on rank %d: %s", g.rank, decision["why"])
        inner = self._install(decision["spec"])
        self.set_up_s = time.perf_counter() - t0
        return inner

    def _install(self, spec: str) -> Strategy:
        self.spec = spec
        self.inner = self._build(spec)
        self.optimizer, self.nonfinite = self.inner.optimizer, self.inner.nonfinite
        return self.inner

    def chosen(self) -> Strategy:
        """The chosen strategy; refused before the choice (a first training forward or train_step)."""
        if self.inner is None:
            raise InvalidArgumentError(
                f"{self._where}: the strategy is chosen at the first training step (its first forward "
                "profiles the model); train a step first, or give probe= or profile="
            )
        return self.inner

    # -- the chosen strategy ----------------------------------------------------------------------
    def _build(self, spec: str) -> Strategy:
        inner = auto_switch.build(self, spec)
        if self._scaler is not None:
            inner.set_grad_scaler(self._scaler)
        return inner

    @property
    def predicted(self) -> Mapping[str, Any]:
        """The latest plan's figures of the current choice."""
        return self.history[-1]

    def _window_len(self) -> int:
        return window_steps(self.check_every, int(self.predicted.get("local_steps", 1)))

    def replan(self, reason: str, links: Links | None = None) -> bool:
        """Collective, between steps, every rank alike: re-measure the links (or take ``links``), re-plan
        and switch when another choice is predicted ``min_gain`` faster. Returns whether it switched."""
        t0 = time.perf_counter()
        self.chosen().synchronize()
        new_links = links or self._links_given or auto_switch.measure(self.group)
        decision = auto_switch.choose(self, new_links, self.spec, reason)
        self.links = new_links
        if self.watch is not None:
            self.watch.reset()
        self._window, self._since = [], 0
        decision["step"], decision["replan_s"] = self.steps, time.perf_counter() - t0
        switch = bool(decision["spec"] != self.spec)
        log.info("auto on rank %d at step %d (%s): %s", self.group.rank, self.steps, reason, decision["why"])
        if switch:
            t0 = time.perf_counter()
            decision["carried"] = auto_switch.switch(self, decision["spec"])
            decision["switch_s"] = time.perf_counter() - t0
        self.history.append(decision)
        return switch

    def _after(self, seconds: float | None) -> None:
        if self.watch is None or self.group.size == 1:
            return
        if seconds is not None:
            self._window.append(seconds)
        self._since += 1
        if self._since % self._window_len():
            return
        mean = sum(self._window) / max(1, len(self._window))
        self._window = []
        agreed = float(comm.allreduce(torch.tensor([mean], dtype=torch.float64), op="max", group=self.group))
        if self._since == self._window_len():
            return  # the first window after a (re)build warms up (lazy profiles, DDP's buckets)
        ratio = self.watch.ratio(agreed)
        self.history[-1].setdefault("windows_ms", []).append(round(agreed * 1e3, 3))
        if self.watch.observe(agreed):
            self.replan(f"drift: mean step {agreed * 1e3:.1f} ms, {ratio:.2f}x the baseline")

    # -- the loop, forwarded ------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._first if self.inner is None else self.inner.module

    @property
    def syncing(self) -> bool:
        return True if self.inner is None else self.inner.syncing

    def zero_grad(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self.inner is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.inner.zero_grad()

    def backward(self, loss: torch.Tensor, *, divided: bool = False) -> None:
        self.chosen().backward(loss, divided=divided)

    def step(self) -> None:
        inner = self.chosen()
        before = inner.steps
        inner.step()
        if inner.steps == before:  # a micro-batch of an accumulating step
            return
        self.steps += 1
        seconds = None if self._t0 is None else time.perf_counter() - self._t0
        self._t0 = None
        self._after(seconds)

    def train_step(self, loss_fn: LossFn) -> float:
        if self.inner is None:  # the first step's loss profiles the model
            self._choose_first(None, loss_fn)
        return super().train_step(loss_fn)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        return self.chosen().clip_grad_norm_(max_norm, norm_type)

    def synchronize(self) -> None:
        if self.inner is not None:
            self.inner.synchronize()

    def lookahead(self, ids: Mapping[str, torch.Tensor]) -> None:
        if self.inner is not None:
            self.inner.lookahead(ids)

    def side_collective(self, fn: Callable[[], Any], what: str, alone: Callable[[], Any]) -> Any:
        return fn() if self.inner is None else self.inner.side_collective(fn, what, alone)

    def membership_settled(self) -> bool:
        return True if self.inner is None else self.inner.membership_settled()

    def in_sync(self) -> bool:
        return True if self.inner is None else self.inner.in_sync()

    def replicated_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return super().replicated_parameters() if self.inner is None else self.inner.replicated_parameters()

    def average_state_dict(self) -> dict[str, torch.Tensor]:
        return super().average_state_dict() if self.inner is None else self.inner.average_state_dict()

    def set_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        if self.inner is not None:
            self.inner.set_grad_scaler(scaler)
        self._scaler = scaler

    def set_nonfinite(self, policy: str) -> None:
        self._nonfinite = policy
        if self.inner is not None:
            self.inner.set_nonfinite(policy)
            self.nonfinite = self.inner.nonfinite
            auto_switch.refresh_config(self, self.inner)

    def set_accumulate(self, passes: int) -> None:
        if self.inner is not None:
            self.inner.set_accumulate(passes)
        self._accumulate = self.accumulate = passes
        if self.inner is not None:
            auto_switch.refresh_config(self, self.inner)

    # -- reports and checkpoints ------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        return {"chosen": self.spec}

    def label(self) -> str:
        return f"auto({self.spec or 'not chosen yet'})"

    def report(self) -> dict[str, Any]:
        links = None if self.links is None else auto_switch.links_json(self.links)
        out: dict[str, Any] = {
            "auto": {"chosen": self.spec, "history": self.history, "links": links, "set_up_s": self.set_up_s}
        }
        if self.inner is not None:
            out["inner"] = self.inner.report()
            if "predicted_ms" in self.predicted:
                out["predicted_step_s"] = self.predicted["predicted_ms"] / 1e3
        return out

    def state_dict(self) -> dict[str, Any]:
        """The choice and its state, the profile it was chosen on (a re-plan after a resume needs it) and the
        drift watch; the history of decisions is the report's (their figures are this run's measurements)."""
        out: dict[str, Any] = {
            "strategy": self.name,
            "steps": self.steps,
            "spec": self.spec,
            "auto": {
                "since": self._since,
                "watch": None if self.watch is None else self.watch.state(),
                "local_steps": int(self.predicted.get("local_steps", 1)) if self.history else 1,
                "profile": None if self.plan_profile is None else auto_switch.profile_text(self.plan_profile),
            },
        }
        if self.inner is None:
            out["model"] = self.local_module.state_dict()
        else:
            out["inner"] = self.inner.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: the saved choice is built (every rank alike; no profiling) before its state loads."""
        if state.get("strategy") != self.name or "spec" not in state:
            raise InvalidArgumentError(
                f"AutoStrategy.load_state_dict on rank {self.group.rank}: checkpoint is for strategy "
                f"{state.get('strategy')!r}, not 'auto'"
            )
        spec = state["spec"]
        extra = state.get("auto", {})
        if spec is None:  # saved before the first step
            self.local_module.load_state_dict(state["model"])
        else:
            if spec != self.spec:
                if self.inner is not None:
                    self.inner.close()
                self._install(str(spec))
            self.chosen().load_state_dict(state["inner"])
        if extra.get("profile") is not None:
            self.plan_profile = PlanProfile.from_json(json.loads(extra["profile"]), self._where)
        self.steps = int(state["steps"])
        self._since, self._window, self._t0 = int(extra.get("since", 0)), [], None
        if self.watch is not None and extra.get("watch") is not None:
            self.watch.load(extra["watch"])
        if spec is not None:  # the decisions' figures were this run's measurements: not carried over
            self.history = [
                {"reason": "resumed", "spec": spec, "step": self.steps, "why": f"{spec}: resumed from a checkpoint",
                 "local_steps": int(extra.get("local_steps", 1))}
            ]  # fmt: skip

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
