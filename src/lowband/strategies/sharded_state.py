"""Checkpoints of strategies with sharded parameters: each rank's shard with its layout, the full
(assembled) form that loads at any world size, and the re-sharding between them.

A strategy checkpoint of a model with sharded parameters carries ``"sharding"``: ``world_size``,
``rank``, ``full`` (True when every sharded tensor is whole) and ``params`` (name -> the
:class:`~lowband.nn.sharding.ShardSpec` as plain ints). Sharded tensors are the parameter in
``"model"`` and the optimizer's per-parameter state of the same shape (momentum, Adam moments);
scalars (Adam's step) are kept as they are. Two ways to a checkpoint that loads at another world size:
:meth:`Strategy.full_state_dict` (collective, at save time) or :func:`assemble_state_dicts` (offline,
from every rank's checkpoint). Loading a full checkpoint slices each tensor to this rank's spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.nn.sharding import ShardSpec, assemble

TensorFn = Callable[[str, ShardSpec, torch.Tensor], torch.Tensor]


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Name of each parameter in the optimizer's state-dict numbering (param_groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), "") for grp in optimizer.param_groups for p in grp["params"]]


def map_sharded(
    state: Mapping[str, Any],
    specs: Mapping[str, ShardSpec],
    index_names: Sequence[str],
    fn: TensorFn,
    *,
    shard_shape: Callable[[ShardSpec], tuple[int, ...]],
) -> dict[str, Any]:
    """A copy of a strategy checkpoint with ``fn(name, spec, t)`` applied to every sharded tensor: the
    model's parameter and the optimizer state tensors of shape ``shard_shape(spec)``. Deterministic
    order (model keys, then optimizer entries by index and key), the same on every rank."""
    out = dict(state)
    model = dict(state["model"])
    for name, spec in specs.items():
        model[name] = fn(name, spec, model[name])
    out["model"] = model
    opt = state.get("optimizer")
    if isinstance(opt, Mapping) and isinstance(opt.get("state"), Mapping):
        new_opt = dict(opt)
        per_param: dict[Any, Any] = {}
        for idx in sorted(opt["state"], key=lambda k: (str(type(k)), k)):
            entry = opt["state"][idx]
            name = index_names[idx] if isinstance(idx, int) and 0 <= idx < len(index_names) else ""
            found = specs.get(name)
            if found is None or not isinstance(entry, Mapping):
                per_param[idx] = entry
                continue
            per_param[idx] = {
                k: fn(name, found, v)
                if isinstance(v, torch.Tensor) and tuple(v.shape) == shard_shape(found)
                else v
                for k, v in sorted(entry.items())
            }
        new_opt["state"] = per_param
        out["optimizer"] = new_opt
    return out


def layout(
    specs: Mapping[str, ShardSpec], rank: int, world: int, *, full: bool, optimizer_names: Sequence[str]
) -> dict[str, Any]:
    """The ``"sharding"`` entry of a checkpoint (plain ints, strings and lists)."""
    return {
        "world_size": world,
        "rank": rank,
        "full": full,
        "params": {n: s.to_dict() for n, s in specs.items()},
        "optimizer_names": list(optimizer_names),
    }


def full_spec(spec: ShardSpec) -> ShardSpec:
    return ShardSpec(spec.dim, spec.global_shape, 0, spec.global_shape[spec.dim])


def assemble_state_dicts(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pure: the full checkpoint from every rank's strategy checkpoint (one per rank of the world it was
    saved at, any order). Replicated state is taken from rank 0's. The result loads at any world size."""
    if not states:
        raise InvalidArgumentError("assemble_state_dicts: no checkpoints")
    lays = [s.get("sharding") for s in states]
    if any(lay is None or lay["full"] for lay in lays):
        raise InvalidArgumentError(
            "assemble_state_dicts: every checkpoint must be one rank's sharded checkpoint"
        )
    world = int(lays[0]["world_size"])  # type: ignore[index]
    ranks = sorted(int(lay["rank"]) for lay in lays)  # type: ignore[index]
    if ranks != list(range(world)):
        raise InvalidArgumentError(
            f"assemble_state_dicts: need one checkpoint per rank 0..{world - 1}, got ranks {ranks}"
        )
    by_rank = {int(lay["rank"]): st for lay, st in zip(lays, states, strict=True)}  # type: ignore[index]
    specs_of = {
        r: {n: ShardSpec.from_dict(d) for n, d in st["sharding"]["params"].items()}
        for r, st in by_rank.items()
    }
    base = by_rank[0]
    specs0 = specs_of[0]
    # every rank's sharded tensors, in the deterministic order map_sharded visits them
    pieces: dict[int, list[torch.Tensor]] = {}
    for r, st in by_rank.items():
        got: list[torch.Tensor] = []

        def take(_n: str, _s: ShardSpec, t: torch.Tensor, got: list[torch.Tensor] = got) -> torch.Tensor:
            got.append(t)
            return t

        map_sharded(st, specs_of[r], _index_names(st), take, shard_shape=lambda s: s.local_shape)
        pieces[r] = got
    counter = iter(range(len(pieces[0])))

    def join(name: str, _spec: ShardSpec, _t: torch.Tensor) -> torch.Tensor:
        i = next(counter)
        return assemble([(pieces[r][i], specs_of[r][name]) for r in range(world)])

    out = map_sharded(base, specs0, _index_names(base), join, shard_shape=lambda s: s.local_shape)
    full_specs = {n: full_spec(s) for n, s in specs0.items()}
    out["sharding"] = layout(full_specs, 0, world, full=True, optimizer_names=_index_names(base))
    return out


def _index_names(state: Mapping[str, Any]) -> list[str]:
    names = state.get("sharding", {}).get("optimizer_names")
    return list(names) if names is not None else []


def localize(state: dict[str, Any], shards: Mapping[str, ShardSpec], size: int, where: str) -> dict[str, Any]:
    """``state`` with this rank's slices (``shards``: this rank's specs, of a group of ``size``) of every
    sharded tensor: a full checkpoint re-sharded, a per-rank one checked to hold this rank's slices."""
    lay = state.get("sharding")
    if not shards and lay is None:
        return state
    saved_names = sorted(lay["params"]) if lay is not None else []
    if lay is None or saved_names != sorted(shards):
        raise InvalidArgumentError(
            f"{where}: the checkpoint's sharded parameters {saved_names} are not this model's {sorted(shards)}"
        )
    saved = {n: ShardSpec.from_dict(d) for n, d in lay["params"].items()}
    for n, spec in shards.items():
        if (saved[n].dim, saved[n].global_shape) != (spec.dim, spec.global_shape):
            raise InvalidArgumentError(
                f"{where}: {n!r} was saved cut along dim {saved[n].dim} of {saved[n].global_shape}, "
                f"this model cuts dim {spec.dim} of {spec.global_shape}"
            )
    if lay["full"]:
        return map_sharded(
            state,
            saved,
            lay["optimizer_names"],
            lambda n, _s, t: shards[n].slice(t),
            shard_shape=lambda s: s.global_shape,
        )
    if any(saved[n] != shards[n] for n in shards):
        raise InvalidArgumentError(
            f"{where}: the checkpoint holds the shards of rank {lay['rank']} of a world of "
            f"{lay['world_size']}, this rank (of {size}) holds other slices; load a full "
            f"checkpoint (Strategy.full_state_dict(), or assemble_state_dicts of every rank's checkpoint)"
        )
    return state
