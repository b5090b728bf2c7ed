"""Vertical scheduling of embedding gradients (EmbRace, Algorithm 1), on column-partitioned tables.

A table's backward hands its coalesced gradient rows here instead of exchanging them
(:attr:`PartitionedEmbedding.gradient_sink`). They are delivered to their owners in parts:

- *prior* rows: when a later call of the same table has gathered its ids (every rank's:
  :attr:`PartitionedEmbedding.on_plan`, before its lookup), the pending rows it reads are exchanged
  and applied first, so the lookup sees them;
- *delayed* rows: the rest, exchanged in idle time (:meth:`VerticalSchedule.deliver_before`, at the
  end of the next iteration's step) and in any case before evaluation and checkpoints
  (:meth:`VerticalSchedule.deliver_all`, from the strategy's ``synchronize``).

Both sides derive every mask from rows every rank knows, so the exchanges carry values only and every
rank issues the same exchanges in the same order. Each part is applied with :func:`lazy_step` as part
of the iteration it belongs to, so the parts equal one update (lazy optimizer semantics).

With an ``executor`` (one communication thread, :class:`lowband.comm.engine.Lane`),
the delayed rows go in the background (:meth:`VerticalSchedule.submit_delayed`, e.g. while the next
backward computes). Its queue is a priority queue whose order every rank agrees on: the tasks of one
submission (one per iteration, its parts in the order they were made) are sorted by iteration before
they enter the thread's FIFO, and the
training thread drains the thread before any exchange of its own, so the channel's collectives are
issued in the same order on every rank whatever each rank's timing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lowband.comm.lane import Lane
from lowband.errors import InvalidArgumentError
from lowband.sparse.embedding import PartitionedEmbedding
from lowband.sparse.exchange import LookupPlan, iexchange_gradients, mask_counts, sum_blocks
from lowband.sparse.lazy import lazy_step, sparse_rows
from lowband.sparse.partition import split_rows


@dataclass
class _Part:
    """One call's gradient, not yet all delivered: ``left[q]`` marks rank ``q``'s rows still due."""

    table: str
    iteration: int
    rows: list[torch.Tensor]
    grad: torch.Tensor
    left: list[torch.Tensor]
    #: rows of ``left`` still due over every rank, known on the host once a delivery counted them
    due: int | None = None


class VerticalSchedule:
    """Takes over the backward of ``tables`` (name -> table) and applies their gradients with
    ``optimizer`` (a lazy one, :func:`lowband.sparse.lazy.lazy_optimizer`), scaled by ``scale``
    (1 / group size for the mean of the ranks' losses). :attr:`iteration` (1-based) is the iteration
    the next backward belongs to; the strategy sets it."""

    def __init__(
        self,
        tables: dict[str, PartitionedEmbedding],
        optimizer: torch.optim.Optimizer,
        scale: float,
        executor: Lane | None = None,
    ) -> None:
        self.tables, self.optimizer, self.scale = tables, optimizer, scale
        self.executor = executor
        self.iteration = 1
        self.pending: list[_Part] = []
        self.delivered_rows = {"prior": 0, "delayed": 0}
        for name, t in tables.items():
            t.gradient_sink = self._sink
            t.on_plan = self._on_plan
            t.table_name = name

    def _sink(self, table: PartitionedEmbedding, plan: LookupPlan, grad_rows: torch.Tensor) -> None:
        self.pending.append(
            _Part(table.table_name, self.iteration, plan.rows, grad_rows.detach(), table.grad_masks(plan))
        )

    def _on_plan(self, table: PartitionedEmbedding, plan: LookupPlan) -> None:
        self.drain()
        ids = plan.every_id
        self._deliver(
            [p for p in self.pending if p.table == table.table_name],
            lambda rows: split_rows(rows, ids),
            "prior",
        )

    def drain(self) -> None:
        """Waits for the background deliveries (bounded; raises their first error)."""
        if self.executor is not None:
            self.executor.drain()

    def deliver_before(self, iteration: int) -> None:
        """Delivers every row of the parts of iterations before ``iteration`` (idle time)."""
        self.drain()
        self._deliver([p for p in self.pending if p.iteration < iteration], None, "delayed")

    def submit_delayed(self, iteration: int) -> None:
        """:meth:`deliver_before` on the communication thread (at once without an executor): one task
        per earlier iteration, in the agreed priority order (iteration, then the order the parts were
        made). An iteration's parts travel in one task because they are applied in one step: a table
        read several times per forward has one part per call, and a row two calls read must have its
        summed gradient applied once (an Adam step per part would differ)."""
        if self.executor is None:
            self.deliver_before(iteration)
            return
        self.drain()
        order = sorted(range(len(self.pending)), key=lambda k: (self.pending[k].iteration, k))
        due: dict[int, list[_Part]] = {}
        for k in order:
            if self.pending[k].iteration < iteration:
                due.setdefault(self.pending[k].iteration, []).append(self.pending[k])
        self.pending = [p for p in self.pending if p.iteration >= iteration]
        for parts in due.values():
            self.executor.submit(functools.partial(self._deliver, parts, None, "delayed", keep=False))

    def deliver_all(self) -> None:
        """Delivers everything pending (before evaluation and checkpoints)."""
        self.drain()
        self._deliver(list(self.pending), None, "delayed")

    def _deliver(
        self,
        parts: list[_Part],
        select: Callable[[torch.Tensor], torch.Tensor] | None,
        kind: str,
        *,
        keep: bool = True,
    ) -> None:
        by_iter: dict[int, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        for part in parts:
            table = self.tables[part.table]
            masks = [
                m if select is None else m & select(r) for m, r in zip(part.left, part.rows, strict=True)
            ]
            # one host sync per part: the selected rows per rank (the exchange's splits) and, when only
            # some are selected, the rows left before it (so the pending filter needs no further sync)
            n = len(masks)
            counts = mask_counts(masks if select is None else [*masks, *part.left])
            sel = counts[:n]
            count = sum(sel)
            part.due = 0 if select is None else sum(counts[n:]) - count
            if count == 0:
                continue
            blocks = iexchange_gradients(
                part.grad, part.rows, masks, table.widths, name=part.table, group=table.group, counts=sel
            ).wait()
            got = sum_blocks(blocks, part.rows, masks, table.weight.shape[1], part.grad.dtype)
            by_iter.setdefault(part.iteration, {}).setdefault(part.table, []).append(got)
            part.left = [m & ~s for m, s in zip(part.left, masks, strict=True)]
            self.delivered_rows[kind] += count
        if keep:
            self.pending = [p for p in self.pending if p.due is None or p.due > 0]
        for it in sorted(by_iter):
            grads = {}
            for name, pieces in by_iter[it].items():
                w = self.tables[name].weight
                rows = torch.cat([r for r, _ in pieces])
                vals = torch.cat([v for _, v in pieces]) * self.scale
                grads[w] = sparse_rows(rows, vals, w.shape)
            lazy_step(self.optimizer, grads, it)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The undelivered gradients (this rank's rows, every column) and the iteration counter."""
        self.drain()
        return {
            "iteration": self.iteration,
            "world_size": len(self.pending[0].rows) if self.pending else 0,
            "pending": [
                {"table": p.table, "iteration": p.iteration, "rows": p.rows, "grad": p.grad, "left": p.left}
                for p in self.pending
            ],
        }

    def load_state_dict(self, state: dict[str, Any], world_size: int, where: str) -> None:
        parts = state.get("pending", [])
        if parts and int(state.get("world_size", 0)) != world_size:
            raise InvalidArgumentError(
                f"{where}: the checkpoint holds embedding gradients not yet delivered at "
                f"{state.get('world_size')} ranks; this group has {world_size}: save it after synchronize() "
                "(which delivers them) to load at another world size"
            )
        unknown = sorted({p["table"] for p in parts} - set(self.tables))
        if unknown:
            raise InvalidArgumentError(
                f"{where}: the checkpoint's pending gradients are for unknown tables {unknown}"
            )
        self.iteration = int(state.get("iteration", 1))
        self.pending = [
            _Part(p["table"], int(p["iteration"]), list(p["rows"]), p["grad"], list(p["left"])) for p in parts
        ]
