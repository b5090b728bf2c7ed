"""``embedding-ps``: parameter servers for the embedding tables, colocated on the ranks, with the rows
partitioned over them (``partition=range|modulo``), and dense parameters allreduced: Parallax's
hybrid ("Parallax: Sparsity-aware Data Parallel Training of Deep Neural Networks").

Rank ``j`` is the server of its rows of every table (:class:`~lowband.sparse.rows.RowPartition`):
it holds them as a parameter of its own (the authoritative rows) and steps them with the torch
optimizer, which also steps the dense parameters. Each step:

- *pull*, before a table is read (its forward pre-hook, in a training forward): the distinct ids are
  sent to their owners (an all-to-all of ids) and the owners return the current rows (an all-to-all
  of values), which are written into the rank's copy of the table: the forward reads up-to-date rows;
- backward: the dense parameters' gradients are averaged by the gradient stage's allreduce;
- *push*, in ``step()``: each rank's coalesced table gradient rows go to their owners as
  (index, values) pairs in one all-to-all; each owner sums them in rank order, divides by ``N`` and
  the optimizer steps its rows (untouched rows with a zero gradient: dense semantics, so training equals
  single-process training for every torch optimizer).

The rank's copy of a table is a cache: rows it did not pull lag behind. :meth:`synchronize` (called
before evaluation and checkpoints) refreshes it whole from the owners (one allgather of every
owner's rows), so the local module is the model afterwards; that traffic is outside the training
steps. Bytes per rank per table and step: :func:`~lowband.sparse.costs.ps_request_bytes`,
:func:`~lowband.sparse.costs.ps_reply_bytes` and :func:`~lowband.sparse.costs.ps_push_bytes`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowband.comm.gather import allgather, alltoall
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.units import BUCKET_OPTIONS
from lowband.options import Opt, Options
from lowband.sparse.rows import PARTITIONS, RowPartition, coalesce, pack_rows, unpack_rows
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.embedding_baselines import EmbeddingSyncStrategy
from lowband.strategies.registry import register_strategy

Tensor = torch.Tensor


@register_strategy(
    "embedding-ps",
    "embedding rows on colocated parameter servers (partition=range|modulo; Parallax's way) + dense allreduce",
    Options(
        {
            "partition": Opt(str, choices=PARTITIONS, doc="which rank serves which rows"),
            "bucket_mb": BUCKET_OPTIONS.opts["bucket_mb"],
        }
    ),
)
class EmbeddingPSStrategy(EmbeddingSyncStrategy):
    """Module docstring."""

    name = "embedding-ps"

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        partition: str = "modulo",
        bucket_mb: float = 25.0,
    ) -> None:
        self.partition = partition
        self.servers: dict[str, nn.Parameter] = {}
        self.parts: dict[str, RowPartition] = {}
        self._stale = False
        super().__init__(model, make_optimizer, group, bucket_mb=bucket_mb)

    def optimizer_params(self, model: nn.Module) -> list[nn.Parameter]:
        # runs inside the base constructor, after the tables were found and the model broadcast
        n, me = self.fast.size, self.fast.rank
        for name, emb in self.tables:
            part = RowPartition(self.partition, emb.weight.shape[0], n)
            self.parts[name] = part
            w = emb.weight.detach()
            self.servers[name] = nn.Parameter(w[part.owned(me, w.device)].clone())
        dense = [p for p in model.parameters() if id(p) not in self.table_ids]
        return dense + list(self.servers.values())

    def replicated_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in super().replicated_parameters() if id(p) not in self.table_ids]

    # -- pull ---------------------------------------------------------------------------------------
    def on_lookup(self, name: str, ids: Tensor) -> None:
        super().on_lookup(name, ids)
        w = next(e for n, e in self.tables if n == name).weight
        part, server = self.parts[name], self.servers[name]
        want, counts = part.by_owner(coalesce([ids]))  # counts: host splits (by_owner's one sync)
        asked, got = alltoall(want, counts, name=f"{name}.pull-ids", group=self.fast)
        rows = server.detach()[part.local(asked)]
        back, _ = alltoall(rows, got, recv_splits=counts, name=f"{name}.pull-rows", group=self.fast)
        with torch.no_grad():
            w[want] = back
        self._stale = True

    # -- push ---------------------------------------------------------------------------------------
    def sync_tables(self) -> None:
        n = self.group.size
        for name, emb in self.tables:
            w, part, server = emb.weight, self.parts[name], self.servers[name]
            rows, counts = part.by_owner(self.coalesced[name])
            vals = w.grad[rows] if w.grad is not None else w.new_zeros((rows.numel(), w.shape[1]))
            buf, _ = alltoall(pack_rows(rows, vals.detach()), counts, name=f"{name}.push", group=self.fast)
            ids, got = unpack_rows(buf, w.shape[1], w.dtype)
            g = torch.zeros_like(server)
            g.index_add_(0, part.local(ids), got)  # every rank's rows in rank order
            server.grad = g.div_(n)
            w.grad = None

    def synchronize(self) -> None:
        super().synchronize()
        if not self._stale:
            return
        n = self.fast.size
        for name, emb in self.tables:
            part, server = self.parts[name], self.servers[name]
            full = allgather(server.detach(), sizes=part.counts(), name=f"{name}.refresh", group=self.fast)
            with torch.no_grad():
                w = emb.weight
                w[torch.cat([part.owned(j, w.device) for j in range(n)])] = full
        self._stale = False

    def hparams(self) -> dict[str, Any]:
        return {"partition": self.partition, **super().hparams()}

    def extra_state(self) -> dict[str, Any]:
        return {
            **super().extra_state(),
            "ps": {
                "partition": self.partition,
                "world_size": self.group.size,
                "stale": self._stale,
                "servers": {k: v.detach().clone() for k, v in self.servers.items()},
            },
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        where = f"EmbeddingPSStrategy.load_state_dict on rank {self.group.rank}"
        ps = state.get("ps")
        if not isinstance(ps, dict):
            raise InvalidArgumentError(f"{where}: checkpoint has no parameter-server state")
        saved = (ps.get("partition"), ps.get("world_size"))
        if saved != (self.partition, self.group.size):
            raise InvalidArgumentError(
                f"{where}: the checkpoint's servers hold partition {saved[0]!r} of {saved[1]} ranks, this "
                f"strategy {self.partition!r} of {self.group.size}: each rank's rows are its own"
            )
        if sorted(ps["servers"]) != sorted(self.servers):
            raise InvalidArgumentError(
                f"{where}: the checkpoint's tables {sorted(ps['servers'])} are not {sorted(self.servers)}"
            )
        super().load_extra_state(state)
        with torch.no_grad():
            for k, v in ps["servers"].items():
                self.servers[k].copy_(v)
        self._stale = bool(ps.get("stale", False))
