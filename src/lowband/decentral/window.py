"""One-sided windows for asynchronous decentralized algorithms (BlueFog paper §III-C, §IV-C, §VI-B).

A *window* is a named tensor registered by every rank of a group (:func:`win_create`, collective) plus,
on each rank, one buffer per in-neighbor of a static topology. Neighbors then write into a rank's
buffers and read its tensor without that rank calling anything:

- :func:`win_put` / :func:`win_accumulate`: ``tensor * dst_weights[r]`` overwrites / is added to the
  buffer that each destination ``r`` keeps for this rank (default: every out-neighbor, weight 1); then
  ``tensor *= self_weight`` in place (default 1), as in BlueFog;
- :func:`win_get`: each source's registered tensor ``* src_weights[r]`` is fetched into this rank's
  buffer for it (default: every in-neighbor, weight 1);
- :func:`win_update`: this rank's tensor becomes ``self_weight * tensor + sum_r src_weights[r] * buffer_r``
  (default: the static topology's pull weights), :func:`win_update_then_collect`:
  ``tensor += sum_r buffer_r`` and the buffers are zeroed;
- :func:`win_mutex` / :func:`win_lock` and ``require_mutex``: the distributed mutex of each rank's window.

Each ``win_put`` / ``win_accumulate`` / ``win_get`` has a ``_nonblocking`` form returning a
:class:`~lowband.comm.handle.Handle` (:func:`win_wait`, :func:`win_poll`). Ranks in ``dst_weights`` /
``src_weights`` / ``ranks`` must be neighbors in the window's static topology.

Transport: :mod:`lowband.decentral.window_service` (a process group of its own and one receiver thread
per neighbor, which applies requests as they arrive).

Consistency model
-----------------
- *Completion means applied*: a put/accumulate/get handle is complete (its blocking form returns) once
  every destination has applied it (for get: once the data is in this rank's buffer). No destination's
  main thread takes part; a busy rank's window still receives.
- *Atomic operations*: each operation is applied under the window's lock, so it is atomic with respect
  to every other operation and to :func:`win_update`, :func:`win_update_then_collect`,
  :func:`get_win_version` and the state dict: a reader never sees half an update, and accumulate +
  update_then_collect conserve the total exactly (what makes push-sum exact). A get reads the source's
  registered tensor; the source's own in-place changes to that tensor (an optimizer step) are not
  covered by the window lock: hold ``win_mutex(name, for_self=True)`` while making them and pass
  ``require_mutex=True`` to the get to exclude torn reads.
- *Per-pair FIFO*: operations from one rank to another are applied in the order they were issued.
  Operations from different ranks interleave arbitrarily.
- *Mutex*: every rank's window has one distributed mutex, granted first come, first served.
  ``require_mutex=True`` makes an operation wait for (and hold, while it is applied) the destination's
  mutex; operations without it are applied even while someone holds the mutex. A rank that holds a
  neighbor's mutex (``win_mutex``) has its own operations to it applied at once. ``win_lock`` holds this
  rank's own mutex and holds back *every* incoming operation until it exits (their handles complete
  then). Acquire several mutexes in ascending rank order (``win_mutex`` does) to avoid deadlock.
- *Versions*: :func:`get_win_version` counts, per in-neighbor, the writes into its buffer since the last
  :func:`win_update` that read that buffer.
- *Failures*: every wait is bounded by the runtime timeout; a dead peer makes operations fail with
  :class:`CommFailedError` (or :class:`CommTimeoutError`); an error inside the service surfaces on this
  rank's next window call. A gloo timeout closes the window process group: the windows are then unusable.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lowband.comm.base import contiguous_flat, make_handle
from lowband.comm.handle import Handle, comm_error
from lowband.comm.validate import DTYPE_CODES
from lowband.decentral.mutex import WindowMutex, own_mutex, win_lock, win_mutex
from lowband.decentral.peers import check_dst, check_weight, check_weight_map
from lowband.decentral.state import check_topology_arg, load_topology
from lowband.decentral.window_service import (
    ACCUMULATE,
    GET,
    PUT,
    WindowRecord,
    check_flag,
    check_neighbors,
    check_statuses,
    lookup,
    registry,
    service_for,
    where,
)
from lowband.errors import CollectiveMismatchError, InvalidArgumentError
from lowband.group import Group
from lowband.runtime import Context, current, world_group
from lowband.topology import Topology

Tensor = torch.Tensor


def _same_tensor(at: str, rec: WindowRecord, t: object) -> Tensor:
    """``t`` (detached) if it has the window's dtype and shape, else an :class:`InvalidArgumentError`."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{at}: tensor must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != rec.data.dtype or t.shape != rec.data.shape:
        raise InvalidArgumentError(
            f"{at}: tensor is {t.dtype} {tuple(t.shape)} but the window holds {rec.data.dtype} "
            f"{tuple(rec.data.shape)}"
        )
    return t.detach()


