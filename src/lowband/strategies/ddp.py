"""Synchronous data parallelism with torch DDP (the S-SGD / WFBP baseline) and DDP + PowerSGD.

Used exactly as PyTorch ships them: DDP buckets gradients and launches each bucket's allreduce from the
autograd engine as soon as the bucket is ready, overlapping communication with the rest of backward;
PowerSGD replaces the bucket allreduce with torch's ``powerSGD_hook`` (low-rank compression with error
feedback and warm start); ``ddp:hook=fp16`` with torch's ``fp16_compress_hook`` (half precision on the
wire).

Exact resume. DDP buckets the gradients in parameter order for its first backward and, from the second
iteration on, in the order the first backward produced them. A DDP built to resume a checkpoint would
run its first step in parameter order: the allreduce then sums each element in another order (rounding
differences at 3+ ranks) and PowerSGD's error memory and warm-start factors, kept per bucket, would be
applied to the wrong layout. So a checkpoint records whether DDP had already run a backward, and the
first training forward after :meth:`load_state_dict` (``train_step``'s or the user's own loop's: a
forward pre-hook on the DDP module, :class:`~lowband.strategies.replay.ForwardReplay`) is preceded by one
extra forward and backward on its inputs outside training (random state, module buffers and gradients
put back, no optimizer step), only so that DDP rebuilds its buckets as the uninterrupted run did; the
PowerSGD state is applied after it. The resumed run then matches the uninterrupted one bit for bit.

Accumulation (``accumulate=J``): the same pre-hook sets DDP's ``require_backward_grad_sync`` before
every forward (what ``DDP.no_sync()`` sets), off for a step's first J-1 passes: their gradients
accumulate in ``.grad`` and the J-th pass's backward reduces the sum, bucket by bucket.

fp16 loss scaling (:meth:`Strategy.set_grad_scaler`). ``ddp`` takes torch's own path: DDP averages the
scaled gradients, so every rank holds the same ones (an overflow on any rank is inf/NaN in everyone's
average) and ``GradScaler.unscale_`` / ``step`` / ``update`` decide alike on every rank with no extra
communication. ``powersgd`` cannot: its error-feedback memory would hold scaled values and be poisoned
for good by one overflow. Its comm hook therefore unscales each bucket first (a bucket holding inf/NaN
on this rank is zeroed, :mod:`lowband.optim.scaling`), and the ranks agree on the flag before the step.

Non-finite gradients (:mod:`lowband.optim.nonfinite`). ``ddp`` checks each bucket in a comm hook, torch's
``allreduce_hook`` with the check fused into its division by the group size (a power of two; other sizes
check first, then run torch's hook): a rank's inf/NaN rides the average to every rank (nothing stateful
sees it), so a clean step needs no exchange of flags; the averaged gradients are checked before the
step, and only a non-finite one makes the ranks exchange who held it. ``powersgd`` zeroes a bad bucket
before PowerSGD's memory sees it and the ranks agree on the flag every step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from lowband.comm.initial import claim_initial_broadcast
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.finite import poison_
from lowband.optim.nonfinite import NonFiniteGuard, snapshot
from lowband.optim.scaling import GradUnscaler, check_scaled_, exact_scale
from lowband.options import Opt, Options
from lowband.rng import fork_rng
from lowband.strategies.base import LossFn, OptimizerFactory, Strategy
from lowband.strategies.psgd_cpu import tolerate_cpu_buckets
from lowband.strategies.registry import register_strategy
from lowband.strategies.replay import ForwardReplay
from lowband.strategies.torchcomm import comm_errors

if TYPE_CHECKING:
    from lowband.plan.links import Links
    from lowband.plan.prediction import Prediction
    from lowband.plan.profile import PlanProfile

#: torch's own stateless DDP comm hooks that work on gloo (``ddp:hook=fp16``); bf16_compress_hook fails
#: on gloo in torch 2.13
_TORCH_HOOKS: dict[str, Any] = {"none": None, "fp16": default_hooks.fp16_compress_hook}


_BUCKET_CAP = Opt(float, min=0.001, unit="MB", doc="DDP's bucket size (bucket_cap_mb)")


class _DDP(DistributedDataParallel):
    """torch's DDP, whose forward's own communication (the bucket rebuild after the first backward,
    buffer broadcasts) fails as lowband's errors do, naming the strategy and the rank, whichever loop
    calls it (:mod:`lowband.strategies.torchcomm`)."""

    lowband_errors: tuple[str, Group]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        name, group = self.lowband_errors
        with comm_errors(name, "forward (DDP's bucket rebuild, buffer broadcast)", group):
            return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]


@dataclass
class _CheckedAllreduce:
    """The comm hook's state under the non-finite policy: the group, and the guard that checks this
    step's buckets (None: none does; the strategy's current guard, read at every bucket)."""

    pg: Any
    guard: Callable[[], NonFiniteGuard | None]


def _checked_allreduce_hook(
    state: _CheckedAllreduce, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``allreduce_hook`` after the bucket's inf/NaN check (carried: not zeroed, module docstring)."""
    guard = state.guard()
    label = f"DDP bucket {bucket.index()}"
    n = state.pg.size()
    if guard is not None and guard.enabled and exact_scale(n):
        # torch's hook divides the bucket by the group size before summing; here that division is the
        # check (one fused pass, bit for bit the same average), no finite sum overflows, and the
        # average's first element tells (a sentinel): decide() reads one element per bucket
        buf = bucket.buffer()
        flag = check_scaled_([buf], 1.0 / n)
        poison_(buf, flag)
        guard.ride_(label, buf.view(-1)[:1], flag)
        work = dist.all_reduce(buf, group=state.pg, async_op=True)
        assert work is not None
        out: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda f: f.value()[0])
        return out
    if guard is not None:  # a group size whose division is not exact: checked, then torch's hook
        guard.check_([bucket.buffer()], label, carried=True, zero=False, sentinel=True)
    return default_hooks.allreduce_hook(state.pg, bucket)


