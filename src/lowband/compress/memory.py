"""Error feedback: what a compressor dropped, remembered and added back to the next gradient.

A :class:`Memory` works on a unit's flat gradient but keeps its state **per parameter name** (a unit is
described by its :data:`Segments`, the ``(name, numel)`` of its parameters in flat order), so the state
survives a new bucketing (DDP's bucket rebuild, another ``bucket_mb``), a restart, and goes into
``state_dict`` as ``{name: tensor}``.

- :meth:`Memory.compensate` returns ``p = x + e`` (the gradient plus what is remembered for its
  parameters; zeros the first time);
- :meth:`Memory.update` is told ``p`` and the local decode ``d`` of what was sent, and remembers what
  matters for the next step (:class:`ResidualMemory`: ``e = p - d``).

Telescoping: with :class:`ResidualMemory`, the sum of every decode sent plus the final memory equals the
sum of the gradients given, exactly up to rounding.

Re-sharding: a memory's state is per rank. :func:`reshard_memories` maps the states of N ranks onto M
ranks preserving their sum over ranks (the quantity error feedback promises to deliver eventually).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options
from lowband.registry import Registry

Tensor = torch.Tensor
#: a unit's parameters in flat order: ``((name, numel), ...)``
Segments = tuple[tuple[str, int], ...]


#: every memory by name, for specs (``"residual"``, ``"dgc:momentum=0.9"``): ``factory(**options) -> Memory``
MEMORIES: Registry[Callable[..., Memory]] = Registry("memory")


def check_segments(where: str, segments: Segments, x: Tensor) -> None:
    total = sum(n for _, n in segments)
    if total != x.numel():
        raise InvalidArgumentError(
            f"{where}: the segments {[s for s, _ in segments][:4]}... hold {total} elements, the tensor {x.numel()}"
        )


class Memory(abc.ABC):
    """Error-feedback state keyed by parameter name; see the module docstring."""

    @abc.abstractmethod
    def compensate(self, segments: Segments, x: Tensor) -> Tensor:
        """``x`` plus what is remembered for these parameters (a new tensor; ``x`` is not modified)."""

    @abc.abstractmethod
    def update(self, segments: Segments, compensated: Tensor, decoded: Tensor) -> None:
        """Remember what ``decoded`` (the local decode of what was sent) left of ``compensated``."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """``{"kind": ..., "tensors": {parameter name: tensor}}``."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""


@MEMORIES.registering("none", "no error feedback")
class NoMemory(Memory):
    """No error feedback: the compressor's error is lost (unbiased compressors, or an ablation)."""

    def compensate(self, segments: Segments, x: Tensor) -> Tensor:
        return x

    def update(self, segments: Segments, compensated: Tensor, decoded: Tensor) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "none", "tensors": {}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind", "none") != "none" or state.get("tensors"):
            raise InvalidArgumentError(
                f"NoMemory.load_state_dict: got a {state.get('kind')!r} memory with tensors; "
                "build the reducer with the memory the checkpoint was taken with"
            )

    def __repr__(self) -> str:
        return "NoMemory()"


@MEMORIES.registering(
    "residual",
    "error feedback: what the compressor dropped, added to the next gradient",
    Options({"beta": Opt(float, min=0, max=1, doc="the memory's weight when compensating (p = x + beta e)")}),
)
class ResidualMemory(Memory):
    """Error feedback (EF-SGD; MXNet's residual): ``p = x + e``, then ``e = p - decode(Q(p))``.

    ``beta`` (default 1) scales the memory when compensating (``p = x + beta * e``), as some variants do.
    """

    kind = "residual"

    def __init__(self, *, beta: float = 1.0) -> None:
        self.beta = float(beta)
        self.tensors: dict[str, Tensor] = {}

    def _flat(self, segments: Segments, like: Tensor) -> Tensor | None:
        if not any(name in self.tensors for name, _ in segments):
            return None
        parts = []
        for name, n in segments:
            e = self.tensors.get(name)
            if e is None:
                e = torch.zeros(n, dtype=like.dtype, device=like.device)
            elif e.numel() != n:
                raise InvalidArgumentError(
                    f"ResidualMemory: parameter {name!r} has {n} elements, its memory {e.numel()}"
                )
            elif e.device != like.device:  # loaded with map_location="cpu", say: moved once, to the input's
                e = self.tensors[name] = e.to(like.device)
            parts.append(e)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def compensate(self, segments: Segments, x: Tensor) -> Tensor:
        check_segments("ResidualMemory.compensate", segments, x)
        e = self._flat(segments, x)
        if e is None:
            return x.clone()
        return x + e if self.beta == 1.0 else x + self.beta * e

    def update(self, segments: Segments, compensated: Tensor, decoded: Tensor) -> None:
        check_segments("ResidualMemory.update", segments, compensated)
        err = compensated - decoded
        pos = 0
        for name, n in segments:
            self.tensors[name] = err[pos : pos + n].clone() if len(segments) > 1 else err
            pos += n

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "beta": self.beta,
            "tensors": {k: v.clone() for k, v in self.tensors.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise InvalidArgumentError(
                f"ResidualMemory.load_state_dict: expected a {self.kind!r} memory, got {state.get('kind')!r}"
            )
        tensors = state.get("tensors", {})
        if not isinstance(tensors, Mapping) or not all(isinstance(v, Tensor) for v in tensors.values()):
            raise InvalidArgumentError("ResidualMemory.load_state_dict: 'tensors' must map names to tensors")
        self.tensors = {str(k): v.clone() for k, v in tensors.items()}

    def __repr__(self) -> str:
        return f"ResidualMemory(beta={self.beta})" if self.beta != 1.0 else "ResidualMemory()"


def reshard_memories(states: Sequence[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The memory states of N ranks as states for ``world_size`` ranks, preserving, per parameter, the
    sum over ranks: every new rank holds ``sum / world_size`` (of every entry mapping names to
    tensors). Pure (no communication)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"reshard_memories: world_size must be an int >= 1, got {world_size!r}")
    if not states:
        raise InvalidArgumentError("reshard_memories: no states given")
    kinds = {s.get("kind") for s in states}
    if len(kinds) != 1:
        raise InvalidArgumentError(
            f"reshard_memories: the states are of different kinds {sorted(map(str, kinds))}"
        )
    # every entry mapping names to tensors ("tensors"; a DGC memory's "momenta" too) is summed
    fields = {k for s in states for k, v in s.items() if isinstance(v, Mapping)} | {"tensors"}
    sums: dict[str, dict[str, Tensor]] = {f: {} for f in fields}
    for s in states:
        for f in fields:
            for k, v in s.get(f, {}).items():
                sums[f][k] = sums[f][k] + v if k in sums[f] else v.clone()
    base = {k: v for k, v in states[0].items() if k not in fields}
    return [
        dict(base, **{f: {k: v / world_size for k, v in sums[f].items()} for f in fields})
        for _ in range(world_size)
    ]