# ---------------------------------------------------------------- create / free


def _signature(t: Tensor, name: str, topo: Topology) -> list[int]:
    dims = list(t.shape)
    crc = binascii.crc32
    return [
        DTYPE_CODES[t.dtype],
        len(dims),
        crc(repr(tuple(dims)).encode()),
        crc(name.encode()),
        crc(topo.weights.tobytes()),
    ]


def _agree(ctx: Context, g: Group, at: str, sig: list[int]) -> None:
    """Allgather every rank's window signature on ``g``'s control group; every rank raises the same
    :class:`CollectiveMismatchError` if they differ."""
    import datetime

    mine = torch.tensor(sig, dtype=torch.int64)
    out = torch.empty(g.size * mine.numel(), dtype=torch.int64)
    try:
        g.control_pg._allgather_base(out, mine).wait(datetime.timedelta(seconds=ctx.config.timeout))
    except RuntimeError as exc:
        raise comm_error(f"{at} (argument check)", exc, ctx.config.timeout) from exc
    rows = out.view(g.size, -1).tolist()
    fields = ("dtype", "shape", "shape", "name", "topology")
    for r, row in enumerate(rows):
        diff = sorted({fields[i] for i in range(len(fields)) if row[i] != rows[0][i]})
        if diff:
            raise CollectiveMismatchError(
                f"{at}: {'/'.join(diff)} differ across ranks: rank {g.ranks[0]} and rank {g.ranks[r]} "
                "called win_create with different windows (every rank must give the same name, dtype, "
                "shape and topology)"
            )


def _barrier(ctx: Context, g: Group, at: str) -> None:
    import datetime

    import torch.distributed as dist

    if g.size == 1:
        return
    try:
        g.control_pg.barrier(dist.BarrierOptions()).wait(datetime.timedelta(seconds=ctx.config.timeout))
    except RuntimeError as exc:
        raise comm_error(f"{at} (barrier)", exc, ctx.config.timeout) from exc


def win_create(
    tensor: Tensor,
    name: str,
    *,
    zero_init: bool = False,
    topology: Topology | None = None,
    group: Group | None = None,
) -> bool:
    """Register ``tensor`` as window ``name`` on every rank of ``group`` (collective; default: the world).

    The tensor itself (not a copy) is the window's registered value, read by neighbors' gets and written
    by :func:`win_update`. One buffer per in-neighbor of ``topology`` (default: the group's static
    topology, :func:`lowband.decentral.state.load_topology`) is made: a copy of ``tensor``, or zeros with
    ``zero_init``. Every rank must pass the same name, dtype, shape and topology. Returns True.
    """
    op = "win_create"
    ctx, g = world_group(group, op)
    at = where(op, ctx, name)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{where(op, ctx)}: name must be a non-empty str, got {name!r}")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise InvalidArgumentError(f"{at}: tensor must be a dense torch.Tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point or tensor.dtype not in DTYPE_CODES:
        raise InvalidArgumentError(
            f"{at}: tensor has dtype {tensor.dtype}; windows hold floating-point tensors (weights apply)"
        )
    if tensor.device.type != "cpu":
        raise InvalidArgumentError(f"{at}: tensor is on {tensor.device}; windows live on the CPU")
    zero_init = check_flag(at, "zero_init", zero_init)
    reg = registry(ctx)
    if name in reg.by_name:
        raise InvalidArgumentError(f"{at}: a window named {name!r} already exists; free it first (win_free)")
    topo = load_topology(g) if topology is None else check_topology_arg(op, ctx, topology, g.size, "topology")
    if g.size > 1:
        _agree(ctx, g, at, _signature(tensor, name, topo))
    svc = service_for(ctx, g)
    svc.check()
    me = g.rank
    data = tensor.detach()
    ins = tuple(int(r) for r in topo.in_neighbors(me))
    rec = WindowRecord(
        name=name,
        wid=svc.next_wid,
        tensor=tensor,
        topology=topo,
        me=me,
        in_nbrs=ins,
        out_nbrs=tuple(int(r) for r in topo.out_neighbors(me)),
        buffers={r: torch.zeros_like(data) if zero_init else data.clone() for r in ins},
        versions=dict.fromkeys(ins, 0),
        mutex=WindowMutex(),
    )
    svc.next_wid += 1
    svc.register(rec)
    reg.by_name[name] = (svc, rec)
    svc.start_receivers(rec.peers)
    _barrier(ctx, g, at)  # nobody sends to a window that a neighbor has not registered yet
    return True


