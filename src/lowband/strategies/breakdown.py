"""Where a step's time goes on the training thread, for strategies on the gradient stage: computation,
compression on the critical path, and communication not overlapped.

Measured per step on the thread that trains (never inferred from another run):

- ``compute_s``: zero_grad + forward + backward + optimizer step, less the time spent inside the
  reducer's ``reduce`` calls during backward (:attr:`GradientStage.reduce_s`: compressing and issuing
  the unit's communication);
- ``compression_s``: compression (error-feedback memory included) and the decoding done on this
  thread (the reducer's :attr:`~lowband.optim.Reducer.timings`: ``compress_s`` + ``decompress_inline_s``); decodes a
  transport runs on torch's callback threads are overlapped and not counted here;
- ``comm_s``: the rest of the reducer's launches during backward (issuing collectives, exchanging sizes)
  plus the time the thread waits in :meth:`GradientStage.wait`, less the compression done inside it.

The three add up to the step's duration on this rank (``compute_s + compression_s + comm_s``). With
four ranks on two cores the communication threads also slow computation; that shows as compute time,
not communication (see the guide's note on overlap).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lowband.optim.reducer import Timings
from lowband.optim.stage import GradientStage
from lowband.strategies.base import Strategy

PARTS = ("compute_s", "compression_s", "comm_s")


@dataclass
class StepClock:
    """Marks taken by a stage strategy's step: :meth:`start` (at its ``zero_grad``), :meth:`backward_done`,
    :meth:`wait_done`, :meth:`stop` (after its step; a missing mark counts its phase as computation)."""

    stage: GradientStage
    timings: Timings | None = None
    #: the strategy's step index of the first recorded step
    first_step: int | None = None
    steps: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PARTS})
    _t: list[float] = field(default_factory=list, repr=False)
    _mark: dict[str, float] = field(default_factory=dict, repr=False)

    def _spent(self) -> float:
        t = self.timings
        return 0.0 if t is None else t.compress_s + t.decompress_inline_s

    def start(self, step: int) -> None:
        if self.first_step is None or self.first_step + len(self.steps["compute_s"]) != step:
            self.clear(step)  # the first step, or the step counter moved (a checkpoint was loaded)
        self._mark = {"t0": time.perf_counter(), "r0": self.stage.reduce_s, "c0": self._spent()}

    def backward_done(self) -> None:
        if self._mark:
            self._mark.update(t1=time.perf_counter(), r1=self.stage.reduce_s)

    def wait_done(self) -> None:
        if self._mark:
            self._mark["t2"] = time.perf_counter()

    def stop(self) -> None:
        m, self._mark = self._mark, {}
        if not m:
            return
        t3 = time.perf_counter()
        t1, t2 = m.get("t1", t3), m.get("t2", m.get("t1", t3))
        red = m.get("r1", m["r0"]) - m["r0"]
        wait = t2 - t1
        compression = self._spent() - m["c0"]
        self.steps["compute_s"].append((t1 - m["t0"]) - red + (t3 - t2))
        self.steps["compression_s"].append(compression)
        self.steps["comm_s"].append(max(0.0, red + wait - compression))

    def clear(self, first_step: int) -> None:
        self.first_step = first_step
        self.steps = {k: [] for k in PARTS}

    def report(self) -> dict[str, Any]:
        """``{"first_step": k, "compute_s": [...], "compression_s": [...], "comm_s": [...]}`` (one value
        per step from step ``k``), and the means over them."""
        out: dict[str, Any] = {
            "first_step": self.first_step or 0,
            **{k: list(v) for k, v in self.steps.items()},
        }
        out["mean"] = {k: statistics.fmean(v) if v else None for k, v in self.steps.items()}
        return out


class ClockedStrategy(Strategy):
    """A strategy whose training steps :attr:`clock` times (subclasses set it in their constructor and
    call ``self.clock.wait_done()`` where their step has waited for its reductions)."""

    clock: StepClock

    def begin_step(self) -> None:
        super().begin_step()
        self.clock.start(self.steps)

    def run_backward(self, loss: torch.Tensor) -> None:
        super().run_backward(loss)
        self.clock.backward_done()

    def after_step(self) -> None:
        super().after_step()
        self.clock.stop()
