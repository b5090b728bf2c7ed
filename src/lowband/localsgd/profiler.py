"""DreamDDP's profiler: per-layer forward, backward and communication costs of a real model and batch.

- Layers are :func:`lowband.optim.parameter_layers` (parameter-owning modules). The profile lists them in
  FORWARD order defined as the reverse of the backward order actually observed (the order the layers'
  gradients become ready), so the cost model's "backward runs L -> 1" matches the model; a model whose
  modules are registered in another order than they run is profiled in the order they run.
- Forward time of a layer: time inside its owning module's forward (pre/post hooks), children that own
  layers excluded; the rest of the forward (activations, the loss) is spread over the layers in
  proportion, so the layers' sum is the measured forward time.
- Backward time of a layer: the interval between successive layer-ready events (post-accumulate-grad
  hooks; the first from the start of backward), so non-parameter ops are charged to the next layer in
  backward order; the tail after the last ready layer goes to that layer. Layers that get no gradient
  cost 0 and come last in backward order (as :class:`~lowband.optim.LayerwiseOptimizer` steps them).
- Medians over ``repeats`` timed iterations after ``warmup``, the ranks lined up before each (one
  one-element allreduce); then the per-layer times are reduced
  across ranks with the MAX (one small allgather): in local SGD every averaging waits for the slowest
  rank. Every rank gets the same profile (rank 0's backward order if the ranks' orders differ). Then
  the layers' times are scaled together so that their sum is the ranks' typical whole pass (mean over
  ranks of each rank's median pass): per-layer maxima add up to more than any real pass.
- Communication: blocking ``allreduce`` (average) of float32 buffers of several sizes on the group,
  median per size, MAX across ranks, then ``comm(bytes) = alpha + beta * bytes`` by least squares;
  ``LayerCost.comm = alpha + beta * nbytes``. A world of one has no communication: ``alpha = beta = 0``.
- Interference (:func:`measure_interference`, the cost model's ``kappa``/``sigma``): forward + backward
  passes timed quietly and while a nonblocking allreduce is in flight, the allreduce timed quietly and
  while passes run back to back; ratios of medians minus one, median across ranks (0 in a world of one).

Profiling leaves gradients, buffers (BatchNorm statistics) and the CPU RNG state as it found them. It
steps no optimizer itself; a caller whose backward hooks step one (the DreamDDP strategies, so the
profile includes the per-layer update) restores the parameters and the optimizer state afterwards.
Times on CUDA are taken after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lowband.comm.base import host_value
from lowband.comm.collectives import allgather, allreduce
from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.localsgd.costmodel import CostProfile, LayerCost
from lowband.optim.layerwise import parameter_layers
from lowband.rng import fork_rng
from lowband.runtime import world_group

LossFn = Callable[[nn.Module], torch.Tensor]

#: default message sizes for the communication fit: 4 KiB, 16 KiB, ..., 16 MiB (bounded per model)
COMM_SIZES: tuple[int, ...] = tuple(4096 * 4**k for k in range(7))
MIN_COMM_CAP = 16 * 1024
#: :func:`measure_comm` measures no larger size once one allreduce took this long (seconds) on the
#: slowest rank: the fit's slope is then known, and a slow link would spend most of the profile on it
#: (16 MiB sizes at 10 Mbit/s: 25 s)
COMM_TIME_CAP = 0.15
#: busy measurements of the interference in a profile (each: one allreduce with passes run beside it)
INTERFERENCE_REPEATS = 2


def _check_int(where: str, what: str, v: object, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidArgumentError(f"{where}: {what} must be an int >= {minimum}, got {v!r}")
    return v


# ------------------------------------------------------------------ communication fit (pure)


def fit_comm(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = alpha + beta * bytes`` to ``(bytes, seconds)`` samples.

    Needs two distinct sizes. The fit is constrained to ``alpha, beta >= 0``: a negative ``beta`` is
    replaced by ``beta = 0, alpha = mean(seconds)``, a negative ``alpha`` by the fit through the origin."""
    pts = list(samples)
    for s in pts:
        ok = isinstance(s, (tuple, list)) and len(s) == 2
        if ok:
            b, t = s
            ok = not isinstance(b, bool) and isinstance(b, int) and b >= 0
            ok = (
                ok and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
            )
        if not ok:
            raise InvalidArgumentError(
                f"fit_comm: samples must be (bytes >= 0, seconds >= 0) pairs, got {s!r}"
            )
    if len({b for b, _ in pts}) < 2:
        raise InvalidArgumentError(
            f"fit_comm: needs samples of at least 2 distinct sizes, got sizes {sorted({b for b, _ in pts})}"
        )
    x = np.array([float(b) for b, _ in pts])
    y = np.array([float(t) for _, t in pts])
    a_mat = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
    if beta < 0:
        return float(y.mean()), 0.0
    if alpha < 0:
        return 0.0, float(max(0.0, float(x @ y) / float(x @ x)))
    return float(alpha), float(beta)


