"""Checkpoints of a strategy on the gradient stage (``compressed``, ``stage``, and the globally sparse
``gs-sgd``, ``sketched-sgd``, ``gtopk``, ``topk-allgather``: :data:`RESHARDABLE`) moved to another world
size: :func:`reshard_checkpoints` (pure, no communication). Other strategies' checkpoints are refused
here (``slimgc``'s backup and memories, for one, are each rank's own and do not re-shard).

What moves and how:

- the model, the optimizer state and the counters are replicated (every rank steps the same averaged
  gradient): rank 0's are taken;
- the reducer's state (:func:`lowband.compress.reshard.reshard_reducer_states`): error-feedback
  memories (and the sparse reducers' worker momentum) are per rank and re-sharded keeping, per
  parameter, their sum over ranks (what error feedback still owes the model): each new rank holds
  ``sum / M``. The resumed run is then not
  bit-identical to an uninterrupted one at M ranks (no such run exists), but no remembered gradient is
  lost or counted twice. A compressor's state must be the same on every rank (it is copied); a
  transport's own per-rank state (the two-stage server memory) is re-cut by the transport's function;
  anything else is refused, naming it.

At the same world size the checkpoints are returned unchanged (the exact resume).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from lowband.compress.reshard import reshard_reducer_states
from lowband.errors import InvalidArgumentError

WHERE = "reshard_checkpoints"
#: the strategies whose checkpoints re-shard here: their per-rank state is the stage's reducer state
RESHARDABLE = frozenset({"stage", "compressed", "gs-sgd", "sketched-sgd", "gtopk", "topk-allgather"})


def reshard_checkpoints(states: Sequence[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Every rank's :meth:`Strategy.state_dict` of a stage strategy (in rank order) as checkpoints for
    ``world_size`` ranks: rank ``r`` of the new run loads the ``r``-th (module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"{WHERE}: world_size must be an int >= 1, got {world_size!r}")
    if not states or not all(isinstance(s, Mapping) for s in states):
        raise InvalidArgumentError(f"{WHERE}: expects every rank's checkpoint (dicts), in rank order")
    n = len(states)
    for r, s in enumerate(states):
        if s.get("strategy") not in RESHARDABLE:
            raise InvalidArgumentError(
                f"{WHERE}: rank {r}'s checkpoint is of strategy {s.get('strategy')!r}, whose per-rank state "
                f"does not re-shard; only {sorted(RESHARDABLE)} re-shard here (sharded tables: "
                "lowband.strategies.assemble_state_dicts); resume it at the world size it was saved at"
            )
        if "stage" not in s.get("extra", {}):
            raise InvalidArgumentError(
                f"{WHERE}: rank {r}'s checkpoint (strategy {s.get('strategy')!r}) has no gradient-stage "
                "state: it is not a whole checkpoint of that strategy (Strategy.state_dict())"
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
        [s["extra"]["stage"]["reducer"] for s in states], world_size, extra0.get("transport"), where=WHERE
    )
    out = []
    for red in reducers:
        state = copy.deepcopy(dict(states[0]))
        state["extra"]["stage"] = {"rounds": extra0["stage"]["rounds"], "reducer": red}
        if "world_size" in extra0:
            state["extra"]["world_size"] = world_size
        if "world_size" in state:
            state["world_size"] = world_size
        out.append(state)
    return out
