"""Accelerate front end: two routes, both launched by ``accelerate launch``, torchrun or ``lowband run``.

Every strategy (:func:`prepare_strategy`). The strategy replaces ``accelerator.prepare(model,
optimizer)``; the loop is lowband's, around Accelerate's data loaders, autocast and checkpoints::

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=1)
    s = prepare_strategy(accelerator, "dreamddp", model, optimizer, period=5)
    loader = accelerator.prepare(loader)                 # this rank's shard, as usual
    for x, y in loader:
        s.zero_grad()
        with accelerator.autocast():                     # mixed_precision="bf16" runs under autocast
            loss = F.cross_entropy(s.module(x), y)
        s.backward(loss)                                 # not accelerator.backward: the strategy's
        s.step()
    accelerator.save_state("ckpt")                       # + every rank's strategy state in ckpt/lowband/

:func:`prepare_strategy` joins Accelerate's process group (``lowband.init``), moves the model to the
accelerator's device, builds ``make_strategy(name, model, optimizer, **options)`` with
``accumulate=accelerator.gradient_accumulation_steps`` (the strategy divides the loss and holds the
first J-1 passes' communication, as ``accelerator.accumulate`` would), hands ``accelerator.scaler``
(``mixed_precision="fp16"``) to the strategy, and registers ``save_state``/``load_state`` hooks that
write and read every rank's strategy state (``s.save``/``s.load`` in ``DIR/lowband``): model,
optimizer, strategy state and step count, each rank its own. Accelerate itself saves what it owns: RNG
states, data loader samplers, its step.

Comm-hook strategies (:func:`register_comm_hook`). A model prepared by Accelerate is a torch DDP
model; any lowband compressed reducer (``compressor=...``, ``reducer=TRANSPORT``, as the ``compressed``
strategy takes them) becomes its comm hook (``lowband.ddp_comm_hook``), and the hook's state (step,
error-feedback memories) goes into ``save_state`` per rank. Accelerate's own
``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's built-in hooks, so the hook is
registered on the prepared model instead. The loop is Accelerate's (``accelerator.backward``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

import lowband
from lowband.compress.specs import build_reducer
from lowband.errors import InvalidArgumentError
from lowband.optim.ddp_hook import DDPHookState
from lowband.strategies import make_strategy
from lowband.strategies.base import OptimizerFactory, Strategy

#: the folder inside Accelerate's checkpoint folder where every rank's strategy state goes
FOLDER = "lowband"


def prepare_strategy(
    accelerator: Accelerator,
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    **options: Any,
) -> Strategy:
    """The lowband strategy ``name`` (``options`` as :func:`lowband.strategies.make_strategy` takes
    them) on ``model`` and ``optimizer``, wired into ``accelerator`` (module docstring). Collective."""
    where = f"lowband.integrations.accelerate.prepare_strategy({name!r})"
    if not isinstance(accelerator, Accelerator):
        raise InvalidArgumentError(
            f"{where}: expects an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    if any(m is model for m in accelerator._models):
        raise InvalidArgumentError(
            f"{where}: the model went through accelerator.prepare already; give the plain model (the "
            "strategy owns its communication)"
        )
    passes = accelerator.gradient_accumulation_steps
    if passes > 1 and options.setdefault("accumulate", passes) != passes:
        raise InvalidArgumentError(
            f"{where}: accumulate={options['accumulate']} differs from the Accelerator's "
            f"gradient_accumulation_steps={passes}; give one of them"
        )
    lowband.init()  # adopts the process group Accelerate made
    model.to(accelerator.device)
    s = make_strategy(name, model, optimizer, **options)
    if accelerator.scaler is not None:
        s.set_grad_scaler(accelerator.scaler)

    def save(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        s.save(Path(output_dir) / FOLDER)

    def load(models: list[nn.Module], input_dir: str) -> None:
        s.load(Path(input_dir) / FOLDER)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return s


def register_comm_hook(
    accelerator: Accelerator,
    model: nn.Module,
    compressor: str = "identity",
    reducer: str = "auto",
    memory: str = "residual",
    *,
    seed: int = 0,
) -> DDPHookState:
    """A lowband compressed reducer (``compressor``, ``reducer`` transport, error-feedback ``memory``:
    :func:`lowband.compress.specs.build_reducer`) as the comm hook of ``model``, the DDP model
    ``accelerator.prepare`` returned; its state is saved and loaded per rank with ``save_state`` and
    ``load_state`` (``DIR/lowband/hook-rank{r}.pt``). Returns the hook's state. Collective."""
    where = "lowband.integrations.accelerate.register_comm_hook"
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise InvalidArgumentError(
            f"{where}: expects the torch DDP model accelerator.prepare(model) returns at 2+ processes, got "
            f"{type(model).__name__}"
        )
    lowband.init()
    state, hook = lowband.ddp_comm_hook(
        build_reducer(compressor, reducer, memory, seed=seed, where=where), model
    )
    model.register_comm_hook(state, hook)
    rank = lowband.rank()

    def save(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        folder = Path(output_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state.state_dict(), folder / f"hook-rank{rank}.pt")

    def load(models: list[nn.Module], input_dir: str) -> None:
        state.load_state_dict(torch.load(Path(input_dir) / FOLDER / f"hook-rank{rank}.pt", weights_only=True))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state


__all__ = ["FOLDER", "prepare_strategy", "register_comm_hook"]
