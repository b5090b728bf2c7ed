"""Cross-rank agreement: every rank learns whether all ranks of a group hold the same small values.

:func:`agree` is the one mechanism for "every rank must have passed the same thing" (a model's layer
layout, a schedule, a window's signature): every rank contributes a row of int64, the ranks meet
through the rendezvous store (bounded wait), and every rank raises the same
:class:`CollectiveMismatchError`, naming what differs, the differing values and the ranks.

:func:`exchange` (from :mod:`lowband.comm.control`) is that meeting, shared with the per-op argument
check (:mod:`lowband.comm.validate`) and the neighbor ops' topology check: it takes the group's next
op sequence number, like a checked op that was not predicted. Every row has the same length
(``HEADER + group size``) and starts with :data:`MAGIC` and an op code, so a rank agreeing on one
thing while another checks a collective gets a clean error naming both, never a size mismatch inside
gloo (which would abort the process). Only values too long for a row take one more allgather, on the
group's control process group.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Sequence

import torch

from lowband.comm.control import F_MAGIC, F_OP, HEADER, MAGIC, exchange, row_length
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group

__all__ = ["HEADER", "MAGIC", "agree", "crc", "exchange", "row_length"]

#: the op code of :func:`agree` rows (collectives use 1-99, neighbor ops 101-199)
AGREE_OP = 201
# an agree row: magic, AGREE_OP, crc(what), len(ints), crc(ints), then the ints inline when they fit
_A_WHAT, _A_LEN, _A_CRC, _A_INLINE = 2, 3, 4, 5
_MAX_SHOWN = 4


def crc(values: object) -> int:
    """A stable 31-bit hash of ``repr(values)`` (the same on every rank and run)."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


def _as_ints(where: str, ints: Sequence[int]) -> list[int]:
    try:
        vals = [int(v) for v in ints]
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{where}: the values to agree on must be ints, got {ints!r}") from exc
    if any(not -(2**63) <= v < 2**63 for v in vals):
        raise InvalidArgumentError(f"{where}: the values to agree on must fit in int64, got {vals!r}")
    return vals


def _differences(
    rows: list[list[int]], ranks: Sequence[int], fields: Sequence[str] | None
) -> tuple[list[int], str]:
    """World ranks whose values differ from the first rank's, and what differs (values shown)."""
    ref = rows[0]
    bad = [ranks[r] for r, row in enumerate(rows) if row != ref]
    first = next(r for r, row in enumerate(rows) if row != ref)
    other = rows[first]
    if len(other) != len(ref):
        return bad, f"{len(ref)} values on rank {ranks[0]} but {len(other)} on rank {ranks[first]}"
    idx = [i for i in range(len(ref)) if ref[i] != other[i]]
    parts = []
    for i in idx[:_MAX_SHOWN]:
        label = fields[i] if fields is not None and i < len(fields) else f"value {i}"
        parts.append(f"{label} is {ref[i]} on rank {ranks[0]} but {other[i]} on rank {ranks[first]}")
    more = f" (and {len(idx) - _MAX_SHOWN} more)" if len(idx) > _MAX_SHOWN else ""
    return bad, "; ".join(parts) + more


def agree(
    group: Group | None,
    what: str,
    ints: Sequence[int],
    *,
    fields: Sequence[str] | None = None,
    where: str | None = None,
) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank of ``group`` unless every rank passed equal
    ``ints`` (collective; default group: the world).

    ``what`` says what the values are ("the model's layer layout"); ``fields`` optionally names each
    value (shown in the error with the differing values and ranks); ``where`` is the caller's label
    for errors (default ``lowband.agree on rank R``). Any number of ints: up to ``7 + group size`` of
    them travel in one store meeting, more in an allgather when (and only when) their hashes differ.
    Independent of the per-op check setting: it is the check.
    """
    from lowband.runtime import world_group

    ctx, g = world_group(group, "agree")
    at = where if where is not None else f"lowband.agree on rank {ctx.rank}"
    if not isinstance(what, str):
        raise InvalidArgumentError(f"{at}: what must be a str, got {type(what).__name__}")
    vals = _as_ints(at, ints)
    if g.size == 1:
        return
    n = row_length(g)
    row = [0] * n
    row[F_MAGIC], row[F_OP] = MAGIC, AGREE_OP
    row[_A_WHAT], row[_A_LEN], row[_A_CRC] = crc(what), len(vals), crc(vals)
    inline = len(vals) <= n - _A_INLINE
    if inline:
        row[_A_INLINE : _A_INLINE + len(vals)] = vals
    rows = exchange(
        g, torch.tensor(row, dtype=torch.int64, device="cpu"), at, ctx.config.timeout, label="agreement"
    )
    for r, other in enumerate(rows):
        if other[F_MAGIC] != MAGIC or other[F_OP] != AGREE_OP:
            from lowband.comm.validate import describe

            raise CollectiveMismatchError(
                f"{at}: rank {g.ranks[r]} of group {g.name!r} called {describe(other)} while this rank "
                f"agrees on {what}"
            )
        if other[_A_WHAT] != row[_A_WHAT]:
            raise CollectiveMismatchError(
                f"{at}: ranks of group {g.name!r} agree on different things: this rank on {what}, "
                f"rank {g.ranks[r]} on something else"
            )
    if all(other == rows[0] for other in rows):
        return
    if inline or any(other[_A_LEN] != rows[0][_A_LEN] for other in rows):
        # every value is in the table (or the counts differ): the same verdict on every rank
        table = [
            other[_A_INLINE : _A_INLINE + other[_A_LEN]] if inline else [other[_A_LEN]] for other in rows
        ]
        names = fields if inline else ["the number of values"]
    else:
        # same count, different hashes: one more allgather of the values themselves
        out = torch.empty(g.size * len(vals), dtype=torch.int64, device="cpu")
        try:
            g.control_pg._allgather_base(out, torch.tensor(vals, dtype=torch.int64, device="cpu")).wait(
                datetime.timedelta(seconds=ctx.config.timeout)
            )
        except RuntimeError as exc:
            from lowband.comm.handle import comm_error

            raise comm_error(f"{at} (agreement)", exc, ctx.config.timeout) from exc
        table = out.view(g.size, len(vals)).tolist()
        names = fields
    bad, detail = _differences(table, g.ranks, names)
    raise CollectiveMismatchError(f"{at}: ranks {bad} differ from rank {g.ranks[0]} in {what}: {detail}")
