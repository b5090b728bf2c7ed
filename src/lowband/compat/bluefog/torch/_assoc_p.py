"""Windows with an associated p (BlueFog's push-sum weight carried with every window op).

While :func:`turn_on_win_ops_with_associated_p` is in effect, a window is created on an *augmented*
tensor ``[tensor.flatten(), p]`` (p starts at 1, each in-neighbor's p buffer at 0) and the user's tensor
is rebound (``Tensor.set_``) to the leading part of that storage, so that it stays the window's registered
value. Every op then moves p exactly as it moves the tensor: a put/accumulate sends ``p * dst_weight`` and
scales p by ``self_weight``, a get fetches the source's p, an update combines the p buffers with the same
weights, a collect adds them. :func:`win_associated_p` reads p.
"""

from __future__ import annotations

import torch

import lowband
from lowband.compat.bluefog.torch._state import MOD, compat_state
from lowband.decentral import window as dw
from lowband.errors import InvalidArgumentError
from lowband.runtime import current

Tensor = torch.Tensor


def create(tensor: Tensor, name: str, zero_init: bool) -> bool:
    """Create window ``name`` on the augmented tensor (see the module docstring)."""
    op = "win_create"
    ctx = current(op)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{MOD}.{op} on rank {ctx.rank} (window {name!r}): with associated p the tensor must be a "
            "contiguous torch.Tensor (it is rebound to the window's storage)"
        )
    aug = torch.cat([tensor.detach().reshape(-1), tensor.new_ones(1)])
    ok = dw.win_create(aug, name, zero_init=zero_init)
    if not zero_init:
        # the buffers are copies of the tensor, p included: p buffers start at 0. No neighbor may write
        # into them before they are fixed, hence the barrier (the creation is collective anyway).
        state = dw.win_state_dict(name)
        for b in state["buffers"].values():
            b[-1] = 0.0
        dw.win_load_state_dict(name, state)
        lowband.barrier()
    with torch.no_grad():
        tensor.set_(aug.untyped_storage(), 0, tensor.shape, tensor.stride())
    compat_state(ctx).p_windows[name] = (tensor, aug)
    return ok


def augmented(name: str) -> Tensor | None:
    """The augmented tensor of window ``name`` when it carries p, else None."""
    entry = compat_state(op="win_associated_p").p_windows.get(name)
    return None if entry is None else entry[1]


def with_p(tensor: Tensor, aug: Tensor) -> Tensor:
    """A new tensor ``[tensor.flatten(), p]`` to send (p: this rank's current p of the window)."""
    return torch.cat([tensor.detach().reshape(-1).to(aug.dtype), aug[-1:]])


def scaled_back(tensor: Tensor, sent: Tensor, aug: Tensor) -> None:
    """After a put/accumulate scaled ``sent`` by ``self_weight``: the tensor and p take the scaled values."""
    with torch.no_grad():
        if tensor.data_ptr() != aug.data_ptr():
            tensor.copy_(sent[:-1].view(tensor.shape))
        else:
            aug[:-1].copy_(sent[:-1])
        aug[-1] = sent[-1]


def forget(name: str | None) -> None:
    """Drop the compat record of window ``name`` (every window with None) once freed."""
    wins = compat_state(op="win_free").p_windows
    if name is None:
        wins.clear()
    else:
        wins.pop(name, None)


def associated_p(name: str) -> float:
    """The p of window ``name``: 1.0 for a window created without associated p (never changed)."""
    op = "win_associated_p"
    ctx = current(op)
    if name not in dw.window_names():
        raise InvalidArgumentError(f"{MOD}.{op} on rank {ctx.rank}: no window named {name!r}")
    aug = augmented(name)
    return 1.0 if aug is None else float(aug[-1])
