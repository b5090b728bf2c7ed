"""Exceptions raised by lowband. Every message names the operation and the rank."""

from __future__ import annotations


class LowbandError(RuntimeError):
    """Base class of every error lowband raises on purpose."""


class NotInitializedError(LowbandError):
    """An operation was called before :func:`lowband.init` (or after :func:`lowband.shutdown`)."""


class InvalidArgumentError(LowbandError, ValueError):
    """An argument is wrong on this rank alone (type, dtype, shape, rank out of range...)."""


class CollectiveMismatchError(LowbandError):
    """Ranks called a collective with arguments that do not fit together (shapes, dtypes, roots, ops)."""


class CommTimeoutError(LowbandError, TimeoutError):
    """A communication did not finish within its bounded wait.

    When lowband's launchers started the ranks (``LOWBAND_REPORT_DIR``: each rank's pid file), the
    message also names the peers whose processes are stopped now (state ``T``: SIGSTOP, a suspended job,
    a debugger): the ranks that stopped answering, the usual cause of the timeout."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str) and _STOPPED not in args[0]:
            args = (args[0] + _stopped_peers(),)
        super().__init__(*args)


class CommFailedError(LowbandError):
    """A communication failed, typically because a peer rank died or closed its connection."""


class NonFiniteError(InvalidArgumentError):
    """A gradient (or pseudo-gradient, or payload) held a NaN or an infinity; raised before the value is
    communicated or stored in any residual, by every rank of the step (``on_nonfinite="raise"``)."""


_STOPPED = "stopped answering (its process is stopped"


def _stopped_peers() -> str:
    """ "; rank R stopped answering (...)" for the peers stopped now (module docstring of
    :class:`CommTimeoutError`), or "" outside lowband's launchers or when none is."""
    import os

    folder = os.environ.get("LOWBAND_REPORT_DIR")
    if not folder:
        return ""
    from lowband.rank_main import stopped_ranks  # (a light module: the standard library only)

    try:
        me = int(os.environ.get("RANK", "-1"))
        ranks = [r for r in stopped_ranks(folder) if r != me]
    except (OSError, ValueError):
        return ""
    if not ranks:
        return ""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
    return f"; {who} {_STOPPED}: SIGSTOP, a suspended job or a debugger)"