def win_free(name: str | None = None) -> bool:
    """Free window ``name`` (every window with ``None``) on every rank of its group (collective).

    Waits for this rank's operations in flight, then a barrier: once it returns every operation any rank
    issued on the window has been applied. When a group's last window goes, its receiver threads stop
    (a later :func:`win_create` starts them again). Returns True.
    """
    op = "win_free"
    ctx = current(op)
    reg = registry(ctx)
    names = list(reg.by_name) if name is None else [name]
    for n in names:
        _, svc, rec = lookup(op, n)
        at = where(op, ctx, n)
        if rec.held or rec.mutex.holds_local():
            raise InvalidArgumentError(
                f"{at}: this rank still holds window mutexes (ranks {sorted(rec.held)}); exit win_mutex/win_lock first"
            )
        svc.wait_pending()
        _barrier(ctx, svc.group, at)
        svc.drop(rec.wid)
        del reg.by_name[n]
        if not svc.windows:
            svc.stop(at)
    return True


def window_names() -> list[str]:
    """Names of this rank's windows, in creation order."""
    return list(registry(current("window_names")).by_name)


# ---------------------------------------------------------------- put / accumulate / get


def _push(
    op: str,
    kind: int,
    tensor: Tensor,
    name: str,
    self_weight: float | None,
    dst_weights: object,
    require_mutex: bool,
) -> Handle[bool]:
    ctx, svc, rec = lookup(op, name)
    at = where(op, ctx, name)
    t = _same_tensor(at, rec, tensor)
    sw = 1.0 if self_weight is None else check_weight(at, "self_weight", self_weight)
    n = svc.group.size
    dsts = (
        dict.fromkeys(rec.out_nbrs, 1.0)
        if dst_weights is None
        else check_dst(at, "dst_weights", dst_weights, n, rec.me)
    )
    check_neighbors(at, "dst_weights", list(dsts), rec.out_nbrs, "out-neighbor")
    mutexed = check_flag(at, "require_mutex", require_mutex)
    # Snapshot the scaled copies now: the caller may change ``tensor`` as soon as this returns.
    copies: dict[float, Tensor] = {}
    for w in dsts.values():
        if w not in copies:
            copies[w] = contiguous_flat(t.clone(memory_format=torch.contiguous_format) if w == 1.0 else t * w)
    if sw != 1.0:
        with rec.lock:
            t.mul_(sw)
    peers = sorted(dsts)
    statuses: list[Tensor] = []

    def issue() -> list[Any]:
        works: list[Any] = []
        for d in peers:
            ws, st = svc.request(
                d, kind, rec.wid, mutexed=mutexed, payload=copies[dsts[d]], numel=t.numel(), dtype=t.dtype
            )
            works += ws
            statuses.append(st)
        return works

    def finish() -> bool:
        check_statuses(at, op.replace("_nonblocking", ""), peers, statuses, svc.group)
        return True

    nbytes = t.numel() * t.element_size() * len(peers)
    h = make_handle(ctx, svc.group, op, name, issue, finish, sent=nbytes)
    svc.track(h)
    return h


def win_put_nonblocking(
    tensor: Tensor,
    name: str,
    *,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    require_mutex: bool = False,
) -> Handle[bool]:
    """Nonblocking :func:`win_put`; the handle completes once every destination applied it."""
    return _push("win_put_nonblocking", PUT, tensor, name, self_weight, dst_weights, require_mutex)


def win_put(
    tensor: Tensor,
    name: str,
    *,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    require_mutex: bool = False,
) -> bool:
    """Overwrite, on each destination ``r`` (default: every out-neighbor, weight 1), the buffer it keeps
    for this rank with ``tensor * dst_weights[r]``; then ``tensor *= self_weight`` (default 1). With
    ``require_mutex`` each destination applies it while holding its window mutex. Returns True once
    every destination has applied it."""
    return _push("win_put", PUT, tensor, name, self_weight, dst_weights, require_mutex).wait()


