"""Pure maths of a column-partitioned embedding table: which columns each rank owns, the unique rows
a batch reads, and the vertical schedule's split of a step's gradient rows.

A table of ``V`` rows and ``D`` columns over ``N`` ranks: rank ``j`` owns the contiguous columns
``[start_j, start_j + width_j)`` of every row, the first ``D % N`` ranks one column wider
(:func:`lowband.nn.sharding.shard_range`), so each rank holds ``ceil(D/N)`` or ``floor(D/N)`` of the
``D`` columns. ``D < N`` would leave a rank without columns and is rejected.
"""

from __future__ import annotations

import torch

from lowband.errors import InvalidArgumentError
from lowband.nn.sharding import shard_range


def column_partition(dim: int, world: int, *, table: str = "embedding") -> list[tuple[int, int]]:
    """``(start, width)`` of every rank's columns, in rank order; :class:`InvalidArgumentError`
    naming ``table`` when ``dim < world`` (a rank would own no column) or the sizes are invalid."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise InvalidArgumentError(f"column_partition: table {table!r} needs a dimension >= 1, got {dim!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InvalidArgumentError(
            f"column_partition: table {table!r}: world size must be >= 1, got {world!r}"
        )
    if dim < world:
        raise InvalidArgumentError(
            f"column_partition: table {table!r} has dimension {dim} < {world} ranks: column partitioning "
            f"needs at least one column per rank (use a dimension >= {world} or fewer ranks)"
        )
    return [shard_range(dim, r, world) for r in range(world)]


def unique_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, inverse)``: the sorted distinct ids of ``ids`` (flattened) and, for every id, its
    position in ``rows`` (``rows[inverse] == ids.reshape(-1)``)."""
    flat = ids.reshape(-1)
    rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    return rows, inverse.reshape(-1)


def split_rows(rows: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The vertical schedule's split: a boolean mask over ``rows`` (one step's gradient rows), True
    for the rows that ``next_ids`` (the next step's ids of every rank) read. Those are sent and applied
    before the next lookup; the others may wait until a later lookup reads them."""
    if rows.numel() == 0 or next_ids.numel() == 0:
        return torch.zeros_like(rows, dtype=torch.bool)
    return torch.isin(rows, next_ids.reshape(-1))


def owner_rows(per_rank_rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What an owner does with the rows it receives gradient blocks for: ``(union, positions)`` where
    ``union`` is the sorted distinct rows over every rank and ``positions[q]`` places rank ``q``'s
    rows in it (blocks are summed into ``union`` with ``index_add_``)."""
    if not per_rank_rows:  # nothing to take a device from: an empty host tensor
        return torch.zeros(0, dtype=torch.int64, device="cpu"), []
    union = torch.unique(torch.cat(per_rank_rows), sorted=True)
    return union, [torch.searchsorted(union, r) for r in per_rank_rows]
