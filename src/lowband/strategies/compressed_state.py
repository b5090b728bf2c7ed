"""Checkpoints of a strategy on the gradient stage (``compressed``, ``stage``) moved to another world
size: :func:`reshard_checkpoints` (pure, no communication).

What moves and how:

- the model, the optimizer state and the counters are replicated (every rank steps the same averaged
  gradient): rank 0's are taken;
- error-feedback memories are per rank; they are re-sharded with
  :func:`lowband.compress.memory.reshard_memories`, which keeps, per parameter, their sum over ranks
  (what error feedback still owes the model): each new rank holds ``sum / M``. The resumed run is then
  not bit-identical to an uninterrupted one at M ranks (no such run exists), but no remembered gradient
  is lost or counted twice;
- a compressor's state must be the same on every rank (it is then copied), else the checkpoint cannot
  be re-sharded;
- any other per-rank state of a transport is re-sharded by the transport's own function
  (:data:`RESHARD`: the two-stage transport's server memory, its per-rank parts re-cut exactly by
  :func:`lowband.compress.reshard_server_memories`) or a transport class's
  ``reshard_states(states, world_size)``; otherwise the checkpoint is refused, naming the state.

At the same world size the checkpoints are returned unchanged (the exact resume).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lowband.compress.memory import reshard_memories
from lowband.compress.reducer import TRANSPORTS
from lowband.compress.twostage import reshard_server_memories
from lowband.errors import InvalidArgumentError

WHERE = "reshard_checkpoints"

#: transports keeping per-rank state of their own, with the function that re-shards their states
#: (a transport class may instead define ``reshard_states(states, world_size)``)
RESHARD: dict[str, Callable[[Sequence[Mapping[str, Any]], int], list[dict[str, Any]]]] = {
    "twostage": reshard_server_memories,  # the server's error memory: its parts re-cut exactly
}


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
    states: Sequence[Mapping[str, Any]], world_size: int, transport: str | None = None
) -> list[dict[str, Any]]:
    """Every rank's compressed-reducer state (``{"memory": ..., "compressor": ..., ...}``) for
    ``world_size`` ranks (module docstring)."""
    custom = RESHARD.get(transport or "")
    if custom is None and transport is not None and transport in TRANSPORTS:
        custom = getattr(TRANSPORTS.get(transport), "reshard_states", None)
    if custom is not None:
        return list(custom(states, world_size))
    if all(not s for s in states):  # a reducer without state (the plain allreduce)
        return [{} for _ in range(world_size)]
    keys = {k for s in states for k in s}
    extra = sorted(keys - {"memory", "compressor"})
    if extra:
        raise InvalidArgumentError(
            f"{WHERE}: the transport {transport!r} keeps per-rank state {extra} and does not say how to "
            "re-shard it (a reshard_states classmethod); resume at the world size it was saved at"
        )
    comp = states[0].get("compressor", {})
    for r, s in enumerate(states[1:], 1):
        if not same(s.get("compressor", {}), comp):
            raise InvalidArgumentError(
                f"{WHERE}: the compressor's state differs between rank 0 and rank {r}; per-rank "
                "compressor state cannot be re-sharded"
            )
    memories = reshard_memories([s["memory"] for s in states], world_size)
    return [{"memory": m, "compressor": copy.deepcopy(comp)} for m in memories]


def reshard_checkpoints(states: Sequence[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Every rank's :meth:`Strategy.state_dict` of a stage strategy (in rank order) as checkpoints for
    ``world_size`` ranks: rank ``r`` of the new run loads the ``r``-th (module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"{WHERE}: world_size must be an int >= 1, got {world_size!r}")
    if not states or not all(isinstance(s, Mapping) for s in states):
        raise InvalidArgumentError(f"{WHERE}: expects every rank's checkpoint (dicts), in rank order")
    n = len(states)
    for r, s in enumerate(states):
        if "stage" not in s.get("extra", {}):
            raise InvalidArgumentError(
                f"{WHERE}: rank {r}'s checkpoint (strategy {s.get('strategy')!r}) has no gradient-stage "
                "state; only strategies on the gradient stage (compressed, stage) re-shard here"
            )
        if "sharding" in s:
            raise InvalidArgumentError(
                f"{WHERE}: rank {r}'s checkpoint holds sharded parameters; assemble them first "
                "(lowband.strategies.assemble_state_dicts)"
            )
        saved_n = s["extra"].get("world_size", n)
        if saved_n != n:
            raise InvalidArgumentError(
                f"{WHERE}: rank {r}'s checkpoint was taken at {saved_n} ranks, {n} checkpoints given"
            )
        for key in ("strategy", "steps"):
            if s.get(key) != states[0].get(key):
                raise InvalidArgumentError(
                    f"{WHERE}: rank {r}'s checkpoint has {key}={s.get(key)!r}, rank 0's {states[0].get(key)!r}"
                )
        if s["extra"]["stage"].get("rounds") != states[0]["extra"]["stage"].get("rounds"):
            raise InvalidArgumentError(f"{WHERE}: rank {r}'s checkpoint is of another reduction round")
    if world_size == n:
        return [copy.deepcopy(dict(s)) for s in states]
    extra0 = states[0]["extra"]
    reducers = reshard_reducer_states(
        [s["extra"]["stage"]["reducer"] for s in states], world_size, extra0.get("transport")
    )
    out = []
    for red in reducers:
        state = copy.deepcopy(dict(states[0]))
        state["extra"]["stage"] = {"rounds": extra0["stage"]["rounds"], "reducer": red}
        if "world_size" in extra0:
            state["extra"]["world_size"] = world_size
        out.append(state)
    return out