_checked_allreduce_hook.__annotations__ = {
    "state": _CheckedAllreduce,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


@register_strategy(
    "ddp",
    "S-SGD: torch DDP, bucketed allreduce overlapped with backward (WFBP)",
    Options(
        {
            "bucket_cap_mb": _BUCKET_CAP,
            "hook": Opt(
                str, choices=tuple(_TORCH_HOOKS), doc="torch's comm hook: none, or fp16_compress_hook"
            ),
        }
    ),
)
class DDPStrategy(Strategy):
    name = "ddp"
    # fp16: torch's own path (module docstring): identical averaged gradients on every rank
    no_grad_scaler_reason = None
    agree_found_inf = False
    #: the non-finite check in lowband's allreduce comm hook, the flag riding the average (module docstring)
    carry_nonfinite = True

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        bucket_cap_mb: float = 25.0,
        hook: str = "none",
    ) -> None:
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.hook = hook
        # DDP broadcasts rank 0's model itself (once: not when make_strategy is told broadcast_init=False)
        self.ddp = _DDP(
            model,
            process_group=group.pg,
            bucket_cap_mb=self.bucket_cap_mb,
            init_sync=claim_initial_broadcast(),
        )
        self.ddp.lowband_errors = (self.name, group)
        self._checked: _CheckedAllreduce | None = None
        if _TORCH_HOOKS[hook] is not None:
            self.ddp.register_comm_hook(group.pg, _TORCH_HOOKS[hook])
        super().__init__(model, make_optimizer(model.parameters()), group)
        self._ran_backward = False  # DDP has seen a backward: its buckets follow the gradient order
        self._rebucket_pending = False  # loaded from a checkpoint taken after a backward
        self._sync_hook = self.ddp.register_forward_pre_hook(self._before_forward)
        self._replay = ForwardReplay(
            self.ddp, lambda: self._rebucket_pending, self._rebucket, where=f"strategy {self.name!r}"
        )

    @property
    def module(self) -> nn.Module:
        return self.ddp

    def set_nonfinite(self, policy: str) -> None:
        super().set_nonfinite(policy)
        guard = self.nonfinite
        assert guard is not None  # (set by the base)
        guard.params_averaged = True  # what the step checks is DDP's average (module docstring)
        if not guard.enabled or not self.carry_nonfinite or self.hook != "none":
            return
        if self._checked is None:  # a comm hook is registered once
            self._checked = _CheckedAllreduce(self.group.pg, self._bucket_guard)
            self.ddp.register_comm_hook(self._checked, _checked_allreduce_hook)
        guard.rides_data = True

    def _bucket_guard(self) -> NonFiniteGuard | None:
        """The guard the comm hook checks buckets for: none under a grad scaler (it decides) or once a
        later policy no longer rides the data."""
        guard = self.nonfinite
        return guard if guard is not None and guard.rides_data and self.grad_scaler is None else None

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        # DDP reads it in this forward: whether the coming backward reduces (accumulate; the rebucketing
        # pass always does)
        self.ddp.require_backward_grad_sync = self.syncing or self._replay.running

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models

        return models.ddp(profile, links, options)

    def hparams(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb, **({"hook": self.hook} if self.hook != "none" else {})}

    def run_backward(self, loss: torch.Tensor) -> None:
        syncing = self.syncing
        with comm_errors(self.name, "backward (DDP bucket allreduce)", self.group):
            super().run_backward(loss)
        self._ran_backward = self._ran_backward or syncing  # a reducing pass records the gradient order

    def _rebucket(self, loss_fn: LossFn) -> None:
        """One forward and backward that leaves no trace but DDP's rebuilt buckets (module docstring)."""
        # the gradients so far (None after zero_grad), put back after the pass
        grads = {p: None if p.grad is None else p.grad.clone() for p in self.local_module.parameters()}
        buffers = [b.detach().clone() for b in self.local_module.buffers()]
        cuda = sorted({p.get_device() for p in self.local_module.parameters() if p.is_cuda})
        what = "the bucket-rebuilding pass after a resume"
        with comm_errors(self.name, what, self.group), fork_rng(devices=cuda):
            loss_fn(self.ddp).backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for p, g in grads.items():
                p.grad = g
            for b, saved in zip(self.local_module.buffers(), buffers, strict=True):
                b.copy_(saved)
        self._rebucket_pending = False
        self._ran_backward = True
        if self.unscaler is not None:
            self.unscaler.discard()  # that pass's overflow flags are not the next step's
        if self.nonfinite is not None:
            self.nonfinite.discard()
        self._after_rebucket()

    def _after_rebucket(self) -> None:
        """Subclasses apply state laid out in the rebuilt buckets here."""

    def extra_state(self) -> dict[str, Any]:
        return {"ddp_ran_backward": self._ran_backward or self._rebucket_pending}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        # checkpoints written before this key existed resume as before (parameter-order first step)
        self._rebucket_pending = bool(state.get("ddp_ran_backward", False)) and not self._ran_backward

    def close(self) -> None:
        self._sync_hook.remove()
        self._replay.remove()


