"""The backend contract: what differs between gloo and NCCL, decided in one place.

torch 2.13's NCCL process group differs from gloo where lowband relies on it (GUIDE.md section 5 and
``lowband.comm.nccl_emulator``, which enforces these rules on the CPU):

- **Waits.** A timed ``Work.wait(timeout)`` on an NCCL work that has not finished marks it failed and
  aborts the communicator (ProcessGroupNCCL.cpp ``WorkNCCL::wait``). So an NCCL work is never waited
  with a timeout: :class:`PolledWork` polls ``is_completed()`` (the work's CUDA events) against
  lowband's own deadline, then waits without a timeout (which then only orders the caller's stream
  after the communication). When lowband's whole timeout expires the communicator is aborted through
  torch's API (:meth:`PolledWork.abort`) and the handle raises ``CommTimeoutError``.
- **Futures.** An NCCL work's future completes when its kernel is *enqueued*. A :class:`PolledWork`
  offers no future, so lowband's handles run ``then`` callbacks and complete ``future()`` only after
  the data is there (observed through ``is_completed``), never at enqueue.
- **Point-to-point.** A pair's sends and receives share one NCCL stream and tags are ignored: an
  exchange round is posted as one coalesced batch (:func:`coalesced`), so both directions of an edge
  proceed together, matched by issue order.
- **Timeouts.** :func:`nccl_env` makes a failed or timed-out NCCL op surface as a Python exception
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: abort the communicator, keep the process) and gives the
  watchdog a longer timeout than lowband's, so lowband's own ``CommTimeoutError`` (naming the op and
  rank) comes first, never a bare SIGABRT.

gloo keeps its own semantics (timed waits are safe; its point-to-point ops are posted one by one).
"""

from __future__ import annotations

import datetime
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: per process group and device type: whether NCCL's contract applies (weak: no sockets kept alive)
_NCCL: weakref.WeakKeyDictionary[Any, dict[str, bool]] = weakref.WeakKeyDictionary()


def _backend_name(pg: Any, device: torch.device) -> str:
    from lowband.comm.nccl_emulator import NcclEmulator

    if isinstance(pg, NcclEmulator):
        return "nccl"
    try:
        return str(pg._get_backend(device).name()).lower()
    except (RuntimeError, AttributeError, TypeError):
        return "gloo" if "gloo" in type(pg).__name__.lower() else "?"


def nccl_semantics(pg: Any, device: torch.device) -> bool:
    """Whether ops on ``pg`` with tensors on ``device`` run under NCCL's contract (an NCCL backend, or
    the NCCL emulator)."""
    try:
        seen = _NCCL.setdefault(pg, {})
    except TypeError:  # not weakly referable
        seen = {}
    got = seen.get(device.type)
    if got is None:
        got = seen[device.type] = _backend_name(pg, device) == "nccl"
    return got


#: first poll interval and the longest one (seconds): fine-grained while an op is short
_FIRST_POLL = 20e-6
_MAX_POLL = 1e-3


class PolledWork:
    """An NCCL work waited without ever calling a timed ``wait`` (see the module docstring)."""

    def __init__(self, work: Any, pg: Any, device: torch.device) -> None:
        self.work, self.pg, self.device = work, pg, device

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Poll until the work completes (then an untimed wait: the caller's stream waits for it, or the
        work's error is raised), or raise ``RuntimeError`` ("timed out") once ``timeout`` passed."""
        limit = None if timeout is None else time.monotonic() + timeout.total_seconds()
        pause = _FIRST_POLL
        while not self.work.is_completed():
            if limit is not None and time.monotonic() >= limit:
                raise RuntimeError(f"timed out after {timeout} (the work is still in flight)")
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL)
        return bool(self.work.wait())

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def get_future(self) -> Any:
        raise RuntimeError("an NCCL work's future completes at enqueue: lowband does not use it")

    def abort(self) -> None:
        """Abort the communicator the work runs on (lowband's timeout expired): the op will never
        complete, and torch's API tears the communicator down so that nothing waits on it again."""
        for target in (self.pg, _backend_or_none(self.pg, self.device)):
            fn = getattr(target, "abort", None)
            if fn is not None:
                try:
                    fn()
                    return
                except RuntimeError:
                    continue


def _backend_or_none(pg: Any, device: torch.device) -> Any:
    try:
        return pg._get_backend(device)
    except (RuntimeError, AttributeError, TypeError):
        return None


def host_staged(pg: Any) -> bool:
    """Whether GPU tensors on ``pg`` must travel through host memory for point-to-point: gloo's
    send/recv move host buffers only (its collectives stage GPU tensors themselves); NCCL moves them
    as they are."""
    return _backend_name(pg, torch.device("cuda")) == "gloo"


def polled(works: Sequence[Any], pg: Any, device: torch.device) -> list[Any]:
    """``works`` as the handle must wait them: wrapped in :class:`PolledWork` under NCCL's contract."""
    if not nccl_semantics(pg, device):
        return list(works)
    return [PolledWork(w, pg, device) for w in works]


def coalesced(pg: Any, device: torch.device, post: Callable[[], list[Any]]) -> list[Any]:
    """Post point-to-point ops so that they run as one batch under NCCL's contract (torch's
    ``_start_coalescing`` / ``_end_coalescing``, what ``batch_isend_irecv`` does), returning the one
    work of the batch; under gloo ``post()``'s works as they are."""
    if not nccl_semantics(pg, device):
        return post()
    pg._start_coalescing(device)
    try:
        post()
    except BaseException:
        pg._end_coalescing(device)
        raise
    return polled([pg._end_coalescing(device)], pg, device)


#: seconds the NCCL watchdog waits beyond lowband's own timeout (so lowband's error comes first)
WATCHDOG_MARGIN = 30.0


def nccl_env() -> None:
    """Before an NCCL group exists: a failed or timed-out op raises in Python and aborts the
    communicator instead of killing the process (unless the user chose otherwise)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def group_timeout(timeout: float, backend: str | None) -> datetime.timedelta:
    """The process-group timeout for lowband's ``timeout``: NCCL's watchdog gets a margin so that
    lowband's own bounded waits raise first (naming the op and the rank)."""
    extra = WATCHDOG_MARGIN if backend is not None and "nccl" in backend else 0.0
    return datetime.timedelta(seconds=timeout + extra)
