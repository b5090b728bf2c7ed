"""The ``embrace`` strategy (EmbRace: "Accelerating Sparse Communication for Distributed Training of
Deep Neural Networks"): every ``nn.Embedding`` of the model becomes a column-partitioned
:class:`~lowband.sparse.PartitionedEmbedding` (AlltoAll of looked-up rows and of their gradients),
the dense rest is allreduced on the gradient stage (the hybrid), and torch optimizers step: one over
the replicated parameters, one over this rank's table columns (their state lives on this rank only).

Spec: ``embrace:schedule=hybrid|horizontal|vertical|2d,overlap=false|true,bucket_mb=MB``.

- ``hybrid``: the embedding gradients are exchanged in backward and stepped with the dense ones.
- ``horizontal``: block-level horizontal scheduling (:mod:`lowband.strategies.embrace_blocks`): the
  dense layers are reduced on one communication thread in forward-order priority (an order negotiated
  with every rank) and each is stepped just before its module's next forward; the next step's
  embedding lookups (ids from :meth:`EmbraceStrategy.lookahead`) and their all-to-alls are issued at
  the end of the step, ahead of the dense forward, while the dense reductions are still in flight.
  The queue runs one reduction per negotiation (one small allreduce each): on models with many dense
  layers at fast links this costs more than it overlaps (a 20-layer transformer at 1 Gbit/s: 13% slower
  than ``hybrid``); on embedding-dominated models it pays (README, "EmbRace").
- ``vertical``: Algorithm 1 (:mod:`lowband.sparse.vertical`): the rows the next batch of every rank
  reads are exchanged and applied before its lookup, the rest in idle time (the end of the next step),
  before evaluation and before a checkpoint (``synchronize``); undelivered rows go into
  ``state_dict``. Needs a lazy optimizer on the tables: Adam runs as ``SparseAdam`` with its step
  counter advanced once per iteration, SGD without momentum as is. ``overlap=true``: the delayed rows
  go on one communication thread while the next backward computes (and the dense allreduces run),
  in an order every rank agrees on.
- ``2d``: horizontal and vertical together (the paper's 2D communication scheduling); ``overlap`` as
  for ``vertical``.

Equivalence: both schedules train as the single-process model on every rank's batch with the ranks'
losses averaged (``vertical`` with lazy Adam semantics on the tables). The tables' traffic runs on its
own channel over the group, so it never interleaves with the stage's allreduces, except for CUDA tables
on an NCCL group, which share the data group (:func:`table_channel`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowband.comm.engine import issue_lane
from lowband.comm.initial import broadcast_initial_state
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.nn.tied import refuse_tied
from lowband.optim.layerwise import parameter_layers
from lowband.optim.reducer import AllreduceReducer, bucket_units, layer_units, parameter_names
from lowband.optim.stage import GradientStage
from lowband.options import Opt, Options, Rule
from lowband.runtime import open_member_group, world_group
from lowband.sparse.embedding import PartitionedEmbedding
from lowband.sparse.lazy import lazy_optimizer
from lowband.sparse.vertical import VerticalSchedule
from lowband.strategies import digest, sharded_state
from lowband.strategies.base import OptimizerFactory, Strategy
from lowband.strategies.embrace_blocks import BlockSchedule
from lowband.strategies.registry import register_strategy

SCHEDULES = ("hybrid", "horizontal", "vertical", "2d")


def _nccl(group: Group) -> bool:
    """Whether ``group``'s data backend is NCCL (``nccl`` or ``cpu:gloo,cuda:nccl``); thread ranks' own
    gloo groups and groups torch does not know by name are not."""
    if isinstance(group.pg, dist.ProcessGroupGloo):
        return False
    try:
        return "nccl" in str(dist.get_backend(group.pg)).lower()
    except (RuntimeError, ValueError):
        return False


def table_device(model: nn.Module, where: str) -> torch.device:
    """The one device every ``nn.Embedding`` of ``model`` is on (the CPU when it has none)."""
    found = {m.weight.device for m in model.modules() if isinstance(m, nn.Embedding)}
    if len(found) > 1:
        raise InvalidArgumentError(
            f"{where}: the embedding tables are on several devices {sorted(map(str, found))}: move the "
            "model to one device"
        )
    return found.pop() if found else torch.device("cpu")


def table_channel(group: Group, device: torch.device, schedule: str, overlap: bool, where: str) -> Group:
    """The process group the tables' traffic runs on (chosen here only), for tables on ``device``.

    - A private gloo group over ``group``'s ranks when the tables are on the CPU, or when ``group``
      itself is gloo (thread ranks, ``backend='gloo'``: gloo moves CUDA tensors, staged through host
      memory, as it does on the data group): the table traffic never queues behind the dense
      gradients' collectives, and the schedules' communication threads have a group of their own.
    - ``group`` itself when the tables are on CUDA and ``group`` is NCCL: a private gloo group would
      stage every table byte through the host. NCCL needs one issuing order from one thread per group,
      so with more than one rank the schedules that issue on it from a communication thread while the
      training thread issues the table traffic (``horizontal`` and ``2d``'s dense queue, ``overlap``'s
      delayed rows) are refused, naming the fix.
    """
    if device.type == "cuda" and _nccl(group):
        if group.size > 1 and (schedule in ("horizontal", "2d") or overlap):
            raise InvalidArgumentError(
                f"{where}: tables on {device} over the NCCL group {group.name!r}: schedule={schedule!r}"
                f"{', overlap=true' if overlap else ''} would issue NCCL collectives on one group from two "
                "threads (a deadlock); use schedule='hybrid' or 'vertical' without overlap, or a gloo backend"
            )
        return group
    ctx, g = world_group(group, "strategy 'embrace'")
    counts: dict[tuple[int, ...], int] = ctx.state.setdefault("lowband.sparse.channels", {})
    gen = counts.get(g.ranks, 0)
    counts[g.ranks] = gen + 1
    return open_member_group(
        ctx, g, f"lowband/embrace/{'.'.join(map(str, g.ranks))}/{gen}", f"{g.name}/embrace"
    )


def partition_tables(model: nn.Module, group: Group) -> dict[str, PartitionedEmbedding]:
    """Replaces every ``nn.Embedding`` of ``model`` by its :class:`PartitionedEmbedding` (this rank's
    columns), named by its (first) path in the model; returns them. A table registered at several
    paths is replaced by one partitioned table at every path (it stays one module)."""
    tables: dict[str, PartitionedEmbedding] = {}
    made: dict[int, PartitionedEmbedding] = {}
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if isinstance(m, nn.Embedding):
            if not name:
                raise InvalidArgumentError(
                    "strategy 'embrace': the model itself is an nn.Embedding; wrap it in a module"
                )
            if id(m) not in made:
                made[id(m)] = tables[name] = PartitionedEmbedding.from_embedding(m, group, name=name)
            model.set_submodule(name, made[id(m)])
    return tables


def _calls(where: str, name: str, ids: object) -> list[torch.Tensor]:
    """A table's lookahead ids as the list of its calls' ids (one tensor: one call)."""
    if isinstance(ids, torch.Tensor):
        return [ids]
    if isinstance(ids, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in ids):
        return list(ids)
    raise InvalidArgumentError(
        f"{where}: lookahead ids of table {name!r} must be a tensor or a list of tensors (one per call), "
        f"got {type(ids).__name__}"
    )


class EmbraceStrategy(Strategy):
    """Column-partitioned tables + allreduced dense parameters (module docstring). No cost model
    (``lowband plan``): its all-to-all bytes depend on the ids each batch looks up (the data), which the
    profile does not hold."""

    name = "embrace"
    no_skip_reason = "its tables' gradient rows are exchanged during backward, before the step"

    def __init__(
        self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, schedule: str = "hybrid",
        overlap: bool = False, bucket_mb: float = 0.0,
    ) -> None:  # fmt: skip
        where = f"strategy 'embrace' on rank {group.rank}"
        self.schedule, self.overlap, self.bucket_mb = schedule, overlap, float(bucket_mb)
        if schedule in ("vertical", "2d"):  # (accumulate=J)
            self.no_accumulate_reason = (
                f"schedule={schedule!r} applies a pass's table rows before the next lookup reads them, "
                "so a later pass of the same step would read updated rows; use schedule='hybrid' or "
                "'horizontal'"
            )
        refuse_tied(
            model,
            [m.weight for m in model.modules() if isinstance(m, nn.Embedding)],
            where=where,
            why="embrace cuts every embedding table by columns over the ranks, so the other module would "
            "train a copy of its own (an output layer on the partitioned table needs the whole table, an "
            "allgather of it, every step)",
            fix="untie them (give the other module its own weight), or train the tied model with a strategy "
            "that keeps the table whole on every rank (ddp, stage, compressed, dense-priority)",
        )
        broadcast_initial_state(model, group=group)  # every replica starts from rank 0's model, as DDP does
        channel = table_channel(group, table_device(model, where), schedule, overlap, where)
        self.tables = partition_tables(model, channel)
        if not self.tables:
            raise InvalidArgumentError(f"{where}: the model has no nn.Embedding to partition")
        table_params = {id(t.weight) for t in self.tables.values()}
        dense = [p for p in model.parameters() if id(p) not in table_params]
        if not dense:
            raise InvalidArgumentError(f"{where}: the model has no parameter besides its embedding tables")
        timeout = world_group(group, where)[0].config.timeout
        layers = [(n, [p for p in ps if id(p) not in table_params]) for n, ps in parameter_layers(model)]
        layers = [(n, ps) for n, ps in layers if ps]
        self.blocks = (
            BlockSchedule(model, layers, make_optimizer, group, timeout=timeout, where=where)
            if schedule in ("horizontal", "2d")
            else None
        )
        super().__init__(
            model, make_optimizer(dense) if self.blocks is None else self.blocks.optimizer, group
        )
        shard_opt = make_optimizer([t.weight for t in self.tables.values()])
        lazy = schedule in ("vertical", "2d")
        self.table_optimizer = lazy_optimizer(shard_opt, where=where) if lazy else shard_opt
        self.executor = (
            issue_lane(channel, timeout=timeout, where=f"embrace-comm on rank {group.rank}")
            if overlap
            else None
        )
        self.vertical = (
            VerticalSchedule(self.tables, self.table_optimizer, 1.0 / group.size, self.executor)
            if lazy
            else None
        )
        names = parameter_names(model)
        if self.blocks is not None:
            self.stage = self.blocks.stage
            return
        if self.bucket_mb == 0:
            units = layer_units(layers, names)
        else:
            units = [
                u
                for u in bucket_units(model, self.bucket_mb)
                if not any(id(p) in table_params for p in u.params)
            ]
            if sum(len(u.params) for u in units) != len(dense):
                raise InvalidArgumentError(
                    f"{where}: use bucket_mb=0 when a table shares a bucket with dense layers"
                )
        self.stage = GradientStage(units, AllreduceReducer(), group=group, where=where)

    # -- training ---------------------------------------------------------------------------------
    def clear_gradients(self) -> None:
        if self.blocks is not None:
            self.blocks.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.table_optimizer.zero_grad(set_to_none=True)

    def lookahead(self, ids: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        """With ``schedule=horizontal|2d``: the ids each table (by module name) is called on in the next
        step, known one step ahead (the paper prefetches its data): their lookups and all-to-alls are
        issued now, ahead of the next dense forward. ``ids[name]`` is the ids of the table's next call,
        or a sequence of them, one per call in the order the forward makes them (a model that reads a
        table twice per forward). Call it after :meth:`step` (``train_step``), on every rank alike;
        ignored by the other schedules. A lookup prefetched by the last call and not read by the step
        since is refused (the forward called that table fewer times)."""
        if self.blocks is None:
            return
        where = f"strategy 'embrace' on rank {self.group.rank}"
        unknown = sorted(set(ids) - set(self.tables))
        if unknown:
            raise InvalidArgumentError(
                f"{where}: lookahead ids for {unknown}, which are not embedding tables of the model "
                f"(tables: {sorted(self.tables)})"
            )
        calls = {name: _calls(where, name, v) for name, v in ids.items()}
        unread = {n: t.prefetched for n, t in self.tables.items() if t.prefetched}
        if unread:
            raise InvalidArgumentError(
                f"{where}: lookups prefetched by the last lookahead were not read by the step "
                f"({unread}: the forward called those tables fewer times): give one ids tensor per call"
            )
        if self.vertical is not None:
            self.vertical.drain()
        for name, table in self.tables.items():  # model order, then call order: the same on every rank
            for one in calls.get(name, ()):
                table.prefetch(one)

    def after_step(self) -> None:
        if self.vertical is not None:  # the next step's rows belong to its iteration (1-based)
            self.vertical.iteration = self.steps + 1

    def run_backward(self, loss: torch.Tensor) -> None:
        if self.blocks is not None:  # layers the forward did not read
            self.blocks.finish_all()
        if self.vertical is not None and self.overlap:  # the delayed rows travel during the backward
            self.vertical.submit_delayed(self.steps + 1)
        loss.backward()  # type: ignore[no-untyped-call]

    def finish_gradients(self) -> None:
        self.stage.wait()

    def set_nonfinite(self, policy: str) -> None:
        super().set_nonfinite(policy)
        guard = self.nonfinite
        check = guard.check_ if guard is not None and guard.enabled else None
        for table in self.tables.values():  # each rank's rows checked before they travel
            table.check_gradient = check

    def apply_step(self) -> None:
        self.check_nonfinite()  # the non-finite policy, before anything is stepped (Strategy.check_nonfinite)
        if self.vertical is not None:
            self.vertical.drain()
        if self.blocks is not None:
            self.blocks.end_step()  # each layer stepped just before its next forward
        else:
            self.stage.wait()
            self.optimizer.step()
        if self.vertical is None:
            for t in self.tables.values():
                if t.weight.grad is not None:
                    t.weight.grad.div_(self.group.size)
            self.table_optimizer.step()
        else:  # idle time: the rows of earlier iterations that no lookup has needed yet
            self.vertical.deliver_before(self.steps + 1)

    def synchronize(self) -> None:
        if self.blocks is not None:
            self.blocks.finish_all()
            if self.vertical is not None:
                self.vertical.drain()
            for t in self.tables.values():
                t.drop_prefetched()
        else:
            self.stage.wait()
        if self.vertical is not None:
            self.vertical.deliver_all()

    def hparams(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "overlap": self.overlap, "bucket_mb": self.bucket_mb}

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tables": {n: {"rows": t.num_embeddings, "columns": t.columns} for n, t in self.tables.items()}
        }
        if self.vertical is not None:
            out["delivered_rows"] = dict(self.vertical.delivered_rows)
        if self.executor is not None:
            out["comm_thread_busy_s"] = self.executor.busy_s
        if self.blocks is not None:
            q = self.blocks.queue
            out["negotiations"], out["empty_negotiations"] = q.negotiations, q.empty_negotiations
        return out

    # -- checkpoints: both optimizers in one torch-style optimizer state --------------------------
    def _optimizers(self) -> list[torch.optim.Optimizer]:
        dense = [self.optimizer] if self.blocks is None else list(self.blocks.optimizer.optimizers)
        return [*dense, self.table_optimizer]

    def _optimizer_names(self) -> list[str]:
        return [
            n for o in self._optimizers() for n in sharded_state.optimizer_param_names(o, self.local_module)
        ]

    def state_dict(self) -> dict[str, Any]:
        if self.blocks is not None:  # the dense updates still due are applied (as the next forward would)
            self.blocks.finish_all()
        state = super().state_dict()
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        offset = 0
        for o in self._optimizers():
            sd = o.state_dict()
            merged["state"].update({offset + int(k): v for k, v in sd["state"].items()})
            merged["param_groups"] += [
                {**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        state["optimizer"] = merged
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise InvalidArgumentError(
                f"EmbraceStrategy.load_state_dict: checkpoint is for strategy {state.get('strategy')!r}, not 'embrace'"
            )
        digest.check_checkpoint(self, state)  # collective: the ranks load one save, of these options
        state = self._localize(state)
        self.steps, self._passes = int(state["steps"]), 0
        self.local_module.load_state_dict(state["model"])
        saved = state["optimizer"]
        offset, first_group = 0, 0
        for o in self._optimizers():
            n_groups = len(o.param_groups)
            n = sum(len(g["params"]) for g in o.param_groups)
            groups = saved["param_groups"][first_group : first_group + n_groups]
            o.load_state_dict({
                "state": {int(k) - offset: v for k, v in saved["state"].items() if offset <= int(k) < offset + n},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in groups],
            })  # fmt: skip
            offset, first_group = offset + n, first_group + n_groups
        self.load_extra_state(state.get("extra", {}))

    def extra_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage.state_dict(), "schedule": self.schedule}
        if self.vertical is not None:
            out["vertical"] = self.vertical.state_dict()
        return out

    def load_extra_state(self, state: dict[str, Any]) -> None:
        where = f"EmbraceStrategy.load_state_dict on rank {self.group.rank}"
        if state.get("schedule") != self.schedule:
            raise InvalidArgumentError(
                f"{where}: the checkpoint is of schedule {state.get('schedule')!r}, this strategy runs {self.schedule!r}"
            )
        self.stage.load_state_dict(state["stage"])
        if self.vertical is not None:
            self.vertical.load_state_dict(state["vertical"], self.group.size, where)
            self.vertical.iteration = self.steps + 1

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()
        self.stage.remove_hooks()
        if self.executor is not None:
            self.executor.close()


@register_strategy(
    "embrace",
    "EmbRace: column-partitioned embedding tables (AlltoAll) + allreduced dense layers "
    "(schedule=hybrid|horizontal|vertical|2d, overlap, bucket_mb)",
    Options(
        {
            "schedule": Opt(
                str, choices=SCHEDULES, doc="how the tables' and dense layers' exchanges are ordered"
            ),
            "overlap": Opt(
                bool, doc="the next step's table lookups prefetched during this one (vertical, 2d)"
            ),
            "bucket_mb": Opt(float, min=0, unit="MB", doc="dense gradient buckets (0: one per layer)"),
        },
        rules=[
            Rule(
                ("overlap", "schedule"),
                "overlap=true only with schedule='vertical' or '2d'",
                lambda o: not o["overlap"] or o["schedule"] in ("vertical", "2d"),
            ),
            Rule(
                ("bucket_mb", "schedule"),
                "schedule='horizontal' and '2d' schedule the dense layers as blocks: bucket_mb must be 0",
                lambda o: not o["bucket_mb"] or o["schedule"] not in ("horizontal", "2d"),
            ),
        ],
    ),
)
def embrace(
    model: nn.Module, make_optimizer: OptimizerFactory, group: Group, *, schedule: str = "hybrid",
    overlap: bool = False, bucket_mb: float = 0.0,
) -> EmbraceStrategy:  # fmt: skip
    return EmbraceStrategy(
        model, make_optimizer, group, schedule=schedule, overlap=overlap, bucket_mb=bucket_mb
    )
