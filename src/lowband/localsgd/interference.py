"""DreamDDP cost model's interference parameters, measured: how much backward slows while an averaging
is in flight (``kappa``) and how much an averaging slows while backward runs (``sigma``).

lowband's extension beyond the paper's Eq. 7 (see :mod:`lowband.localsgd.costmodel`): on GPUs with a
NIC both are ~0; on a CPU testbed where ranks, gloo and the kernel's network work share the cores they
are not, and a schedule that overlaps more is then not faster. :func:`profile_model` calls this.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

from lowband.comm.base import host_value
from lowband.comm.collectives import allgather, allreduce, iallreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.localsgd.profiler import LossFn, _check_int, _preserved, _sync
from lowband.optim.layerwise import parameter_layers
from lowband.runtime import world_group

#: largest buffer :func:`measure_interference` averages by default (bytes)
INTERFERENCE_CAP = 8 << 20


def _one_pass(model: nn.Module, loss_fn: LossFn, params: list[nn.Parameter], where: str) -> float:
    """Seconds of one forward + backward (gradients cleared first)."""
    device = next((p.device for p in params if p.device.type != "cpu"), None)
    for p in params:
        p.grad = None
    t0 = _sync(device)
    loss = loss_fn(model)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidArgumentError(f"{where}: loss_fn must return a one-element tensor, got {got}")
    loss.backward()  # type: ignore[no-untyped-call]
    return _sync(device) - t0


def _ratio_excess(busy: float, quiet: float) -> float:
    """``busy / quiet - 1`` clamped to ``>= 0`` (0 when ``quiet`` is 0)."""
    if quiet <= 0.0 or not math.isfinite(busy / quiet):
        return 0.0
    return max(0.0, busy / quiet - 1.0)


def measure_interference(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    group: Group | None = None,
    repeats: int = 3,
    nbytes: int | None = None,
    quiet: tuple[float, float] | None = None,
) -> tuple[float, float]:
    """Measure the cost model's interference ``(kappa, sigma)`` on ``model`` and the group's links (every
    rank of ``group`` calls it at once).

    Per repeat: (a) two forward + backward passes of ``loss_fn(model)`` quietly, the ranks lined up
    first so that all of them compute at once; (b) one blocking allreduce of a
    float32 buffer of ``nbytes`` bytes (default: the model's parameter bytes, capped at
    :data:`INTERFERENCE_CAP`) quietly; (c) the same allreduce nonblocking, with forward + backward passes
    run back to back until it completes. ``kappa = median(busy pass) / median(quiet pass) - 1`` (busy
    passes: those that ended before the allreduce did; the first pass if none did), ``sigma = median(busy
    allreduce) / median(quiet allreduce) - 1``, both clamped to ``>= 0``, then the MEDIAN across ranks (one
    small allgather), so every rank returns the same pair. A world of one returns ``(0.0, 0.0)``. The
    model is left unchanged (gradients, buffers, CPU RNG state restored); no optimizer is stepped.

    ``quiet=(pass_s, allreduce_s)``: the quiet figures are known already (:func:`profile_model` has the
    ranks' typical pass and the link's fit at ``nbytes``, which must then be given): (a) and (b) are
    skipped, and the busy measurements (c) are compared with them; the same on every rank."""
    ctx, g = world_group(group, "measure_interference")
    where = f"measure_interference on rank {ctx.rank}"
    repeats = _check_int(where, "repeats", repeats, 1)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise InvalidArgumentError(f"{where}: loss_fn must be callable, got {type(loss_fn).__name__}")
    params = [p for _, ps in parameter_layers(model) for p in ps]
    if not params:
        raise InvalidArgumentError(f"{where}: the model has no trainable parameters")
    if nbytes is None:
        if quiet is not None:
            raise InvalidArgumentError(f"{where}: quiet= needs the nbytes its allreduce time is for")
        nb = min(max(4, sum(p.numel() * p.element_size() for p in params)), INTERFERENCE_CAP)
    else:
        nb = _check_int(where, "nbytes", nbytes, 4)
    if quiet is not None and not (
        len(quiet) == 2 and all(isinstance(q, float) and math.isfinite(q) and q >= 0.0 for q in quiet)
    ):
        raise InvalidArgumentError(
            f"{where}: quiet must be (pass seconds, allreduce seconds) >= 0, got {quiet!r}"
        )
    if g.size == 1:
        return 0.0, 0.0
    fast = g.unchecked()
    timeout = ctx.config.timeout
    dev = params[0].device  # the link training uses: NCCL for a model on a GPU
    buf = torch.zeros(nb // 4, dtype=torch.float32, device=dev)
    quiet_pass: list[float] = []
    quiet_comm: list[float] = []
    busy_pass: list[float] = []
    busy_comm: list[float] = []
    with _preserved(model, params):
        allreduce(buf, inplace=True, group=g)  # warm-up; with the check on, the ranks' sizes are validated
        if quiet is None:  # with the quiet figures given, the caller's passes warmed the model up
            _one_pass(model, loss_fn, params, where)
        tick = torch.zeros(1, device=dev)
        for _ in range(repeats):
            # every rank computes at once, as in training: on shared cores a pass run while the other
            # ranks idle would be faster than any training step and inflate kappa
            allreduce(tick, inplace=True, group=fast)
            if quiet is None:
                quiet_pass.append(_one_pass(model, loss_fn, params, where))
                quiet_pass.append(_one_pass(model, loss_fn, params, where))
                t0 = _sync(dev)
                allreduce(buf, inplace=True, group=fast)  # also lines the ranks up for (c)
                quiet_comm.append(_sync(dev) - t0)
            t0 = time.perf_counter()
            done_at = iallreduce(buf, inplace=True, group=fast).then(lambda _t: time.perf_counter())
            passes: list[tuple[float, float]] = []  # (seconds, end time)
            while True:
                d = _one_pass(model, loss_fn, params, where)
                passes.append((d, time.perf_counter()))
                if done_at.done() or time.perf_counter() - t0 > timeout:
                    break
            t_end = done_at.wait()  # bounded by the runtime's timeout
            busy_comm.append(t_end - t0)
            full = [d for d, end in passes if end <= t_end] or [passes[0][0]]
            busy_pass.append(statistics.median(full))
    if quiet is not None:
        quiet_pass, quiet_comm = [quiet[0]], [quiet[1]]
    kappa = _ratio_excess(statistics.median(busy_pass), statistics.median(quiet_pass))
    sigma = _ratio_excess(statistics.median(busy_comm), statistics.median(quiet_comm))
    table = allgather(
        host_value(torch.tensor([[kappa, sigma]], dtype=torch.float64, device="cpu"), g), group=g
    )
    rows = table.tolist()  # the median over ranks: one rank's noisy estimate does not set it
    return float(statistics.median(r[0] for r in rows)), float(statistics.median(r[1] for r in rows))