def win_accumulate_nonblocking(
    tensor: Tensor,
    name: str,
    *,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    require_mutex: bool = False,
) -> Handle[bool]:
    """Nonblocking :func:`win_accumulate`; the handle completes once every destination applied it."""
    return _push(
        "win_accumulate_nonblocking", ACCUMULATE, tensor, name, self_weight, dst_weights, require_mutex
    )


def win_accumulate(
    tensor: Tensor,
    name: str,
    *,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    require_mutex: bool = False,
) -> bool:
    """Like :func:`win_put` but *adds* ``tensor * dst_weights[r]`` to the destination's buffer."""
    return _push("win_accumulate", ACCUMULATE, tensor, name, self_weight, dst_weights, require_mutex).wait()


def win_get_nonblocking(
    name: str, *, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False
) -> Handle[bool]:
    """Nonblocking :func:`win_get`; the buffers are written when the handle is waited (or polled done
    and then waited)."""
    op = "win_get_nonblocking"
    ctx, svc, rec = lookup(op, name)
    at = where(op, ctx, name)
    srcs = (
        dict.fromkeys(rec.in_nbrs, 1.0)
        if src_weights is None
        else check_weight_map(at, "src_weights", src_weights, svc.group.size, rec.me)
    )
    check_neighbors(at, "src_weights", list(srcs), rec.in_nbrs, "in-neighbor")
    mutexed = check_flag(at, "require_mutex", require_mutex)
    peers = sorted(srcs)
    data = rec.data
    replies = {s: torch.empty(data.numel(), dtype=data.dtype) for s in peers}
    statuses: list[Tensor] = []

    def issue() -> list[Any]:
        works: list[Any] = []
        for s in peers:
            ws, st = svc.request(
                s, GET, rec.wid, mutexed=mutexed, numel=data.numel(), dtype=data.dtype, reply=replies[s]
            )
            works += ws
            statuses.append(st)
        return works

    def finish() -> bool:
        check_statuses(at, "win_get", peers, statuses, svc.group)
        with rec.lock:
            for s in peers:
                buf = rec.buffers[s]
                w = srcs[s]
                val = replies[s].view(buf.shape)
                buf.copy_(val) if w == 1.0 else torch.mul(val, w, out=buf)
                rec.versions[s] += 1
        return True

    nbytes = data.numel() * data.element_size() * len(peers)
    h = make_handle(ctx, svc.group, op, name, issue, finish, received=nbytes)
    svc.track(h)
    return h


def win_get(
    name: str, *, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False
) -> bool:
    """Fetch each source's registered tensor ``* src_weights[r]`` (default: every in-neighbor, weight 1)
    into this rank's buffer for it. With ``require_mutex`` each source answers while holding its window
    mutex. Returns True once the buffers are written."""
    return win_get_nonblocking(name, src_weights=src_weights, require_mutex=require_mutex).wait()


def win_wait(handle: Handle[Any]) -> bool:
    """Wait (bounded) for a window op's handle; True once it completed (its error is raised)."""
    _check_handle("win_wait", handle)
    handle.wait()
    return True


def win_poll(handle: Handle[Any]) -> bool:
    """Whether a window op's handle has completed; never blocks."""
    _check_handle("win_poll", handle)
    return handle.done()


def _check_handle(op: str, handle: object) -> None:
    if not isinstance(handle, Handle):
        raise InvalidArgumentError(
            f"{where(op, current(op))}: handle must be a lowband Handle from a *_nonblocking window op, "
            f"got {type(handle).__name__}"
        )


# ---------------------------------------------------------------- update


def _update_weights(
    at: str, rec: WindowRecord, n: int, self_weight: float | None, src_weights: object
) -> tuple[float, dict[int, float]]:
    if self_weight is None and src_weights is None:
        return rec.topology.self_weight(rec.me), {
            int(k): v for k, v in rec.topology.src_weights(rec.me).items()
        }
    if self_weight is None or src_weights is None:
        raise InvalidArgumentError(
            f"{at}: give self_weight and src_weights together (or neither, for the topology's weights); "
            f"got self_weight={self_weight!r}, src_weights={src_weights!r}"
        )
    sw = check_weight(at, "self_weight", self_weight)
    srcs = check_weight_map(at, "src_weights", src_weights, n, rec.me)
    check_neighbors(at, "src_weights", list(srcs), rec.in_nbrs, "in-neighbor")
    return sw, srcs


