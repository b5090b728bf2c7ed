"""lowband's errors for the strategies that communicate through torch's own machinery.

``ddp``/``powersgd`` (torch DDP's reducer, in backward) and ``localsgd`` (torch's model averager, in
the optimizer step) wait on gloo/NCCL works that lowband's handles never see, so a dead peer surfaces
there as torch's raw ``RuntimeError`` (``DistBackendError``, "Connection closed by peer", ...).
:func:`comm_errors` turns those into :class:`~lowband.errors.CommFailedError` or
:class:`~lowband.errors.CommTimeoutError` naming the strategy, the step and the rank. The waits are
bounded already: torch's works time out after the process group's timeout (``lowband.init(timeout=)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lowband.comm.handle import comm_error
from lowband.errors import LowbandError
from lowband.group import Group
from lowband.runtime import current

# what torch's gloo/NCCL/store layers put in the messages of errors that are about communication
# (older torch versions raise a plain RuntimeError where newer ones raise DistBackendError)
_COMM_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out")


def _is_comm_error(exc: RuntimeError) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    msg = str(exc).lower()
    return any(m in msg for m in _COMM_MARKERS)


@contextmanager
def comm_errors(strategy: str, what: str, group: Group) -> Iterator[None]:
    """Re-raise torch's communication errors inside the block as lowband's, naming ``strategy``,
    ``what`` (the step that was waiting) and this rank; every other exception passes unchanged."""
    try:
        yield
    except LowbandError:
        raise
    except (RuntimeError, ValueError) as exc:
        # on a group outside torch's registry (lowband.runtime.open_group's) torch's exception logger
        # replaces a failed collective's RuntimeError by its own ValueError ("not initialized in the
        # world group map"): the failure is the context
        cause = exc if isinstance(exc, RuntimeError) else exc.__context__
        if not isinstance(cause, RuntimeError) or not _is_comm_error(cause):
            raise
        timeout = current(f"{strategy}.{what}").config.timeout
        raise comm_error(f"strategy {strategy!r}: {what} on rank {group.world_rank}", cause, timeout) from exc
