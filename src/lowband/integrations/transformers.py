"""transformers front end: :class:`LowbandTrainer`, a ``transformers.Trainer`` whose training step and
checkpoints go through a lowband strategy::

    trainer = LowbandTrainer(model=model, args=TrainingArguments(..., max_grad_norm=0.0),
                             train_dataset=data, lowband_strategy="dreamddp", lowband_options={"period": 5})
    trainer.train()                                   # torchrun / accelerate launch / lowband run

The Trainer keeps its loop, data loaders, optimizer and scheduler choice, logging and callbacks; the
strategy replaces torch DDP (the model is not handed to ``accelerator.prepare``):

- the optimizer the Trainer creates (``optim``, ``learning_rate``, weight-decay groups, or the one given)
  is given to ``make_strategy(lowband_strategy, model, optimizer, **lowband_options)`` with
  ``accumulate=gradient_accumulation_steps``; the Trainer steps :class:`StrategyOptimizer` (``s.step()``),
  whose ``param_groups`` are the strategy's optimizer's, so the learning-rate scheduler drives it;
- each micro-batch: ``s.zero_grad()`` (a no-op inside an accumulating step), ``compute_loss`` on the
  strategy's module under ``accelerator.autocast()`` (``bf16=True``), ``s.backward(loss, divided=True)``
  (the Trainer has normalised the loss for accumulation already);
- ``max_grad_norm`` clips with ``s.clip_grad_norm_``; strategies that step layers in backward (atc,
  dreamddp, ...) need ``max_grad_norm=0`` (the Trainer's default of 1.0 is refused with one error);
- checkpoints: the model in ``checkpoint-N/`` is the consensus (``s.average_state_dict()``, so
  ``from_pretrained`` loads it) and every rank's strategy state (model, optimizer, strategy state, steps)
  goes into ``checkpoint-N/lowband/`` (``s.save``); ``train(resume_from_checkpoint=...)`` restores it on
  every rank (``s.load``), the scheduler and the Trainer's state from the Trainer's files.

Refused: ``fp16=True`` (use ``bf16``), DeepSpeed and FSDP (they own communication themselves).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.strategies.base import Strategy
from lowband.strategies.registry import check_strategy_options

#: the folder inside a Trainer checkpoint (``checkpoint-N/``) where every rank's strategy state goes
FOLDER = "lowband"


class StrategyOptimizer(torch.optim.Optimizer):
    """What the Trainer steps: :meth:`step` is the strategy's ``step()`` (``zero_grad`` its
    ``zero_grad()``); ``param_groups`` are the strategy's optimizer's own dicts, so a learning-rate
    scheduler built on this object drives the strategy's optimizer. torch.optim.Optimizer's own
    ``__init__`` is not called: the state lives in the strategy's optimizer."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.defaults = dict(strategy.optimizer.defaults)

    @property  # the strategy's optimizer's, read each time: loading a state replaces torch's list
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.strategy.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.strategy.optimizer.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise InvalidArgumentError("StrategyOptimizer.step: closures are not supported")
        self.strategy.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.strategy.label()})"


class StrategyModule(nn.Module):
    """The model the Trainer trains: the strategy's module (a torch DDP wrapper for ddp/powersgd, else
    the model itself), so that forward passes go through it."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        self.inner = strategy.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


class LowbandTrainer(Trainer):
    """A ``transformers.Trainer`` training with the lowband strategy ``lowband_strategy`` (options
    ``lowband_options``, as :func:`lowband.strategies.make_strategy` takes them); module docstring."""

    def __init__(
        self, *args: Any, lowband_strategy: str, lowband_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        options = dict(lowband_options or {})
        check_strategy_options(lowband_strategy, dict(options), f"LowbandTrainer({lowband_strategy!r})")
        super().__init__(*args, **kwargs)
        self.lowband_name = lowband_strategy
        self.lowband_options = options
        #: the lowband strategy (built when training starts)
        self.lowband: Strategy | None = None
        self._consensus: dict[str, torch.Tensor] | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, StrategyOptimizer):
            return self.optimizer
        where = f"LowbandTrainer({self.lowband_name!r})"
        if self.args.fp16 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise InvalidArgumentError(f"{where}: fp16, DeepSpeed and FSDP are not supported (use bf16=True)")
        optimizer = super().create_optimizer(model)
        options = dict(self.lowband_options)
        passes = self.args.gradient_accumulation_steps
        if passes > 1 and options.setdefault("accumulate", passes) != passes:
            raise InvalidArgumentError(
                f"{where}: accumulate={options['accumulate']} differs from gradient_accumulation_steps={passes}"
            )
        lowband.init()  # adopts the process group Accelerate made for the Trainer
        if self.lowband is not None:
            self.lowband.close()
        if not isinstance(self.model, nn.Module):
            raise InvalidArgumentError(f"{where}: the Trainer has no model to train")
        self.lowband = make_strategy(self.lowband_name, self.model, optimizer, **options)
        if self.args.max_grad_norm > 0 and (self.lowband.steps_in_backward or self.lowband.no_clip_reason):
            raise InvalidArgumentError(
                f"{where}: strategy {self.lowband_name!r} cannot clip gradients (it steps layers in backward); "
                "set TrainingArguments(max_grad_norm=0)"
            )
        self.optimizer = StrategyOptimizer(self.lowband)
        return self.optimizer

    def _strategy(self) -> Strategy:
        if self.lowband is None:
            raise InvalidArgumentError("LowbandTrainer: the strategy is built when training starts")
        return self.lowband

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not training or self.lowband is None:
            return super()._wrap_model(model, training, dataloader)  # type: ignore[no-any-return]
        if isinstance(model, StrategyModule):
            return model
        return StrategyModule(self.lowband)

    # -- the step -----------------------------------------------------------------------------------
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        s = self._strategy()
        model.train()
        s.zero_grad()  # a no-op inside an accumulating step
        inputs = self._prepare_inputs(inputs)
        with self.accelerator.autocast(), self.compute_loss_context_manager():
            out = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        loss: torch.Tensor = out[0] if isinstance(out, tuple) else out
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        s.backward(loss, divided=True)
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor | None:
        norm = self._strategy().clip_grad_norm_(self.args.max_grad_norm)
        return None if norm is None else torch.tensor(norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        return None if grad_norm is None else float(grad_norm)

    # -- checkpoints ------------------------------------------------------------------------------
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        s = self._strategy()
        self._consensus = s.average_state_dict()  # collective: the model every rank would export
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._consensus = None
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        s.save(Path(output_dir) / FOLDER)  # collective: every rank its own file

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        if state_dict is None and self._consensus is not None:
            state_dict = self._consensus
        super()._save(output_dir, state_dict=state_dict)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.lowband is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self.lowband.load(Path(checkpoint) / FOLDER)  # every rank its own model, optimizer and state
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


__all__ = ["FOLDER", "LowbandTrainer", "StrategyModule", "StrategyOptimizer"]