def win_update(
    name: str,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    reset: bool = False,
    clone: bool = False,
    require_mutex: bool = False,
) -> Tensor:
    """``self_weight * tensor + sum_r src_weights[r] * buffer_r`` (both weights, or neither for the static
    topology's pull weights), written into the registered tensor and returned (a new tensor with
    ``clone``, the registered one unchanged). ``reset`` zeroes the buffers used. The versions of the
    buffers used restart at 0. ``require_mutex`` holds this rank's window mutex meanwhile."""
    op = "win_update"
    ctx, svc, rec = lookup(op, name)
    at = where(op, ctx, name)
    sw, srcs = _update_weights(at, rec, svc.group.size, self_weight, src_weights)
    reset, clone = check_flag(at, "reset", reset), check_flag(at, "clone", clone)
    held = check_flag(at, "require_mutex", require_mutex)
    data = rec.data
    acc = torch.float32 if data.dtype in (torch.float16, torch.bfloat16) else data.dtype
    with own_mutex(ctx, rec, at, held), rec.lock:
        out = data.to(acc) * sw
        for r, w in srcs.items():
            out.add_(rec.buffers[r].to(acc), alpha=w)
            rec.versions[r] = 0
            if reset:
                rec.buffers[r].zero_()
        if clone:
            return out.to(data.dtype)
        data.copy_(out)
    return rec.tensor


def win_update_then_collect(name: str, *, require_mutex: bool = True) -> Tensor:
    """``tensor += sum of every buffer`` and zero the buffers, atomically with respect to incoming
    operations (``win_update(self_weight=1, src_weights={r: 1 ...}, reset=True)``); returns the registered
    tensor. This is push-sum's collect step: the window's total (tensor + buffers) is conserved."""
    rec = lookup("win_update_then_collect", name)[2]
    return win_update(
        name,
        self_weight=1.0,
        src_weights=dict.fromkeys(rec.in_nbrs, 1.0),
        reset=True,
        require_mutex=require_mutex,
    )


# ---------------------------------------------------------------- versions, state


def get_win_version(name: str) -> dict[int, int]:
    """``{in-neighbor: number of writes into its buffer since the last win_update that read it}``."""
    rec = lookup("get_win_version", name)[2]
    with rec.lock:
        return dict(rec.versions)


def win_state_dict(name: str) -> dict[str, Any]:
    """A copy of the window's buffers and versions (for a checkpoint; the registered tensor is the
    caller's and is saved with it): ``{"buffers": {rank: tensor}, "versions": {rank: int}}``."""
    rec = lookup("win_state_dict", name)[2]
    with rec.lock:
        return {
            "buffers": {r: b.clone() for r, b in rec.buffers.items()},
            "versions": dict(rec.versions),
        }


def win_load_state_dict(name: str, state: Mapping[str, Any]) -> None:
    """Restore buffers and versions saved by :func:`win_state_dict` (same in-neighbors, dtype, shape)."""
    op = "win_load_state_dict"
    ctx, _, rec = lookup(op, name)
    at = where(op, ctx, name)
    if not isinstance(state, Mapping) or set(state) != {"buffers", "versions"}:
        raise InvalidArgumentError(f"{at}: state must be a dict with keys 'buffers' and 'versions'")
    bufs, vers = state["buffers"], state["versions"]
    if not isinstance(bufs, Mapping) or not isinstance(vers, Mapping):
        raise InvalidArgumentError(f"{at}: state['buffers'] and state['versions'] must be dicts")
    if set(bufs) != set(rec.in_nbrs) or set(vers) != set(rec.in_nbrs):
        raise InvalidArgumentError(
            f"{at}: state is for in-neighbors {sorted(bufs)} but the window has {list(rec.in_nbrs)}"
        )
    for r, b in bufs.items():
        _same_tensor(f"{at} (buffer of rank {r})", rec, b)
        v = vers[r]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidArgumentError(f"{at}: versions[{r}] must be an int >= 0, got {v!r}")
    with rec.lock:
        for r, b in bufs.items():
            rec.buffers[r].copy_(b)
            rec.versions[r] = int(vers[r])


__all__ = [
    "get_win_version",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_create",
    "win_free",
    "win_get",
    "win_get_nonblocking",
    "win_load_state_dict",
    "win_lock",
    "win_mutex",
    "win_poll",
    "win_put",
    "win_put_nonblocking",
    "win_state_dict",
    "win_update",
    "win_update_then_collect",
    "win_wait",
    "window_names",
]
