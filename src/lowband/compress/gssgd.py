"""Globally sparse reducers of the gradient stage: gs-SGD (global CountSketch aggregation over the
halving/doubling tree), Sketched-SGD (sketches summed on one rank) and gTop-k (global top-k by merging
(index, value) pairs up the tree).

gs-SGD ("A Distributed SGD Algorithm with Global Sketching for Deep Learning Training Acceleration"),
per unit and step: every worker sketches its compensated gradient ``p`` (:mod:`~lowband.compress.sketch`);
the sketches are summed over the ranks, by the paper's tree (``reduce="tree"``: ``2 ceil(log2 P)``
rounds, one sketch per message, :mod:`~lowband.compress.tree`) or, since sketches are linear, by one ring
allreduce (``reduce="allreduce"``: ``2 (P-1)/P`` sketches per rank); every rank holds the same summed
sketch and recovers the same ``k`` coordinates (``recovery="topk"``, the default: the ``k`` largest
estimates; ``"heavymix"``: the paper's HEAVYMIX); a second round sums the exact values of those
coordinates with one dense allreduce of length ``k`` (no indices on the wire). Oversampling recovers
``ceil(oversample * k)`` candidates and keeps the ``k`` of largest exact sum.

Recovery default, by measurement (``benchmarks/gssgd_recovery.py``, :mod:`~lowband.compress.heavymix`):
on the fmnist-cnn gradient summed over 4 ranks, the ``k`` largest estimates hold 41.9% of the true
top-k at density 0.01 and 8.7% at 0.001, HEAVYMIX 4.1% and 0.6% (few coordinates are heavy, so it fills
``k`` at random); Sketched-SGD's authors' code recovers by the largest estimates too. HEAVYMIX, correct
to the paper, stays one option away for both sketching schemes.

Sketched-SGD ("Communication-efficient distributed SGD with sketching"), the central original: the
sketches go to rank 0 in one round, rank 0 recovers the coordinates and broadcasts them, the workers
send their exact values there and rank 0 sends back the sums.

gTop-k ("A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low Bandwidth
Networks"): every worker selects its ``k`` largest ``|p_i|`` as (index, value) pairs; up the same tree
each receiver sums the two sparse vectors and keeps the ``k`` largest (ties: the smaller index), and the
root's ``k`` pairs come back down. Any ``P``: the tree's odd member sits a round out (the published code
assumed a power of two). Values dropped at an intermediate merge: with ``feedback="exact"`` (default)
the merging rank adds the partial sums it dropped to its own residual, so the sum of residuals is
conserved with no extra bytes; ``feedback="paper"`` is the published rule (each worker zeroes its
residual at the global indices; what was dropped on the way is lost).

Defaults the papers leave open: 5 rows; ``cols=0`` means ``10 k`` columns (Sketched-SGD's published
runs), at most ``ceil(numel / rows)`` so a sketch is never larger than the gradient; the hash tables of a
unit are seeded from ``(seed, unit)`` and their checksum is agreed across ranks (:func:`lowband.agree`)
when the gradient stage is built (:meth:`SketchingReducer.prepare`; else, as a DDP comm hook, the first time
the unit is reduced).
A warm-up density (``warmup=``, :mod:`~lowband.compress.sparse_update`) with another ``k`` has its own
sketch of ``10 k`` columns, built and agreed at the same time.
Later rounds run in ``wait()`` (see :func:`lowband.comm.tree.itree`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from lowband.comm.agree import agree
from lowband.comm.collectives import ibroadcast
from lowband.comm.handle import Handle
from lowband.comm.reduce import iallreduce
from lowband.comm.tree import itree
from lowband.compress.base import CompressContext
from lowband.compress.heavymix import candidates, heavymix, keep_largest, local_topk, merge_topk, topk_indices
from lowband.compress.sketch import CountSketch
from lowband.compress.sparse import index_dtype
from lowband.compress.sparse_update import SparseUpdateReducer, Step
from lowband.compress.tree import star_schedule, tree_schedule
from lowband.group import Group
from lowband.optim.reducer import ReduceContext, Unit
from lowband.options import Opt, Options

Tensor = torch.Tensor

RECOVERIES = ("heavymix", "topk")
REDUCES = ("tree", "allreduce")
FEEDBACKS = ("exact", "paper")

#: the sketch's options (:class:`SketchingReducer`, checked by its constructor; ``gs-sgd``, ``sketched-sgd``)
SKETCH_OPTIONS = Options(
    {
        "rows": Opt(int, min=1, max=64, doc="rows of each CountSketch"),
        "cols": Opt(int, min=0, max=2**31 - 1, doc="columns of each CountSketch (0: 10 k)"),
        "recovery": Opt(str, choices=RECOVERIES, doc="how the heavy coordinates are found from the sketch"),
        "oversample": Opt(float, min=1, max=1e6, doc="candidates taken per coordinate to keep"),
    }
)
#: gs-SGD's reduction of the sketches (:class:`GsSGDReducer`)
REDUCE_OPTIONS = Options(
    {
        "reduce": Opt(
            str, choices=REDUCES, doc="sketches summed over the halving/doubling tree or by allreduce"
        )
    }
)
#: gTop-k's error feedback (:class:`GTopKReducer`)
FEEDBACK_OPTIONS = Options(
    {"feedback": Opt(str, choices=FEEDBACKS, doc="residuals of the exact global top-k, or the paper's")}
)


class SketchingReducer(SparseUpdateReducer):
    """Sketch tables per unit (agreed once) and recovery; shared by gs-SGD and Sketched-SGD."""

    def __init__(
        self,
        *,
        rows: int,
        cols: int,
        density: float,
        k: int,
        recovery: str,
        oversample: float,
        momentum: float,
        masking: bool,
        seed: int,
        warmup: str | Sequence[float] = "",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(
            density=density, k=k, momentum=momentum, masking=masking, seed=seed, warmup=warmup,
            warmup_steps=warmup_steps,
        )  # fmt: skip
        given = {"rows": rows, "cols": cols, "recovery": recovery, "oversample": oversample}
        o = SKETCH_OPTIONS.check(type(self).__name__, given)
        self.rows: int = o["rows"]
        self.cols: int = o["cols"]
        self.oversample: float = o["oversample"]
        self.recovery: str = o["recovery"]
        self._sketches: dict[tuple[str, int], CountSketch] = {}

    def cols_for(self, numel: int, step: int | None = None, *, density: float | None = None) -> int:
        """Columns of a unit's sketch: ``cols``, else ``10 k`` for the ``k`` of ``step`` (or of
        ``density``), at most ``ceil(numel / rows)``."""
        if self.cols > 0:
            return self.cols
        return max(1, min(10 * self.k_for(numel, step, density=density), -(-numel // self.rows)))

    def prepare(self, units: Sequence[Unit], group: Group) -> None:
        """Build (and agree on) every unit's tables when the gradient stage is built rather than at the
        unit's first reduction: one sketch per distinct size (a warm-up density may need its own)."""
        for u in units:
            numel = sum(p.numel() for p in u.params)
            for d in self.densities():
                self.sketch_for(u, numel, group, cols=self.cols_for(numel, density=d))

    def sketch_for(
        self, unit: Unit, numel: int, group: Group, step: int | None = None, *, cols: int | None = None
    ) -> CountSketch:
        """The unit's sketch with ``cols`` columns (default: those of reduction ``step``)."""
        c = self.cols_for(numel, step) if cols is None else cols
        sk = self._sketches.get((unit.key, c))
        if sk is None or sk.d != numel:
            sk = CountSketch(numel, self.rows, c, seed=self.unit_seed(unit.key))
            agree(
                group,
                f"the CountSketch tables of unit {unit.key!r}",
                [sk.d, sk.rows, sk.cols, sk.checksum()],
                fields=("the unit's size", "rows", "columns", "the tables' checksum"),
                where=f"lowband.{self.name} on rank {group.rank}",
            )
            self._sketches[(unit.key, c)] = sk
        return sk

    def recover(self, sk: CountSketch, table: Tensor, m: int, unit: Unit, step: int) -> Tensor:
        """``m`` coordinates from the summed sketch (the same on every rank that holds ``table``)."""
        est = sk.estimate(table)
        if self.recovery == "topk":
            return topk_indices(est, m)
        gen = CompressContext(unit.key, step, 0, self.seed).generator(shared=True)
        return heavymix(est, sk.norm_sq_tensor(table), m, gen)

    def options(self) -> dict[str, Any]:
        return {
            **super().options(),
            "rows": self.rows,
            "cols": self.cols,
            "recovery": self.recovery,
            "oversample": self.oversample,
        }


