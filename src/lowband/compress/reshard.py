"""Every rank's compressed-reducer state moved to another world size (pure, no communication): the
error-feedback memories by :func:`~lowband.compress.memory.reshard_memories` (per parameter, their sum
over ranks kept: what error feedback still owes the model), a compressor's state copied when it is the
same on every rank (else refused), a transport's own per-rank state by its function in :data:`RESHARD`
(the two-stage transport's server memory, re-cut exactly) or a transport class's
``reshard_states(states, world_size)`` (else refused, naming the state).

The globally sparse reducers (:mod:`~lowband.compress.gssgd`: gs-SGD, Sketched-SGD, gTop-k) keep the
same shape of state: their residual (``"memory"``) and, with worker momentum, the velocity
(``"velocity"``, None without), both per rank and both re-sharded keeping their sum over ranks (the
momentum every worker still carries, in total)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lowband.compress.memory import reshard_memories
from lowband.compress.reducer import TRANSPORTS
from lowband.compress.twostage import reshard_server_memories
from lowband.errors import InvalidArgumentError

#: transports keeping per-rank state of their own, with the function that re-shards their states
#: (a transport class may instead define ``reshard_states(states, world_size)``)
RESHARD: dict[str, Callable[[Sequence[Mapping[str, Any]], int], list[dict[str, Any]]]] = {
    "twostage": reshard_server_memories,  # the server's error memory: its parts re-cut exactly
}


#: per-rank memories every reducer state may hold, re-sharded keeping their sum over ranks: the
#: error-feedback residual, and the globally sparse reducers' worker momentum (None when off)
MEMORIES_SUMMED = ("memory", "velocity")


def same(a: Any, b: Any) -> bool:
    """Deep equality of checkpoint values (tensors compared exactly, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def reshard_reducer_states(
    states: Sequence[Mapping[str, Any]],
    world_size: int,
    transport: str | None = None,
    *,
    where: str = "reshard_reducer_states",
) -> list[dict[str, Any]]:
    """Every rank's compressed-reducer state (``{"memory": ..., "compressor": ..., ...}``, in rank
    order) for ``world_size`` ranks, carried by ``transport`` (module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"{where}: world_size must be an int >= 1, got {world_size!r}")
    custom = RESHARD.get(transport or "")
    if custom is None and transport is not None and transport in TRANSPORTS:
        custom = getattr(TRANSPORTS.get(transport), "reshard_states", None)
    if custom is not None:
        return list(custom(states, world_size))
    if all(not s for s in states):  # a reducer without state (the plain allreduce)
        return [{} for _ in range(world_size)]
    keys = {k for s in states for k in s}
    extra = sorted(keys - {*MEMORIES_SUMMED, "compressor"})
    if extra:
        raise InvalidArgumentError(
            f"{where}: the transport {transport!r} keeps per-rank state {extra} and does not say how to "
            "re-shard it (a reshard_states classmethod); resume at the world size it was saved at"
        )
    out: list[dict[str, Any]] = [{} for _ in range(world_size)]
    for key in MEMORIES_SUMMED:
        if not any(key in s for s in states):
            continue
        given = [s.get(key) for s in states]
        if all(m is None for m in given):  # an optional memory switched off (no worker momentum)
            parts: list[Any] = [None] * world_size
        elif any(m is None for m in given):
            raise InvalidArgumentError(
                f"{where}: rank {given.index(None)}'s checkpoint has no {key!r} state but rank "
                f"{next(r for r, m in enumerate(given) if m is not None)}'s has; they are of different runs"
            )
        else:
            parts = reshard_memories([m for m in given if m is not None], world_size)
        for o, m in zip(out, parts):
            o[key] = m
    if "compressor" in keys:  # the same on every rank (its random streams are shared), copied
        comp = states[0].get("compressor", {})
        for r, s in enumerate(states[1:], 1):
            if not same(s.get("compressor", {}), comp):
                raise InvalidArgumentError(
                    f"{where}: the compressor's state differs between rank 0 and rank {r}; per-rank "
                    "compressor state cannot be re-sharded"
                )
        for o in out:
            o["compressor"] = copy.deepcopy(comp)
    return out
