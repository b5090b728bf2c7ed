"""Parameters that live sharded across the ranks of a group (e.g. a column shard of an embedding
table), next to replicated ones.

A module that holds a shard declares it by implementing :class:`Sharded` (``shard_specs()``: local
parameter name -> :class:`ShardSpec`). The contract: the module's state-dict keys are those of its
dense counterpart, and a sharded parameter is that counterpart's tensor cut along ``dim``, rank ``r``
of the group holding the contiguous slice ``[start, start + length)``, ranks in order. So the
assembled state dict of a sharded model loads into the dense model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lowband.comm import collectives as comm
from lowband.errors import InvalidArgumentError
from lowband.group import Group


def shard_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s part of ``total`` items cut into ``world`` contiguous parts,
    the first ``total % world`` parts one item longer."""
    if world < 1 or not 0 <= rank < world or total < 0:
        raise InvalidArgumentError(
            f"shard_range: need 0 <= rank < world and total >= 0, got total={total}, rank={rank}, world={world}"
        )
    base, extra = divmod(total, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ShardSpec:
    """One rank's slice of a sharded tensor: ``global_shape`` cut along ``dim``; this rank holds
    ``[start, start + length)`` of that dimension."""

    dim: int
    global_shape: tuple[int, ...]
    start: int
    length: int

    def __post_init__(self) -> None:
        n = len(self.global_shape)
        if not 0 <= self.dim < n or self.start < 0 or self.length < 0:
            raise InvalidArgumentError(f"ShardSpec: invalid {self}")
        if self.start + self.length > self.global_shape[self.dim]:
            raise InvalidArgumentError(f"ShardSpec: slice beyond dimension {self.dim} of {self.global_shape}")

    @classmethod
    def even(cls, global_shape: Sequence[int], dim: int, rank: int, world: int) -> ShardSpec:
        """Rank ``rank``'s part of the :func:`shard_range` layout."""
        shape = tuple(int(s) for s in global_shape)
        if not 0 <= dim < len(shape):
            raise InvalidArgumentError(f"ShardSpec.even: dim {dim} out of range for shape {shape}")
        start, length = shard_range(shape[dim], rank, world)
        return cls(dim, shape, start, length)

    @property
    def local_shape(self) -> tuple[int, ...]:
        s = list(self.global_shape)
        s[self.dim] = self.length
        return tuple(s)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (a copy)."""
        if tuple(full.shape) != self.global_shape:
            raise InvalidArgumentError(
                f"ShardSpec.slice: tensor of shape {tuple(full.shape)}, expected {self.global_shape}"
            )
        return full.narrow(self.dim, self.start, self.length).clone()

    def to_dict(self) -> dict[str, Any]:
        """Plain ints and lists (checkpoints load with ``torch.load(weights_only=True)``)."""
        return {
            "dim": self.dim,
            "global_shape": list(self.global_shape),
            "start": self.start,
            "length": self.length,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardSpec:
        return cls(int(d["dim"]), tuple(int(s) for s in d["global_shape"]), int(d["start"]), int(d["length"]))


@runtime_checkable
class Sharded(Protocol):
    """A module holding shards of some of its own parameters."""

    def shard_specs(self) -> Mapping[str, ShardSpec]:
        """Local parameter name (as in ``named_parameters(recurse=False)``) -> this rank's spec."""
        ...


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Every sharded parameter of ``model``, by its names in ``model.state_dict()``: a shard registered
    under several names (a Sharded module at several paths, or its parameter tied into another module)
    is listed under each, so no name of it is ever taken for a replica (broadcast, averaged or saved
    uncut in a full checkpoint)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out: dict[str, ShardSpec] = {}
    for prefix, m in model.named_modules():
        declared = m.shard_specs() if isinstance(m, Sharded) else None
        if declared:
            own = dict(m.named_parameters(recurse=False))
            for k, spec in declared.items():
                if k not in own or tuple(own[k].shape) != spec.local_shape:
                    raise InvalidArgumentError(
                        f"shard_specs: {type(m).__name__} declares {k!r} with local shape {spec.local_shape}, "
                        f"its parameter is {tuple(own[k].shape) if k in own else 'missing'}"
                    )
                for name in names.get(id(own[k]), [f"{prefix}.{k}" if prefix else k]):
                    out[name] = spec
    return out


def gather_full(t: torch.Tensor, spec: ShardSpec, *, group: Group | None = None) -> torch.Tensor:
    """Collective: the full tensor from every rank's shard (ranks' slices in rank order)."""
    if tuple(t.shape) != spec.local_shape:
        raise InvalidArgumentError(
            f"gather_full: shard of shape {tuple(t.shape)}, its spec says {spec.local_shape}"
        )
    moved = t.detach().movedim(spec.dim, 0).contiguous()
    full = comm.allgather(moved, group=group).movedim(0, spec.dim).contiguous()
    if tuple(full.shape) != spec.global_shape:
        raise InvalidArgumentError(
            f"gather_full: the ranks' shards make shape {tuple(full.shape)}, expected {spec.global_shape}"
        )
    return full


def assemble(parts: Sequence[tuple[torch.Tensor, ShardSpec]]) -> torch.Tensor:
    """Pure: the full tensor from every rank's ``(shard, spec)`` (any order; must tile the dimension)."""
    if not parts:
        raise InvalidArgumentError("assemble: no shards")
    ordered = sorted(parts, key=lambda p: p[1].start)
    spec0 = ordered[0][1]
    pos = 0
    for t, spec in ordered:
        if spec.dim != spec0.dim or spec.global_shape != spec0.global_shape or spec.start != pos:
            raise InvalidArgumentError(
                f"assemble: shards do not tile dimension {spec0.dim} of {spec0.global_shape} (at {pos}: {spec})"
            )
        if tuple(t.shape) != spec.local_shape:
            raise InvalidArgumentError(f"assemble: shard of shape {tuple(t.shape)} for {spec}")
        pos += spec.length
    if pos != spec0.global_shape[spec0.dim]:
        raise InvalidArgumentError(
            f"assemble: shards cover {pos} of {spec0.global_shape[spec0.dim]} along dim {spec0.dim}"
        )
    return torch.cat([t for t, _ in ordered], dim=spec0.dim)
