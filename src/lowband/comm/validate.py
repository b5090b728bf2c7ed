"""Argument checks: local ones (types, dtypes, ranks) and the cross-rank agreement check.

gloo aborts the whole process (``terminate called after throwing gloo::EnforceNotMet``) when ranks
pass buffers of different sizes to one collective. The agreement check prevents that: before the op,
every rank contributes a small int64 signature (op, dtype, shape, root/op arguments, split sizes) to
one allgather, and every rank raises the same :class:`CollectiveMismatchError` naming the ranks that
differ. It costs one small collective per op; ``lowband.init(check=False)`` (or ``LOWBAND_CHECK=0``)
turns it off. Ops that need the other ranks' sizes anyway (allgather of uneven sizes, alltoall with
unknown receive splits) always exchange the signature and get the check for free.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from lowband.comm import agree as _agree
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group

OP_CODES: dict[str, int] = {
    "allreduce": 1, "broadcast": 2, "allgather": 3, "alltoall": 4, "reduce_scatter": 5,
    "grouped_allreduce": 6, "send": 7, "barrier": 8,
    "neighbor_allreduce": 101, "grouped_neighbor_allreduce": 102, "neighbor_allgather": 103,
    "hierarchical_neighbor_allreduce": 104, "agree": _agree.AGREE_OP,
}  # fmt: skip

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(DTYPES)}
CODE_DTYPES = {i: dt for dt, i in DTYPE_CODES.items()}

REDUCE_OPS = ("sum", "average", "min", "max", "product")

_MAGIC = _agree.MAGIC
_MAX_DIMS = 6
HEADER = _agree.HEADER  # magic, op, dtype, ndim, 6 dims, hash of the rest of the shape, argument
F_OP, F_DTYPE, F_NDIM, F_DIM0, F_HASH, F_ARG = 1, 2, 3, 4, 10, 11


def check_tensor(op: str, rank: int, t: object, what: str = "tensor") -> torch.Tensor:
    """A dense tensor of a dtype lowband can communicate, or a clear error."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} must be a torch.Tensor, got {type(t).__name__}"
        )
    if t.layout != torch.strided:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} must be a dense tensor, got layout {t.layout}"
        )
    if t.dtype not in DTYPE_CODES:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} has unsupported dtype {t.dtype}; supported: "
            + ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        )
    return t


def check_reduce_op(op: str, rank: int, reduce_op: object, dtype: torch.dtype) -> str:
    if reduce_op not in REDUCE_OPS:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: op must be one of {REDUCE_OPS}, got {reduce_op!r}"
        )
    assert isinstance(reduce_op, str)
    if reduce_op == "average" and not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: op='average' needs a floating-point tensor, got {dtype}; use op='sum'"
        )
    if dtype == torch.bool and reduce_op in ("sum", "product"):
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: op={reduce_op!r} is not defined for bool tensors"
        )
    return reduce_op


def _shape_hash(dims: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(dims)).encode()) & 0x7FFFFFFF


def signature(
    op: str, dtype: torch.dtype, shape: Sequence[int], arg: int, extras: Sequence[int], group_size: int
) -> torch.Tensor:
    """The int64 signature one rank contributes: HEADER fields then ``group_size`` op-specific ints."""
    sig = torch.zeros(HEADER + group_size, dtype=torch.int64)
    dims = list(shape)
    head = [_MAGIC, OP_CODES[op], DTYPE_CODES[dtype], len(dims)]
    head += [dims[i] if i < len(dims) else -1 for i in range(_MAX_DIMS)]
    head += [_shape_hash(dims[_MAX_DIMS:]), arg]
    sig[:HEADER] = torch.tensor(head, dtype=torch.int64)
    if extras:
        sig[HEADER : HEADER + len(extras)] = torch.tensor(list(extras), dtype=torch.int64)
    return sig


