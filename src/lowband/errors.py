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
    """A communication did not finish within its bounded wait."""


class CommFailedError(LowbandError):
    """A communication failed, typically because a peer rank died or closed its connection."""


class NonFiniteError(InvalidArgumentError):
    """A gradient (or pseudo-gradient, or payload) held a NaN or an infinity; raised before the value is
    communicated or stored in any residual, by every rank of the step (``on_nonfinite="raise"``)."""