# PowerSGDState slots that change while training (the rest are the constructor's hyperparameters)
_PSGD_DYNAMIC = (
    "error_dict", "p_memory_dict", "q_memory_dict", "iter",
    "total_numel_before_compression", "total_numel_after_compression", "next_stats_report",
)  # fmt: skip


def _rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    """numpy's generator state as tensors and numbers (loadable with ``torch.load(weights_only=True)``)."""
    state = rng.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: ("MT19937", keys, pos, has_gauss, cached_gaussian)
    kind, keys, pos, has_gauss, gauss = state
    return {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}  # fmt: skip


def _set_rng_state(rng: np.random.RandomState, st: dict[str, Any]) -> None:
    keys = st["keys"].numpy().astype(np.uint32)
    rng.set_state((st["kind"], keys, st["pos"], st["has_gauss"], st["cached_gaussian"]))


@dataclass
class _ScaledPowerSGD:
    """The comm hook's state: torch's PowerSGD state, the unscaler once fp16 scaling is on, and the
    non-finite guard (with, under ``skip``, the hook's state as the step began)."""

    psgd: psgd.PowerSGDState
    unscaler: GradUnscaler | None = None
    guard: NonFiniteGuard | None = None
    saved: dict[str, Any] | None = None

    def restore(self) -> None:
        """A skipped step: PowerSGD's error memory, factors and counters as the step began."""
        if self.saved is not None:
            for slot, value in self.saved.items():
                setattr(self.psgd, slot, value)
            self.saved = None