def _arg_text(op: str, arg: int) -> str:
    if op in ("allreduce", "reduce_scatter", "grouped_allreduce"):
        return f" with op={REDUCE_OPS[arg]!r}" if 0 <= arg < len(REDUCE_OPS) else f" with op #{arg}"
    if op == "broadcast":
        return f" from root {arg}"
    return ""


def describe(row: list[int], args: bool = False) -> str:
    """What a signature row says its rank called, e.g. ``allreduce of a float32 tensor of shape
    (3, 4)``; with ``args``, also the op's argument (`` with op='sum'``, `` from root 1``)."""
    inv = {v: k for k, v in OP_CODES.items()}
    op = inv.get(row[F_OP], f"op #{row[F_OP]}")
    if op == "agree":
        return "lowband.agree (a cross-rank agreement)"
    if op in ("grouped_allreduce", "grouped_neighbor_allreduce"):
        text = f"{op} of {row[F_DIM0]} tensors (layout hash {row[F_HASH]})"
        return text + (_arg_text(op, row[F_ARG]) if args else "")
    nd = row[F_NDIM]
    dims = [row[F_DIM0 + i] for i in range(min(max(nd, 0), _MAX_DIMS))]
    more = f", ... ({nd} dims, hash {row[F_HASH]})" if nd > _MAX_DIMS else ""
    shape = "(" + ", ".join(map(str, dims)) + more + ("," if nd == 1 else "") + ")"
    dt = str(CODE_DTYPES.get(row[F_DTYPE], "?")).replace("torch.", "")
    return f"{op} of a {dt} tensor of shape {shape}" + (_arg_text(op, row[F_ARG]) if args else "")


def exchange(group: Group, sig: torch.Tensor, timeout: float) -> torch.Tensor:
    """Allgather every rank's signature: a ``[group.size, len(sig)]`` int64 table."""
    op = {v: k for k, v in OP_CODES.items()}.get(int(sig[F_OP]), "op")
    rows = _agree.exchange(group, sig, f"lowband.{op} on rank {group.world_rank} (argument check)", timeout)
    return torch.tensor(rows, dtype=torch.int64)


def check_rows(
    op: str,
    group: Group,
    table: torch.Tensor,
    *,
    vary_dim0: bool = False,
    arg_name: str | None = None,
    extras_must_match: bool = False,
) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank if the signatures do not fit together.

    ``vary_dim0``: the first dimension may differ (allgather). ``arg_name``: the argument slot must be
    equal (a root, a reduce op). ``extras_must_match``: the op-specific ints must be equal.
    """
    rows = table.tolist()
    me = group.rank
    ref = rows[0]
    for r, row in enumerate(rows):
        if row[0] != _MAGIC:
            raise CollectiveMismatchError(
                f"lowband.{op} on rank {group.world_rank}: rank {group.ranks[r]} sent no lowband signature "
                f"(is it running with check=False, or calling a different op?)"
            )
        diff: list[str] = []
        if row[F_OP] != ref[F_OP]:
            diff.append("op")
        if row[F_DTYPE] != ref[F_DTYPE]:
            diff.append("dtype")
        lo = F_DIM0 + 1 if vary_dim0 else F_DIM0
        if row[F_NDIM] != ref[F_NDIM] or row[lo:F_ARG] != ref[lo:F_ARG]:
            diff.append("shape")
        if arg_name is not None and row[F_ARG] != ref[F_ARG]:
            diff.append(arg_name)
        if extras_must_match and row[HEADER:] != ref[HEADER:]:
            diff.append("sizes")
        if diff:
            a = "op" in diff or (arg_name is not None and arg_name in diff)
            raise CollectiveMismatchError(
                f"lowband.{op} on rank {group.world_rank} (group {group.name!r}): {'/'.join(diff)} differ "
                f"across ranks: rank {group.ranks[0]} called {describe(ref, a)}, rank {group.ranks[r]} called "
                f"{describe(row, a)}" + (f" (this rank: {describe(rows[me], a)})" if me not in (0, r) else "")
            )
