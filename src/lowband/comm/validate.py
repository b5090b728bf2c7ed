"""Argument checks: local ones (types, dtypes, ranks) and the cross-rank check of every collective.

gloo aborts the whole process (``terminate called after throwing gloo::EnforceNotMet``) when ranks
pass buffers of different sizes to one collective. The cross-rank check prevents that: the ranks
compare small int64 signatures (op, dtype, shape, root/op argument, split sizes), and every rank that
would otherwise issue mismatched data raises :class:`CollectiveMismatchError` naming the ranks and
the values that differ. ``lowband.init(check=False)`` (or ``LOWBAND_CHECK=0``, or
:meth:`Group.unchecked`) turns it off. Ops that need the other ranks' sizes anyway (allgather without
``sizes``, alltoall without ``recv_splits``) always meet the other ranks and read the sizes there.

No message at all per op in the steady state (:func:`check`). Every rank keeps, per group, the
verified tables (every rank's signature at one op) in a successor map: "after table A came table B".
The map changes only when every rank has read the same verified table, so it is the same on every
rank, and so is the prediction ``P`` of the next table (the successor of the last one). Each checked
op has a sequence number ``s``, the same on every rank while the calls agree. Per op:

* predicted path: a rank whose signature is its row of ``P`` issues the data op at once, with the
  sizes ``P`` gives, and sends nothing; it remembers ``(s, P)`` until the op's data completes;
* deviating path: any other rank (every rank, when there is no prediction, or for an agreement)
  publishes its row under ``s/rank`` in the rendezvous store (a prefix per group) and waits (bounded)
  for every rank's row at ``s``, then checks the table as a whole;
* a predicted rank whose data is late looks (50 ms, doubling to 0.5 s) in the store at each of its
  remembered ops; where another rank published, it publishes its own row (marked FAST) and raises if
  a published row is not its rank's row of ``P``. A deviating rank looks likewise while it waits.

Why this is safe. A data op is issued only (a) on the predicted path, where every rank that issues
issues ``P``'s op at ``s``, or (b) after reading every rank's row at ``s``: with no FAST row, no rank
issued data at ``s`` and every rank read the same table and decides alike; with a FAST row, only if
the table is ``P`` (a rank that needed the sizes while the others had them). So no two ranks ever
issue different sizes at one ``s``. Liveness: a deviating rank waits for rows that the predicted ranks
publish when their data (which cannot complete without it) is late, and a FAST row next to a row
that is not ``P``'s is a mismatch every rank that sees it raises at once, marking the group unusable
(a data op is left pending: every later op on it raises, never issuing data gloo could pair with it).
A predicted rank that never waits on the group again answers nobody: the deviating rank then gets a
:class:`CommTimeoutError` after the timeout. Keys are deleted once every rank has read them (a
counter per ``s``); after a mismatch or a timeout they stay (a few per broken group).

The steady state sends nothing beyond the data; a deviating op costs a few store round trips. A
rank's local argument errors are raised before anything is published.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowband.comm import control
from lowband.comm.agree import AGREE_OP
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group

OP_CODES: dict[str, int] = {
    "allreduce": 1, "broadcast": 2, "allgather": 3, "alltoall": 4, "reduce_scatter": 5,
    "grouped_allreduce": 6, "send": 7, "barrier": 8,
    "neighbor_allreduce": 101, "grouped_neighbor_allreduce": 102, "neighbor_allgather": 103,
    "hierarchical_neighbor_allreduce": 104, "agree": AGREE_OP,
}  # fmt: skip

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(DTYPES)}
CODE_DTYPES = {i: dt for dt, i in DTYPE_CODES.items()}

REDUCE_OPS = ("sum", "average", "min", "max", "product")

_MAGIC = control.MAGIC
_MAX_DIMS = 6
HEADER = control.HEADER  # magic, op, dtype, ndim, 6 dims, hash of the rest of the shape, argument
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
    if t.device.type == "meta":
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} is on the meta device (it has no data to send)"
        )
    if t.dtype not in DTYPE_CODES:
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} has unsupported dtype {t.dtype}; supported: "
            + ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        )
    return t


#: the device types each torch backend moves (gloo: CUDA tensors staged through host memory)
_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",)}
#: device types in signatures: a rank calling with a CUDA tensor while another passes a CPU one is a
#: mismatch (the two would go to different backends of a ``cpu:gloo,cuda:nccl`` group and hang)
DEVICE_CODES = {"cpu": 0, "cuda": 1}
_DEVICE_STEP = 1000


def backend_devices(backend: str) -> set[str]:
    """The device types a process group's backend string (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``)
    can communicate; unknown backends (a user's or an emulator's) are trusted with everything."""
    out: set[str] = set()
    for part in backend.lower().split(","):
        dev, _, name = part.rpartition(":")
        if name not in _BACKEND_DEVICES:
            return {"cpu", "cuda", "meta"}
        out |= {dev} if dev else set(_BACKEND_DEVICES[name])
    return out


#: per process group: (its backend's name, the device types it moves); weak, so a destroyed group's
#: sockets are not kept alive
_SERVED: weakref.WeakKeyDictionary[Any, tuple[str, set[str]]] = weakref.WeakKeyDictionary()


def _served(pg: Any) -> tuple[str, set[str]]:
    try:
        got = _SERVED.get(pg)
    except TypeError:  # not weakly referable
        got = None
    if got is None:
        import torch.distributed as dist

        try:
            backend = str(dist.get_backend(pg))
        except (RuntimeError, ValueError, AttributeError):
            backend = "?"  # a group torch does not know by name (thread ranks' own gloo groups): trusted
        got = (backend, backend_devices(backend))
        try:
            _SERVED[pg] = got
        except TypeError:  # not weakly referable: looked up again next time
            pass
    return got


def served_devices(pg: Any) -> set[str]:
    """The device types process group ``pg``'s backend moves (every type for a group torch does not
    know by name)."""
    return _served(pg)[1]


def check_device(op: str, rank: int, g: object, t: torch.Tensor, what: str = "tensor") -> None:
    """``t``'s device type must be one the group's data backend moves (a CPU tensor on an NCCL-only
    group, a tensor on a device no backend of the group serves), before anything is sent."""
    pg = getattr(g, "pg", None)
    if pg is None:
        return
    backend, devs = _served(pg)
    if t.device.type not in devs:
        name = getattr(g, "name", "?")
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} is on {t.device} but group {name!r} has backend "
            f"{backend!r}, which does not move {t.device.type} tensors; move it (tensor.to(lowband.device()) "
            "for the data group) or use a group whose backend serves that device"
        )


def dtype_code(dtype: torch.dtype, device: torch.device | None = None) -> int:
    """The signature's dtype field: the dtype and the device type together."""
    dev = DEVICE_CODES.get(device.type, 9) if device is not None else 0
    return DTYPE_CODES[dtype] + _DEVICE_STEP * dev


