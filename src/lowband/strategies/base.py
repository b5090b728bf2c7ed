"""The one interface every training strategy implements, so ``lowband bench`` can run any of them.

A strategy wraps a model and an optimizer (built by a factory, so the strategy decides which
parameters the optimizer sees) and owns all the communication of data-parallel training. The training
loop is the same for every strategy, and it is the API: ``train_step`` is exactly this loop::

    s = make_strategy("ddp", model, workload.make_optimizer)   # or a torch optimizer instance
    for batch in batches:
        s.zero_grad()
        loss = workload.loss(s.module, batch)   # forward through s.module (DDP's wrapper for ddp)
        s.backward(loss)
        s.clip_grad_norm_(1.0)                  # optional
        s.step()
        # or, in one call: loss = s.train_step(lambda m: workload.loss(m, batch))  -> float
    s.save("ckpt")                      # every rank: ckpt/rank{r}-of-{n}.pt, everything needed to resume
    s.load("ckpt")                      # (a fresh strategy, every rank) restores it, whichever loop follows
    dense = s.average_model(make_model())  # collective: the consensus model, for evaluation or export

The loop protocol. :meth:`zero_grad`, :meth:`backward`, :meth:`step` and :meth:`train_step` are the
base class's and are not overridden; a strategy implements the hooks they call: :meth:`clear_gradients`,
:meth:`run_backward` (one backward pass, the loss already scaled), :meth:`apply_step` (the update),
:meth:`begin_step` and :meth:`after_step` (after :attr:`steps` counted it). What a strategy needs before a step's forward it
arranges in :meth:`after_step` (for the next step), at construction and in :meth:`load_state_dict`, or in
a forward pre-hook on its module (DDP's bucket rebuild after a resume, DreamDDP's first profile:
:mod:`lowband.strategies.replay`), never in :meth:`train_step`, so both ways of stepping train alike.

Accumulation (``accumulate=J``, an option of every strategy, :meth:`set_accumulate`): a step applies the
gradients of J backward passes. :meth:`backward` scales each loss by 1/J (J micro-batches of a mean loss
then make the gradient of their big batch), the first J-1 passes only accumulate ``.grad`` locally (no gradient
communication, no layer stepped in backward: :meth:`local_pass`) and the J-th communicates. Both
loops work unchanged: :meth:`step` and :meth:`zero_grad` between the first and the J-th backward do
nothing, so ``J x (zero_grad, forward, backward, step)`` makes one step, as does ``zero_grad, J x
(forward, backward), step``; :meth:`train_step` is one micro-batch. :attr:`steps` counts applied steps.

Strategies integrate through PyTorch's own extension points (DDP and its comm hooks, torch's model
averagers, optimizer step hooks, post-accumulate-grad hooks); none re-implements an optimizer.

Sharded state: a model may hold parameters that live on one rank only (modules implementing
:class:`lowband.nn.sharding.Sharded`, found at construction in :attr:`Strategy.shards`) next to
replicated ones. :meth:`Strategy.in_sync` and :meth:`Strategy.replica_spread` are about the replicated
part; :meth:`Strategy.state_dict` saves this rank's shards with their layout; a checkpoint loads at
another world size once whole (:meth:`Strategy.full_state_dict`, or
:func:`lowband.strategies.sharded_state.assemble_state_dicts` of every rank's checkpoint; see there).

Precision. bf16 and fp16 run the forward and the loss under ``torch.autocast`` (the caller's ``loss_fn``)
while the parameters stay float32, so gradients, and every piece of strategy state derived from them
(error-feedback memories, outer momenta, DreamDDP's averaged layers, SlimGC's backup), stay float32.
fp16 also needs loss scaling: :meth:`Strategy.set_grad_scaler` hands the strategy a
``torch.amp.GradScaler``; :meth:`backward` then scales the loss, the gradients are unscaled before any
compression, clipping or step reads them (:mod:`lowband.optim.scaling`), a step with inf/NaN on any rank
is skipped on every rank, and the scale is updated after each step. Strategies that cannot do this
correctly refuse the scaler (:attr:`Strategy.no_grad_scaler_reason`) with one clear error.

Consensus: :meth:`Strategy.average_state_dict` / :meth:`Strategy.average_model` give the one model
to evaluate or export, for every strategy: replicated floating-point state averaged over the ranks
(skipped when :meth:`in_sync` says the replicas are identical), sharded parameters assembled whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from lowband.comm import collectives as comm
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.nn.sharding import ShardSpec, gather_full, shard_specs
from lowband.strategies import checkpoint, digest, sharded_state
from lowband.strategies.gradient_policy import GradientPolicies

if TYPE_CHECKING:
    from lowband.plan.links import Links
    from lowband.plan.prediction import Prediction
    from lowband.plan.profile import PlanProfile

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module], torch.Tensor]


T = TypeVar("T")


class Strategy(GradientPolicies):
    """A data-parallel training strategy on one rank.

    Subclasses set :attr:`name`, build their wrapped module and optimizer in ``__init__`` and
    implement the loop's hooks (:meth:`run_backward`, :meth:`apply_step`, ...: the defaults do plain
    local autograd and an optimizer step; never :meth:`backward`/:meth:`step` themselves), and
    :meth:`in_sync` (whether every rank's replica is identical right now).
    """

    name: str = "strategy"
    #: whether layers are stepped by the optimizer during backward (their gradients are consumed and
    #: cleared before ``backward`` returns): no clipping between backward and step, no second backward
    #: before :meth:`step` (refused with :class:`InvalidArgumentError`)
    steps_in_backward: bool = False
    #: why :meth:`clip_grad_norm_` is refused (None: supported)
    no_clip_reason: str | None = None
    #: the configuration every rank agreed on when make_strategy built it (lowband.strategies.digest);
    #: its options go into checkpoints and are compared when one is loaded (None: built directly)
    agreed_config: dict[str, str] | None = None

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> None:
        self.local_module = model
        self.optimizer = optimizer
        self.group = group
        self.steps = 0
        self.shards: dict[str, ShardSpec] = shard_specs(model)

    # -- the training loop (the protocol; strategies implement the hooks below) ----------------------
    @property
    def module(self) -> nn.Module:
        """The module to call forward on (a DDP wrapper, or the plain model)."""
        return self.local_module

    def zero_grad(self) -> None:
        """Clear the gradients (as torch's ``zero_grad``); between the first and the J-th backward of an
        accumulating step (``accumulate=J``) it keeps them."""
        if not 0 < self._passes < self.accumulate:
            self.begin_step()
            self.clear_gradients()

    def backward(self, loss: torch.Tensor, *, divided: bool = False) -> None:
        """One backward pass of ``loss`` (divided by ``accumulate``, then scaled by the grad scaler if one
        is set). The J-th pass since the last step communicates; earlier ones accumulate locally.
        ``divided=True``: the caller divided ``loss`` by ``accumulate`` already (front ends over a
        framework that normalises accumulated losses itself, :mod:`lowband.integrations`)."""
        if self.accumulate > 1 and not divided:
            loss = loss / self.accumulate
        with self.local_pass() if not self.syncing else contextlib.nullcontext():
            self.run_backward(self.scaled(loss))
        self._passes += 1

    def step(self) -> None:
        """Apply the step (after the J-th backward; between the first and the J-th it does nothing) and
        count it in :attr:`steps`."""
        if 0 < self._passes < self.accumulate:
            return
        self.apply_step()
        self._passes = 0
        self.steps += 1
        self.after_step()

    def train_step(self, loss_fn: LossFn) -> float:
        """The loop above in one call: zero_grad, forward (``loss_fn(self.module)``), backward, step.
        Returns the loss (with ``accumulate=J``: of this micro-batch; every J-th call steps)."""
        self.zero_grad()
        loss = loss_fn(self.module)
        self.backward(loss)
        self.step()
        # the protocol returns the loss as a float (the bench records every step's): one host sync
        return float(loss.detach())

    @property
    def syncing(self) -> bool:
        """Whether the coming (or running) backward pass is a step's J-th, the one that communicates
        (every pass with ``accumulate=1``)."""
        return self._passes + 1 >= self.accumulate

    # the hooks
    def begin_step(self) -> None:
        """Called by :meth:`zero_grad` when a step begins: per-step marks (a step timer's start)."""

    def clear_gradients(self) -> None:
        """:meth:`zero_grad`'s work: the gradients the next backward accumulates into, cleared."""
        self.optimizer.zero_grad(set_to_none=True)

    def run_backward(self, loss: torch.Tensor) -> None:
        """:meth:`backward`'s work: one backward pass of ``loss`` (already divided and scaled); inside
        :meth:`local_pass` when it is not the step's J-th."""
        loss.backward()  # type: ignore[no-untyped-call]

    def apply_step(self) -> None:
        """:meth:`step`'s work: the update (:meth:`optimizer_step` by default)."""
        self.optimizer_step()

    def after_step(self) -> None:
        """After a step, once :attr:`steps` counts it: per-step bookkeeping, and what the next step
        needs in place before its forward."""

    # -- accumulation ---------------------------------------------------------------------------
    accumulate: int = 1
    #: why ``accumulate > 1`` is refused (None: supported)
    no_accumulate_reason: str | None = None
    _passes = 0  # backward passes since the last step

    def set_accumulate(self, passes: int) -> None:
        """Apply the gradients of ``passes`` backward passes per step (see the module docstring);
        :func:`~lowband.strategies.make_strategy` calls it (option ``accumulate``, default 1). Every rank
        alike, before the first step."""
        where = f"{type(self).__name__} (accumulate={passes!r}) on rank {self.group.world_rank}"
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise InvalidArgumentError(f"{where}: accumulate must be an int >= 1, got {passes!r}")
        if passes > 1 and self.no_accumulate_reason is not None:
            raise InvalidArgumentError(
                f"{where}: strategy {self.name!r} cannot accumulate backward passes: "
                f"{self.no_accumulate_reason}; use accumulate=1 and a larger batch"
            )
        if self._passes:
            raise InvalidArgumentError(f"{where}: set accumulate between steps, not after a backward")
        self.accumulate = passes
        self.configure_accumulation(passes)

    def configure_accumulation(self, passes: int) -> None:
        """Strategies whose communication counts passes itself (BlueFog's optimizers) set it here."""

    @contextlib.contextmanager
    def local_pass(self) -> Iterator[None]:
        """Around a backward pass that is not a step's J-th: no gradient communication and no layer
        stepped in it. By default every gradient stage of the strategy (:meth:`gradient_stages`) holds
        its reductions (``GradientStage.no_sync``); strategies reducing elsewhere override it, or decide
        before the forward from :attr:`syncing` (DDP)."""
        with contextlib.ExitStack() as stack:
            for stage in self.gradient_stages():
                stack.enter_context(stage.no_sync())
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        """Between :meth:`backward` and :meth:`step`: clip the gradients :meth:`step` will apply (after
        their communication, :meth:`finish_gradients`) to total norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping. Between the first
        and the J-th backward of an accumulating step it clips nothing and returns None (the gradients
        are not complete yet). Strategies that step in backward (or otherwise cannot) raise
        :class:`InvalidArgumentError` instead."""
        where = f"{type(self).__name__}.clip_grad_norm_ on rank {self.group.world_rank}"
        reason = self.no_clip_reason
        if reason is None and self.steps_in_backward:
            reason = (
                "it steps each layer during backward, so its gradients are applied and cleared before "
                "backward returns"
            )
        if reason is not None:
            raise InvalidArgumentError(
                f"{where}: strategy {self.name!r} cannot clip gradients between backward and step: {reason}"
            )
        if 0 < self._passes < self.accumulate:
            return None
        self.finish_gradients()
        self.unscale_gradients()  # clip true gradients, not scaled ones
        grads = [p for p in self.local_module.parameters() if p.grad is not None]
        # the norm is returned as a float (the protocol's, torch's own is a tensor): a host sync
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type))

    def synchronize(self) -> None:
        """Finish all in-flight communication (between steps by default only the local-step strategies'
        non-finite agreements, :mod:`lowband.optim.nonfinite`)."""
        self.settle_nonfinite("synchronize()")

    def lookahead(self, ids: Mapping[str, torch.Tensor]) -> None:
        """After a step: the ids each embedding table (by module name) will be called on in the next
        step, for strategies that issue lookups ahead (``embrace:schedule=horizontal|2d``); ignored by
        default. Call it on every rank alike."""

    def side_collective(self, fn: Callable[[], T], what: str, alone: Callable[[], T]) -> T:
        """``fn()``, a collective on :attr:`group` outside the strategy's own steps (the checkpoint loop's
        stop agreement); strategies that train on without a lost rank return ``alone()`` instead while
        a loss is pending (:mod:`lowband.strategies.peer_loss`)."""
        return fn()

    def membership_settled(self) -> bool:
        """False while a lost rank is noticed and its membership not yet agreed (on_peer_loss)."""
        return True

    def in_sync(self) -> bool:
        """True when, by construction, every rank holds the same replicated parameters after the last
        step (always for synchronous SGD; after an averaging step for periodic averaging). Sharded
        parameters differ across ranks by design and are not part of it."""
        return True

    def replicated_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters every rank holds a copy of (all but :attr:`shards`)."""
        return [(n, p) for n, p in self.local_module.named_parameters() if n not in self.shards]

    def replica_spread(self) -> float:
        """Collective: max over replicated parameter entries of (max over ranks - min over ranks);
        0.0 when every rank's replicated parameters are identical (a hash of them agreed first: the
        parameters travel only where the replicas differ or hold a non-finite value, then once, in their
        own dtype, where max and min are exact: ``[x, -x]`` reduced by max)."""
        by_dtype: dict[str, list[torch.Tensor]] = {}
        for _, p in self.replicated_parameters():
            by_dtype.setdefault(str(p.dtype), []).append(p.detach().reshape(-1))
        flats = [torch.cat(by_dtype[k]) for k in sorted(by_dtype)]
        if not flats:
            return 0.0
        where = f"{type(self).__name__}.replica_spread on rank {self.group.world_rank}"
        if all(bool(torch.isfinite(f).all()) for f in flats) and digest.identical_on_every_rank(
            self.group, flats, where
        ):
            return 0.0
        spreads = [torch.zeros((), dtype=torch.float64)]
        for flat in flats:
            both = comm.allreduce(torch.cat([flat, -flat]), op="max", group=self.group)
            hi, lo = both[: flat.numel()].double(), -both[flat.numel() :].double()
            spreads += [(hi - lo).abs().max().cpu()] if flat.numel() else []
        return float(torch.stack(spreads).max())  # NaN where a replica holds one

    # -- consensus for evaluation and export ------------------------------------------------------
    def average_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective (every rank of the strategy's group calls it): the model's state dict as one
        model, the same on every rank, without touching training. Floating-point replicated entries
        are averaged over the ranks (unless :meth:`in_sync`), other entries are this rank's, sharded
        parameters are assembled whole (so it loads into the dense model)."""
        self.synchronize()
        sd = {k: v.detach().clone() for k, v in self.local_module.state_dict().items()}
        for name, spec in self.shards.items():
            sd[name] = gather_full(sd[name], spec, group=self.group)
        if self.group.size > 1 and not self.in_sync():
            keys = [k for k, v in sd.items() if k not in self.shards and v.is_floating_point()]
            for dtype in sorted({sd[k].dtype for k in keys}, key=str):
                ks = [k for k in keys if sd[k].dtype == dtype]
                flat = comm.allreduce(torch.cat([sd[k].reshape(-1) for k in ks]), group=self.group)
                pos = 0
                for k in ks:
                    sd[k] = flat[pos : pos + sd[k].numel()].view_as(sd[k])
                    pos += sd[k].numel()
        return sd

    def average_model(self, into: nn.Module) -> nn.Module:
        """Collective: :meth:`average_state_dict` loaded into ``into`` (a fresh instance of the dense
        model), which is returned."""
        into.load_state_dict(self.average_state_dict())
        return into

    # -- the cost model (lowband plan) -----------------------------------------------------------------
    #: the settings ``lowband plan`` predicts by default, each ``key=value,...`` ("": the defaults)
    plan_grid: ClassVar[tuple[str, ...]] = ("",)
    #: options for a strategy that takes over a run in progress (``auto``'s switch), where a warm-up
    #: meant for the first steps of training has served its purpose; a spec's own options win
    mid_run_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        """This strategy's predicted step (:class:`lowband.plan.prediction.Prediction`) on the workload
        ``profile`` over ``links`` with ``options`` (every option of the strategy, defaults filled in);
        pure, talks to no rank. None (the default): no model."""
        return None

    # -- reports and checkpoints ------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        """Name and parameters, for reports."""
        return {}

    def report(self) -> dict[str, Any]:
        """Facts the strategy knows about itself, for the bench's results (JSON-able: numbers, strings,
        lists and dicts of them): e.g. ``predicted_step_s`` (a cost model's predicted mean iteration
        time, compared there with the measured one), timings, tables. Local (no communication); the
        bench stores every rank's, after the last round (rank 0's as ``report``, all as
        ``report_ranks``)."""
        return {}

    def label(self) -> str:
        hp = ", ".join(f"{k}={v}" for k, v in self.hparams().items())
        return f"{self.name}({hp})" if hp else self.name

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Collective: this rank's :meth:`state_dict` written atomically to ``folder/rank{r}-of-{n}.pt``
        (one file per rank; :mod:`lowband.strategies.checkpoint`); returns the file. Call it between
        steps, on every rank of the group."""
        return checkpoint.save(self, folder)

    def load(self, folder: str | os.PathLike[str]) -> Path:
        """Collective: this rank's file of ``folder`` (written by :meth:`save` at the same world size)
        read with ``weights_only=True`` and loaded (:meth:`load_state_dict`); returns the file. A missing
        or unreadable file on any rank raises on every rank, naming the rank and the file."""
        return checkpoint.load(self, folder)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume on this rank (its own shards, with their layout); between steps
        (not between the first and the J-th backward of an accumulating step). Strategies complete
        first what is in flight and cannot be saved (reductions whose updates are still due)."""
        if 0 < self._passes < self.accumulate:
            raise InvalidArgumentError(
                f"{type(self).__name__}.state_dict on rank {self.group.world_rank}: {self._passes} of "
                f"{self.accumulate} backward passes of the step are accumulated; save after step()"
            )
        self.settle_nonfinite("state_dict()")  # local steps: a non-finite gradient is raised first
        state = {
            "strategy": self.name,
            "steps": self.steps,
            "world_size": self.group.size,  # per-rank state of another size loads only if replicated
            "model": self.local_module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extra": self.extra_state(),
        }
        if self.shards:
            state["sharding"] = self._layout(self.shards, full=False)
        if self.agreed_config is not None:  # what the state means, checked when it is loaded
            state["config"] = digest.checkpoint_config(self.agreed_config)
        return state

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: :meth:`state_dict` with every sharded tensor (parameters and their optimizer
        state) assembled whole; loads at any world size. Replicated state is this rank's."""
        state = self.state_dict()
        if not self.shards:
            return state
        g = self.group
        out = sharded_state.map_sharded(
            state,
            self.shards,
            self._optimizer_names(),
            lambda _n, spec, t: gather_full(t, spec, group=g),
            shard_shape=lambda s: s.local_shape,
        )
        out["sharding"] = self._layout(
            {n: sharded_state.full_spec(s) for n, s in self.shards.items()}, full=True
        )
        return out

    def _optimizer_names(self) -> list[str]:
        return sharded_state.optimizer_param_names(self.optimizer, self.local_module)

    def _layout(self, specs: dict[str, ShardSpec], *, full: bool) -> dict[str, Any]:
        return sharded_state.layout(
            specs, self.group.rank, self.group.size, full=full, optimizer_names=self._optimizer_names()
        )

    def _localize(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with this rank's slices of every sharded tensor (re-sharding a full checkpoint)."""
        where = f"{type(self).__name__}.load_state_dict on rank {self.group.rank}"
        return sharded_state.localize(state, self.shards, self.group.size, where)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: checkpoint is for strategy {state.get('strategy')!r}, "
                f"not {self.name!r}"
            )
        digest.check_checkpoint(self, state)  # collective: the ranks load one save, of these options
        state = self._localize(state)
        self.steps, self._passes = int(state["steps"]), 0
        self.local_module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_extra_state(state.get("extra", {}))

    def extra_state(self) -> dict[str, Any]:
        """Strategy state beyond model and optimizer (compression memory, counters, schedules)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`extra_state`."""

    def close(self) -> None:
        """Release hooks and buffers."""
