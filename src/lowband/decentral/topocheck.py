"""The topology check of the neighbor ops (BlueFog paper §VI-C): one small exchange before the data moves.

Every rank contributes one int64 row to an allgather on the group's control process group: the op, the
tensor's dtype and shape, and one slot per rank of the group holding two bits, "I send to you" and "I
receive from you", plus two flags saying which of the two sets the rank knows (a push-only call knows
whom it sends to but not whom it receives from; a pull-only call the reverse). From the table every rank
computes the same edge set, so on any inconsistency every rank raises the same
:class:`CollectiveMismatchError` naming the ranks and the direction, instead of hanging in a receive that
no one will match.

Edge ``j -> i`` exists iff ``j`` says it sends to ``i`` (when ``j`` knows its sends), else iff ``i`` says it
receives from ``j`` (when ``i`` knows its receives), else not. When both know, both must agree.

The row has the same length and header layout as :mod:`lowband.comm.validate`'s signatures (12 + group
size int64), so a rank calling a neighbor op while another calls a checked collective gets a clean error
instead of a size mismatch inside gloo.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowband.comm import validate
from lowband.decentral.peers import Peers
from lowband.errors import CollectiveMismatchError
from lowband.group import Group

#: the same magic as lowband.comm.validate's signatures (rows of both checks are comparable)
MAGIC = 0x10BA
OP_CODES: dict[str, int] = {
    "neighbor_allreduce": 101,
    "grouped_neighbor_allreduce": 102,
    "neighbor_allgather": 103,
    "hierarchical_neighbor_allreduce": 104,
}
_OP_NAMES = {**{v: k for k, v in validate.OP_CODES.items()}, **{v: k for k, v in OP_CODES.items()}}
SENDS, RECVS = 1, 2  # bits of a peer slot
KNOWS_SENDS, KNOWS_RECVS = 1, 2  # flags in the argument field
_MAX_DIMS = 6
_MAX_LISTED = 8


def _hash(values: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(values)).encode()) & 0x7FFFFFFF


def make_row(op: str, dtype: torch.dtype, shape: Sequence[int], peers: Peers, size: int) -> torch.Tensor:
    """This rank's row: header (op, dtype, shape, knowledge flags) and one send/receive slot per rank."""
    dims = [int(d) for d in shape]
    flags = (KNOWS_SENDS if peers.send is not None else 0) | (KNOWS_RECVS if peers.recv is not None else 0)
    head = [MAGIC, OP_CODES[op], validate.DTYPE_CODES[dtype], len(dims)]
    head += [dims[i] if i < len(dims) else -1 for i in range(_MAX_DIMS)]
    head += [_hash(dims[_MAX_DIMS:]), flags]
    slots = [0] * size
    for j in peers.send or {}:
        slots[j] |= SENDS
    for j in peers.recv or {}:
        slots[j] |= RECVS
    return torch.tensor(head + slots, dtype=torch.int64)


def exchange(op: str, g: Group, row: torch.Tensor, timeout: float) -> list[list[int]]:
    """Allgather every rank's row on the control process group (bounded wait)."""
    rows: list[list[int]] = validate.exchange(g, row, timeout).tolist()
    return rows


def describe(row: Sequence[int]) -> str:
    """What a row says the rank called, e.g. ``neighbor_allreduce of a float32 tensor of shape (3, 4)``."""
    op = _OP_NAMES.get(row[validate.F_OP], "an unknown op")
    nd = row[validate.F_NDIM]
    dims = [row[validate.F_DIM0 + i] for i in range(min(max(nd, 0), _MAX_DIMS))]
    if op == "grouped_neighbor_allreduce":
        return f"{op} of a list of {dims[0] if dims else '?'} tensors"
    shape = (
        "(" + ", ".join(map(str, dims)) + (", ..." if nd > _MAX_DIMS else "") + ("," if nd == 1 else "") + ")"
    )
    dt = str(validate.CODE_DTYPES.get(row[validate.F_DTYPE], "?")).replace("torch.", "")
    return f"{op} of a {dt} tensor of shape {shape}"


@dataclass(frozen=True)
class Links:
    """The resolved edges of one rank: whom it sends to and receives from (ascending), and every rank's
    first dimension (for an allgather of uneven sizes; a 0-d tensor counts as 1)."""

    send: list[int]
    recv: list[int]
    dim0: list[int]


def _agree(where: str, ranks: Sequence[int], rows: list[list[int]], vary_dim0: bool) -> None:
    ref = rows[0]
    for r, row in enumerate(rows):
        if row[0] != MAGIC or row[validate.F_OP] != ref[validate.F_OP]:
            other = describe(row) if row[0] == MAGIC else "an op without a lowband signature"
            raise CollectiveMismatchError(
                f"{where}: ranks called different ops: rank {ranks[0]} called {describe(ref)}, "
                f"rank {ranks[r]} called {other}"
            )
        diff = []
        if row[validate.F_DTYPE] != ref[validate.F_DTYPE]:
            diff.append("dtype")
        lo = validate.F_DIM0 + 1 if vary_dim0 else validate.F_DIM0
        if (
            row[validate.F_NDIM] != ref[validate.F_NDIM]
            or row[lo : validate.F_ARG] != ref[lo : validate.F_ARG]
        ):
            diff.append("shape")
        if diff:
            raise CollectiveMismatchError(
                f"{where}: {'/'.join(diff)} differ across ranks: rank {ranks[0]} called {describe(ref)}, "
                f"rank {ranks[r]} called {describe(row)}"
            )


def resolve(
    where: str, ranks: Sequence[int], me: int, rows: list[list[int]], *, vary_dim0: bool = False
) -> Links:
    """Check the table and resolve this rank's edges (pure; the same verdict on every rank).

    ``ranks``: world rank of each group rank (for messages); ``me``: this rank in the group. Raises
    :class:`CollectiveMismatchError` when ops, dtypes or shapes differ (only the first dimension may
    differ if ``vary_dim0``) or when a rank sends to one that does not receive from it, or the reverse.
    """
    _agree(where, ranks, rows, vary_dim0)
    n = len(rows)
    h = validate.HEADER
    knows_send = [bool(row[validate.F_ARG] & KNOWS_SENDS) for row in rows]
    knows_recv = [bool(row[validate.F_ARG] & KNOWS_RECVS) for row in rows]
    problems: list[str] = []

    def edge(j: int, i: int) -> bool:
        sends = bool(rows[j][h + i] & SENDS)
        recvs = bool(rows[i][h + j] & RECVS)
        if knows_send[j] and knows_recv[i] and sends != recvs:
            if sends:
                problems.append(
                    f"rank {ranks[j]} sends to rank {ranks[i]} but rank {ranks[i]} does not receive from rank {ranks[j]}"
                )
            else:
                problems.append(
                    f"rank {ranks[i]} receives from rank {ranks[j]} but rank {ranks[j]} does not send to rank {ranks[i]}"
                )
        if knows_send[j]:
            return sends
        return recvs if knows_recv[i] else False

    table = [[i != j and edge(j, i) for i in range(n)] for j in range(n)]
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CollectiveMismatchError(
            f"{where}: the ranks' send and receive sets do not match: "
            + "; ".join(problems[:_MAX_LISTED])
            + more
        )
    dim0 = [1 if row[validate.F_NDIM] == 0 else row[validate.F_DIM0] for row in rows]
    return Links(
        send=[i for i in range(n) if table[me][i]],
        recv=[j for j in range(n) if table[j][me]],
        dim0=dim0,
    )
