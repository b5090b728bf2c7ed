"""Put, accumulate and get on the one-sided windows (see :mod:`lowband.decentral.window` for the
model), blocking and nonblocking, and the waiting of their handles (:func:`win_wait`, :func:`win_poll`).

Each operation is one batch of requests on the window service's channel
(:mod:`lowband.decentral.window_protocol`, :class:`lowband.comm.batch.Channel`): traced and counted under
the op's name, its handle complete once every destination has applied it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lowband.comm.base import contiguous_flat
from lowband.comm.batch import P2POp
from lowband.comm.handle import Handle
from lowband.decentral.peers import check_dst, check_weight, check_weight_map
from lowband.decentral.window_protocol import (
    ACCUMULATE,
    GET,
    PUT,
    check_flag,
    check_neighbors,
    check_statuses,
    request_ops,
)
from lowband.decentral.window_service import WindowRecord, lookup, where
from lowband.errors import InvalidArgumentError
from lowband.runtime import current

Tensor = torch.Tensor


def same_tensor(at: str, rec: WindowRecord, t: object) -> Tensor:
    """``t`` (detached) if it has the window's dtype and shape, else an :class:`InvalidArgumentError`."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{at}: tensor must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != rec.data.dtype or t.shape != rec.data.shape:
        raise InvalidArgumentError(
            f"{at}: tensor is {t.dtype} {tuple(t.shape)} but the window holds {rec.data.dtype} "
            f"{tuple(rec.data.shape)}"
        )
    return t.detach()


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
    t = same_tensor(at, rec, tensor)
    sw = 1.0 if self_weight is None else check_weight(at, "self_weight", self_weight)
    n = svc.group.size
    dsts = (
        dict.fromkeys(rec.out_nbrs, 1.0)
        if dst_weights is None
        else check_dst(at, "dst_weights", dst_weights, n, rec.me)
    )
    check_neighbors(at, "dst_weights", list(dsts), rec.out_nbrs, "out-neighbor")
    mutexed = check_flag(at, "require_mutex", require_mutex)
    # Snapshot the scaled copies now: the caller may change ``tensor`` as soon as this returns. The
    # window service's wire is a private gloo channel: a window on a GPU is staged through host memory.
    copies: dict[float, Tensor] = {}
    for w in dsts.values():
        if w not in copies:
            snap = t.clone(memory_format=torch.contiguous_format) if w == 1.0 else t * w
            copies[w] = contiguous_flat(snap.to("cpu"))
    if sw != 1.0:
        with rec.lock:
            t.mul_(sw)
    peers = sorted(dsts)
    statuses: list[Tensor] = []
    ops: list[P2POp] = []
    for d in peers:
        ms, st = request_ops(
            d,
            kind,
            rec.wid,
            svc.next_tag(),
            mutexed=mutexed,
            payload=copies[dsts[d]],
            numel=t.numel(),
            dtype=t.dtype,
        )
        ops += ms
        statuses.append(st)

    def finish() -> bool:
        check_statuses(at, op.replace("_nonblocking", ""), peers, statuses, svc.group)
        return True

    h = svc.post(op, ops, finish, name)
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
    return _fetch("win_get_nonblocking", name, src_weights, require_mutex)


def _fetch(op: str, name: str, src_weights: Mapping[int, float] | None, require_mutex: bool) -> Handle[bool]:
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
    # host staging buffers (the window service's wire is a gloo channel; see _push)
    replies = {s: torch.empty(data.numel(), dtype=data.dtype, device="cpu") for s in peers}
    statuses: list[Tensor] = []
    ops: list[P2POp] = []
    for s in peers:
        ms, st = request_ops(
            s,
            GET,
            rec.wid,
            svc.next_tag(),
            mutexed=mutexed,
            numel=data.numel(),
            dtype=data.dtype,
            reply=replies[s],
        )
        ops += ms
        statuses.append(st)

    def finish() -> bool:
        check_statuses(at, "win_get", peers, statuses, svc.group)
        with rec.lock:
            for s in peers:
                buf = rec.buffers[s]
                w = srcs[s]
                val = replies[s].view(buf.shape).to(buf.device)
                buf.copy_(val) if w == 1.0 else torch.mul(val, w, out=buf)
                rec.versions[s] += 1
        return True

    h = svc.post(op, ops, finish, name)
    svc.track(h)
    return h


def win_get(
    name: str, *, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False
) -> bool:
    """Fetch each source's registered tensor ``* src_weights[r]`` (default: every in-neighbor, weight 1)
    into this rank's buffer for it. With ``require_mutex`` each source answers while holding its window
    mutex. Returns True once the buffers are written."""
    return _fetch("win_get", name, src_weights, require_mutex).wait()


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