def comm_sizes_for(largest_layer_bytes: int) -> tuple[int, ...]:
    """The default sizes (:data:`COMM_SIZES`) up to twice the largest layer (at least two sizes)."""
    cap = max(2 * int(largest_layer_bytes), MIN_COMM_CAP)
    return tuple(s for s in COMM_SIZES if s <= cap)


def with_comm(profile: CostProfile, alpha: float, beta: float) -> CostProfile:
    """``profile`` with every layer's ``comm`` recomputed as ``alpha + beta * nbytes`` (interference kept)."""
    layers = tuple(
        LayerCost(lc.name, lc.fwd, lc.bwd, alpha + beta * lc.nbytes, lc.nbytes) for lc in profile.layers
    )
    return CostProfile(layers, alpha, beta, profile.kappa, profile.sigma)


# ------------------------------------------------------------------ communication measurement


def measure_comm(
    group: Group | None = None,
    sizes: Sequence[int] | None = None,
    repeats: int = 3,
    device: torch.device | None = None,
) -> tuple[float, float, list[tuple[int, float]]]:
    """Time blocking allreduces of float32 buffers of ``sizes`` bytes on ``group`` (every rank calls it)
    and fit ``alpha + beta * bytes``. Returns ``(alpha, beta, samples)``, identical on every rank: the
    median of ``repeats`` timings per size, then the MAX across ranks (one tiny allreduce per size). Sizes
    go in increasing order and stop after the first whose allreduce took :data:`COMM_TIME_CAP` seconds
    or more (at least two sizes are measured; the ranks decide on the same agreed figure). The buffers live
    on ``device`` (default: the rank's, :func:`lowband.device`), so on a GPU the path training uses (NCCL)
    is the one timed; a CUDA timing ends when the device has finished (``torch.cuda.synchronize``)."""
    ctx, g = world_group(group, "measure_comm")
    dev = ctx.device if device is None else torch.device(device)
    where = f"measure_comm on rank {ctx.rank}"
    repeats = _check_int(where, "repeats", repeats, 1)
    raw = list(COMM_SIZES if sizes is None else sizes)
    for s in raw:
        _check_int(where, "every size", s, 4)
    nbs = [(s // 4) * 4 for s in raw]
    if len(set(nbs)) < 2:
        raise InvalidArgumentError(f"{where}: sizes must hold at least 2 distinct sizes (bytes), got {raw}")
    if g.size == 1:
        return 0.0, 0.0, [(nb, 0.0) for nb in sorted(set(nbs))]
    fast = g.unchecked()
    samples: list[tuple[int, float]] = []
    for nb in sorted(set(nbs)):
        buf = torch.zeros(nb // 4, dtype=torch.float32, device=dev)
        allreduce(buf, inplace=True, group=g)  # warm-up; with the check on, the ranks' sizes are validated
        ts = []
        for _ in range(repeats):
            t0 = _sync(dev)
            allreduce(buf, inplace=True, group=fast)
            ts.append(_sync(dev) - t0)
        # host-side timings (a CPU tensor: on a cpu:gloo,cuda:nccl group it goes through gloo)
        mine = host_value(torch.tensor([statistics.median(ts)], dtype=torch.float64, device="cpu"), g)
        red = allreduce(mine, "max", group=g)
        samples.append((nb, float(red.item())))
        if len(samples) >= 2 and samples[-1][1] >= COMM_TIME_CAP:
            break
    alpha, beta = fit_comm(samples)
    return alpha, beta, samples


def refit_comm(
    profile: CostProfile, group: Group | None = None, *, sizes: Sequence[int] | None = None, repeats: int = 3
) -> CostProfile:
    """Re-measure the links (:func:`measure_comm`) and return ``profile`` with the new fit; sizes default
    to :func:`comm_sizes_for` the profile's largest layer."""
    if sizes is None:
        sizes = comm_sizes_for(max(lc.nbytes for lc in profile.layers))
    alpha, beta, _ = measure_comm(group, sizes, repeats)
    return with_comm(profile, alpha, beta)


# ------------------------------------------------------------------ layer timing


@contextmanager
def _preserved(model: nn.Module, params: list[nn.Parameter]) -> Iterator[None]:
    """Run the body with the RNG states forked (the CPU's and those of the GPUs ``params`` live on: the
    profiled passes must not move the training run's dropout streams), then restore ``params``'
    gradients and the buffers."""
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    gpus = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with fork_rng(devices=gpus):
            yield
    finally:
        with torch.no_grad():
            for p, gr in zip(params, saved_grads):
                p.grad = gr
            for buf, old in zip(model.buffers(), saved_buffers):
                buf.copy_(old)


def _sync(device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _LayerTimer:
    """Forward/backward hooks that time one forward + backward of the model, layer by layer."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, list[nn.Parameter]]]) -> None:
        self.layers = layers
        self.n = len(layers)
        self.device = next((p.device for _, ps in layers for p in ps if p.device.type != "cpu"), None)
        mods = dict(model.named_modules())
        self.fwd = [0.0] * self.n
        self._stack: list[list[float]] = []  # [layer, start, time in child layers]
        self._seen = [0] * self.n
        self.ready: list[tuple[int, float]] = []
        self._hooks: list[Any] = []
        for i, (name, ps) in enumerate(layers):
            mod = mods["" if name == "<root>" else name]
            self._hooks.append(mod.register_forward_pre_hook(self._pre(i)))
            self._hooks.append(mod.register_forward_hook(self._post(), always_call=True))
            for p in ps:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad(i)))  # type: ignore[no-untyped-call]

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            self._stack.append([float(i), _sync(self.device), 0.0])

        return hook

    def _post(self) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            if not self._stack:
                return
            i, start, child = self._stack.pop()
            elapsed = _sync(self.device) - start
            self.fwd[int(i)] += max(0.0, elapsed - child)
            if self._stack:
                self._stack[-1][2] += elapsed

        return hook

    def _grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            self._seen[i] += 1
            if self._seen[i] == len(self.layers[i][1]):
                self.ready.append((i, _sync(self.device)))

        return hook

    def run(
        self, loss_fn: LossFn, model: nn.Module, where: str
    ) -> tuple[list[float], list[float], list[int], float]:
        """One forward + backward: per-layer forward and backward seconds, the backward order, and the
        wall time of the whole pass."""
        self.fwd = [0.0] * self.n
        self._stack.clear()
        self._seen = [0] * self.n
        self.ready = []
        t0 = _sync(self.device)
        loss = loss_fn(model)
        t1 = _sync(self.device)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InvalidArgumentError(f"{where}: loss_fn must return a one-element tensor, got {got}")
        tb = _sync(self.device)
        loss.backward()  # type: ignore[no-untyped-call]
        te = _sync(self.device)
        fwd_total = t1 - t0
        hooked = sum(self.fwd)
        rest = max(0.0, fwd_total - hooked)
        fwd = [f + (rest * f / hooked if hooked > 0 else rest / self.n) for f in self.fwd]
        bwd = [0.0] * self.n
        order: list[int] = []
        prev = tb
        for i, t in self.ready:
            bwd[i] += t - prev
            prev = t
            order.append(i)
        if order:
            bwd[order[-1]] += max(0.0, te - prev)
        order += [i for i in reversed(range(self.n)) if i not in set(order)]
        return fwd, bwd, order, te - t0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def profile_model(
    model: nn.Module,
    loss_fn: LossFn,
    *,
    group: Group | None = None,
    warmup: int = 1,
    repeats: int = 4,
    comm_sizes: Sequence[int] | None = None,
    comm_repeats: int = 3,
    interference: bool = True,
) -> CostProfile:
    """Profile ``model`` on the batch of ``loss_fn(model) -> scalar loss`` (every rank of ``group`` calls
    it): per-layer forward/backward times (medians of ``repeats`` after ``warmup`` iterations, MAX across
    ranks), parameter bytes, and per-layer communication from the fitted allreduce cost on the group's
    links (``comm_sizes`` bytes, default :func:`comm_sizes_for` the largest layer). Layers in forward
    order, the reverse of the observed backward order. With ``interference`` (default) the profile's
    ``kappa``/``sigma`` come from :func:`measure_interference` (:data:`INTERFERENCE_REPEATS` busy measurements against the quiet pass and link fit measured here), else they are 0
    (the paper's model). The model is left unchanged (see module doc)."""
    ctx, g = world_group(group, "profile_model")
    where = f"profile_model on rank {ctx.rank}"
    if not isinstance(interference, bool):
        raise InvalidArgumentError(f"{where}: interference must be a bool, got {interference!r}")
    warmup = _check_int(where, "warmup", warmup, 0)
    repeats = _check_int(where, "repeats", repeats, 1)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise InvalidArgumentError(f"{where}: loss_fn must be callable, got {type(loss_fn).__name__}")
    layers = parameter_layers(model)
    if not layers:
        raise InvalidArgumentError(f"{where}: the model has no trainable parameters")
    n = len(layers)
    nbytes = [sum(p.numel() * p.element_size() for p in ps) for _, ps in layers]
    params = [p for _, ps in layers for p in ps]
    timer = _LayerTimer(model, layers)
    fwds: list[list[float]] = []
    bwds: list[list[float]] = []
    orders: list[tuple[int, ...]] = []
    walls: list[float] = []
    try:
        tick, fast = torch.zeros(1, device=params[0].device), g.unchecked()  # on the data's device
        with _preserved(model, params):
            for it in range(warmup + repeats):
                # all ranks compute at once, as in training (on shared cores a lone rank runs faster)
                allreduce(tick, inplace=True, group=fast)
                for p in params:
                    p.grad = None
                f, b, o, w = timer.run(loss_fn, model, where)
                if it >= warmup:
                    fwds.append(f)
                    bwds.append(b)
                    orders.append(tuple(o))
                    walls.append(w)
    finally:
        timer.remove()
    order = Counter(orders).most_common(1)[0][0]
    fwd = [statistics.median(x[i] for x in fwds) for i in range(n)]
    bwd = [statistics.median(x[i] for x in bwds) for i in range(n)]
    pos = [0.0] * n
    for k, i in enumerate(order):
        pos[i] = float(k)
    row = torch.tensor([*fwd, *bwd, *pos, *walls], dtype=torch.float64, device="cpu")  # host timings
    table = allgather(host_value(row, g), group=g).view(g.size, 3 * n + repeats).cpu()
    fwd = table[:, :n].amax(0).tolist()
    bwd = table[:, n : 2 * n].amax(0).tolist()
    order = tuple(sorted(range(n), key=lambda i: float(table[0, 2 * n + i])))  # rank 0's order
    # per-layer maxima of medians add up to more than any real pass (each layer's worst rank): scale the
    # layers so that one forward + backward takes the ranks' typical pass, the mean over ranks of each
    # rank's median pass (the ranks compute at once, as in training)
    typical = sum(statistics.median(row) for row in table[:, 3 * n :].tolist()) / g.size
    hooked = sum(fwd) + sum(bwd)
    if hooked > 0.0 and typical > 0.0:
        fwd = [x * typical / hooked for x in fwd]
        bwd = [x * typical / hooked for x in bwd]
    sizes = comm_sizes_for(max(nbytes)) if comm_sizes is None else comm_sizes
    alpha, beta, samples = measure_comm(g, sizes, comm_repeats, device=params[0].device)
    costs = tuple(
        LayerCost(layers[i][0], fwd[i], bwd[i], alpha + beta * nbytes[i], nbytes[i]) for i in reversed(order)
    )
    if interference:
        from lowband.localsgd.interference import measure_interference  # it builds on this module

        # the quiet figures are those measured above: the ranks' typical pass, the fit at the largest
        # size measured (capped by the model's bytes); only the busy ones are measured again
        nb = max(4, min(sum(nbytes), max(b for b, _ in samples)))
        quiet = (typical, alpha + beta * nb) if typical > 0.0 else None
        kappa, sigma = measure_interference(
            model, loss_fn, group=g, repeats=INTERFERENCE_REPEATS, nbytes=nb, quiet=quiet
        )
    else:
        kappa, sigma = 0.0, 0.0
    return CostProfile(costs, alpha, beta, kappa, sigma)


# ------------------------------------------------------------------ JSON


def save_profile(profile: CostProfile, path: str | Path) -> None:
    """Write ``profile`` as JSON (:meth:`CostProfile.to_json`), so a schedule can be reproduced."""
    if not isinstance(profile, CostProfile):
        raise InvalidArgumentError(
            f"save_profile: profile must be a CostProfile, got {type(profile).__name__}"
        )
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")


def save_profile_atomic(profile: CostProfile, path: str | Path) -> None:
    """:func:`save_profile` through a temporary file renamed into place (a reader never sees half)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    save_profile(profile, tmp)
    os.replace(tmp, target)


def load_profile(path: str | Path) -> CostProfile:
    """Read a profile written by :func:`save_profile`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"load_profile: cannot read a profile from {str(path)!r}: {exc}") from None
    return CostProfile.from_json(data)


def resolve_profile(
    profile: str | Path | CostProfile | None, where: str
) -> tuple[CostProfile | None, Path | None]:
    """A ``profile=`` option: (the profile, None) for a profile or a saved file; (None, the path) for a
    file that does not exist yet (measured at the first step and saved there by rank 0); (None, None)
    for none. A path whose folder does not exist is refused."""
    if isinstance(profile, (str, Path)) and not Path(profile).exists():
        if not Path(profile).parent.is_dir():
            raise InvalidArgumentError(
                f"{where}: cannot read a profile from {str(profile)!r} nor save one there (no such directory)"
            )
        return None, Path(profile)
    if isinstance(profile, (str, Path)):
        return load_profile(profile), None
    return profile, None
