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
from lowband.comm.base import host_value
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
    # control plane: the counts are host numbers (they size the receive buffer), so they travel as a
    # CPU tensor (a CPU gloo path on every group lowband makes: no device synchronisation), on the GPU
    # only on an adopted NCCL-only group
    mine = host_value(torch.tensor([flat.numel()], dtype=torch.int64, device="cpu"), group)
    counts = comm.allgather(mine, name=f"{name}/counts", group=group)
    sizes = [int(c) for c in counts.tolist()]
    every = comm.allgather(flat, sizes=sizes, name=f"{name}/ids", group=group)
    rows = []
    pos = 0
    inverse = flat.new_zeros(0)
    for q, n in enumerate(sizes):  # torch.unique sizes its result on the host: one sync per rank's ids
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
    counts: Sequence[int] | None = None,
) -> Handle[list[torch.Tensor]]:
    """Nonblocking: sends the column blocks of this rank's gradient rows (``grad_rows``: one row per
    ``rows[me]``, every column) selected by ``masks[me]`` to their owners; ``wait()`` gives, for every
    rank ``q``, the block ``[masks[q].sum(), width_me]`` of ``q``'s selected rows in this rank's
    columns. ``masks`` must be the same on every rank; ``counts`` (``masks[q].sum()`` for every ``q``,
    :func:`mask_counts`) when the caller has them."""
    me = group.rank
    if counts is None:
        counts = mask_counts(masks)
    n_sel = counts[me]
    # the rows picked without a further sync: the count is known, so nonzero needs no host round trip
    at = torch.nonzero_static(masks[me], size=n_sel).view(-1)
    picked = grad_rows.index_select(0, at)
    send = torch.cat([b.reshape(-1) for b in torch.split_with_sizes(picked, list(widths), dim=1)])
    splits = [n_sel * w for w in widths]
    recv = [c * widths[me] for c in counts]

    def blocks(got: tuple[torch.Tensor, list[int]]) -> list[torch.Tensor]:
        return [
            b.view(c, widths[me]) for b, c in zip(torch.split_with_sizes(got[0], recv), counts, strict=True)
        ]

    return comm.ialltoall(send, splits, recv_splits=recv, name=f"{name}/grad", group=group).map(blocks)


def mask_counts(masks: list[torch.Tensor]) -> list[int]:
    """``masks[q].sum()`` for every ``q``, on the host: one synchronisation for all of them (the counts
    size the all-to-all's splits, which the host must know)."""
    if not masks:
        return []
    return [int(c) for c in torch.stack([m.sum() for m in masks]).tolist()]


def sum_blocks(
    blocks: list[torch.Tensor],
    rows: list[torch.Tensor],
    masks: list[torch.Tensor],
    width: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's sum of the received blocks: ``(union, values)`` with ``union`` the sorted distinct
    rows and ``values[k]`` the sum of every block row for ``union[k]`` (on the blocks' device)."""
    # each block's row count is its mask's count: the rows picked without a host round trip
    picked = [
        r.index_select(0, torch.nonzero_static(m, size=b.shape[0]).view(-1))
        for r, m, b in zip(rows, masks, blocks, strict=True)
    ]
    union, places = owner_rows(picked)  # torch.unique sizes the union on the host: one sync
    device = blocks[0].device if blocks else union.device
    values = torch.zeros((union.numel(), width), dtype=dtype, device=device)
    for at, b in zip(places, blocks, strict=True):
        values.index_add_(0, at, b)
    return union, values