def describe_dtype(code: int) -> str:
    dt = str(CODE_DTYPES.get(code % _DEVICE_STEP, "?")).replace("torch.", "")
    dev = {v: k for k, v in DEVICE_CODES.items()}.get(code // _DEVICE_STEP, "another device")
    return dt if code // _DEVICE_STEP == 0 else f"{dt} {dev}"


def overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded tensor, overlapping strides)."""
    dims = sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1)
    reach = 0  # the largest offset the smaller-stride dimensions reach
    for st, n in dims:
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def ints_arg(op: str, rank: int, what: str, values: object) -> list[int]:
    """A sequence of ints (Python or integer-valued tensors/NumPy ints; no floats, no bools)."""
    import operator

    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | torch.Tensor):
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what} must be a sequence of ints, got {type(values).__name__}"
        )
    out = []
    for x in values:
        try:
            if isinstance(x, bool):
                raise TypeError
            out.append(operator.index(x))
        except TypeError:
            raise InvalidArgumentError(
                f"lowband.{op} on rank {rank}: {what} must hold ints, got {x!r} in {list(values)!r}"
            ) from None
    return out


def check_splits(op: str, rank: int, what: str, splits: object, p: int, total: int | None) -> list[int]:
    """``p`` non-negative ints (see :func:`ints_arg`), summing to ``total`` unless it is None."""
    s = ints_arg(op, rank, what, splits)
    if len(s) != p or any(x < 0 for x in s) or (total is not None and sum(s) != total):
        need = f" summing to {total}" if total is not None else ""
        raise InvalidArgumentError(
            f"lowband.{op} on rank {rank}: {what}={s} must be {p} non-negative ints{need}"
        )
    return s


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


def signature_row(
    op: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    arg: int,
    extras: Sequence[int],
    group_size: int,
    device: torch.device | None = None,
) -> list[int]:
    """The int64 signature one rank contributes: HEADER fields then ``group_size`` op-specific ints
    (the dtype field carries the tensor's device type too: :func:`dtype_code`)."""
    dims = [int(d) for d in shape]
    row = [_MAGIC, OP_CODES[op], dtype_code(dtype, device), len(dims)]
    row += [dims[i] if i < len(dims) else -1 for i in range(_MAX_DIMS)]
    row += [_shape_hash(dims[_MAX_DIMS:]), arg]
    row += [int(x) for x in extras]
    row += [0] * (HEADER + group_size - len(row))
    return row


def signature(
    op: str, dtype: torch.dtype, shape: Sequence[int], arg: int, extras: Sequence[int], group_size: int
) -> torch.Tensor:
    """:func:`signature_row` as a tensor."""
    return torch.tensor(
        signature_row(op, dtype, shape, arg, extras, group_size), dtype=torch.int64, device="cpu"
    )


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
    dt = describe_dtype(row[F_DTYPE])
    return f"{op} of a {dt} tensor of shape {shape}" + (_arg_text(op, row[F_ARG]) if args else "")


def check(
    op: str,
    g: Group,
    sig: list[int],
    timeout: float,
    *,
    vary_dim0: bool = False,
    arg_name: str | None = None,
    needs_table: bool = False,
    fits: Callable[[control.Table], bool] | None = None,
) -> tuple[Sequence[Sequence[int]], control.Prediction | None]:
    """The cross-rank check of one op (see the module docstring): ``(table, guard)``.

    ``table`` holds every rank's signature (read sizes from it); ``guard`` is None when the ranks met
    in the store, else what the op's handle must watch its data works with (``make_handle(guard=)``).
    ``needs_table``: this rank needs the others' sizes, so it always meets them. ``fits(predicted
    table)``: whether a prediction agrees with this rank's other arguments (sizes it was given); if
    not, the rank meets the others. Raises :class:`CollectiveMismatchError` on every rank when the
    calls do not fit together.
    """
    where = f"lowband.{op} on rank {g.world_rank}"
    st = control.state_of(g)
    st.usable(where)
    node = st.prediction()
    if node is not None and not needs_table and node.mine == tuple(sig) and (fits is None or fits(node.rows)):
        return node.rows, control.Prediction(st, st.predicted_op(node, where), g)
    seq = st.take_seq()
    rows = st.meet(g, seq, sig, where, timeout)
    table = control.normalized(rows)
    fast = any(r[control.F_MAGIC] == control.FAST for r in rows)
    if fast and (node is None or table != node.rows):
        # some ranks issued the predicted op's data and the table is not the prediction
        raise st.fail(control.mismatch(where, g, dict(enumerate(rows))))
    st.read_done(seq, g.size)  # with FAST rows, only when they are let go on (the table is P)
    if not fast and (node is None or table != node.rows):
        check_rows(op, g, rows, vary_dim0=vary_dim0, arg_name=arg_name)
    st.advance(table, g.rank)
    return table, None


def check_rows(
    op: str,
    group: Group,
    table: torch.Tensor | list[list[int]],
    *,
    vary_dim0: bool = False,
    arg_name: str | None = None,
    extras_must_match: bool = False,
) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank if the signatures do not fit together.

    ``vary_dim0``: the first dimension may differ (allgather). ``arg_name``: the argument slot must be
    equal (a root, a reduce op). ``extras_must_match``: the op-specific ints must be equal.
    """
    rows = table.tolist() if isinstance(table, torch.Tensor) else table
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
        if row[F_DTYPE] % _DEVICE_STEP != ref[F_DTYPE] % _DEVICE_STEP:
            diff.append("dtype")
        if row[F_DTYPE] // _DEVICE_STEP != ref[F_DTYPE] // _DEVICE_STEP:
            diff.append("device")
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
