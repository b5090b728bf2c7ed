"""The compat layer's errors: lowband's errors (same messages) that are also the exception classes
BlueFog raises in the same situations, so that ``except ValueError`` / ``except TypeError`` written for
BlueFog catches them.

BlueFog raises ``ValueError`` for bad arguments and for a failed dynamic-topology check, ``TypeError``
for a topology that is not a ``networkx.DiGraph``. lowband's :class:`InvalidArgumentError` already is a
``ValueError``; a send/receive mismatch (:class:`CollectiveMismatchError`) becomes
:class:`TopologyMismatchError` here, which is both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from lowband.errors import CollectiveMismatchError, InvalidArgumentError


class TopologyMismatchError(CollectiveMismatchError, ValueError):
    """Senders and receivers of a neighbor op disagree (BlueFog: ``ValueError``)."""


class TopologyTypeError(InvalidArgumentError, TypeError):
    """A topology that is not a ``networkx.DiGraph`` (BlueFog: ``TypeError``)."""


class _Converter:
    """``with as_bluefog_errors(): ...`` re-raises lowband's mismatch errors as BlueFog's classes."""

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        try:
            yield
        except CollectiveMismatchError as exc:
            if isinstance(exc, ValueError):
                raise
            raise TopologyMismatchError(str(exc)) from exc


as_bluefog_errors = _Converter()
