"""Byte models of the globally sparse reducers (pure): what one rank sends and receives for one unit of
``d`` elements, as lowband's byte counters record it (the logical traffic of the algorithms; the bench
compares the kernel's interface counters, headers included, against it).

- gs-SGD: the tree moves whole sketches (``rows * cols`` values): rank ``r`` sends and receives
  :meth:`TreeSchedule.counts` sketches; with ``reduce="allreduce"`` a ring allreduce of the sketch
  (``2 (P-1)/P`` sketches each way). Then a ring allreduce of ``m = ceil(oversample * k)`` values.
- Sketched-SGD: every rank but 0 sends one sketch and rank 0 receives ``P - 1``; rank 0 broadcasts
  ``m`` indices (``(P-1) m`` sent by rank 0); the ``m`` values go to rank 0 and back (star).
- gTop-k: the tree with ``k`` (index, value) pairs per message.
"""

from __future__ import annotations

from lowband.comm.reduce import ring_bytes
from lowband.compress.heavymix import candidates
from lowband.compress.tree import TreeSchedule, star_schedule, tree_schedule


def index_bytes(d: int) -> int:
    """Bytes of one index on the wire (int32 below ``2**31`` elements)."""
    return 4 if d < 2**31 else 8


def schedule_bytes(s: TreeSchedule, rank: int, message: int, *, broadcast: bool = True) -> tuple[int, int]:
    """``(sent, received)`` bytes of ``rank`` running ``s`` over messages of ``message`` bytes."""
    rs, rr, bs, br = s.counts(rank)
    if not broadcast:
        bs = br = 0
    return (rs + bs) * message, (rr + br) * message


def gs_sgd_bytes(
    d: int,
    size: int,
    rank: int,
    *,
    k: int,
    rows: int,
    cols: int,
    itemsize: int = 4,
    reduce: str = "tree",
    oversample: float = 1.0,
) -> tuple[int, int]:
    sketch = rows * cols * itemsize
    if reduce == "tree":
        sent, recv = schedule_bytes(tree_schedule(size), rank, sketch)
    else:
        sent = recv = ring_bytes(sketch, size)
    second = ring_bytes(candidates(k, oversample, d) * itemsize, size)
    return sent + second, recv + second


def sketched_sgd_bytes(
    d: int, size: int, rank: int, *, k: int, rows: int, cols: int, itemsize: int = 4, oversample: float = 1.0
) -> tuple[int, int]:
    star = star_schedule(size)
    m = candidates(k, oversample, d)
    s1, r1 = schedule_bytes(star, rank, rows * cols * itemsize, broadcast=False)
    idx = m * index_bytes(d)
    s2, r2 = ((size - 1) * idx, 0) if rank == 0 else (0, idx if size > 1 else 0)
    s3, r3 = schedule_bytes(star, rank, m * itemsize)
    return s1 + s2 + s3, r1 + r2 + r3


def gtopk_bytes(d: int, size: int, rank: int, *, k: int, itemsize: int = 4) -> tuple[int, int]:
    return schedule_bytes(tree_schedule(size), rank, min(k, d) * (index_bytes(d) + itemsize))
