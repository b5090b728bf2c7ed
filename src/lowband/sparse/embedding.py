""":class:`PartitionedEmbedding`: an embedding table cut by columns over the ranks of a group, a
drop-in for ``torch.nn.Embedding`` inside data parallelism (EmbRace: "Accelerating Sparse
Communication for Distributed Training of Deep Neural Networks").

Rank ``j`` holds columns ``c_j`` of every row (:func:`lowband.sparse.partition.column_partition`) as
its ``weight`` parameter, and so its optimizer holds their state. A call on ids:

1. the ids of every rank are allgathered (uneven batches, empty ones too), and every rank derives each
   rank's unique rows and its own inverse index (:func:`lowband.sparse.exchange.plan_lookup`);
2. each rank looks up its columns for every rank's unique rows and one all-to-all returns each rank
   its column blocks; the blocks are joined column-wise and expanded by the inverse index (so the
   output is bitwise the full table's rows).

Backward: the expansion's gradient is the coalesced gradient (duplicate rows summed), whose column
blocks go back to their owners with the reverse all-to-all (owners know the rows: no indices on the
wire) and are summed into ``weight.grad``. The gradient is that of the sum of every rank's loss (the
convention of :mod:`lowband.nn.functional`); a strategy divides by the group size for the mean.
A strategy may take the backward over (:attr:`gradient_sink`) to split or delay the exchange, be
told each call's plan before its lookup (:attr:`on_plan`), and check the gradient rows before they
travel (:attr:`check_gradient`).

Every rank of the group must call the table the same number of times, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lowband.comm.handle import Handle
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.nn.sharding import ShardSpec
from lowband.runtime import world_group
from lowband.sparse.exchange import LookupPlan, iexchange_gradients, ilookup, plan_lookup, sum_blocks
from lowband.sparse.partition import column_partition

#: ``sink(table, plan, grad_rows)``: takes the coalesced gradient of this rank's unique rows; returns
#: the shard's gradient, or None when it handles the rows itself
GradientSink = Callable[["PartitionedEmbedding", LookupPlan, torch.Tensor], "torch.Tensor | None"]
PlanHook = Callable[["PartitionedEmbedding", LookupPlan], None]


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        table: PartitionedEmbedding,
        plan: LookupPlan,
        issued: Handle[torch.Tensor] | None,
    ) -> torch.Tensor:
        ctx.table, ctx.plan = table, plan
        if issued is not None:  # prefetched: the exchange was issued ahead of the forward
            return issued.wait()
        return ilookup(shard.detach(), plan, table.widths, name=table.table_name, group=table.group).wait()

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        table: PartitionedEmbedding = ctx.table
        sink = table.gradient_sink or PartitionedEmbedding.exchange_now
        rows = grad_rows.contiguous()
        if table.check_gradient is not None:  # before any row travels (a non-finite one is zeroed here)
            table.check_gradient([rows], f"{table.table_name} (embedding rows)")
        return sink(table, ctx.plan, rows), None, None, None


class PartitionedEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim, padding_idx, ...)`` holding this rank's columns
    (module docstring). ``group``: the ranks sharing the table (default: the world). ``_weight``: the
    full table to take this rank's columns from (default: ``nn.Embedding``'s initialisation on this
    rank, so seed every rank alike, or use :meth:`from_embedding`). ``max_norm``,
    ``scale_grad_by_freq`` and ``sparse=True`` are not supported."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group | None = None,
        name: str = "embedding",
    ) -> None:
        super().__init__()
        ctx, g = world_group(group, "PartitionedEmbedding")
        where = f"PartitionedEmbedding {name!r} on rank {ctx.rank}"
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise InvalidArgumentError(
                f"{where}: max_norm, scale_grad_by_freq and sparse=True are not supported "
                f"(got max_norm={max_norm}, scale_grad_by_freq={scale_grad_by_freq}, sparse={sparse})"
            )
        del norm_type
        self.columns = column_partition(embedding_dim, g.size, table=name)
        dense = nn.Embedding(
            num_embeddings, embedding_dim, padding_idx, _weight=_weight, device=device, dtype=dtype
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = dense.padding_idx
        self.group, self.table_name = g, name
        start, width = self.columns[g.rank]
        self.spec = ShardSpec(1, (num_embeddings, embedding_dim), start, width)
        self.weight = nn.Parameter(self.spec.slice(dense.weight.detach()), requires_grad=not _freeze)
        self.gradient_sink: GradientSink | None = None
        self.on_plan: PlanHook | None = None
        #: ``check(rows, label)`` run on this rank's coalesced gradient rows before they are sent (a
        #: strategy's non-finite check, :mod:`lowband.optim.nonfinite`: zeroes and flags inf/NaN)
        self.check_gradient: Callable[[list[torch.Tensor], str], object] | None = None
        self._prefetched: list[tuple[torch.Tensor, LookupPlan, Handle[torch.Tensor]]] = []

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, group: Group | None = None, *, name: str = "embedding"
    ) -> PartitionedEmbedding:
        """This rank's columns of ``emb`` (every rank must pass the same table)."""
        if not isinstance(emb, nn.Embedding):
            raise InvalidArgumentError(
                f"PartitionedEmbedding.from_embedding: {name!r} is a {type(emb).__name__}, not an nn.Embedding"
            )
        w = emb.weight.detach()
        return cls(
            emb.num_embeddings,
            emb.embedding_dim,
            emb.padding_idx,
            emb.max_norm,
            emb.norm_type,
            emb.scale_grad_by_freq,
            emb.sparse,
            _weight=w,
            _freeze=not emb.weight.requires_grad,
            device=w.device,
            dtype=w.dtype,
            group=group,
            name=name,
        )

    @property
    def widths(self) -> list[int]:
        return [w for _, w in self.columns]

    def shard_specs(self) -> Mapping[str, ShardSpec]:
        return {"weight": self.spec}

    def extra_repr(self) -> str:
        start, width = self.columns[self.group.rank]
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}{pad}, columns [{start}, {start + width}) "
            f"of rank {self.group.rank}/{self.group.size}"
        )

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start the lookup of ``ids`` now (every rank's ids gathered, :attr:`on_plan` told, the
        all-to-all of the rows issued), ahead of the call that reads them: the next call must be on
        equal ids and takes the rows from here. Prefetches queue: a table called several times per
        forward is prefetched once per call, in call order, and its calls read them in that order.
        Every rank must prefetch alike (a collective). The rows are those of the table as it is now:
        change it only after that call (or :meth:`drop_prefetched`)."""
        self._check_ids(ids)
        plan = plan_lookup(ids, name=self.table_name, group=self.group)
        if self.on_plan is not None:
            self.on_plan(self, plan)
        issued = ilookup(self.weight.detach(), plan, self.widths, name=self.table_name, group=self.group)
        self._prefetched.append((ids.detach().clone(), plan, issued))

    @property
    def prefetched(self) -> int:
        """How many prefetched lookups no call has read yet."""
        return len(self._prefetched)

    def drop_prefetched(self) -> None:
        """Complete and discard the prefetched lookups no call has read (every rank alike)."""
        while self._prefetched:
            self._prefetched.pop(0)[2].wait()

    def _check_ids(self, ids: torch.Tensor) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(
                f"PartitionedEmbedding {self.table_name!r} on rank {self.group.rank}: ids must be an int32/int64 "
                f"tensor, got {getattr(ids, 'dtype', type(ids).__name__)}"
            )
        if ids.device != self.weight.device:
            raise InvalidArgumentError(
                f"PartitionedEmbedding {self.table_name!r} on rank {self.group.rank}: ids are on {ids.device}, "
                f"the table on {self.weight.device}: move the ids to the table's device"
            )
        if ids.numel():
            # one host sync per call: an id out of range would be a device-side assert on CUDA (which
            # ruins the process), so the range is read on the host, both ends at once
            lo, hi = (int(v) for v in torch.stack(torch.aminmax(ids.reshape(-1))).tolist())
            if lo < 0 or hi >= self.num_embeddings:
                raise InvalidArgumentError(
                    f"PartitionedEmbedding {self.table_name!r} on rank {self.group.rank}: ids must lie in "
                    f"[0, {self.num_embeddings}), got [{lo}, {hi}]"
                )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        issued: Handle[torch.Tensor] | None = None
        if self._prefetched:
            want, plan, issued = self._prefetched.pop(0)
            # torch.equal reads a bool on the host (a sync on CUDA): the price of never training on
            # rows prefetched for other ids; the shapes are compared first, for free
            if want.shape != ids.shape or not torch.equal(want, ids.to(want.dtype)):
                issued.wait()
                raise InvalidArgumentError(
                    f"PartitionedEmbedding {self.table_name!r} on rank {self.group.rank}: called on ids "
                    f"{tuple(ids.shape)} other than the ones prefetched {tuple(want.shape)} (the next call "
                    "after prefetch() must be on the same ids)"
                )
        else:
            plan = plan_lookup(ids, name=self.table_name, group=self.group)
            if self.on_plan is not None:
                self.on_plan(self, plan)
        rows: torch.Tensor = _Lookup.apply(self.weight, self, plan, issued)  # type: ignore[no-untyped-call]
        return rows.index_select(0, plan.inverse).view(*ids.shape, self.embedding_dim)

    def grad_masks(self, plan: LookupPlan) -> list[torch.Tensor]:
        """Rows that carry gradient: every unique row but ``padding_idx``."""
        if self.padding_idx is None:
            return [torch.ones_like(r, dtype=torch.bool) for r in plan.rows]
        return [r != self.padding_idx for r in plan.rows]

    @staticmethod
    def exchange_now(table: PartitionedEmbedding, plan: LookupPlan, grad_rows: torch.Tensor) -> torch.Tensor:
        """The default backward: every row's column blocks to their owners now, summed into a dense
        gradient of the shard."""
        masks = table.grad_masks(plan)
        blocks = iexchange_gradients(
            grad_rows, plan.rows, masks, table.widths, name=table.table_name, group=table.group
        ).wait()
        union, values = sum_blocks(blocks, plan.rows, masks, table.weight.shape[1], grad_rows.dtype)
        return torch.zeros_like(table.weight).index_add_(0, union, values)
