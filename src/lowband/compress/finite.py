"""The finiteness check of a compressor's input, without a host synchronisation on accelerators.

A NaN or infinity in a gradient would be spread by compression (a scale, a norm, a sketch), so every
compressor's input is checked (:func:`lowband.compress.base.check_input`). How, by the tensor's device
and the environment variable ``LOWBAND_CHECK_FINITE``:

- ``auto`` (the default): a CPU tensor is checked at once (reading the flag costs no device
  synchronisation), and the error names the first bad element. A tensor on an accelerator is checked
  *asynchronously*: the flag ``isfinite(x).all()`` is computed on the device, copied without blocking
  into pinned host memory behind an event, and read once the event has completed, by the next check of
  any compressor input (on any thread) or by :func:`raise_pending`. A non-finite gradient therefore
  still raises a clear :class:`~lowband.errors.NonFiniteError` (naming the compressor, unit, rank
  and step it came from), typically one reduction later, and the training thread never waits for the
  device;
- ``sync``: every tensor is checked at once, as on the CPU (one host synchronisation per unit and step
  on an accelerator: for debugging, to stop at the very reduction that holds the value);
- ``off``: no check (the caller guarantees finite gradients, e.g. a loss scaler that skips such steps).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from lowband.errors import InvalidArgumentError, NonFiniteError

Tensor = torch.Tensor

ENV = "LOWBAND_CHECK_FINITE"
MODES = ("auto", "sync", "off")
#: asynchronous checks kept in flight at most; past it the oldest is waited for (bounded host memory)
MAX_PENDING = 1024


@dataclass
class _Pending:
    where: str
    numel: int
    flag: Tensor  # 0-dim bool in pinned host memory, written by the device when ``event`` completes
    event: Any  # torch.Event


_lock = threading.Lock()
_pending: deque[_Pending] = deque()


def mode() -> str:
    """The check's mode from ``LOWBAND_CHECK_FINITE`` (see the module docstring)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise InvalidArgumentError(f"{ENV}={value!r}: must be one of {list(MODES)}")
    return value


def _error(where: str, detail: str) -> NonFiniteError:
    return NonFiniteError(
        f"{where}: the gradient holds a non-finite value ({detail}); compression would spread it"
    )


def check_now(where: str, x: Tensor) -> None:
    """Raise at once if ``x`` holds a NaN or an infinity (a host read of the flag)."""
    # bool(): the flag read on the host; free for a CPU tensor, a device synchronisation otherwise.
    # A NaN or infinity anywhere makes the sum non-finite, so a finite sum proves every element finite
    # (one reduction: ~8x cheaper than isfinite(x).all() on a CPU); a non-finite sum may be an overflow
    # of finite values, so then the elements are checked one by one.
    if bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all()):
        return
    bad = int((~torch.isfinite(x)).nonzero()[0])
    raise _error(where, f"{float(x[bad])} at element {bad} of {x.numel()}")


def check_finite(where: str, x: Tensor) -> None:
    """Check ``x`` (a non-empty floating-point tensor) by the mode of the module docstring."""
    m = mode()
    if m == "off":
        return
    if x.device.type == "cpu" or m == "sync":
        check_now(where, x)
        return
    raise_pending()
    flag = torch.empty((), dtype=torch.bool, device="cpu", pin_memory=True)  # host side of the flag
    flag.copy_(torch.isfinite(x).all(), non_blocking=True)
    event = torch.Event(device=x.device)
    event.record()
    with _lock:
        _pending.append(_Pending(where, x.numel(), flag, event))
        oldest = _pending[0] if len(_pending) > MAX_PENDING else None
    if oldest is not None:
        oldest.event.synchronize()
        raise_pending()


def raise_pending() -> None:
    """Raise for the first asynchronous check that has completed and found a non-finite value (every
    completed check is consumed); checks still in flight stay pending. Never blocks."""
    bad: _Pending | None = None
    with _lock:
        while _pending and _pending[0].event.query():
            done = _pending.popleft()
            if bad is None and not bool(done.flag):  # pinned host memory, already written: no sync
                bad = done
    if bad is not None:
        raise _error(
            bad.where,
            f"found asynchronously in a tensor of {bad.numel} elements on an accelerator; "
            f"{ENV}=sync stops at the reduction that holds it and names the element",
        )
