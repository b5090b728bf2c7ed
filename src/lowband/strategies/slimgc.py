"""SlimGC ("SlimGC: Gradient Compression Optimization Strategy For Distributed Deep Learning") as a
strategy: a compressed reducer on lowband's gradient stage with the paper's three mechanisms, each
switchable for the ablation:

- ``comm_threshold`` (``auto`` | bytes | ``0`` | ``inf``): the communication threshold table; ``auto``
  measures BestCT in a warm-up of ``pre_steps`` steps, ``0`` compresses every tensor, ``inf`` none;
  ``bestct_rule``: ``stable`` (default: the smallest size from which every larger size pays off) or
  ``paper`` (Algorithm 2: the smallest size that pays off; one noisy small tensor can then switch
  compression on for every larger one);
- ``offload``: compression on a worker thread fed from the backward hooks (else inline, on the
  training thread, in the hooks);
- ``backup``: the model backup of Eq. 8 (the next step starts from the last global weights updated
  with this rank's own gradient; the global aggregate lands one step later), with ``local_lr``.

Plain compression (the ablation's baseline) is ``comm_threshold=0,offload=false,backup=false``. Units
are single parameter tensors, as in the paper (it decides per gradient tensor by its size).

The quantizer (``compressor``, default ``onebit:threshold=0.5``): MXNet's 1-bit codes at the paper's
threshold 0.5, in the quantizer's default ``threshold_mode=relative``: the threshold and the levels are
in units of each tensor's mean magnitude (1-bit decodes to ``+-mean|g + e|``, sent as one float32 per
tensor), which fits PyTorch's mean-reduced gradients whatever the batch size. MXNet's and the paper's
units (Gluon sums the gradient over the batch; levels +-1) are ``onebit:threshold_mode=absolute``, with
``;scale=B`` for a per-rank batch of ``B``; at ``scale=1`` on PyTorch's averaged gradients those levels
are hundreds of times the gradient and the fmnist-cnn bench stays at chance level, where the relative
default tracks DDP (:mod:`lowband.compress.threshold`, README "SlimGC").

Precision: under bf16/fp16 autocast the parameters, gradients, error-feedback memories and the backup's
global weights and optimizer state stay float32 (``tests/test_precision.py`` checks the state's dtypes);
fp16 loss scaling is refused (:attr:`SlimGCStrategy.no_grad_scaler_reason`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from lowband.comm.engine import issue_lane
from lowband.comm.initial import broadcast_initial_state
from lowband.compress.reducer import make_reducer
from lowband.compress.slimgc.backup import ModelBackup
from lowband.compress.slimgc.pipeline import SlimGCReducer
from lowband.compress.slimgc.table import parse_comm_threshold
from lowband.compress.specs import REDUCER_OPTIONS
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.reducer import Unit, parameter_names
from lowband.optim.reduction import Reduction
from lowband.optim.stage import GradientStage
from lowband.options import Opt, Options, Rule
from lowband.runtime import current, open_member_group
from lowband.strategies.base import OptimizerFactory
from lowband.strategies.breakdown import ClockedStrategy, StepClock
from lowband.strategies.registry import register_strategy


def parameter_units(model: nn.Module) -> list[Unit]:
    """One unit per trainable parameter tensor (registration order), keyed by its name."""
    return [Unit(n, (n,), (p,)) for p, n in parameter_names(model).items() if p.requires_grad]


class SlimGCStrategy(ClockedStrategy):
    """See the module docstring. No cost model (``lowband plan``): which tensors go compressed is decided
    by the threshold table its warm-up measures on the real links (``comm_threshold=auto``), and the model
    backup overlaps each aggregate with the next iteration on a worker thread; neither is known before
    a run."""

    name = "slimgc"
    no_clip_reason = "its reducer hands the averaged gradients to the optimizer inside step()"
    no_grad_scaler_reason = (
        "its model backup applies each round's averaged gradients one step late (Eq. 8), after the next "
        "local step, so a step skipped for an overflow cannot be skipped consistently"
    )

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        group: Group,
        *,
        compressor: str,
        reducer: str,
        comm_threshold: object,
        pre_steps: int,
        offload: bool,
        backup: bool,
        local_lr: float | None,
        fuse_mb: float,
        memory: str,
        seed: int,
        bestct_rule: str = "stable",
    ) -> None:
        where = f"{type(self).__name__} on rank {group.rank}"
        threshold = parse_comm_threshold(where, comm_threshold)
        self.options = {
            "compressor": compressor, "reducer": reducer, "comm_threshold": comm_threshold,
            "pre_steps": pre_steps, "offload": offload, "backup": backup, "local_lr": local_lr,
        }  # fmt: skip
        inner = make_reducer(reducer, compressor, memory, seed=seed)
        broadcast_initial_state(model, group=group)  # every replica starts from rank 0's model, as DDP
        units = parameter_units(model)
        self.executor = issue_lane(
            group, offload=offload, timeout=current(where).config.timeout, where="slimgc-executor"
        )
        self.reducer = SlimGCReducer(
            inner,
            units,
            self.executor,
            threshold=threshold,
            pre_steps=pre_steps,
            fuse_bytes=int(fuse_mb * 2**20),
            copy_grads=backup,
            bestct_rule=bestct_rule,
        )
        self.stage = GradientStage(units, self.reducer, group=group, where=type(self).__name__)
        self.clock = StepClock(self.stage, self.reducer.timings)
        #: seconds the training thread waited for rounds (non-overlapped communication and compression)
        self.wait_s = 0.0
        self.params = [p for p in parameter_names(model) if p.requires_grad]  # the units' order
        self.backup: ModelBackup | None = None
        if backup:
            self.backup = ModelBackup(self.params, make_optimizer, local_lr=local_lr)
            optimizer = self.backup.global_optimizer
        else:
            optimizer = make_optimizer(model.parameters())
        self._pending: Reduction | None = None  # the round whose global step is due (backup)
        super().__init__(model, optimizer, group)

    # -- the training step -------------------------------------------------------------------------
    def clear_gradients(self) -> None:
        for p in self.params:
            p.grad = None

    no_skip_reason = "its reducer's rounds complete asynchronously (a skipped round cannot be put back)"

    def nonfinite_channel(self) -> Group | None:
        # the executor thread communicates on the data group while the step agrees the flags
        if not self.executor.offload or self.group.size == 1:
            return None
        ctx = current("SlimGCStrategy")
        counts: dict[tuple[int, ...], int] = ctx.state.setdefault("lowband.slimgc.nonfinite", {})
        gen = counts[self.group.ranks] = counts.get(self.group.ranks, -1) + 1
        key = f"lowband/slimgc-nonfinite/{'.'.join(map(str, self.group.ranks))}/{gen}"
        return open_member_group(ctx, self.group, key, f"{self.group.name}/nonfinite")

    def apply_step(self) -> None:
        reduction = self.stage.hand_off()  # every unit handed to the reducer (launched or queued)
        self.check_nonfinite()  # the non-finite policy: every unit was checked before the reducer saw it
        if self.backup is None:
            self._wait(reduction, into_grads=True)  # the averages are in .grad (reduced in place)
            self.clock.wait_done()
            self.optimizer.step()
            return
        self._global_step(mark=True)  # w(i) from the previous round, waited for only now
        self._pending = reduction
        self.backup.local_step()  # Eq. 8: the next step starts from w(i) - lr * own gradient

    def _wait(self, reduction: Reduction, *, into_grads: bool = False) -> list[list[torch.Tensor]]:
        t0 = time.perf_counter()
        results = reduction.wait(into_grads=into_grads)
        self.wait_s += time.perf_counter() - t0
        return results

    def _global_step(self, *, mark: bool = False) -> None:
        if self._pending is None or self.backup is None:
            if mark:
                self.clock.wait_done()
            return
        results = self._wait(self._pending)
        if mark:
            self.clock.wait_done()
        self._pending = None
        self.backup.global_step([results[i][0] for i in range(len(self.params))])

    def synchronize(self) -> None:
        if self.stage.pending():  # a backward not stepped: its round completed (.grad, without backup)
            self._wait(self.stage.hand_off(), into_grads=self.backup is None)
        self._global_step()
        self.executor.drain()

    def in_sync(self) -> bool:
        return self.backup is None

    def average_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: with the model backup, the global weights (the same on every rank) with the
        ranks' buffers averaged; else the model's state."""
        sd = super().average_state_dict()
        if self.backup is not None:
            for u, w in zip(self.stage.units, self.backup.weights):
                sd[u.names[0]] = w.detach().clone()
        return sd

    # -- reports and checkpoints -------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if v is not None}

    def report(self) -> dict[str, Any]:
        return {"breakdown": self.clock.report(), "slimgc": {**self.reducer.report(), "wait_s": self.wait_s}}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; completes the reduction in flight (and its global step) first."""
        self.synchronize()
        return super().state_dict()

    def extra_state(self) -> dict[str, Any]:
        return {
            "world_size": self.group.size,
            "stage": self.stage.state_dict(),
            "backup": {} if self.backup is None else self.backup.state_dict(),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        where = f"{type(self).__name__}.load_state_dict"
        if "stage" not in state or "backup" not in state:
            raise InvalidArgumentError(f"{where}: the checkpoint has no 'stage' and 'backup' state")
        n = state.get("world_size", self.group.size)
        if n != self.group.size:
            raise InvalidArgumentError(
                f"{where} on rank {self.group.rank}: the checkpoint was taken at {n} ranks, this group has "
                f"{self.group.size}; its per-rank state (error-feedback memories, the backup's local "
                "weights and optimizer) does not re-shard: resume at the world size it was saved at"
            )
        if bool(state["backup"]) != (self.backup is not None):
            raise InvalidArgumentError(
                f"{where}: the checkpoint's backup setting differs from this strategy's"
            )
        if self._pending is not None:
            raise InvalidArgumentError(f"{where}: a round is in flight (synchronize() first)")
        self.stage.load_state_dict(state["stage"])
        if self.backup is not None:
            self.backup.load_state_dict(state["backup"])

    def close(self) -> None:
        self.stage.remove_hooks()
        self.executor.close()


@register_strategy(
    "slimgc",
    "SlimGC: compression with a measured communication threshold, asynchronous compression, model backup",
    REDUCER_OPTIONS
    | Options(
        {
            "comm_threshold": Opt(
                float,
                min=0,
                finite=False,
                words=("auto",),
                unit="bytes",
                doc="units of at least this size are compressed (auto: measured in the warm-up; inf: none)",
            ),
            "pre_steps": Opt(int, min=0, unit="steps", doc="the warm-up that measures comm_threshold=auto"),
            "offload": Opt(bool, doc="compression on a helper thread, overlapped with the next step"),
            "backup": Opt(
                bool, doc="the model backup: a local step on the local gradient, corrected a step late"
            ),
            "local_lr": Opt(float, gt=0, doc="the backup's local step size (None: the optimizer's)"),
            "fuse_mb": Opt(float, min=0, unit="MB", doc="small uncompressed units fused up to this size"),
            "bestct_rule": Opt(str, choices=("paper", "stable"), doc="how the warm-up picks the threshold"),
        },
        rules=[
            Rule(
                ("comm_threshold", "pre_steps"),
                "comm_threshold=auto needs pre_steps >= 2 (full-precision and compressed warm-up steps alternate)",
                lambda o: o["comm_threshold"] != "auto" or o["pre_steps"] >= 2,
            ),
            Rule(
                ("local_lr", "backup"),
                "local_lr is the model backup's; it needs backup=true",
                lambda o: o["local_lr"] is None or o["backup"],
            ),
        ],
    ),
)
def slimgc(
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    group: Group,
    *,
    compressor: str = "onebit:threshold=0.5",
    reducer: str = "ps",
    comm_threshold: str | int | float = "auto",
    pre_steps: int = 10,
    offload: bool = True,
    backup: bool = True,
    local_lr: float | None = None,
    fuse_mb: float = 1.0,
    memory: str = "residual",
    seed: int = 0,
    bestct_rule: str = "stable",
) -> SlimGCStrategy:
    return SlimGCStrategy(
        model,
        make_optimizer,
        group,
        compressor=compressor,
        reducer=reducer,
        comm_threshold=comm_threshold,
        pre_steps=pre_steps,
        offload=offload,
        backup=backup,
        local_lr=local_lr,
        fuse_mb=fuse_mb,
        memory=memory,
        seed=seed,
        bestct_rule=bestct_rule,
    )
