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
from lowband.comm.initial import broadcast_initial_state
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.options import Opt, Options
from lowband.plan.drift import DriftWatch, window_steps
from lowband.plan.links import Links
from lowband.plan.planner import Acceptance
from lowband.plan.profile import PlanProfile
from lowband.strategies import auto_switch
from lowband.strategies.base import OptimizerFactory, Strategy
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
            doc="the model's profile, from lowband plan's plan.json (None: probe= profiles it here)",
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
        if profile is None and probe is None:
            raise InvalidArgumentError(
                f"{where}: auto needs the model's profile: probe=loss_fn (a function of the module computing "
                "the loss on one batch) or profile=PATH (the plan.json `lowband plan --out DIR` wrote)"
            )
        self._where, self._make = where, make_optimizer
        self.accept = Acceptance(max_local_steps, max_compression, max_staleness)
        self.candidates = auto_switch.candidate_specs(only)
        self.min_gain = min_gain
        self._links_given = links
        self._nonfinite, self._accumulate = "raise", 1
        self._scaler: torch.amp.GradScaler | None = None
        self.group, self.local_module = group, model  # (the base's __init__ sets them again below)
        broadcast_initial_state(model, group=group, where=where)  # every rank profiles rank 0's model
        t0 = time.perf_counter()
        self.plan_profile = auto_switch.resolve_profile(profile, probe, model, make_optimizer, group, where)
        self.links = links if links is not None else auto_switch.measure(group)
        decision = auto_switch.choose(self, self.links, None, "start")
        self.spec: str = decision["spec"]
        self.history: list[dict[str, Any]] = [{**decision, "step": 0, "set_up_s": time.perf_counter() - t0}]
        log.info("auto on rank %d: %s", group.rank, decision["why"])
        self.inner: Strategy = self._build(self.spec)
        super().__init__(model, self.inner.optimizer, group)
        self.watch = DriftWatch(drift) if drift > 0 else None
        self.check_every = check_every
        self._window: list[float] = []
        self._since = 0  # steps since the last (re)build
        self._t0: float | None = None

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
        self.inner.synchronize()
        new_links = links or self._links_given or auto_switch.measure(self.group)
        decision = auto_switch.choose(self, new_links, self.spec, reason)
        self.links = new_links
        if self.watch is not None:
            self.watch.reset()
        self._window, self._since = [], 0
        decision["step"] = self.steps
        switch = bool(decision["spec"] != self.spec)
        log.info("auto on rank %d at step %d (%s): %s", self.group.rank, self.steps, reason, decision["why"])
        if switch:
            decision["carried"] = auto_switch.switch(self, decision["spec"])
            self.spec = decision["spec"]
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
        return self.inner.module

    @property
    def syncing(self) -> bool:
        return self.inner.syncing

    def zero_grad(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self.inner.zero_grad()

    def backward(self, loss: torch.Tensor, *, divided: bool = False) -> None:
        self.inner.backward(loss, divided=divided)

    def step(self) -> None:
        before = self.inner.steps
        self.inner.step()
        if self.inner.steps == before:  # a micro-batch of an accumulating step
            return
        self.steps += 1
        seconds = None if self._t0 is None else time.perf_counter() - self._t0
        self._t0 = None
        self._after(seconds)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        return self.inner.clip_grad_norm_(max_norm, norm_type)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def lookahead(self, ids: Mapping[str, torch.Tensor]) -> None:
        self.inner.lookahead(ids)

    def side_collective(self, fn: Callable[[], Any], what: str, alone: Callable[[], Any]) -> Any:
        return self.inner.side_collective(fn, what, alone)

    def membership_settled(self) -> bool:
        return self.inner.membership_settled()

    def in_sync(self) -> bool:
        return self.inner.in_sync()

    def replicated_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.inner.replicated_parameters()

    def average_state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.average_state_dict()

    def set_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        self.inner.set_grad_scaler(scaler)
        self._scaler = scaler

    def set_nonfinite(self, policy: str) -> None:
        self.inner.set_nonfinite(policy)
        self._nonfinite = policy
        auto_switch.refresh_config(self, self.inner)

    def set_accumulate(self, passes: int) -> None:
        self.inner.set_accumulate(passes)
        self._accumulate = passes
        self.accumulate = passes
        auto_switch.refresh_config(self, self.inner)

    # -- reports and checkpoints ------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        return {"chosen": self.spec}

    def label(self) -> str:
        return f"auto({self.spec})"

    def report(self) -> dict[str, Any]:
        inner = self.inner.report()
        out = {
            "auto": {
                "chosen": self.spec,
                "history": self.history,
                "links": auto_switch.links_json(self.links),
            },
            "inner": inner,
            "predicted_step_s": self.predicted["predicted_ms"] / 1e3,
        }
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "steps": self.steps,
            "spec": self.spec,
            "inner": self.inner.state_dict(),
            "auto": {
                "since": self._since,
                "watch": None if self.watch is None else self.watch.state(),
                "history": json.dumps(self.history),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name or "spec" not in state:
            raise InvalidArgumentError(
                f"AutoStrategy.load_state_dict on rank {self.group.rank}: checkpoint is for strategy "
                f"{state.get('strategy')!r}, not 'auto'"
            )
        spec = str(state["spec"])
        if spec != self.spec:  # the saved choice, built before its state loads (every rank alike)
            auto_switch.replace(self, spec)
            self.spec = spec
        self.inner.load_state_dict(state["inner"])
        self.steps = int(state["steps"])
        extra = state.get("auto", {})
        self._since, self._window, self._t0 = int(extra.get("since", 0)), [], None
        if self.watch is not None and extra.get("watch") is not None:
            self.watch.load(extra["watch"])
        if "history" in extra:
            self.history = json.loads(extra["history"])

    def close(self) -> None:
        self.inner.close()
