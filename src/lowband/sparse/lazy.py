"""Lazy (sparse) optimizer semantics for split embedding updates.

The vertical schedule applies one iteration's embedding gradient in parts (the rows the next batch
reads first, the rest later). Parts equal one update only when the optimizer touches just the rows a
gradient holds (torch's ``SparseAdam``, Adagrad, or SGD without momentum and weight decay, on sparse
gradients) and when every part of iteration ``t`` uses iteration ``t``'s step count. ``SparseAdam``
advances its counter on every ``step()`` call, so two calls in one iteration would use bias corrections of
iterations ``t`` and ``t + 1``; :func:`lazy_step` pins the counter to the iteration before each call
(the fix). The optimizers stay torch's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lowband.errors import InvalidArgumentError


def lazy_optimizer(opt: torch.optim.Optimizer, *, where: str) -> torch.optim.Optimizer:
    """The lazy counterpart of ``opt`` over the same parameters: ``Adam`` (or ``AdamW`` without weight
    decay) -> ``SparseAdam`` (same ``lr``, ``betas``, ``eps``), ``SGD`` without momentum and weight
    decay and ``Adagrad`` without weight decay -> ``opt`` itself (they take sparse gradients; Adagrad's
    state is per entry, a zero gradient leaves an entry unchanged, and its step counter, read only by
    ``lr_decay``, is pinned as Adam's); any other optimizer or setting (weight decay moves rows without
    gradient): :class:`InvalidArgumentError` naming ``where``."""
    groups = opt.param_groups
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):  # AdamW without weight decay is Adam
        bad = [k for k in ("weight_decay", "amsgrad", "maximize") if any(g.get(k) for g in groups)]
        if bad:
            raise InvalidArgumentError(
                f"{where}: lazy Adam (SparseAdam) does not support {bad} on embedding tables"
            )
        return torch.optim.SparseAdam(
            [{"params": g["params"], "lr": g["lr"], "betas": g["betas"], "eps": g["eps"]} for g in groups]
        )
    if type(opt) is torch.optim.SGD:
        if any(g.get("momentum") or g.get("weight_decay") or g.get("nesterov") for g in groups):
            raise InvalidArgumentError(
                f"{where}: SGD with momentum or weight decay moves rows without gradient, so split "
                "embedding updates cannot equal one update; use momentum=0, weight_decay=0 or Adam"
            )
        return opt
    if type(opt) is torch.optim.Adagrad:
        if any(g.get("weight_decay") for g in groups):
            raise InvalidArgumentError(
                f"{where}: Adagrad with weight decay moves rows without gradient, so split embedding "
                "updates cannot equal one update; use weight_decay=0"
            )
        return opt
    raise InvalidArgumentError(
        f"{where}: split embedding updates need a lazy optimizer: torch.optim.Adam (run as SparseAdam), "
        f"torch.optim.Adagrad or torch.optim.SGD without momentum, got {type(opt).__name__}"
    )


def _empty(p: torch.Tensor) -> torch.Tensor:
    idx = torch.zeros((1, 0), dtype=torch.int64, device=p.device)
    return torch.sparse_coo_tensor(
        idx, p.new_zeros((0, *p.shape[1:])), p.shape, device=p.device, check_invariants=True
    )


def lazy_step(
    opt: torch.optim.Optimizer, grads: Mapping[torch.nn.Parameter, torch.Tensor], iteration: int
) -> None:
    """Applies ``grads`` (parameter -> sparse gradient) as part of iteration ``iteration`` (1-based):
    every step counter in ``opt``'s state is set to ``iteration - 1`` before the call, so the call
    advances it to ``iteration`` however many parts the iteration is applied in."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if isinstance(opt, torch.optim.SparseAdam):
        # (by identity: ``in`` on a list of tensors would compare their values)
        fresh = {id(p) for p in params if p in grads and not opt.state.get(p)}
        if fresh:  # torch creates the state on the first call: create it with an empty update
            for p in params:
                p.grad = _empty(p) if id(p) in fresh else None
            opt.step()  # type: ignore[no-untyped-call]
    for p in params:
        st = opt.state.get(p)
        if st and "step" in st:
            if isinstance(st["step"], torch.Tensor):  # in place: torch's own device and dtype for it
                st["step"].fill_(iteration - 1)
            else:
                st["step"] = iteration - 1
        p.grad = grads.get(p)
    opt.step()
    for p in params:
        p.grad = None


def sparse_rows(rows: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The sparse gradient holding ``values[k]`` at row ``rows[k]`` (``rows`` distinct), on their device.
    Building it reads the rows on the host (the invariant check and ``coalesce`` size the result): one
    synchronisation per part applied, inherent in a sparse tensor."""
    out = torch.sparse_coo_tensor(
        rows.view(1, -1), values, shape, device=values.device, check_invariants=True
    )
    return out.coalesce()
