"""SlimGC's reduction pipeline: the gradient stage's units, through a lane of the communication engine, compressed or sent in
full precision according to the communication threshold.

:class:`SlimGCReducer` is the :class:`~lowband.optim.Reducer` the gradient stage calls from its backward
hooks (one unit per parameter tensor, in the stage's fixed launch order). It hands the unit to the
:class:`~lowband.comm.engine.Lane` (the "executor") and returns at once a handle whose result is that
unit's averaged gradients: a handle over its round's :class:`~lowband.comm.lane.Promise`, which the
executor settles when the round's last unit has been processed and every operation of the round
waited, in launch order (fused units complete only then). The strategy takes the round's handles from
the stage (:meth:`GradientStage.hand_off <lowband.optim.stage.GradientStage.hand_off>`) and waits for
them at the step (``.grad`` averaged in place), or, with the model backup (``copy_grads``: the
reduction works on copies, ``.grad`` keeps this rank's gradient), a step later. Nothing else carries
results: no side channel.
On the executor (worker thread, or inline), per unit:

- warm-up (``comm_threshold=auto``, the first ``pre_steps`` rounds): every unit is sent alone and
  waited for before the next (a probe), compressed on odd rounds and in full precision on even ones;
  the seconds from launch to completion, and of compression, go into the warm-up
  :class:`~lowband.compress.slimgc.table.Samples`;
- afterwards a unit of at least BestCT bytes goes through the compressed reducer (compressor + error
  feedback + transport); smaller units are fused into one full-precision allreduce (launched when
  ``fuse_bytes`` have gathered, and at the end of the round), where the paper pushes each tensor alone.

A unit sent in full precision carries its error-feedback memory with it (``g + e`` is sent and ``e``
becomes 0): nothing the compressor left behind is lost when a unit stops being compressed.

Agreement: at the first unit of round ``pre_steps`` a decision task runs (in the executor's order,
so between the same collectives on every rank): the ranks' samples are combined (communication time:
the minimum over ranks, which removes the wait for the last rank to arrive; compression time: the
maximum, the slowest rank delays the collective), the table is built from them on every rank, and rank
0's BestCT is broadcast (Algorithm 2, line 2).

What is measured, per warm-up unit, on the thread that reduces it, with no other unit in flight: the
wall time from the start of the reduction to the return of a blocking wait on it (a transport with
phases, such as the parameter servers' all-to-all then allgather, included whole); of it, the seconds
the compressed reducer itself counts in compression (error feedback, encoding, the local decode the
memory needs) and decompression (of what it received) are ``t_pq``, the rest is the communication time
(``t_cq``, or ``t_c`` for a full-precision step). The communication time includes the waiting thread's
wake-up and arrival skew (the wait for the last rank to launch; partly removed by the minimum over
ranks); backward computation runs concurrently on the training thread, as it does in training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowband.comm.collectives import broadcast
from lowband.comm.fusion import igrouped_allreduce
from lowband.comm.handle import Handle
from lowband.comm.lane import Lane, Promise
from lowband.comm.reduce import allreduce
from lowband.compress.reducer import CompressedReducer, flatten, segments, unflatten_into
from lowband.compress.slimgc.table import (
    INF,
    Samples,
    ThresholdTable,
    build_table,
    compress_mask,
    compressed_step,
)
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import ReduceContext, Reducer, Unit

Tensor = torch.Tensor


@dataclass
class _Round:
    step: int
    #: settled by the executor with ``results`` when the round is complete
    promise: Promise
    submitted: int = 0  # units handed to the executor (training thread)
    received: int = 0  # units processed (executor)
    # (units, handle, fused): a compressed unit's handle returns its gradients, a fused one the flats
    launched: list[tuple[list[int], Handle[Any], bool]] = field(default_factory=list)
    fuse: list[tuple[int, Tensor]] = field(default_factory=list)  # (unit, compensated flat)
    fuse_bytes: int = 0
    bufs: dict[int, list[Tensor]] = field(default_factory=dict)  # each unit's working tensors
    #: what each unit's handle returns: its ``bufs`` once reduced, as the stage's own gradient tensors
    #: when they share storage (reduced in place: nothing to copy back), else the copies (copy_grads)
    results: dict[int, list[Tensor]] = field(default_factory=dict)


class SlimGCReducer(Reducer):
    """See the module docstring. ``threshold`` is a fixed BestCT in bytes (0: compress all, inf: none)
    or None to measure it in a warm-up of ``pre_steps`` rounds (BestCT by ``bestct_rule``, see
    :meth:`~lowband.compress.slimgc.table.ThresholdTable.best_threshold`). ``copy_grads`` makes each unit's
    reduction work on copies (the gradients in ``.grad`` stay this rank's own, for the model backup)."""

    def __init__(
        self,
        inner: CompressedReducer,
        units: Sequence[Unit],
        executor: Lane,
        *,
        threshold: float | None,
        pre_steps: int,
        fuse_bytes: int,
        copy_grads: bool,
        bestct_rule: str = "stable",
    ) -> None:
        # the options are the slimgc strategy's, checked by its schema (bestct_rule, pre_steps >= 2 for
        # a measured threshold)
        self.bestct_rule = bestct_rule
        self.inner = inner
        self.units = list(units)
        self.sizes = [u.nbytes() for u in self.units]
        self.executor = executor
        self.pre_steps = pre_steps if threshold is None else 0
        self.fuse_bytes = fuse_bytes
        self.copy_grads = copy_grads
        self._index = {u.key: i for i, u in enumerate(self.units)}
        self.samples: Samples | None = Samples(pre_steps, len(self.units)) if threshold is None else None
        self.table: ThresholdTable | None = None
        self.threshold: float | None = threshold
        self.mask = compress_mask(self.sizes, threshold) if threshold is not None else []
        self._round: _Round | None = None  # the round the stage is launching (training thread)
        self._decision_due = threshold is None  # read and written on the training thread only
        #: the data's device (the units' parameters'): the decision's collectives run on the data group
        self.device = next((p.device for u in self.units for p in u.params), torch.device("cpu"))
        #: compression on the training thread, for the step clock: all of it inline, none offloaded
        self.timings = None if executor.offload else inner.timings

    # -- the stage's side (training thread) --------------------------------------------------------
    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        i = self._index.get(unit.key)
        if i is None:
            raise InvalidArgumentError(f"{type(self).__name__}: unit {unit.key!r} is not one of its units")
        step = ctx.step
        rnd = self._round
        if rnd is None or rnd.step != step:
            if rnd is not None and rnd.submitted < len(self.units):
                raise InvalidArgumentError(
                    f"{type(self).__name__}: round {step} began before round {rnd.step} handed over every unit"
                )
            rnd = self._round = _Round(step, self.executor.promise())
            if self._decision_due and step >= self.pre_steps:
                self._decision_due = False
                group = ctx.group
                self.executor.submit(lambda: self._decide(group))
        rnd.submitted += 1
        bufs = [g.detach().clone() for g in grads] if self.copy_grads else [g.detach() for g in grads]
        out = bufs if self.copy_grads else grads  # reduced in place: the stage's own tensors come back
        self.executor.submit(lambda: self._process(rnd, i, bufs, out, ctx))
        return rnd.promise.handle(lambda results: results[i], name=unit.key)

    def in_flight(self) -> bool:
        """Whether a round has units not handed over yet, or operations not complete."""
        rnd = self._round
        return rnd is not None and not rnd.promise.done()

    # -- the executor's side -----------------------------------------------------------------------
    def _process(
        self, rnd: _Round, i: int, bufs: list[Tensor], out: list[Tensor], ctx: ReduceContext
    ) -> None:
        unit, step = self.units[i], rnd.step
        rnd.bufs[i], rnd.results[i] = bufs, out  # every path below reduces into ``bufs``
        if self.threshold is None:
            self._probe(rnd, i, bufs, ctx)
        elif self.mask[i]:
            rnd.launched.append(([i], self.inner.reduce(unit, bufs, ReduceContext(ctx.group, step)), False))
        else:
            flat = self._full_precision(unit, bufs)
            rnd.fuse.append((i, flat))
            rnd.fuse_bytes += flat.numel() * flat.element_size()
            if rnd.fuse_bytes >= self.fuse_bytes:
                self._flush(rnd, ctx.group)
        rnd.received += 1
        if rnd.received == len(self.units):
            self._finish(rnd, ctx.group)

    def _full_precision(self, unit: Unit, bufs: list[Tensor]) -> Tensor:
        """``g + e`` as one flat tensor, the unit's error-feedback memory emptied into it."""
        flat = flatten(bufs)
        segs = segments(unit, bufs)
        p = self.inner.memory.compensate(segs, flat)
        self.inner.memory.update(segs, p, p)
        return p

    def _flush(self, rnd: _Round, group: Group) -> None:
        if not rnd.fuse:
            return
        idx = [i for i, _ in rnd.fuse]
        flats = [f for _, f in rnd.fuse]
        name = f"slimgc-fp:{self.units[idx[0]].key}+{len(idx) - 1}"
        total = sum(f.numel() * f.element_size() for f in flats) + 1
        h = igrouped_allreduce(flats, "average", inplace=True, name=name, group=group, fusion_threshold=total)
        rnd.launched.append((idx, h, True))
        rnd.fuse, rnd.fuse_bytes = [], 0

    def _finish(self, rnd: _Round, group: Group) -> None:
        """End of a round: launch what is fused, complete every op in launch order, settle the round."""
        self._flush(rnd, group)
        for idx, h, fused in rnd.launched:
            out = h.wait()
            if fused:
                for i, flat in zip(idx, out):
                    unflatten_into(flat, rnd.bufs[i])
            else:
                _into(rnd.bufs[idx[0]], out)
        rnd.launched, rnd.bufs = [], {}
        rnd.promise.set(rnd.results)

    def _probe(self, rnd: _Round, i: int, bufs: list[Tensor], ctx: ReduceContext) -> None:
        """A warm-up unit: sent alone and waited for, timed (see the module docstring)."""
        unit, step = self.units[i], rnd.step
        timings = self.inner.timings
        if compressed_step(step):
            before = timings.compress_s + timings.decompress_s
            t0 = time.perf_counter()
            h: Handle[Any] = self.inner.reduce(unit, bufs, ReduceContext(ctx.group, step))
            _into(bufs, h.wait())
            total = time.perf_counter() - t0
            coding = timings.compress_s + timings.decompress_s - before
        else:
            flat = self._full_precision(unit, bufs)
            t0 = time.perf_counter()
            h = igrouped_allreduce(
                [flat], "average", inplace=True, name=f"slimgc-fp:{unit.key}", group=ctx.group
            )
            unflatten_into(h.wait()[0], bufs)
            total, coding = time.perf_counter() - t0, 0.0
        assert self.samples is not None
        self.samples.add(step, i, total - coding, coding)

    def _decide(self, group: Group) -> None:
        """BestCT from every rank's samples, the same on every rank (see the module docstring)."""
        assert self.samples is not None
        comm, comp = self.samples.comm, self.samples.compress
        # the samples (host bookkeeping) and the code travel on the data group, so on the data's device;
        # the results come back to the host once (the decision steers host-side control flow)
        if group.size > 1:
            packed = allreduce(
                torch.stack([-comm, comp]).to(self.device), "max", name="slimgc-table", group=group
            ).to("cpu")
            comm, comp = -packed[0], packed[1]
        self.table = build_table(self.sizes, comm, comp)
        best = self.table.best_threshold(self.bestct_rule)
        code = torch.tensor([-1 if math.isinf(best) else int(best)], dtype=torch.int64, device=self.device)
        if group.size > 1:
            code = broadcast(code, 0, name="slimgc-bestct", group=group)
        value = int(code.to("cpu")[0])  # once per run: the threshold is a host value
        self.set_threshold(INF if value < 0 else float(value))

    def set_threshold(self, threshold: float) -> None:
        self.threshold = threshold
        self.mask = compress_mask(self.sizes, threshold)

    # -- reports and state ---------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "best_ct_bytes": _json_number(self.threshold),
            "compressed_units": sum(self.mask),
            "full_precision_units": len(self.mask) - sum(self.mask) if self.mask else None,
            "executor_busy_s": self.executor.busy_s,
            "compress_s": self.inner.timings.compress_s,
            "decompress_s": self.inner.timings.decompress_s,
        }
        if self.table is not None:
            out["threshold_table"] = [{k: _json_number(v) for k, v in r.items()} for r in self.table.report()]
            out["bestct_rule"] = self.bestct_rule
            out["best_ct_by_rule"] = {
                r: _json_number(self.table.best_threshold(r)) for r in ("paper", "stable")
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "threshold": -1.0 if self.threshold is None else self.threshold,
            "samples": {} if self.samples is None else self.samples.state_dict(),
            "table": {} if self.table is None else self.table.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, Mapping) or not {"inner", "threshold", "samples", "table"} <= set(state):
            raise InvalidArgumentError(f"{where}: expects 'inner', 'threshold', 'samples' and 'table'")
        if self.in_flight():
            raise InvalidArgumentError(f"{where}: a round is in flight")
        self.inner.load_state_dict(dict(state["inner"]))
        if self.samples is None:  # a fixed comm_threshold: this strategy's, not the checkpoint's
            return
        if state["samples"]:
            self.samples.load_state_dict(state["samples"])
        self.table = ThresholdTable.from_state_dict(state["table"]) if state["table"] else None
        threshold = float(state["threshold"])
        if threshold >= 0:  # decided before the checkpoint: continue with it
            self.set_threshold(threshold)
            self._decision_due = False
        else:
            self.threshold, self.mask, self._decision_due = None, [], True

    def __repr__(self) -> str:
        return f"SlimGCReducer({self.inner!r}, threshold={self.threshold})"


def _into(bufs: list[Tensor], out: list[Tensor]) -> None:
    """The compressed reducer's result in the unit's buffers (it reduces in place: usually nothing)."""
    for b, r in zip(bufs, out, strict=True):
        if r is not b:
            b.copy_(r)


def _json_number(x: float | None) -> float | str | None:
    """A number for a JSON report: infinity as the string ``"inf"`` (JSON has no infinity)."""
    return "inf" if x is not None and math.isinf(x) else x