class GsSGDReducer(SketchingReducer):
    """gs-SGD; see the module docstring. ``reduce``: ``"tree"`` (the paper's) or ``"allreduce"``."""

    name = "gs-sgd"

    def __init__(
        self,
        *,
        rows: int = 5,
        cols: int = 0,
        density: float = 0.01,
        k: int = 0,
        recovery: str = "topk",
        oversample: float = 1.0,
        reduce: str = "tree",
        momentum: float = 0.0,
        masking: bool = False,
        seed: int = 0,
        warmup: str | Sequence[float] = "",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(
            rows=rows, cols=cols, density=density, k=k, recovery=recovery, oversample=oversample,
            momentum=momentum, masking=masking, seed=seed, warmup=warmup, warmup_steps=warmup_steps,
        )  # fmt: skip
        self.reduce_by: str = REDUCE_OPTIONS.check(type(self).__name__, {"reduce": reduce})["reduce"]

    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        t0 = time.perf_counter()
        g = ctx.group
        st = self.begin(unit, grads, ctx.step)
        sk = self.sketch_for(unit, st.p.numel(), g, ctx.step)
        table = sk.sketch(st.p)
        self.timings.compress_s += time.perf_counter() - t0
        self.timings.units += 1
        if self.reduce_by == "tree":
            h = itree([table], tree_schedule(g.size), name=unit.key, group=g).map(lambda t: t[0])
        else:
            h = iallreduce(table, "sum", inplace=True, name=unit.key, group=g)
        return h.map(lambda summed: self._second_round(st, sk, summed, unit, ctx))

    def _second_round(
        self, st: Step, sk: CountSketch, summed: Tensor, unit: Unit, ctx: ReduceContext
    ) -> list[Tensor]:
        t0 = time.perf_counter()
        m = candidates(st.k, self.oversample, st.p.numel())
        idx = self.recover(sk, summed, m, unit, ctx.step)
        self.add_decode(time.perf_counter() - t0)
        vals = iallreduce(st.p[idx], "sum", inplace=True, name=unit.key, group=ctx.group).wait()
        if m > st.k:
            idx, vals = keep_largest(idx, vals, st.k)
        return self.apply(st, idx, self.masked(st.p, idx), vals, ctx.group.size)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "reduce": self.reduce_by}


