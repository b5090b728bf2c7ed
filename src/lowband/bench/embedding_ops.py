"""Synchronising one embedding table's gradient at a given density, four ways, as ops of
``lowband bench --collectives`` (the micro-benchmark of the paper's Fig. 4; driven by
``benchmarks/embedding_sync.py``).

The message size is the table: ``size`` bytes of float32 seen as ``V = size / 4 / dim`` rows of
``dim`` columns. Each rank's gradient touches ``k = round(density * V)`` distinct rows, drawn per
rank from a seeded generator (a few row sets per rank, cycled over steps, so drawing costs nothing
timed); every rank can rebuild every rank's rows, so no op waits on a size exchange.

- ``allreduce`` (the existing op): the dense gradient, ring allreduce.
- ``emb_allgather:density=a,dim=D``: coalesced rows with their int64 ids, one allgather, summed into
  the dense gradient (Horovod's sparse allgather, coalesced).
- ``emb_alltoall:density=a,dim=D``: the column-partitioned exchange: two all-to-alls of column blocks
  (lookup results to the ranks, gradients to the owners), values only (EmbRace).
- ``emb_ps:density=a,dim=D,partition=modulo|range``: rows (with ids) pushed to their owners by one
  all-to-all, summed there, and the summed rows pulled back by a second (Parallax's colocated PS).

Bytes per rank per op: :mod:`lowband.sparse.costs` (``sparse_allgather_bytes``,
``column_lookup_bytes`` + ``column_gradient_bytes``, ``ps_push_bytes`` + ``ps_reply_bytes``, ``allreduce_bytes``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from lowband.bench.collectives import OpFn, register_collective
from lowband.comm.gather import allgather, alltoall
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.options import Opt, Options
from lowband.sparse.costs import column_split
from lowband.sparse.rows import PARTITIONS, RowPartition, pack_rows, unpack_rows

Tensor = torch.Tensor
#: row sets drawn per rank (cycled over steps)
ROW_SETS = 4


#: the options of every embedding op: the gradient's row density and the table's width
TABLE_OPTIONS = Options(
    {
        "density": Opt(float, min=0, max=1, doc="the fraction of the table's rows each rank touches"),
        "dim": Opt(int, min=1, doc="the table's columns"),
    }
)


def table_rows(size: int, dim: int) -> int:
    """Rows of a float32 table of ``size`` bytes and ``dim`` columns."""
    return size // 4 // dim


def touched_rows(rows: int, density: float, rank: int, which: int, seed: int = 0) -> Tensor:
    """Row set ``which`` of ``rank``: ``round(density * rows)`` distinct rows, increasing."""
    k = round(density * rows)
    # a CPU generator on purpose: every rank rebuilds every rank's rows, bit for bit on any device
    g = torch.Generator(device="cpu").manual_seed(1_000_003 * seed + 7919 * rank + 104_729 * which + 1)
    return torch.sort(torch.randperm(rows, generator=g, device="cpu")[:k]).values


@dataclass
class _Rows:
    """Every rank's row sets for one table size (built once per size)."""

    density: float
    dim: int
    size: int = -1
    sets: list[list[Tensor]] | None = None

    def get(self, buf: Tensor, n: int, step: int) -> tuple[Tensor, list[Tensor]]:
        if buf.numel() * 4 != self.size or self.sets is None:
            self.size = buf.numel() * 4
            v = table_rows(self.size, self.dim)
            # drawn on the CPU (the same rows on every rank whatever its device), moved once per size
            self.sets = [
                [touched_rows(v, self.density, q, w).to(buf.device) for q in range(n)]
                for w in range(ROW_SETS)
            ]
        v = table_rows(self.size, self.dim)
        return buf[: v * self.dim].view(v, self.dim), self.sets[step % ROW_SETS]


@register_collective(
    "emb_allgather",
    "embedding gradient at density=a (dim=D): coalesced rows + ids, one allgather",
    TABLE_OPTIONS,
)
def emb_allgather(group: Group, *, density: float = 0.01, dim: int = 64) -> OpFn:
    rows = _Rows(density, dim)

    def run(buf: Tensor, step: int) -> None:
        table, sets = rows.get(buf, group.size, step)
        mine = sets[group.rank]
        out = allgather(pack_rows(mine, table[mine]), sizes=[s.numel() for s in sets], group=group)
        ids, vals = unpack_rows(out, dim, table.dtype)
        torch.zeros_like(table).index_add_(0, ids, vals)

    return run


def column_exchange(table: Tensor, sets: list[Tensor], group: Group) -> None:
    """The two all-to-alls of a column-partitioned table for ``sets[q]``, the rows of rank ``q``."""
    n, me = group.size, group.rank
    dims = column_split(table.shape[1], n)
    cols = list(itertools.accumulate(dims))
    starts = [0, *cols[:-1]]
    k = sets[me].numel()
    # lookup results: owner `me` sends rank q its columns of q's rows
    send = torch.cat([table[sets[q], starts[me] : cols[me]].reshape(-1) for q in range(n)])
    alltoall(
        send, [sets[q].numel() * dims[me] for q in range(n)], recv_splits=[k * d for d in dims], group=group
    )
    # gradients: rank `me` sends owner j the columns j of its own rows
    grad = table[sets[me]]
    send = torch.cat([grad[:, starts[j] : cols[j]].reshape(-1) for j in range(n)])
    alltoall(
        send, [k * d for d in dims], recv_splits=[sets[q].numel() * dims[me] for q in range(n)], group=group
    )


@register_collective(
    "emb_alltoall",
    "embedding gradient at density=a (dim=D): column blocks, two all-to-alls",
    TABLE_OPTIONS,
)
def emb_alltoall(group: Group, *, density: float = 0.01, dim: int = 64) -> OpFn:
    if dim < group.size:
        raise InvalidArgumentError(f"lowband bench: emb_alltoall: dim={dim} < {group.size} ranks")
    rows = _Rows(density, dim)

    def run(buf: Tensor, step: int) -> None:
        table, sets = rows.get(buf, group.size, step)
        column_exchange(table, sets, group)

    return run


def ps_exchange(table: Tensor, sets: list[Tensor], part: RowPartition, group: Group) -> None:
    """Push every rank's rows (ids + values) to their owners, sum, pull the summed rows back."""
    n, me = group.size, group.rank
    by_owner = [part.by_owner(s) for s in sets]
    mine, counts = by_owner[me]
    from_q = [by_owner[q][1][me] for q in range(n)]
    buf, _ = alltoall(pack_rows(mine, table[mine]), counts, recv_splits=from_q, group=group)
    ids, vals = unpack_rows(buf, table.shape[1], table.dtype)
    server = table.new_zeros((part.counts()[me], table.shape[1]))
    local = part.local(ids)
    server.index_add_(0, local, vals)
    alltoall(server[local], from_q, recv_splits=counts, group=group)


@register_collective(
    "emb_ps",
    "embedding gradient at density=a (dim=D): rows pushed to owners and pulled back (partition=)",
    TABLE_OPTIONS | Options({"partition": Opt(str, choices=PARTITIONS, doc="which rank owns which rows")}),
)
def emb_ps(group: Group, *, density: float = 0.01, dim: int = 64, partition: str = "modulo") -> OpFn:
    kind = partition
    rows = _Rows(density, dim)

    def run(buf: Tensor, step: int) -> None:
        table, sets = rows.get(buf, group.size, step)
        ps_exchange(table, sets, RowPartition(kind, table.shape[0], group.size), group)

    return run
