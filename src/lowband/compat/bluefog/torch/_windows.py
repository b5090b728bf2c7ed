"""BlueFog's one-sided window ops on :mod:`lowband.decentral.window`.

Same names, arguments and defaults as BlueFog; nonblocking forms return integer handles for
:func:`win_wait` / :func:`win_poll` (which also accept lowband handles). The consistency model is lowband's
(see :mod:`lowband.decentral.window`): an operation's handle completes once every destination has applied
it, each operation is applied atomically under the destination's window lock, operations from one rank
to another are applied in order, and ``require_mutex`` waits for the destination's distributed mutex.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

import torch

from lowband.compat.bluefog.torch import _assoc_p as assoc_p
from lowband.compat.bluefog.torch._state import compat_state, lookup, register
from lowband.decentral import window as dw
from lowband.errors import InvalidArgumentError

Tensor = torch.Tensor
logger = logging.getLogger("lowband.compat.bluefog")


def win_create(tensor: Tensor, name: str, zero_init: bool = False) -> bool:
    """Register ``tensor`` (the tensor itself, not a copy) as window ``name`` on every rank (collective),
    with one buffer per in-neighbor of the current topology: a copy of ``tensor``, or zeros with
    ``zero_init``. Returns True. While window ops with associated p are on, the window also carries p
    (see :mod:`lowband.compat.bluefog.torch._assoc_p`)."""
    if compat_state(op="win_create").assoc_p:
        return assoc_p.create(tensor, name, zero_init)
    return dw.win_create(tensor, name, zero_init=zero_init)


def win_free(name: str | None = None) -> bool:
    """Free window ``name``, or every window with ``None`` (collective). Returns True."""
    ok = dw.win_free(name)
    assoc_p.forget(name)
    return ok


def get_current_created_window_names() -> list[str]:
    """Names of this rank's windows, in creation order."""
    return dw.window_names()


def win_update(
    name: str,
    self_weight: float | None = None,
    neighbor_weights: Mapping[int, float] | None = None,
    reset: bool = False,
    clone: bool = False,
    require_mutex: bool = False,
) -> Tensor:
    """``self_weight * tensor + sum_r neighbor_weights[r] * buffer_r`` (both weights, or neither for the
    topology's weights), written into the registered tensor and returned (a new tensor with ``clone``).
    ``reset`` zeroes the buffers used; ``require_mutex`` holds this rank's window mutex meanwhile."""
    out = dw.win_update(
        name,
        self_weight=self_weight,
        src_weights=neighbor_weights,
        reset=reset,
        clone=clone,
        require_mutex=require_mutex,
    )
    return _unaugmented(name, out)


def _unaugmented(name: str, out: Tensor) -> Tensor:
    """The user's view of a window value: without p for a window that carries it."""
    aug = assoc_p.augmented(name)
    if aug is None:
        return out
    user = compat_state(op="win_update").p_windows[name][0]
    return user if out is aug else out[:-1].view(user.shape)


def win_update_then_collect(name: str, require_mutex: bool = True) -> Tensor:
    """``tensor += sum of the buffers`` and zero them, atomically (push-sum's collect); returns the
    registered tensor."""
    return _unaugmented(name, dw.win_update_then_collect(name, require_mutex=require_mutex))


def win_put_nonblocking(
    tensor: Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> int:
    """Nonblocking :func:`win_put`; returns a handle for :func:`win_wait` / :func:`win_poll`."""
    aug = assoc_p.augmented(name) if isinstance(name, str) else None
    sent = tensor if aug is None else assoc_p.with_p(tensor, aug)
    h = dw.win_put_nonblocking(
        sent, name, self_weight=self_weight, dst_weights=dst_weights, require_mutex=require_mutex
    )
    if aug is not None:
        assoc_p.scaled_back(tensor, sent, aug)
    return register(h, window=True)


def win_put(
    tensor: Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> bool:
    """Overwrite each destination's buffer for this rank (default: every out-neighbor, weight 1) with
    ``tensor * dst_weights[r]``, then ``tensor *= self_weight`` (default 1). True once applied."""
    return win_wait(win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


def win_accumulate_nonblocking(
    tensor: Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> int:
    """Nonblocking :func:`win_accumulate`; returns a handle for :func:`win_wait` / :func:`win_poll`."""
    aug = assoc_p.augmented(name) if isinstance(name, str) else None
    sent = tensor if aug is None else assoc_p.with_p(tensor, aug)
    h = dw.win_accumulate_nonblocking(
        sent, name, self_weight=self_weight, dst_weights=dst_weights, require_mutex=require_mutex
    )
    if aug is not None:
        assoc_p.scaled_back(tensor, sent, aug)
    return register(h, window=True)


def win_accumulate(
    tensor: Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> bool:
    """Like :func:`win_put`, but *adds* ``tensor * dst_weights[r]`` to each destination's buffer."""
    return win_wait(win_accumulate_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


def win_get_nonblocking(
    name: str, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False
) -> int:
    """Nonblocking :func:`win_get`; returns a handle for :func:`win_wait` / :func:`win_poll`."""
    h = dw.win_get_nonblocking(name, src_weights=src_weights, require_mutex=require_mutex)
    return register(h, window=True)


def win_get(name: str, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False) -> bool:
    """Fetch each source's registered tensor ``* src_weights[r]`` (default: every in-neighbor, weight 1)
    into this rank's buffer for it. True once written."""
    return win_wait(win_get_nonblocking(name, src_weights, require_mutex))


def win_wait(handle: object) -> bool:
    """Wait (bounded) for a window op; True once it completed. An unknown handle logs a warning and
    returns False, as in BlueFog."""
    try:
        h = lookup("win_wait", handle, window=True, pop=True)
    except InvalidArgumentError as exc:
        logger.warning("%s", exc)
        return False
    return dw.win_wait(h)


def win_poll(handle: object) -> bool:
    """Whether a window op has completed; never blocks."""
    return dw.win_poll(lookup("win_poll", handle, window=True, pop=False))


@contextlib.contextmanager
def win_lock(name: str) -> Iterator[None]:
    """Hold this rank's window mutex and hold back every incoming operation on the window until the block
    exits (BlueFog opens an MPI passive-target epoch instead)."""
    with dw.win_lock(name):
        yield


@contextlib.contextmanager
def win_mutex(name: str, for_self: bool = False, ranks: Sequence[int] | None = None) -> Iterator[None]:
    """Hold the window mutex of ``ranks`` (default: every out-neighbor) or, with ``for_self``, of this
    rank's own window."""
    with dw.win_mutex(name, for_self=for_self, ranks=ranks):
        yield


def get_win_version(name: str) -> dict[int, int]:
    """``{in-neighbor: writes into its buffer since the last win_update that read it}``."""
    return dw.get_win_version(name)


def win_associated_p(name: str) -> float:
    """The associated p of window ``name`` (push-sum's weight; 1.0 at creation and for windows created
    while window ops with associated p were off)."""
    return assoc_p.associated_p(name)


def turn_on_win_ops_with_associated_p() -> None:
    """Windows created from now on carry an associated p that every window op moves as it moves the
    tensor (BlueFog's global switch; off by default)."""
    compat_state(op="turn_on_win_ops_with_associated_p").assoc_p = True


def turn_off_win_ops_with_associated_p() -> None:
    """Windows created from now on carry no associated p."""
    compat_state(op="turn_off_win_ops_with_associated_p").assoc_p = False
