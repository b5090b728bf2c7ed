"""The local side of the one-sided windows (see :mod:`lowband.decentral.window` for the model): combining
the received buffers into the registered tensor (:func:`win_update`, :func:`win_update_then_collect`),
the buffers' versions, and the state dict of a window. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowband.decentral.mutex import own_mutex
from lowband.decentral.peers import check_weight, check_weight_map
from lowband.decentral.window_ops import same_tensor
from lowband.decentral.window_protocol import check_flag, check_neighbors
from lowband.decentral.window_service import WindowRecord, lookup, where
from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor


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
        same_tensor(f"{at} (buffer of rank {r})", rec, b)
        v = vers[r]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidArgumentError(f"{at}: versions[{r}] must be an int >= 0, got {v!r}")
    with rec.lock:
        for r, b in bufs.items():
            rec.buffers[r].copy_(b)
            rec.versions[r] = int(vers[r])
