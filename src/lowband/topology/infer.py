"""Turn every rank's destinations into every rank's sources, and back (pure; the global view).

A communicating form (each rank knows only its own list) is an allgather of these lists followed by
these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lowband.errors import InvalidArgumentError
from lowband.topology._args import check_rank_list, fn


def _transpose(where: str, what: str, lists: object) -> list[list[int]]:
    if isinstance(lists, np.ndarray):
        lists = lists.tolist()
    if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence):
        raise InvalidArgumentError(
            f"{where}: {what} must be a sequence with one list of ranks per rank, got {type(lists).__name__}"
        )
    n = len(lists)
    if n < 1:
        raise InvalidArgumentError(f"{where}: {what} must hold one list per rank, got an empty sequence")
    out: list[list[int]] = [[] for _ in range(n)]
    for owner, ranks in enumerate(lists):
        for peer in check_rank_list(where, what, ranks, owner, n):
            out[peer].append(owner)  # owners ascend, so every result list is sorted
    return out


def infer_sources(dst_ranks_of_every_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every rank's sources (sorted ascending) given every rank's destinations: ``j`` is a source of
    ``i`` iff ``i`` is in ``dst_ranks_of_every_rank[j]``. Lists must hold distinct ranks in
    ``[0, n)`` other than their owner, ``n = len(dst_ranks_of_every_rank)``."""
    return _transpose(fn("infer_sources"), "dst_ranks", dst_ranks_of_every_rank)


def infer_destinations(src_ranks_of_every_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every rank's destinations (sorted ascending) given every rank's sources; the inverse of
    :func:`infer_sources`."""
    return _transpose(fn("infer_destinations"), "src_ranks", src_ranks_of_every_rank)
