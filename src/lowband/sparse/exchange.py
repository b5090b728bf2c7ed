"""The two exchanges of a column-partitioned table (communication through :mod:`lowband.comm` only).

Lookup: every rank knows every rank's unique rows (the ids were allgathered), so each owner sends rank
``q`` its columns of ``q``'s rows and rank ``q`` concatenates the blocks column-wise: one all-to-all
of values, no indices. Gradients: the reverse all-to-all of the same blocks (optionally of the rows a
mask selects, the mask being computable on both sides), which owners sum per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowband.comm import collectives as comm
from lowband.comm.handle import Handle
from lowband.group import Group
from lowband.sparse.partition import owner_rows, unique_rows


@dataclass(frozen=True)
class LookupPlan:
    """One call's rows: ``rows[q]`` the sorted unique ids of rank ``q``, ``inverse`` this rank's ids as
    positions in ``rows[me]``, ``every_id`` the ids of all ranks (rank order)."""

    rows: list[torch.Tensor]
    inverse: torch.Tensor
    every_id: torch.Tensor
    me: int


def plan_lookup(ids: torch.Tensor, *, name: str, group: Group) -> LookupPlan:
    """Collective: gathers every rank's ids (uneven, possibly empty) and derives the unique rows."""
    flat = ids.reshape(-1).to(torch.int64)
    counts = comm.allgather(torch.tensor([flat.numel()]), name=f"{name}/counts", group=group)
    sizes = [int(c) for c in counts.tolist()]
    every = comm.allgather(flat, sizes=sizes, name=f"{name}/ids", group=group)
    rows = []
    pos = 0
    inverse = torch.zeros(0, dtype=torch.int64)
    for q, n in enumerate(sizes):
        r, inv = unique_rows(every[pos : pos + n])
        rows.append(r)
        if q == group.rank:
            inverse = inv
        pos += n
    return LookupPlan(rows, inverse, every, group.rank)


def ilookup(
    shard: torch.Tensor, plan: LookupPlan, widths: Sequence[int], *, name: str, group: Group
) -> Handle[torch.Tensor]:
    """Nonblocking: this rank's unique rows, all columns (``[len(rows[me]), sum(widths)]``)."""
    mine = shard.shape[1]
    send = shard.index_select(0, torch.cat(plan.rows)).reshape(-1)
    n_me = plan.rows[plan.me].numel()
    splits = [r.numel() * mine for r in plan.rows]
    recv = [n_me * w for w in widths]

    def join(got: tuple[torch.Tensor, list[int]]) -> torch.Tensor:
        blocks = [b.view(n_me, w) for b, w in zip(torch.split_with_sizes(got[0], recv), widths, strict=True)]
        return torch.cat(blocks, dim=1)

    return comm.ialltoall(send, splits, recv_splits=recv, name=f"{name}/lookup", group=group).map(join)


def iexchange_gradients(
    grad_rows: torch.Tensor,
    rows: list[torch.Tensor],
    masks: list[torch.Tensor],
    widths: Sequence[int],
    *,
    name: str,
    group: Group,
) -> Handle[list[torch.Tensor]]:
    """Nonblocking: sends the column blocks of this rank's gradient rows (``grad_rows``: one row per
    ``rows[me]``, every column) selected by ``masks[me]`` to their owners; ``wait()`` gives, for every
    rank ``q``, the block ``[masks[q].sum(), width_me]`` of ``q``'s selected rows in this rank's
    columns. ``masks`` must be the same on every rank."""
    me = group.rank
    picked = grad_rows[masks[me]]
    send = torch.cat([b.reshape(-1) for b in torch.split_with_sizes(picked, list(widths), dim=1)])
    n_sel = int(masks[me].sum())
    splits = [n_sel * w for w in widths]
    counts = [int(m.sum()) for m in masks]
    recv = [c * widths[me] for c in counts]

    def blocks(got: tuple[torch.Tensor, list[int]]) -> list[torch.Tensor]:
        return [
            b.view(c, widths[me]) for b, c in zip(torch.split_with_sizes(got[0], recv), counts, strict=True)
        ]

    return comm.ialltoall(send, splits, recv_splits=recv, name=f"{name}/grad", group=group).map(blocks)


def sum_blocks(
    blocks: list[torch.Tensor],
    rows: list[torch.Tensor],
    masks: list[torch.Tensor],
    width: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's sum of the received blocks: ``(union, values)`` with ``union`` the sorted distinct
    rows and ``values[k]`` the sum of every block row for ``union[k]``."""
    union, places = owner_rows([r[m] for r, m in zip(rows, masks, strict=True)])
    values = torch.zeros((union.numel(), width), dtype=dtype)
    for at, b in zip(places, blocks, strict=True):
        values.index_add_(0, at, b)
    return union, values
