"""The topology check of the neighbor ops (BlueFog paper §VI-C): one small exchange before the data moves.

Every rank contributes one int64 row, met through the rendezvous store (lowband.comm.agree.exchange): the op, the
tensor's dtype and shape, and one slot per rank of the group holding two bits, "I send to you" and "I
receive from you", plus two flags saying which of the two sets the rank knows (a push-only call knows
whom it sends to but not whom it receives from; a pull-only call the reverse). From the table every rank
computes the same edge set, so on any inconsistency every rank raises the same
:class:`CollectiveMismatchError` naming the ranks and the direction, instead of hanging in a receive that
no one will match.

Edge ``j -> i`` exists iff ``j`` says it sends to ``i`` (when ``j`` knows its sends), else iff ``i`` says it
receives from ``j`` (when ``i`` knows its receives), else not. When both know, both must agree.

The row *is* a :mod:`lowband.comm.validate` signature (the slots are its op-specific ints), exchanged by
:func:`lowband.comm.agree.exchange` and compared by :func:`lowband.comm.validate.check_rows` like a
collective's, so a rank calling a neighbor op while another calls a checked collective or an
:func:`~lowband.comm.agree.agree` gets a clean error naming both, never a size mismatch inside gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowband.comm import agree, validate
from lowband.decentral.peers import Peers
from lowband.errors import CollectiveMismatchError
from lowband.group import Group

SENDS, RECVS = 1, 2  # bits of a peer slot
KNOWS_SENDS, KNOWS_RECVS = 1, 2  # flags in the argument field
_MAX_LISTED = 8


def make_row(op: str, dtype: torch.dtype, shape: Sequence[int], peers: Peers, size: int) -> torch.Tensor:
    """This rank's row: a :func:`lowband.comm.validate.signature` of the op, dtype and shape whose
    argument holds the knowledge flags and whose ``size`` extra ints are the send/receive slots."""
    flags = (KNOWS_SENDS if peers.send is not None else 0) | (KNOWS_RECVS if peers.recv is not None else 0)
    slots = [0] * size
    for j in peers.send or {}:
        slots[j] |= SENDS
    for j in peers.recv or {}:
        slots[j] |= RECVS
    return validate.signature(op, dtype, [int(d) for d in shape], flags, slots, size)


def exchange(
    op: str, g: Group, row: torch.Tensor, timeout: float, *, vary_dim0: bool = False
) -> list[list[int]]:
    """Every rank's row, met through the rendezvous store (bounded wait), and check that the ranks
    called the same op with the same dtype and shape (only the first dimension may differ if
    ``vary_dim0``): every rank raises the same :class:`CollectiveMismatchError` otherwise."""
    rows = agree.exchange(g, row, f"lowband.{op} on rank {g.world_rank} (topology check)", timeout)
    validate.check_rows(op, g, torch.tensor(rows, dtype=torch.int64, device="cpu"), vary_dim0=vary_dim0)
    return rows


@dataclass(frozen=True)
class Links:
    """The resolved edges of one rank: whom it sends to and receives from (ascending), and every rank's
    first dimension (for an allgather of uneven sizes; a 0-d tensor counts as 1)."""

    send: list[int]
    recv: list[int]
    dim0: list[int]


def resolve(where: str, ranks: Sequence[int], me: int, rows: list[list[int]]) -> Links:
    """Resolve this rank's edges from a table that :func:`exchange` checked (pure; the same verdict on
    every rank).

    ``ranks``: world rank of each group rank (for messages); ``me``: this rank in the group. Raises
    :class:`CollectiveMismatchError` when a rank sends to one that does not receive from it, or the
    reverse.
    """
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
