"""Lightning front end: ``Trainer(strategy=LowbandStrategy("dreamddp", period=5))`` runs any lowband
strategy by name and options under Lightning's own loop, launcher and checkpoints.

:class:`LowbandStrategy` is a Lightning ``DDPStrategy`` (its launcher, process group, distributed sampler,
``reduce``/``barrier``/``broadcast`` are DDP's) whose model is not wrapped in torch DDP: at ``fit`` it
builds ``make_strategy(name, lightning_module, optimizer, **options)`` and maps Lightning's loop onto the
strategy protocol (:mod:`lowband.strategies.base`):

- a step begins (``s.zero_grad()``) at each training batch's start, before ``training_step``;
- ``training_step`` runs through ``s.module``: a torch DDP wrapper for ``ddp``/``powersgd`` (Lightning's
  forward redirection), else the LightningModule itself, whose ``forward`` the step must call
  (``self(x)``) so that the strategy's forward hooks see it;
- ``backward`` (automatic, or ``manual_backward``) is ``s.backward(loss)``; in automatic optimisation
  Lightning divides the loss by ``accumulate_grad_batches`` itself, which becomes the strategy's
  ``accumulate`` (its first J-1 passes accumulate locally, the J-th communicates);
- the optimizer step (automatic, or ``opt.step()`` in manual optimisation) runs the closure, the
  ``on_before_optimizer_step`` hooks, then ``s.clip_grad_norm_(gradient_clip_val)`` (automatic
  optimisation, ``gradient_clip_algorithm="norm"``), then ``s.step()``;
- precision plugins: their forward context (``bf16-mixed`` autocast) wraps the step; a ``16-mixed``
  plugin's ``GradScaler`` is handed to the strategy (``s.set_grad_scaler``), which scales, unscales and
  skips non-finite steps on every rank alike;
- ``Trainer.save_checkpoint(path)`` writes Lightning's file (rank 0; its model is the consensus,
  ``s.average_state_dict()``, so it loads into the plain module) and every rank's strategy state into
  ``path.lowband/`` (``s.save``); ``fit(ckpt_path=path)`` restores Lightning's state and then every
  rank's own (``s.load``), so replicas that differ (local SGD, DreamDDP, ATC, error feedback, table
  shards) resume as they were.

Learning-rate schedulers built in ``configure_optimizers`` drive the optimizer the strategy rebuilt
(:func:`repoint_scheduler`: per-group lists such as ``lr_lambdas`` must be one value for every group).
Refused with one clear error: several optimizers, ``gradient_clip_algorithm="value"``, backward
arguments. In manual optimisation clip with ``trainer.strategy.clip_grad_norm_(max_norm)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lowband
from lowband.errors import InvalidArgumentError
from lowband.integrations import strategy_folder
from lowband.strategies import make_strategy
from lowband.strategies.base import Strategy as LoopStrategy
from lowband.strategies.checkpoint import rank_file
from lowband.strategies.registry import check_strategy_options


@contextlib.contextmanager
def _forward_as(module: nn.Module, method: Callable[..., Any]) -> Iterator[None]:
    """``module.forward`` is ``method`` for one call through a wrapper (torch DDP), re-armed after each
    call so that a replayed wrapper forward (a bucket rebuild after a resume) calls it again; the module's
    own ``forward`` is back while ``method`` runs (``self(x)`` inside ``training_step``)."""
    original = module.forward

    def redirected(*args: Any, **kwargs: Any) -> Any:
        module.forward = original  # type: ignore[method-assign]
        try:
            return method(*args, **kwargs)
        finally:
            module.forward = redirected  # type: ignore[method-assign]

    module.forward = redirected  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.forward = original  # type: ignore[method-assign]


#: per-group lists a scheduler may hold besides ``base_lrs`` (each must be one value for every group)
_PER_GROUP = ("lr_lambdas", "min_lrs")


def repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, where: str) -> None:
    """Make ``scheduler`` (built in ``configure_optimizers`` on the user's optimizer) drive ``optimizer``,
    which the strategy rebuilt from it: each new group carries the options of the group its parameters
    came from, ``initial_lr`` included (:func:`lowband.optim.factory.instance_factory`), so the base
    learning rates are the new groups'; a per-group list (``lr_lambdas``, ``min_lrs``) must hold one value
    for every group (the new groups may be more: one per layer for strategies stepping in backward)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise InvalidArgumentError(f"{where}: a {type(scheduler).__name__} scheduler is not supported")
    groups = optimizer.param_groups
    if any("initial_lr" not in g for g in groups):
        raise InvalidArgumentError(f"{where}: the scheduler's optimizer groups carry no initial_lr")
    for attr in _PER_GROUP:
        values = getattr(scheduler, attr, None)
        if values is None:
            continue
        if any(v is not values[0] and v != values[0] for v in values):
            raise InvalidArgumentError(
                f"{where}: {type(scheduler).__name__}.{attr} differs between parameter groups; the strategy "
                "regroups the parameters, so give one value for every group"
            )
        setattr(scheduler, attr, [values[0]] * len(groups))
    scheduler.optimizer = optimizer
    scheduler.base_lrs = [g["initial_lr"] for g in groups]
    scheduler._last_lr = [g["lr"] for g in groups]


class LowbandStrategy(DDPStrategy):
    """A lowband strategy (``name``, ``**options`` as :func:`lowband.strategies.make_strategy` takes
    them) as Lightning's strategy (module docstring). Launched by Lightning's own launcher
    (``devices=N``), torchrun or ``lowband run``; gloo on CPU."""

    strategy_name = "lowband"

    def __init__(self, name: str, **options: Any) -> None:
        check_strategy_options(name, dict(options), f"LowbandStrategy({name!r})")  # one error, early
        super().__init__()
        self.lowband_name = name
        self.lowband_options = dict(options)
        #: the lowband strategy of the running (or last) fit; None before ``fit``
        self.lowband: LoopStrategy | None = None
        self._resume_from: _PATH | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def configure_ddp(self) -> None:
        """No torch DDP wrapper: the lowband strategy (built in :meth:`setup`) owns communication."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        where = f"LowbandStrategy({self.lowband_name!r})"
        lm = self.lightning_module
        assert lm is not None
        if len(self.optimizers) != 1:
            raise InvalidArgumentError(
                f"{where}: configure_optimizers must return one optimizer, got {len(self.optimizers)}"
            )
        options = dict(self.lowband_options)
        passes = trainer.accumulate_grad_batches
        if lm.automatic_optimization and passes > 1 and options.setdefault("accumulate", passes) != passes:
            raise InvalidArgumentError(
                f"{where}: accumulate={options['accumulate']} differs from the Trainer's "
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}; give one of them"
            )
        if self.lowband is not None:  # a previous fit's hooks off the module first
            self.lowband.close()
        lowband.init()  # adopts the process group Lightning made
        s = make_strategy(self.lowband_name, lm, self.optimizers[0], **options)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            s.set_grad_scaler(scaler)
        self.lowband = s
        self.model = s.module
        self.optimizers = [s.optimizer]
        for config in trainer.lr_scheduler_configs:  # built on the optimizer the strategy rebuilt
            repoint_scheduler(config.scheduler, s.optimizer, where)

    def _strategy(self) -> LoopStrategy:
        if self.lowband is None:
            raise InvalidArgumentError(
                "LowbandStrategy: no lowband strategy yet (it is built when fit starts)"
            )
        return self.lowband

    # -- the loop ---------------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.lowband is not None:
            self.lowband.zero_grad()  # a no-op between an accumulating step's passes

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        lm = self.lightning_module
        assert lm is not None
        s = self.lowband
        with self.precision_plugin.train_step_context():
            if s is None or s.module is lm:
                return lm.training_step(*args, **kwargs)
            wrapper = s.module
            if lm.automatic_optimization or not isinstance(wrapper, DistributedDataParallel):
                with _forward_as(lm, lm.training_step):
                    return wrapper(*args, **kwargs)
            # manual optimisation through torch DDP: the backward runs inside the wrapper's forward
            # (prepared in backward), so the wrapper's own post-forward must not prepare another
            sync = wrapper.require_backward_grad_sync

            def step_then_hold(*a: Any, **k: Any) -> Any:
                out = lm.training_step(*a, **k)
                wrapper.require_backward_grad_sync = False
                return out

            try:
                with _forward_as(lm, step_then_hold):
                    return wrapper(*args, **kwargs)
            finally:
                wrapper.require_backward_grad_sync = sync

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        s = self.lowband
        if s is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if args or kwargs:
            raise InvalidArgumentError("LowbandStrategy.backward: backward arguments are not supported")
        lm = self.lightning_module
        assert lm is not None
        # the plugin's hooks without its loss scaling: the strategy scales (it holds the plugin's scaler)
        closure_loss = Precision.pre_backward(self.precision_plugin, closure_loss, lm)
        if not lm.automatic_optimization and isinstance(s.module, DistributedDataParallel):
            prepare_for_backward(s.module, closure_loss)  # inside the wrapper's forward (training_step)
        s.backward(closure_loss, divided=lm.automatic_optimization)
        return Precision.post_backward(self.precision_plugin, closure_loss, lm)

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        s = self.lowband
        if s is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        lm = self.lightning_module
        assert lm is not None
        result = closure()
        trainer = lm.trainer
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            cb.on_before_optimizer_step(trainer, lm, optimizer)
        lm.on_before_optimizer_step(optimizer)
        clip = trainer.gradient_clip_val
        if lm.automatic_optimization and clip:
            if trainer.gradient_clip_algorithm not in (None, "norm"):
                raise InvalidArgumentError(
                    f"LowbandStrategy: gradient_clip_algorithm={trainer.gradient_clip_algorithm!r} is not "
                    "supported; use 'norm' (the strategy clips after its gradient communication)"
                )
            s.clip_grad_norm_(float(clip))
        s.step()
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float | None:
        """The strategy's clipping (manual optimisation: between ``manual_backward`` and ``opt.step()``)."""
        return self._strategy().clip_grad_norm_(max_norm, norm_type)

    # -- checkpoints ------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model in Lightning's file: the consensus model (collective, as ``save_checkpoint`` is), whole
        tables included, so that the file loads into the plain LightningModule (``load_from_checkpoint``)."""
        if self.lowband is None:
            return super().lightning_module_state_dict()
        return self.lowband.average_state_dict()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.lowband is not None:  # collective: every rank its own file
            self.lowband.save(strategy_folder(filepath))

    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        if self.lowband is not None:
            folder = strategy_folder(filepath)
            rank_file(folder, self.lowband.group.rank, self.lowband.group.size).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # the last rank to remove its file removes the folder

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._resume_from = checkpoint_path
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self.lowband is None or self._resume_from is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        # every rank's own model, optimizer and strategy state (collective); Lightning's file restored
        # rank 0's model before the strategy was built
        self.lowband.load(strategy_folder(self._resume_from))
        self._resume_from = None

    def teardown(self) -> None:
        # the lowband strategy stays (save_checkpoint after fit, average_model); the next fit closes it
        super().teardown()
        if self.lightning_module is not None:
            self.model = self.lightning_module


__all__ = ["LowbandStrategy"]
