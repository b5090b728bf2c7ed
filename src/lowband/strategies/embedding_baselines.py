"""Baselines for models with embedding tables, each a strategy on the same workloads as EmbRace:

- ``ddp-sparse``: torch DDP with the tables switched to ``sparse=True``, so their gradients take
  torch's sparse path (on gloo: an allgather of every token's row index and values, uncoalesced);
- ``sparse-allgather``: Horovod's sparse allgather, coalesced: each rank sums its table gradient's
  duplicate rows, one allgather-v moves every rank's (index, row) pairs, every rank sums them in rank
  order; dense parameters are averaged by the gradient stage's allreduce, overlapped with backward.

(``embedding-ps``, Parallax's colocated parameter servers, is in
:mod:`lowband.strategies.embedding_baselines_ps`; ``dense-priority``, dense allreduce in forward
order, in :mod:`lowband.strategies.embedding_baselines_priority`.)

Optimizer semantics. The averaged table gradient is handed to the torch optimizer as a dense
``.grad`` (zeros in untouched rows), so every torch optimizer works and every baseline trains exactly
as single-process training on the concatenated batches (dense semantics: Adam's momentum moves rows a
batch did not touch). Only the communication is sparse.

The tables are the model's ``nn.Embedding`` modules called as modules on id tensors (forward
pre-hooks record the ids). A table whose weight another module reads (an output layer tied to it)
would have gradient rows the hooks do not see: the three strategies refuse it at construction, naming
both modules (:func:`refuse_sparse_tie`); tie nothing, or use a dense strategy.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from lowband.comm import collectives as comm
from lowband.comm.agree import agree, crc
from lowband.comm.gather import iallgather
from lowband.comm.handle import Handle
from lowband.comm.initial import broadcast_initial_state
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.nn.tied import refuse_tied
from lowband.optim.reducer import AllreduceReducer, Unit, parameter_names
from lowband.optim.stage import GradientStage
from lowband.optim.units import BUCKET_OPTIONS
from lowband.options import Opt, Options
from lowband.sparse.rows import coalesce, embedding_tables, pack_rows, unpack_rows
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.ddp import DDPStrategy
from lowband.strategies.registry import register_strategy

Tensor = torch.Tensor


def dense_units(model: nn.Module, exclude: set[int], bucket_mb: float) -> list[Unit]:
    """The trainable parameters not in ``exclude`` (ids) in buckets of about ``bucket_mb`` MB, in
    backward order as DDP fuses them (0: one unit per parameter); returned in forward order."""
    names = parameter_names(model)
    params = [p for p in names if p.requires_grad and id(p) not in exclude]
    cap = bucket_mb * 2**20
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if buckets[-1] and (buckets[-1][-1].dtype != p.dtype or size >= cap):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    units = []
    for b in reversed([b for b in buckets if b]):
        b = b[::-1]
        pn = tuple(names[p] for p in b)
        units.append(Unit(pn[0] if len(pn) == 1 else f"{pn[0]}..{pn[-1]}", pn, tuple(b)))
    return units


def refuse_sparse_tie(model: nn.Module, strategy: str, where: str) -> None:
    """The tables' gradients travel as the rows their lookups read: a table whose weight another module
    reads (an output layer tied to it) is refused, naming both modules."""
    refuse_tied(
        model,
        [e.weight for _, e in embedding_tables(model)],
        where=where,
        why=f"{strategy!r} synchronises a table's gradient as the rows its lookups read, and the other "
        "module reads every row (the gradient of the rows no lookup read would be lost)",
        fix="untie them (give the other module its own weight), or train the tied model with a strategy "
        "that synchronises the table densely (ddp, stage, compressed, dense-priority)",
    )


class EmbeddingSyncStrategy(Strategy):
    """Dense parameters through the gradient stage (allreduce, from backward hooks), the tables'
    gradients synchronised by :meth:`sync_tables` after backward, then ``optimizer.step()``.

    Subclasses implement :meth:`sync_tables` (``self.ids[name]``: the id tensors each table was called
    on in this step's forward) and may override :meth:`optimizer_params`.
    """

    name = "embedding-sync"
    no_skip_reason = "its tables' rows are exchanged and applied by their owners as the step syncs them"

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, bucket_mb: float = 25.0
    ) -> None:
        where = type(self).__name__
        self.bucket_mb = float(bucket_mb)
        refuse_sparse_tie(model, self.name, f"{where} on rank {group.rank}")
        broadcast_initial_state(model, group=group)  # every replica starts from rank 0's model, as DDP does
        self.tables = embedding_tables(model)
        shapes = [(n, tuple(e.weight.shape), str(e.weight.dtype)) for n, e in self.tables]
        agree(
            group, "the embedding tables", [len(shapes), crc(shapes)], where=f"{where} on rank {group.rank}"
        )
        self.fast = group.unchecked()
        self._reads_checked = False
        self.table_ids = {id(e.weight) for _, e in self.tables}
        units = dense_units(model, self.table_ids, self.bucket_mb)
        self.stage = GradientStage(units, AllreduceReducer(), group=group, where=where) if units else None
        self.ids: dict[str, list[Tensor]] = {n: [] for n, _ in self.tables}
        #: this step's distinct ids per table (set in :meth:`step` before :meth:`sync_tables`)
        self.coalesced: dict[str, Tensor] = {}
        # per table: steps, ids looked up, distinct ids (for report())
        self._seen = {n: [0, 0, 0] for n, _ in self.tables}
        ref = weakref.ref(self)
        self._hooks = []
        for name, emb in self.tables:

            def hook(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                me = ref()
                if me is not None and torch.is_grad_enabled():
                    me.on_lookup(name, args[0])

            self._hooks.append(emb.register_forward_pre_hook(hook))
        super().__init__(model, make_optimizer(self.optimizer_params(model)), group)

    def optimizer_params(self, model: nn.Module) -> list[nn.Parameter]:
        return list(model.parameters())

    def on_lookup(self, name: str, ids: Tensor) -> None:
        """A table is about to be read at ``ids`` in a forward with gradients enabled (training;
        evaluation runs under ``torch.no_grad``)."""
        self.ids[name].append(ids.detach())

    def sync_tables(self) -> None:
        raise NotImplementedError

    def check_lookup_only_reads(self) -> None:
        """Once, at the first step (collective): a table whose gradient has rows no lookup read is read
        elsewhere too (``h @ emb.weight.T``, a tie no module structure shows), and those rows would be
        lost: raises :class:`InvalidArgumentError` on every rank, naming the tables (a flag per table,
        maxed over the ranks; one host read of it)."""
        self._reads_checked = True
        flags = []
        for name, emb in self.tables:
            g = emb.weight.grad
            if g is None or g.is_sparse:
                flags.append(torch.zeros((), dtype=torch.bool, device=emb.weight.device))
                continue
            outside = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
            outside[self.coalesced[name]] = False
            flags.append(g[outside].ne(0).any())
        if not flags:
            return
        seen = torch.stack([f.to("cpu") for f in flags]).to(torch.int32)
        everywhere = comm.allreduce(seen, op="max", name="embedding-reads", group=self.group)
        bad = [n for (n, _), f in zip(self.tables, everywhere.tolist(), strict=True) if f]
        if bad:
            raise InvalidArgumentError(
                f"{type(self).__name__} on rank {self.group.rank}, step {self.steps}: the gradient of table(s) "
                f"{bad} has rows no lookup of the table read on some rank: the model reads the weight outside "
                f"the table's forward (e.g. an output layer computing with it), and {self.name!r} synchronises "
                "only the looked-up rows (the others would be lost); read the table only through its module, "
                "or train with a strategy that synchronises the table densely (ddp, stage, compressed, "
                "dense-priority)"
            )

    def apply_step(self) -> None:
        if self.stage is not None:
            self.stage.wait()
        devices = {n: e.weight.device for n, e in self.tables}
        self.coalesced = {n: coalesce(ids, devices[n]) for n, ids in self.ids.items()}
        for n, ids in self.ids.items():
            seen = self._seen[n]
            seen[0] += 1
            seen[1] += sum(i.numel() for i in ids)
            seen[2] += self.coalesced[n].numel()
        if not self._reads_checked:
            self.check_lookup_only_reads()
        self.check_nonfinite()  # the non-finite policy, before the tables' rows travel (Strategy.check_nonfinite)
        self.sync_tables()
        for v in self.ids.values():
            v.clear()
        self.optimizer.step()

    def synchronize(self) -> None:
        if self.stage is not None:
            self.stage.wait()

    def hparams(self) -> dict[str, Any]:
        return {"bucket_mb": self.bucket_mb}

    def report(self) -> dict[str, Any]:
        """Per table, means over this run's steps on this rank: ids looked up (one gradient row each
        uncoalesced), distinct ids (the coalesced rows sent) and the density (distinct ids / rows)."""
        out = {}
        for name, emb in self.tables:
            steps, looked, rows = self._seen[name]
            k = max(steps, 1)
            out[name] = {
                "rows": emb.num_embeddings,
                "lookups_per_step": looked / k,
                "coalesced_rows_per_step": rows / k,
                "density": rows / k / max(emb.num_embeddings, 1),
            }
        return {"tables": out}

    def extra_state(self) -> dict[str, Any]:
        return {"stage": self.stage.state_dict() if self.stage is not None else None}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "stage" not in state:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: checkpoint has no stage state"
            )
        if self.stage is not None:
            self.stage.load_state_dict(state["stage"])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self.stage is not None:
            self.stage.remove_hooks()


@register_strategy(
    "sparse-allgather",
    "coalesced sparse allgather of the embedding gradients (Horovod's way, coalesced) + dense allreduce",
    Options({"bucket_mb": BUCKET_OPTIONS.opts["bucket_mb"]}),
)
class SparseAllgatherStrategy(EmbeddingSyncStrategy):
    """Module docstring. Bytes per rank per table and step: one allgather of
    ``(N-1) * max_q(rows_q) * (8 + D * itemsize)`` (:func:`lowband.sparse.costs.sparse_allgather_bytes`)."""

    name = "sparse-allgather"

    def sync_tables(self) -> None:
        n = self.group.size
        pending: list[tuple[nn.Embedding, Handle[Tensor]]] = []
        for name, emb in self.tables:
            w = emb.weight
            rows = self.coalesced[name]
            vals = w.grad[rows] if w.grad is not None else w.new_zeros((rows.numel(), w.shape[1]))
            pending.append((emb, iallgather(pack_rows(rows, vals.detach()), name=name, group=self.fast)))
        for emb, h in pending:
            w = emb.weight
            ids, vals = unpack_rows(h.wait(), w.shape[1], w.dtype)
            g = torch.zeros_like(w)
            g.index_add_(0, ids, vals)  # every rank's rows in rank order: the same bits on every rank
            w.grad = g.div_(n)


@register_strategy(
    "ddp-sparse",
    "torch DDP with the embedding tables as sparse=True (torch's sparse gradient path)",
    Options({"bucket_cap_mb": Opt(float, min=0.001, unit="MB", doc="DDP's bucket size (bucket_cap_mb)")}),
)
class DDPSparseStrategy(DDPStrategy):
    """torch DDP with every ``nn.Embedding`` of the model switched to ``sparse=True`` (on the model
    given). DDP averages the sparse gradients (gloo: allgather of indices and values, one per token);
    they are made dense before the torch optimizer steps (module docstring: optimizer semantics)."""

    name = "ddp-sparse"
    carry_nonfinite = False  # sparse buckets: DDP's own path, the flags agreed

    @classmethod
    def predict(cls, profile: Any, links: Any, options: Any) -> None:
        """No model: DDP's dense byte model does not apply to sparse gradients."""
        return None

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, bucket_cap_mb: float = 25.0
    ) -> None:
        refuse_sparse_tie(model, self.name, f"{type(self).__name__} on rank {group.rank}")
        self.tables = embedding_tables(model)
        for _, emb in self.tables:
            emb.sparse = True
        super().__init__(model, make_optimizer, group, bucket_cap_mb=bucket_cap_mb)

    def apply_step(self) -> None:
        for _, emb in self.tables:
            g = emb.weight.grad
            if g is not None and g.is_sparse:
                emb.weight.grad = g.to_dense()
        super().apply_step()
