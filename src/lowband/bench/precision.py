"""Where and in which precision the bench computes (``--device``, ``--precision``).

- Device: ``auto`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``cpu`` or ``cuda``. Each
  rank computes on the device :func:`lowband.init` bound it to (``lowband.device()``: ``cuda:LOCAL_RANK``,
  see :mod:`lowband.devices`); every strategy's model, and the compute-only copy, are built on the CPU
  and moved there *before* the strategy is made, and every batch is moved there in the timed step
  (non-blocking where it is pinned).
- Precision: ``fp32``; ``bf16`` and ``fp16`` run forward and loss under ``torch.autocast`` while the
  parameters (hence gradients and every strategy's state) stay float32; ``fp16`` adds a
  ``torch.amp.GradScaler`` per strategy (:meth:`lowband.strategies.Strategy.set_grad_scaler`: the
  gradients are unscaled before compression or clipping, overflowed steps skipped on every rank).
- Timing on CUDA: kernels run asynchronously, so a step's time is taken between two
  :func:`synchronize` calls (:func:`now`), the one place the bench waits for the device.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, get_type_hints

import torch
from torch import nn

from lowband.errors import InvalidArgumentError

DEVICES = ("auto", "cpu", "cuda")
#: precision -> the autocast dtype (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(device: str) -> str:
    """The device type ``--device`` resolves to on this machine (``auto``: cuda if available)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_device(where: str, device: object) -> str:
    """``device`` is one of :data:`DEVICES` and usable here; returns the device type it resolves to."""
    if device not in DEVICES:
        raise InvalidArgumentError(f"{where}: device must be one of {', '.join(DEVICES)}, got {device!r}")
    assert isinstance(device, str)
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"{where}: --device cuda asked for but CUDA is not available here (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use --device cpu "
            "or --device auto"
        )
    return device_type(device)


def _autocast_works(dev_type: str, dtype: torch.dtype) -> bool:
    """Whether a matmul under ``torch.autocast(dev_type, dtype)`` really computes in ``dtype``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unsupported dtype warns and disables autocast
        with torch.autocast(dev_type, dtype=dtype):
            x = torch.ones(2, 2, device=dev_type)
            return (x @ x).dtype == dtype


def check_precision(where: str, precision: object, dev_type: str) -> None:
    """``precision`` is one of :data:`PRECISIONS` and autocast supports it on ``dev_type``."""
    if precision not in PRECISIONS:
        raise InvalidArgumentError(
            f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    assert isinstance(precision, str)
    dtype = PRECISIONS[precision]
    if dtype is None:
        return
    if dev_type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise InvalidArgumentError(f"{where}: this GPU has no bf16 support; use --precision fp16 or fp32")
    if not torch.amp.is_autocast_available(dev_type) or not _autocast_works(dev_type, dtype):
        other = "bf16" if precision == "fp16" else "fp32"
        raise InvalidArgumentError(
            f"{where}: torch {torch.__version__} has no {precision} autocast on {dev_type}; use --precision "
            f"{other} (or another --device)"
        )


def strategy_class(factory: Any) -> type | None:
    """The class a strategy factory builds: the factory itself, or its return annotation (None when it
    cannot be told before calling it)."""
    if isinstance(factory, type):
        return factory
    try:
        ret = get_type_hints(factory).get("return")
    except Exception:  # an annotation that does not resolve: the rank decides
        return None
    return ret if isinstance(ret, type) else None


def check_grad_scaling(where: str, specs: list[str]) -> None:
    """fp16: every strategy must train with a loss scaler; one error naming those that refuse it."""
    from lowband.strategies import parse_strategy_spec
    from lowband.strategies.registry import STRATEGIES

    refused = []
    for spec in specs:
        name = parse_strategy_spec(spec)[0]
        cls = strategy_class(STRATEGIES.get(name, where))
        if cls is None:
            continue
        reason = getattr(cls, "no_grad_scaler_reason", None)
        if reason is None and getattr(cls, "steps_in_backward", False):
            reason = "it steps each layer during backward, before the whole gradient is known to be finite"
        if reason is not None:
            refused.append(f"{name!r} ({reason})")
    if refused:
        raise InvalidArgumentError(
            f"{where}: --precision fp16 needs a loss scaler (GradScaler) that these strategies cannot use "
            f"correctly: {'; '.join(refused)}; use --precision bf16 (no scaler needed) or fp32"
        )


def check_model_device(where: str, model: nn.Module, dev_type: str) -> None:
    """The workload built its model on the CPU or on ``dev_type`` (the bench moves it to the rank's
    device); a model on another device is an error naming the fix."""
    for name, p in model.named_parameters():
        if p.device.type not in ("cpu", dev_type):
            raise InvalidArgumentError(
                f"{where}: the workload's model has {name!r} on {p.device} but the bench runs on {dev_type} "
                f"(--device): build the model on the CPU (the bench moves it to each rank's device) or pass "
                f"--device {p.device.type}"
            )


def move_batch(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) on ``device``; non-blocking where pinned."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.device.type == "cpu" and batch.is_pinned())
    if isinstance(batch, tuple):
        return tuple(move_batch(b, device) for b in batch)
    if isinstance(batch, list):
        return [move_batch(b, device) for b in batch]
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    return batch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast context for ``precision`` (none for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def autocast_loss(
    loss: Callable[[nn.Module, Any], torch.Tensor], batch: Any, device: torch.device, precision: str
) -> Callable[[nn.Module], torch.Tensor]:
    """``model -> loss(model, batch)`` with forward and loss under :func:`autocast` (backward outside)."""

    def fn(model: nn.Module) -> torch.Tensor:
        with autocast(device, precision):
            return loss(model, batch)

    return fn


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """A fresh loss scaler for one strategy when ``precision`` needs one (fp16), else None."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


@contextlib.contextmanager
def timed(device: torch.device) -> Iterator[list[float]]:
    """``with timed(dev) as t:`` -> ``t == [start, end]`` in ``time.perf_counter`` seconds, the device
    synchronised at both ends (CUDA kernels are asynchronous)."""
    import time

    synchronize(device)
    out = [time.perf_counter(), 0.0]
    yield out
    synchronize(device)
    out[1] = time.perf_counter()
