"""The one interface every training strategy implements, so ``lowband bench`` can run any of them.

A strategy wraps a model and an optimizer (built by a factory, so the strategy decides which
parameters the optimizer sees) and owns all the communication of data-parallel training. The training
loop is the same for every strategy::

    s = make_strategy("ddp", model, workload.make_optimizer)   # or a torch optimizer instance
    for batch in batches:
        loss = s.train_step(lambda m: workload.loss(m, batch))
        # or, spelled out: s.zero_grad(); loss = workload.loss(s.module, batch); s.backward(loss);
        #                  s.clip_grad_norm_(1.0)  (optional); s.step()
    s.synchronize()                     # finish in-flight communication (before eval / checkpoint)
    torch.save(s.state_dict(), path)    # everything needed to resume
    dense = s.average_model(make_model())  # collective: the consensus model, for evaluation or export

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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lowband.comm import collectives as comm
from lowband.errors import CommFailedError, CommTimeoutError, InvalidArgumentError
from lowband.group import Group
from lowband.nn.sharding import ShardSpec, gather_full, shard_specs
from lowband.optim.nonfinite import NonFiniteGuard
from lowband.optim.scaling import GradUnscaler
from lowband.optim.stage import GradientStage
from lowband.strategies import digest, sharded_state

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module], torch.Tensor]


class Strategy:
    """A data-parallel training strategy on one rank.

    Subclasses set :attr:`name`, build their wrapped module and optimizer in ``__init__`` and
    implement :meth:`backward`/:meth:`step` (the defaults do plain local autograd and an optimizer
    step), and :meth:`in_sync` (whether every rank's replica is identical right now).
    """

    name: str = "strategy"
    #: whether layers are stepped by the optimizer during backward (their gradients are consumed and
    #: cleared before ``backward`` returns): no clipping between backward and step, no second backward
    #: before :meth:`step` (refused with :class:`InvalidArgumentError`)
    steps_in_backward: bool = False
    #: why :meth:`clip_grad_norm_` is refused (None: supported)
    no_clip_reason: str | None = None
    #: why fp16 loss scaling (:meth:`set_grad_scaler`) is refused (None: supported). Refused unless a
    #: strategy says how its gradients are unscaled before they are communicated or stepped.
    no_grad_scaler_reason: str | None = (
        "it has not been made safe for loss scaling (its gradients could be communicated or applied while "
        "still scaled)"
    )
    #: with a scaler: unscale each unit before communicating it (True; the strategy wires
    #: :attr:`unscaler` in :meth:`_attach_unscaler`) or ``.grad`` once before the step (False)
    unscale_per_unit: bool = False
    #: with a scaler: the ranks agree on inf/NaN before stepping (one 1-element allreduce per step);
    #: False only where the gradients are identical on every rank already (DDP's allreduce) or the
    #: ranks never communicate
    agree_found_inf: bool = True
    grad_scaler: torch.amp.GradScaler | None = None
    unscaler: GradUnscaler | None = None
    _grads_unscaled: bool = False
    #: the configuration every rank agreed on when make_strategy built it (lowband.strategies.digest);
    #: its options go into checkpoints and are compared when one is loaded (None: built directly)
    agreed_config: dict[str, str] | None = None

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Group) -> None:
        self.local_module = model
        self.optimizer = optimizer
        self.group = group
        self.steps = 0
        self.shards: dict[str, ShardSpec] = shard_specs(model)

    # -- what the training loop calls -------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The module to call forward on (a DDP wrapper, or the plain model)."""
        return self.local_module

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled by the grad scaler, if one is set)."""
        self.scaled(loss).backward()  # type: ignore[no-untyped-call]

    def step(self) -> None:
        self.optimizer_step()

    # -- fp16 loss scaling ------------------------------------------------------------------------
    def set_grad_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Train with fp16 loss scaling by ``scaler`` (see the module docstring); every rank, before the
        first step. Raises :class:`InvalidArgumentError` where the strategy cannot do it correctly."""
        where = f"{type(self).__name__}.set_grad_scaler on rank {self.group.world_rank}"
        reason = self.no_grad_scaler_reason
        if reason is None and self.steps_in_backward:
            reason = "it steps each layer during backward, before the whole gradient is known to be finite"
        if reason is not None:
            raise InvalidArgumentError(
                f"{where}: strategy {self.name!r} cannot train with fp16 loss scaling: {reason}; use bf16 "
                "(--precision bf16: no scaler needed) or fp32"
            )
        if self.grad_scaler is not None or self.steps:
            raise InvalidArgumentError(f"{where}: set the grad scaler once, before the first step")
        self.unscaler = GradUnscaler(
            scaler, per_unit=self.unscale_per_unit, agree=self.agree_found_inf, where=where
        )
        self.grad_scaler = scaler
        self._attach_unscaler(self.unscaler)

    def _attach_unscaler(self, unscaler: GradUnscaler) -> None:
        """Strategies with :attr:`unscale_per_unit` hand ``unscaler`` to where units are communicated."""

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the grad scaler's scale (``loss`` itself without a scaler)."""
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    def unscale_gradients(self) -> None:
        """With a grad scaler: the gradients in ``.grad`` unscaled (once per step) and the ranks' inf/NaN
        flags agreed and recorded for the optimizer; nothing without one. Call after
        :meth:`finish_gradients`."""
        if self.unscaler is None or self._grads_unscaled:
            return
        self.unscaler.finish(self.optimizer, self.group)
        self._grads_unscaled = True

    def optimizer_step(self) -> None:
        """The wrapped optimizer's step; with a grad scaler, after :meth:`unscale_gradients`, skipped on
        every rank when any rank's gradients held inf/NaN, then the scale updated."""
        if not self.check_nonfinite():
            return  # skipped on every rank: no optimizer step (nor a model averager's count or average)
        if self.grad_scaler is None:
            self.optimizer.step()
            return
        self.unscale_gradients()
        # GradScaler.step decides on the host whether to skip: it reads the agreed flag (a host
        # synchronisation on accelerators, unavoidable: skipping is host control flow)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._grads_unscaled = False

    def finish_gradients(self) -> None:
        """Complete the gradient communication of the last backward (the gradients in ``.grad`` are the
        ones :meth:`step` will apply once this returns)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Between :meth:`backward` and :meth:`step`: clip the gradients :meth:`step` will apply (after
        their communication, :meth:`finish_gradients`) to total norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping. Strategies that step
        in backward (or otherwise cannot) raise :class:`InvalidArgumentError` instead."""
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
        self.finish_gradients()
        self.unscale_gradients()  # clip true gradients, not scaled ones
        grads = [p for p in self.local_module.parameters() if p.grad is not None]
        # the norm is returned as a float (the protocol's, torch's own is a tensor): a host sync
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type))

    def train_step(self, loss_fn: LossFn) -> float:
        """One iteration: zero grads, forward (``loss_fn(self.module)``), backward, step. Returns the loss."""
        self.zero_grad()
        loss = loss_fn(self.module)
        self.backward(loss)
        self.step()
        self.steps += 1
        # the protocol returns the loss as a float (the bench records every step's): one host sync
        return float(loss.detach())

    def synchronize(self) -> None:
        """Finish all in-flight communication (nothing is in flight between steps by default)."""

    def lookahead(self, ids: Mapping[str, torch.Tensor]) -> None:
        """After a step: the ids each embedding table (by module name) will be called on in the next
        step, for strategies that issue lookups ahead (``embrace:schedule=horizontal|2d``); ignored by
        default. Call it on every rank alike."""

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
        0.0 when every rank's replicated parameters are identical."""
        params = [p.detach().reshape(-1).double() for _, p in self.replicated_parameters()]
        flat = torch.cat(params) if params else torch.zeros(1, dtype=torch.float64)
        hi = comm.allreduce(flat, op="max", group=self.group)
        lo = comm.allreduce(flat, op="min", group=self.group)
        return float((hi - lo).abs().max()) if flat.numel() else 0.0

    # -- the non-finite policy (lowband.optim.nonfinite) ------------------------------------------
    nonfinite: NonFiniteGuard | None = None
    #: why on_nonfinite="skip" is refused (None: supported, unless the strategy steps in backward)
    no_skip_reason: str | None = None

    def set_nonfinite(self, policy: str) -> None:
        """Catch non-finite gradients by ``policy`` ("raise", "skip" or "off", :mod:`lowband.optim.nonfinite`);
        :func:`~lowband.strategies.make_strategy` calls it (option ``on_nonfinite``, default "raise").
        Every rank alike, before the first step."""
        where = f"{type(self).__name__} (on_nonfinite={policy!r}) on rank {self.group.world_rank}"
        reason = self.no_skip_reason
        if reason is None and self.steps_in_backward:
            reason = "it steps each layer during backward, before the whole gradient is known to be finite"
        if policy == "skip" and reason is not None:
            raise InvalidArgumentError(
                f"{where}: strategy {self.name!r} cannot skip a step: {reason}; use on_nonfinite='raise'"
            )
        self.nonfinite = NonFiniteGuard(
            policy, self.group, where=where, step=lambda: self.steps, channel=self.nonfinite_channel()
        )
        for stage in self.gradient_stages():
            self.nonfinite.attach(stage)

    def nonfinite_channel(self) -> Group | None:
        """A private group to agree the non-finite flags on, for strategies whose data group another
        thread uses at step time (None: the data group)."""
        return None

    def gradient_stages(self) -> list[GradientStage]:
        """The gradient stages whose units the non-finite guard checks before they are communicated or
        stepped: by default those held as ``stage`` by the strategy, its optimizer, or the optimizer's
        ``layerwise`` part; strategies keeping stages elsewhere override it."""
        owners = (self, self.optimizer, getattr(self.optimizer, "layerwise", None))
        found = [getattr(o, "stage", None) for o in owners]
        return [s for i, s in enumerate(found) if isinstance(s, GradientStage) and s not in found[:i]]

    def check_nonfinite(self) -> bool:
        """Before stepping, once per step, on every rank: the gradients' finiteness agreed (one tiny
        allreduce and one host read); raises :class:`~lowband.errors.NonFiniteError` on every rank
        (policy "raise") or returns False with every gradient set to None (policy "skip": the optimizer
        step that follows updates nothing); True to step. With a grad scaler the scaler decides."""
        guard = self.nonfinite
        if guard is None or self.grad_scaler is not None:
            return True
        self.finish_gradients()
        covered = guard.covered()
        try:
            return guard.decide(
                [(n, p) for n, p in self.local_module.named_parameters() if id(p) not in covered]
            )
        except (CommFailedError, CommTimeoutError) as exc:  # a dead or stopped peer, met at the agreement
            raise type(exc)(
                f"strategy {self.name!r}: the non-finite check at step {self.steps} on rank "
                f"{self.group.world_rank}: {exc}"
            ) from exc

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

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume on this rank (its own shards, with their layout)."""
        state = {
            "strategy": self.name,
            "steps": self.steps,
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
        lay = state.get("sharding")
        if not self.shards and lay is None:
            return state
        where = f"{type(self).__name__}.load_state_dict on rank {self.group.rank}"
        saved_names = sorted(lay["params"]) if lay is not None else []
        if lay is None or saved_names != sorted(self.shards):
            raise InvalidArgumentError(
                f"{where}: the checkpoint's sharded parameters {saved_names} are not this model's {sorted(self.shards)}"
            )
        saved = {n: ShardSpec.from_dict(d) for n, d in lay["params"].items()}
        for n, spec in self.shards.items():
            if (saved[n].dim, saved[n].global_shape) != (spec.dim, spec.global_shape):
                raise InvalidArgumentError(
                    f"{where}: {n!r} was saved cut along dim {saved[n].dim} of {saved[n].global_shape}, "
                    f"this model cuts dim {spec.dim} of {spec.global_shape}"
                )
        if lay["full"]:
            return sharded_state.map_sharded(
                state,
                saved,
                lay["optimizer_names"],
                lambda n, _s, t: self.shards[n].slice(t),
                shard_shape=lambda s: s.global_shape,
            )
        if any(saved[n] != self.shards[n] for n in self.shards):
            raise InvalidArgumentError(
                f"{where}: the checkpoint holds the shards of rank {lay['rank']} of a world of "
                f"{lay['world_size']}, this rank (of {self.group.size}) holds other slices; load a full "
                f"checkpoint (Strategy.full_state_dict(), or assemble_state_dicts of every rank's checkpoint)"
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: checkpoint is for strategy {state.get('strategy')!r}, "
                f"not {self.name!r}"
            )
        digest.check_checkpoint(self, state)  # collective: the ranks load one save, of these options
        state = self._localize(state)
        self.steps = int(state["steps"])
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
