"""The ``diloco`` strategy's automatic choices: ``fragments=auto`` and ``inner_steps=auto``.

- ``fragments=auto``: the number of fragments and the split come from DreamDDP's cost profile
  (:mod:`lowband.localsgd.profiler`): one inner step's compute is the profile's forward + backward, the
  link its ``alpha + beta * bytes`` fit; the decision is :func:`lowband.localsgd.fragments.choose_fragments`
  (pure). The profile is ``profile=`` (a :class:`CostProfile` or a saved JSON path: decided at
  construction), else measured at the first training forward on its batch (a replay of it,
  :mod:`lowband.strategies.replay`), as DreamDDP does. Every rank gets the same profile (its figures are
  reduced across ranks), so every rank makes the same choice; the choice is then checked across ranks
  (:func:`lowband.comm.agree.agree` on its hash), as DreamDDP checks its schedule. With a compressor the
  bytes on the wire are the payload of one compression of the whole model's size (``ratio``), times
  ``n / 2`` for a transport that gathers the payloads instead of summing them (an allgather moves
  ``(n - 1)`` payloads per rank, a ring allreduce ``2 (n - 1) / n`` buffers).
- ``inner_steps=auto``: :mod:`lowband.localsgd.inner_budget`. The first period runs ``base_steps`` on
  every rank, each rank timing its inner steps (from ``zero_grad`` to the end of the optimizer step,
  the machine's gradient average included); at its end the ranks allgather their mean seconds per step
  (one small allgather on the strategy's group) and every rank derives the same steps per machine, used
  from the next period on. ``machine_steps=`` gives them instead (no measurement; deterministic).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowband.comm.agree import agree, crc
from lowband.comm.base import host_value
from lowband.comm.collectives import allgather
from lowband.compress.base import CompressContext
from lowband.compress.reducer import CompressedReducer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.localsgd.costmodel import CostProfile
from lowband.localsgd.fragments import FragmentChoice, choose_fragments, sync_offsets
from lowband.localsgd.inner_budget import budget_steps, machine_times
from lowband.localsgd.profiler import profile_model, resolve_profile, save_profile_atomic
from lowband.strategies.replay import ForwardReplay

log = logging.getLogger("lowband.diloco")


def wire_ratio(reducer: CompressedReducer, params: list[nn.Parameter], world: int) -> float:
    """Bytes on the wire per byte of pseudo-gradient (module doc), from one compression of a ramp of the
    model's size on the parameters' device and dtype."""
    comp = reducer.compressor
    if comp.name == "identity":
        return 1.0
    numel = sum(q.numel() for q in params)
    dtype, device = params[0].dtype, params[0].device
    x = torch.linspace(-1.0, 1.0, numel, dtype=dtype, device=device)
    payload = comp.compress(x, CompressContext("diloco:auto", 0, 0, 0))
    ratio = payload.nbytes / max(1, numel * params[0].element_size())
    return ratio if comp.summable and reducer.transport == "allreduce" else ratio * max(1.0, world / 2)


class DiLoCoAuto:
    """The automatic choices of :class:`~lowband.strategies.diloco.DiLoCoStrategy` (module doc)."""

    group: Group
    where: str
    params: list[nn.Parameter]
    reducer: CompressedReducer
    inner_steps: int
    delay: int
    fragments: list[list[int]]
    offsets: list[int]
    sent: list[int]
    h: int
    participants: int
    auto_fragments: bool
    profile_path: Path | None = None
    _replay: ForwardReplay | None
    fragment_choice: FragmentChoice | None
    #: this rank's inner steps per period from the next period on (None: unchanged)
    machine_steps: list[int] | None
    machine_index: int
    local_size: int
    auto_steps: bool
    auto_log: list[str]
    profile: CostProfile | None
    _step_began: float | None
    _step_seconds: list[float]
    inner_done: int
    period_start: int
    machine: Group | None
    local_module: nn.Module

    def _note(self, msg: str) -> None:
        self.auto_log.append(msg)
        if self.group.rank == 0:
            log.info("%s: %s", self.where, msg)

    # -- fragments=auto ---------------------------------------------------------------------------
    def _choose_fragments(self, profile: CostProfile, world: int) -> None:
        """Decide the fragments from ``profile`` (the same on every rank) and check the ranks agree."""
        self.profile = profile
        step = sum(lc.fwd + lc.bwd for lc in profile.layers)
        sizes = [q.numel() * q.element_size() for q in self.params]
        ratio = wire_ratio(self.reducer, self.params, world)
        choice = choose_fragments(
            sizes,
            step_seconds=step,
            alpha=profile.alpha,
            beta=profile.beta,
            inner_steps=self.inner_steps,
            delay=self.delay,
            ratio=ratio,
        )
        agree(self.group, "the fragments chosen by fragments=auto", [crc(choice.fragments)], where=self.where)
        self._set_fragments(choice.fragments)
        self.fragment_choice = choice
        self._note(
            f"{choice.explain()} (step {step:.4g} s, alpha {profile.alpha:.4g} s, "
            f"beta {profile.beta:.4g} s/B, wire ratio {ratio:.4g})"
        )

    def _setup_auto_fragments(self, model: nn.Module, profile: str | Path | CostProfile | None) -> None:
        """Choose now from a given profile, or at the first training forward (a missing ``profile`` file:
        measured then and saved there by rank 0)."""
        profile, self.profile_path = resolve_profile(profile, self.where)
        if isinstance(profile, CostProfile):
            self._choose_fragments(profile, self.participants)
        else:  # DreamDDP's lazy profile: the first training forward (train_step's too) profiles first
            self._replay = ForwardReplay(
                model, lambda: not self.fragments, self._profile_first, where=self.where
            )

    def _profile_first(self, loss_fn: Any) -> None:
        """Profile on the first training forward's batch, then choose the fragments."""
        prof = profile_model(self.local_module, loss_fn, group=self.group, interference=False)
        if self.profile_path is not None and self.group.rank == 0:
            save_profile_atomic(prof, self.profile_path)
        self._choose_fragments(prof, self.group.size)

    @property
    def period_steps(self) -> int:
        """This rank's inner steps in the current period (its machine's, with inner_steps=auto): a loop
        over periods takes this many steps, so every machine reaches each exchange."""
        return self.h

    def _own_steps(self) -> int:
        return self.inner_steps if self.machine_steps is None else self.machine_steps[self.machine_index]

    def _set_fragments(self, fragments: list[list[int]]) -> None:
        self.fragments = fragments
        self.sent = [0] * len(fragments)  # exchanges started, per fragment (the reducer's step)
        self._set_offsets()

    def _set_offsets(self) -> None:
        """Per fragment, the step of the period (1..h) it is sent after (the last: the period's end)."""
        frags = self.fragments
        self.offsets = [] if not frags else [off or self.h for off in sync_offsets(len(frags), self.h)]

    def _load_auto_state(self, where: str, state: dict[str, Any]) -> None:
        """The automatic choices of a checkpoint (before the rest of it is restored)."""
        ms = state.get("machine_steps")
        if ms is not None and len(ms) == self.participants:
            self.machine_steps = [int(h) for h in ms]
        elif ms is not None and not self.auto_steps:
            raise InvalidArgumentError(
                f"{where}: the checkpoint's machine_steps {ms} are not one per machine here"
            )
        elif ms is not None:  # another layout (re-sharded): measured again over the next period
            self.machine_steps = None
        self.h = int(state["h"]) if "h" in state and self.machine_steps == ms else self._own_steps()
        saved = state.get("fragments")
        if saved is not None and [list(f) for f in saved] != self.fragments:
            frags = [[int(i) for i in f] for f in saved]
            if not self.auto_fragments or [i for f in frags for i in f] != list(range(len(self.params))):
                raise InvalidArgumentError(
                    f"{where}: the checkpoint's fragments {frags} are not this run's {self.fragments}"
                )
            self._set_fragments(frags)
        self._set_offsets()
        self._step_seconds = [float(t) for t in state.get("step_seconds", [])]
        self.auto_log = list(state.get("auto_log", self.auto_log))

    # -- inner_steps=auto -------------------------------------------------------------------------
    def _mark_step(self) -> None:
        """At ``zero_grad``: an inner step begins (timed while the steps are being measured)."""
        if self.auto_steps and self.machine_steps is None:
            self._step_began = time.perf_counter()

    def _clock_step(self) -> None:
        """After the inner step's optimizer step: its seconds, while they are being measured."""
        if self._step_began is not None:
            self._step_seconds.append(time.perf_counter() - self._step_began)
            self._step_began = None

    def _decide_steps(self, machine_group_size: int) -> None:
        """At the end of the first period: agree on every rank's seconds per step, derive the steps."""
        own = sum(self._step_seconds) / len(self._step_seconds) if self._step_seconds else 0.0
        row = torch.tensor([own], dtype=torch.float64, device="cpu")  # host timings
        times = allgather(host_value(row, self.group), group=self.group).tolist()
        if min(times) <= 0.0:
            raise InvalidArgumentError(
                f"{self.where}: inner_steps=auto measured no inner step on some rank ({times}); step through "
                "zero_grad/backward/step or train_step"
            )
        per_machine = machine_times(times, self.local_size)
        assert len(per_machine) == machine_group_size
        self.machine_steps = budget_steps(per_machine, self.inner_steps)
        self._step_seconds = []
        self._note(
            f"inner_steps=auto: seconds per inner step per machine {[round(t, 6) for t in per_machine]}, "
            f"inner steps per machine {self.machine_steps} (base {self.inner_steps} on the slowest"
            + ("; homogeneous: every machine keeps it)" if len(set(self.machine_steps)) == 1 else ")")
        )

    def _end_period(self) -> None:
        """The period ends: inner_steps=auto decides after the first; the next period's steps."""
        self.period_start = self.inner_done
        if self.auto_steps and self.machine_steps is None:
            self._decide_steps(self.participants)
        self.h = self._own_steps()
        self._set_offsets()

    def nonfinite_group(self) -> Group:
        """With inner_steps=auto the machines take different numbers of steps: each agrees alone (its
        ranks under inner=ddp, else the rank by itself, a view that never communicates)."""
        if not self.auto_steps:
            return self.group
        if self.machine is not None:
            return self.machine
        g = self.group
        return Group(g.pg, (g.world_rank,), 0, name=f"{g.name}:rank{g.rank}", key=f"{g.key}:rank{g.rank}")

    def checkpoint_clock(self, state: dict[str, Any]) -> object:
        """What the ranks' checkpoints of one save share: the steps, or with per-machine steps (which
        differ between machines) the exchanges started (a save at the same exchange on every rank, e.g.
        at the end of a period)."""
        extra = state.get("extra")
        if not isinstance(extra, dict) or not extra.get("machine_steps"):
            return state.get("steps")
        return f"{sum(int(x) for x in extra.get('sent', []))} exchanges"


__all__ = ["DiLoCoAuto", "wire_ratio"]