class SketchedSGDReducer(SketchingReducer):
    """Sketched-SGD with its central aggregation on rank 0; see the module docstring."""

    name = "sketched-sgd"

    def __init__(
        self,
        *,
        rows: int = 5,
        cols: int = 0,
        density: float = 0.01,
        k: int = 0,
        recovery: str = "topk",
        oversample: float = 1.0,
        momentum: float = 0.0,
        masking: bool = False,
        seed: int = 0,
        warmup: str | Sequence[float] = "",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(
            rows=rows, cols=cols, density=density, k=k, recovery=recovery, oversample=oversample,
            momentum=momentum, masking=masking, seed=seed, warmup=warmup, warmup_steps=warmup_steps,
        )  # fmt: skip

    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        t0 = time.perf_counter()
        g = ctx.group
        st = self.begin(unit, grads, ctx.step)
        sk = self.sketch_for(unit, st.p.numel(), g, ctx.step)
        table = sk.sketch(st.p)
        self.timings.compress_s += time.perf_counter() - t0
        self.timings.units += 1
        h = itree([table], star_schedule(g.size), broadcast=False, name=unit.key, group=g)
        return h.map(lambda t: self._central(st, sk, t[0], unit, ctx))

    def _central(
        self, st: Step, sk: CountSketch, summed: Tensor, unit: Unit, ctx: ReduceContext
    ) -> list[Tensor]:
        g = ctx.group
        m = candidates(st.k, self.oversample, st.p.numel())
        wire = index_dtype(st.p.numel())
        if g.rank == 0:
            t0 = time.perf_counter()
            idx = self.recover(sk, summed, m, unit, ctx.step).to(wire)
            self.add_decode(time.perf_counter() - t0)
        else:
            idx = st.p.new_empty(m, dtype=wire)  # the broadcast's buffer, on the data's device
        idx = ibroadcast(idx, 0, inplace=True, name=unit.key, group=g).wait().long()
        vals = itree([st.p[idx]], star_schedule(g.size), name=unit.key, group=g).wait()[0]
        if m > st.k:
            idx, vals = keep_largest(idx, vals, st.k)
        return self.apply(st, idx, self.masked(st.p, idx), vals, g.size)


class GTopKReducer(SparseUpdateReducer):
    """gTop-k over the halving/doubling tree, any ``P``; see the module docstring."""

    name = "gtopk"

    def __init__(
        self,
        *,
        density: float = 0.01,
        k: int = 0,
        feedback: str = "exact",
        momentum: float = 0.0,
        masking: bool = False,
        seed: int = 0,
        warmup: str | Sequence[float] = "",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(
            density=density, k=k, momentum=momentum, masking=masking, seed=seed, warmup=warmup,
            warmup_steps=warmup_steps,
        )  # fmt: skip
        self.feedback: str = FEEDBACK_OPTIONS.check(type(self).__name__, {"feedback": feedback})["feedback"]

    def reduce(self, unit: Unit, grads: list[Tensor], ctx: ReduceContext) -> Handle[list[Tensor]]:
        t0 = time.perf_counter()
        g = ctx.group
        st = self.begin(unit, grads, ctx.step)
        idx, val = local_topk(st.p, st.k)
        self.timings.compress_s += time.perf_counter() - t0
        self.timings.units += 1
        dropped: list[tuple[Tensor, Tensor]] = []

        def combine(mine: list[Tensor], got: list[Tensor], src: int) -> list[Tensor]:
            t1 = time.perf_counter()
            ki, kv, di, dv = merge_topk(mine[0], mine[1], got[0], got[1], st.k)
            dropped.append((di, dv))
            self.add_decode(time.perf_counter() - t1)
            return [ki, kv]

        wire = idx.to(index_dtype(st.p.numel()))
        h = itree([wire, val], tree_schedule(g.size), combine, name=unit.key, group=g)

        def finish(res: list[Tensor]) -> list[Tensor]:
            gidx, gval = res[0].long(), res[1]
            if self.feedback == "paper":
                contribution = self.masked(st.p, gidx)
            else:
                contribution = torch.zeros_like(st.p)
                contribution[idx] = val
                for di, dv in dropped:
                    contribution.index_add_(0, di.long(), -dv)
            return self.apply(st, gidx, contribution, gval, g.size)

        return h.map(finish)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "feedback": self.feedback}
