"""Compressed data parallelism for a plain training loop: :class:`CompressedOptimizer` wraps any torch
optimizer, reduces the gradients through a compressed reducer during backward (the gradient stage:
units leave as soon as their gradients are complete, overlapping the rest of backward), and steps the
wrapped optimizer on the averaged gradients::

    opt = CompressedOptimizer(model, torch.optim.Adam(model.parameters(), 1e-3), compressor="onebit")
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # waits for the reductions, then Adam steps

Nothing is re-implemented: the wrapped optimizer keeps its own state and ``param_groups`` (shared, so LR
schedulers work). ``state_dict`` holds the wrapped optimizer's state, the step count and the stage's
state (its reduction counter, the memories keyed by parameter name, the compressor's and transport's
state), so a loaded checkpoint resumes exactly. The options are those of
:func:`lowband.compress.specs.build_reducer`, plus ``bucket_mb`` (0 = per layer) and ``accumulate``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lowband.comm.initial import broadcast_initial_state
from lowband.compress.base import Compressor
from lowband.compress.dgc import DGCMemory, check_optimizer
from lowband.compress.reducer import CompressedReducer
from lowband.compress.reshard import reshard_reducer_states
from lowband.compress.specs import build_reducer
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import Timings
from lowband.optim.stage import GradientStage
from lowband.optim.units import check_bucket_mb, model_units
from lowband.runtime import world_group

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class CompressedOptimizer(torch.optim.Optimizer):
    """A torch optimizer (given, or built by a factory on the model's parameters) stepping on gradients
    averaged through a compressed reducer; see the module docstring.

    ``reducer`` is a transport spec (or ``"auto"``) or a built :class:`CompressedReducer` (then
    ``compressor``, ``memory`` and ``seed`` must be left at their defaults). With ``sync_initial`` (the
    default, as DDP does) every rank starts from rank 0's parameters and buffers.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        *,
        compressor: str | Compressor = "identity",
        reducer: str | CompressedReducer = "auto",
        memory: str = "residual",
        seed: int = 0,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        accumulate: int = 1,
        sync_initial: bool = True,
        group: Group | None = None,
    ) -> None:
        ctx, g = world_group(group, "CompressedOptimizer")
        self.where = where = f"lowband.CompressedOptimizer on rank {ctx.rank}"
        self.group = g
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"{where}: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        self.bucket_mb, self.first_bucket_mb = check_bucket_mb(where, bucket_mb, first_bucket_mb)
        if isinstance(reducer, CompressedReducer):
            if (compressor, memory, seed) != ("identity", "residual", 0):
                raise InvalidArgumentError(
                    f"{where}: compressor, memory and seed belong to the built reducer {reducer!r}"
                )
            self.reducer = reducer
        else:
            self.reducer = build_reducer(compressor, reducer, memory, seed=seed, where=where)
        inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())
        if not isinstance(inner, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"{where}: optimizer must be a torch.optim.Optimizer or a factory of one, got "
                f"{type(inner).__name__}"
            )
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for grp in inner.param_groups for p in grp["params"]):
            raise InvalidArgumentError(f"{where}: the optimizer steps parameters that are not the model's")
        if isinstance(self.reducer.memory, DGCMemory):  # before any communication
            check_optimizer(inner)
        units = model_units(model, self.bucket_mb, self.first_bucket_mb)
        self.stage = GradientStage(
            units, self.reducer, group=g, accumulate=accumulate, where="CompressedOptimizer"
        )  # checks the layout on every rank: the first communication
        broadcast_initial_state(model, group=g, enabled=sync_initial)
        self.model = model
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = dict(inner.defaults)
        #: completed :meth:`step` calls
        self.steps = 0

    # torch.optim.Optimizer's own __init__ is not called (as torch's PostLocalSGDOptimizer does): the
    # state lives in the wrapped optimizer.
    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return self.inner.state

    @property
    def timings(self) -> Timings:
        """Seconds spent compressing and decoding (:class:`lowband.optim.reducer.Timings`)."""
        return self.reducer.timings

    def __repr__(self) -> str:
        return f"CompressedOptimizer({self.inner!r}, {self.reducer!r})"

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Complete the reductions (launching what is not launched yet), then step the wrapped
        optimizer on the averaged gradients."""
        if closure is not None:
            raise InvalidArgumentError(f"{self.where}: step(closure) is not supported")
        self.stage.wait()
        self.inner.step()
        self.steps += 1
        return None

    def synchronize(self) -> None:
        """Complete the reductions in flight (the averaged gradients are then in ``.grad``)."""
        self.stage.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage.in_flight():
            raise InvalidArgumentError(
                f"{self.where}: zero_grad() while gradients are being reduced (after backward, before step)"
            )
        self.inner.zero_grad(set_to_none=set_to_none)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and are not reduced."""
        with self.stage.no_sync():
            yield

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InvalidArgumentError(f"{self.where}: add_param_group: the units are fixed at construction")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the step count, the world size and the stage's state
        (reduction counter, memories, compressor and transport state). Completes the reductions."""
        self.stage.wait()
        return {
            "inner": self.inner.state_dict(),
            "steps": self.steps,
            "world_size": self.group.size,
            "transport": self.reducer.transport,
            "stage": self.stage.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or not {"inner", "steps", "stage"} <= set(state_dict):
            raise InvalidArgumentError(
                f"{self.where}: load_state_dict expects a dict with 'inner', 'steps' and 'stage', got "
                f"{sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__}"
            )
        n = state_dict.get("world_size", self.group.size)
        if n != self.group.size:
            raise InvalidArgumentError(
                f"{self.where}: the state was saved at {n} ranks, this group has {self.group.size}; "
                "re-shard every rank's state first (CompressedOptimizer.reshard_state_dicts)"
            )
        self.stage.wait()
        self.inner.load_state_dict(dict(state_dict["inner"]))
        self.stage.load_state_dict(dict(state_dict["stage"]))
        self.steps = int(state_dict["steps"])

    @staticmethod
    def reshard_state_dicts(states: Sequence[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Every rank's :meth:`state_dict` (in rank order) as states for ``world_size`` ranks: the
        wrapped optimizer's state and the counters are rank 0's (replicated), the reducer's state is
        re-sharded (:func:`lowband.compress.reshard.reshard_reducer_states`: memories keep their sum
        over ranks). Pure; at the same world size the states are returned unchanged."""
        where = "CompressedOptimizer.reshard_state_dicts"
        if not states or not all(isinstance(s, Mapping) and "stage" in s for s in states):
            raise InvalidArgumentError(f"{where}: expects every rank's state_dict, in rank order")
        if any(s.get("world_size", len(states)) != len(states) for s in states):
            raise InvalidArgumentError(f"{where}: {len(states)} states of another world size given")
        if any(s["stage"].get("rounds") != states[0]["stage"].get("rounds") for s in states):
            raise InvalidArgumentError(f"{where}: the states are of different reduction rounds")
        if world_size == len(states):
            return [copy.deepcopy(dict(s)) for s in states]
        reducers = reshard_reducer_states(
            [s["stage"]["reducer"] for s in states], world_size, states[0].get("transport"), where=where
        )
        out = []
        for red in reducers:
            st = copy.deepcopy(dict(states[0]))
            st["stage"] = {"rounds": states[0]["stage"]["rounds"], "reducer": red}
            st["world_size"] = world_size
            out.append(st)
        return out

    def remove_hooks(self) -> None:
        """Detach from the model (completing what is in flight first)."""
        self.stage.wait()
        self.stage.remove_hooks()