def _scaled_powersgd_hook(state: _ScaledPowerSGD, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` on the bucket, unscaled first when loss scaling is on, else checked
    for inf/NaN (zeroed and flagged on the device) so that none reaches PowerSGD's error memory."""
    if state.unscaler is not None:
        state.unscaler.unscale_([bucket.buffer()])
    elif state.guard is not None and state.guard.enabled:
        if state.guard.policy == "skip" and bucket.index() == 0:  # the step's first bucket
            state.saved = snapshot({slot: getattr(state.psgd, slot) for slot in _PSGD_DYNAMIC})
        state.guard.check_([bucket.buffer()], f"DDP bucket {bucket.index()}")
    return psgd.powerSGD_hook(state.psgd, bucket)


# DDP compares the hook's annotations with the classes themselves; postponed (string) annotations
# would be refused, so the resolved ones are set here (as lowband.optim.ddp_hook does)
_scaled_powersgd_hook.__annotations__ = {
    "state": _ScaledPowerSGD,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


@register_strategy(
    "powersgd",
    "torch DDP with the PowerSGD comm hook (rank-r compression + error feedback)",
    Options(
        {
            "rank": Opt(int, min=1, doc="the rank of the low-rank approximation"),
            # torch requires start_powerSGD_iter > 1 with error feedback / warm start
            "start_iter": Opt(int, min=2, unit="steps", doc="plain allreduce before compression starts"),
            "bucket_cap_mb": _BUCKET_CAP,
        }
    ),
)
class PowerSGDStrategy(DDPStrategy):
    name = "powersgd"
    # fp16: each bucket unscaled (zeroed on overflow) in the comm hook, the flag agreed before the step
    unscale_per_unit = True
    agree_found_inf = True
    carry_nonfinite = False  # PowerSGD's error memory must never see a NaN: zeroed and agreed
    # taking over a run in progress, the plain-allreduce warm-up (torch's start_powerSGD_iter, for the
    # first steps of training) would send the dense gradient over a link chosen for its slowness
    mid_run_options: ClassVar[dict[str, Any]] = {"start_iter": 2}

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        rank: int = 2,
        start_iter: int = 10,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        super().__init__(model, make_optimizer, group, bucket_cap_mb=bucket_cap_mb)
        self.rank, self.start_iter = int(rank), int(start_iter)
        tolerate_cpu_buckets()  # a CPU model on a machine with CUDA (lowband.strategies.psgd_cpu)
        self.state = psgd.PowerSGDState(
            process_group=group.pg,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        self._hook_state = _ScaledPowerSGD(self.state)
        self.ddp.register_comm_hook(self._hook_state, _scaled_powersgd_hook)
        self._pending: dict[str, Any] | None = None  # checkpointed hook state, applied after _rebucket

    plan_grid = ("rank=1", "rank=2", "rank=4")

    @classmethod
    def predict(cls, profile: PlanProfile, links: Links, options: Mapping[str, Any]) -> Prediction | None:
        from lowband.plan import models

        return models.powersgd(profile, links, options)

    def hparams(self) -> dict[str, Any]:
        return {"rank": self.rank, "start_iter": self.start_iter}

    def _attach_unscaler(self, unscaler: GradUnscaler) -> None:
        self._hook_state.unscaler = unscaler

    def set_nonfinite(self, policy: str) -> None:
        super().set_nonfinite(policy)
        guard = self.nonfinite
        if guard is not None:  # each bucket checked in the comm hook, before PowerSGD's memory sees it
            self._hook_state.guard = guard
            guard.restorers.append(self._hook_state.restore)

    def extra_state(self) -> dict[str, Any]:
        # error-feedback memory and warm-start factors (per DDP bucket), the iteration counter and the
        # generator that draws the first factors: tensors, dicts and numbers only
        if self._pending is not None:
            hook = self._pending
        else:
            hook = {s: getattr(self.state, s) for s in _PSGD_DYNAMIC}
            hook["rng"] = _rng_state(self.state.rng)
        return {**super().extra_state(), "powersgd": {**hook, **self.hparams()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        where = f"PowerSGDStrategy.load_state_dict on rank {self.group.world_rank}"
        if "powersgd" not in state:
            raise InvalidArgumentError(f"{where}: checkpoint has no PowerSGD state")
        hook = state["powersgd"]
        if "matrix_approximation_rank" in hook:  # written when every PowerSGDState slot was saved
            saved = {"rank": hook["matrix_approximation_rank"], "start_iter": hook["start_powerSGD_iter"]}
        else:
            saved = {k: hook.get(k) for k in self.hparams()}
        if saved != self.hparams():
            raise InvalidArgumentError(f"{where}: checkpoint has {saved}, this strategy {self.hparams()}")
        super().load_extra_state(state)
        self._pending = hook
        if not self._rebucket_pending:
            self._after_rebucket()

    def _after_rebucket(self) -> None:
        hook, self._pending = self._pending, None
        if hook is None:
            return
        dev = next(self.module.parameters()).device  # a checkpoint read with map_location="cpu", say
        for slot in _PSGD_DYNAMIC:
            value = hook[slot]
            if isinstance(value, dict):  # the hook updates its memory in place: keep the checkpoint intact
                value = {i: t.to(dev, copy=True) for i, t in value.items()}
            setattr(self.state, slot, value)
        rng = hook["rng"]
        if isinstance(rng, np.random.RandomState):  # a checkpoint pickled with the generator object
            self.state.rng = rng
        else:
            _set_rng_state(self.state.rng, rng)
