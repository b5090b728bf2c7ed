"""Deep Gradient Compression (Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression: Reducing the
Communication Bandwidth for Distributed Training"): a sampled-threshold sparsifier (:class:`DGC`,
``"dgc"``) and its momentum-correction memory (:class:`DGCMemory`), after the authors' code.

Momentum correction. The memory, not the optimizer, holds the momentum: for each parameter it keeps a
momentum ``u`` and an accumulated velocity ``v``; given a gradient ``g`` (optionally clipped: the
unit's L2 norm scaled down to ``clip_norm``, as the paper's local gradient clipping, whose threshold
the paper scales by ``N**-0.5`` for N ranks), it sets ``u = m * u + g``, ``v = v + u`` (Nesterov:
``u = m * (u + g)``, ``v = v + u + g``) and hands ``v`` to the compressor. What is sent is cleared from
``v``, and, with momentum factor masking (on by default), from ``u``. A coordinate counts as sent where
its local decode is non-zero (a sent exact zero leaves ``u`` as it is: it changes nothing in ``v``).
The wrapped torch optimizer must therefore run **without** momentum (plain SGD on the averaged sparse
update); :func:`check_optimizer` refuses one with momentum.

Sampled threshold (per unit, on ``|v|``). With density ``rho`` a unit of ``d`` elements sends
``k = ceil(rho * d)``. A sample of ``|v|`` (``sample_ratio``, at least 1%, and at least ``2 / rho``
elements; strided from a random start, or uniform with replacement) gives the threshold: the smallest
of its top ``ceil(rho * samples)``. Every ``|v| >= threshold`` is selected; if more than
``upper * k`` are, the exact top-k of the selection is taken (``resample``), or the threshold raised by
``upper`` and tried again; if fewer than ``lower * k``, it is lowered by ``lower`` and tried again (at
most ``max_adapt`` times); a selection still above ``k`` keeps its ``k`` lowest indices. Units of at
most ``2 / rho`` elements are not sampled (the threshold is the exact k-th largest). The sample draws
from the rank's own stream (``shared=False``). The payload (indices, values) has a data-dependent
size: ``fixed_size`` is False (an allgather-v transport carries it).

Warm-up. For the first ``warmup_epochs`` epochs (of ``epoch_steps`` steps) the density is
``max(coeff ** (e + 1), ratio)`` in epoch ``e``, ``coeff`` defaulting to ``ratio ** (1 / (warmup_epochs
+ 1))`` (the authors' code: 0.251, 0.063, 0.0158, 0.0040, then 0.001 for ratio 0.001 over 4 epochs);
``warmup_coeff=0.25`` gives the paper's 0.25, 0.0625, 0.015625, 0.0039.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lowband.compress.base import CompressContext, Compressor, Payload, check_input, register_compressor
from lowband.compress.memory import MEMORIES, Memory, Segments, check_segments
from lowband.compress.sparse import count_from_ratio, index_dtype, scatter, topk_indices
from lowband.errors import InvalidArgumentError
from lowband.options import Opt, Options

Tensor = torch.Tensor


def sample_plan(d: int, density: float, sample_ratio: float) -> tuple[int, int]:
    """``(stride, samples)`` for a unit of ``d`` elements at ``density`` (the authors' code): at least
    ``sample_ratio * d`` and ``2 / density`` samples, at a stride of the form ``32 j + 1`` (reduced by 8
    until there are enough); every element (stride 1) when ``d <= 2 / density`` or ``sample_ratio`` is 1."""
    if sample_ratio >= 1.0:
        return 1, d
    pct = math.ceil(d * sample_ratio)
    cpr = math.ceil(2 / density)
    if d <= cpr:
        return 1, d
    want = max(pct, cpr)
    stride = math.ceil(d / want / 32) * 32 + 1
    while d // stride < want:
        stride -= 8
    return stride, d // stride


@register_compressor(
    "dgc",
    "Deep Gradient Compression: sampled top-k threshold with warm-up (memory: DGCMemory)",
    Options(
        {
            "ratio": Opt(float, min=0, max=1, doc="the density sent"),
            "sample_ratio": Opt(float, gt=0, max=1, doc="the fraction sampled for the threshold (>= 1%)"),
            "strided": Opt(bool, doc="a strided sample from a random start (else uniform)"),
            "upper": Opt(float, min=1, finite=False, doc="more than upper * k selected: resample or raise"),
            "lower": Opt(float, gt=0, max=1, doc="fewer than lower * k selected: lower the threshold"),
            "max_adapt": Opt(int, min=0, doc="threshold adaptations at most"),
            "resample": Opt(bool, doc="the exact top-k of an oversized selection"),
            "warmup_epochs": Opt(int, min=0, doc="epochs of decreasing density"),
            "epoch_steps": Opt(int, min=1, unit="steps", doc="steps per warm-up epoch"),
            "warmup_coeff": Opt(
                float, gt=0, max=1, doc="density coeff**(e+1) in epoch e (None: the authors')"
            ),
        }
    ),
)
class DGC(Compressor):
    """The sampled-threshold sparsifier of Deep Gradient Compression; see the module docstring."""

    name = "dgc"
    summable = False
    fixed_size = False

    def __init__(
        self,
        *,
        ratio: float = 0.001,
        sample_ratio: float = 0.01,
        strided: bool = True,
        upper: float = 1.3,
        lower: float = 0.8,
        max_adapt: int = 10,
        resample: bool = True,
        warmup_epochs: int = 0,
        epoch_steps: int = 1,
        warmup_coeff: float | None = None,
    ) -> None:
        self.ratio = float(ratio)
        self.sample_ratio = min(max(float(sample_ratio), 0.01), 1.0)
        self.strided = strided
        self.upper, self.lower = float(upper), float(lower)
        self.max_adapt = max_adapt
        self.resample = resample
        self.warmup_epochs, self.epoch_steps = warmup_epochs, epoch_steps
        if warmup_coeff is None:
            coeff = self.ratio ** (1.0 / (self.warmup_epochs + 1)) if self.warmup_epochs else 1.0
        else:
            coeff = float(warmup_coeff)
        self.warmup_coeff = coeff
        self._explicit_coeff = warmup_coeff is not None

    def density(self, step: int) -> float:
        """The fraction of a unit sent at ``step`` (warm-up, then ``ratio``)."""
        epoch = step // self.epoch_steps
        if epoch < self.warmup_epochs:
            return max(self.warmup_coeff ** (epoch + 1), self.ratio)
        return self.ratio

    def select(self, v: Tensor, ctx: CompressContext) -> Tensor:
        """The indices (int64) of ``v`` to send at ``ctx.step``; see the module docstring."""
        d = v.numel()
        rho = self.density(ctx.step)
        k = count_from_ratio(rho, d)
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=v.device)
        if k >= d:  # density 1: everything (the authors' code sends such a tensor dense)
            return torch.arange(d, device=v.device)
        imp = v.abs()
        stride, n_samples = sample_plan(d, rho, self.sample_ratio)
        if n_samples == d:
            return topk_indices(imp, k)
        # the sample is drawn on the CPU (moved once): the stream does not depend on the device; the
        # strided start is a host integer (a CPU draw, no device synchronisation)
        g = ctx.generator(shared=False)
        if self.strided:
            start = int(torch.randint(0, stride, (1,), generator=g, device="cpu"))
            samples = imp[start::stride]
        else:
            samples = imp[torch.randint(0, d, (n_samples,), generator=g, device="cpu").to(v.device)]
        top = min(samples.numel(), math.ceil(n_samples * rho))
        threshold = torch.topk(samples, top, sorted=False).values.min()
        # the selection's size is data-dependent and steers the adaptation below and the payload's size:
        # it must be known on the host (one synchronisation per try)
        idx = (imp >= threshold).nonzero().view(-1)
        for _ in range(self.max_adapt):
            if idx.numel() > k:
                if idx.numel() <= k * self.upper:
                    break
                if self.resample:
                    return idx[topk_indices(imp[idx], k)]  # the exact top-k of the selection
                threshold = threshold * self.upper
            elif idx.numel() < self.lower * k:
                threshold = threshold * self.lower
            else:
                break
            idx = (imp >= threshold).nonzero().view(-1)
        return idx[:k]

    def compress(self, x: Tensor, ctx: CompressContext) -> Payload:
        x = check_input(self, x, ctx)
        idx = self.select(x, ctx)
        return Payload((idx.to(index_dtype(x.numel())), x[idx]), x.numel(), x.dtype)

    def decompress(self, payload: Payload, ctx: CompressContext) -> Tensor:
        indices, values = payload.data
        return scatter(values, indices, payload.numel, payload.dtype)

    def nbytes(self, k: int, d: int, dtype: torch.dtype) -> int:
        """The payload's size when ``k`` of ``d`` elements of ``dtype`` are sent."""
        return k * (index_dtype(d).itemsize + dtype.itemsize)

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "ratio": self.ratio,
            "sample_ratio": self.sample_ratio,
            "strided": self.strided,
        }
        if self.warmup_epochs:
            opts.update(warmup_epochs=self.warmup_epochs, epoch_steps=self.epoch_steps)
            if self._explicit_coeff:
                opts["warmup_coeff"] = self.warmup_coeff
        return opts


@MEMORIES.registering(
    "dgc",
    "Deep Gradient Compression's momentum correction (momentum=, masking=, clip_norm=)",
    Options(
        {
            "momentum": Opt(float, min=0, max=1, doc="the momentum the memory keeps (not the optimizer)"),
            "nesterov": Opt(bool, doc="Nesterov's momentum"),
            "masking": Opt(bool, doc="momentum factor masking: what is sent is cleared from the momentum"),
            "clip_norm": Opt(float, gt=0, finite=False, doc="local gradient clipping of each unit's L2 norm"),
        }
    ),
)
class DGCMemory(Memory):
    """Momentum correction (``u``, ``v`` per parameter name), momentum factor masking and local gradient
    clipping; see the module docstring."""

    kind = "dgc"

    def __init__(
        self,
        *,
        momentum: float = 0.9,
        nesterov: bool = False,
        masking: bool = True,
        clip_norm: float | None = None,
    ) -> None:
        self.momentum = float(momentum)
        self.nesterov, self.masking = nesterov, masking
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.velocities: dict[str, Tensor] = {}
        self.momenta: dict[str, Tensor] = {}

    @staticmethod
    def _flat(store: dict[str, Tensor], segments: Segments, like: Tensor) -> Tensor:
        parts = []
        for name, n in segments:
            t = store.get(name)
            if t is None:
                t = torch.zeros(n, dtype=like.dtype, device=like.device)
            elif t.numel() != n:
                raise InvalidArgumentError(
                    f"DGCMemory: parameter {name!r} has {n} elements, its memory {t.numel()}"
                )
            elif t.device != like.device:  # loaded with map_location="cpu", say: moved once, to the input's
                t = store[name] = t.to(like.device)
            parts.append(t)
        return torch.cat(parts) if len(parts) != 1 else parts[0].clone()

    @staticmethod
    def _store(store: dict[str, Tensor], segments: Segments, flat: Tensor) -> None:
        pos = 0
        for name, n in segments:
            store[name] = flat[pos : pos + n].clone()
            pos += n

    def clip(self, g: Tensor) -> Tensor:
        """``g`` scaled to an L2 norm of at most ``clip_norm`` (as torch's ``clip_grad_norm_``)."""
        if self.clip_norm is None:
            return g
        # as clip_grad_norm_: the coefficient clamped on the device, no host synchronisation
        coef: Tensor = (self.clip_norm / (g.norm().double() + 1e-6)).clamp_(max=1.0)
        return g * coef.to(g.dtype)

    def compensate(self, segments: Segments, x: Tensor) -> Tensor:
        check_segments("DGCMemory.compensate", segments, x)
        g = self.clip(x)
        u = self._flat(self.momenta, segments, x)
        v = self._flat(self.velocities, segments, x)
        if self.nesterov:
            u.add_(g).mul_(self.momentum)
            v.add_(u).add_(g)
        else:
            u.mul_(self.momentum).add_(g)
            v.add_(u)
        self._store(self.momenta, segments, u)
        self._store(self.velocities, segments, v)
        return v

    def update(self, segments: Segments, compensated: Tensor, decoded: Tensor) -> None:
        check_segments("DGCMemory.update", segments, compensated)
        self._store(self.velocities, segments, compensated - decoded)
        if self.masking:
            u = self._flat(self.momenta, segments, compensated)
            u.masked_fill_(decoded != 0, 0)
            self._store(self.momenta, segments, u)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "tensors": {k: v.clone() for k, v in self.velocities.items()},
            "momenta": {k: v.clone() for k, v in self.momenta.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise InvalidArgumentError(
                f"DGCMemory.load_state_dict: expected a 'dgc' memory, got {state.get('kind')!r}"
            )
        for key in ("tensors", "momenta"):
            got = state.get(key, {})
            if not isinstance(got, Mapping) or not all(isinstance(v, Tensor) for v in got.values()):
                raise InvalidArgumentError(f"DGCMemory.load_state_dict: {key!r} must map names to tensors")
        self.velocities = {str(k): v.clone() for k, v in state.get("tensors", {}).items()}
        self.momenta = {str(k): v.clone() for k, v in state.get("momenta", {}).items()}

    def __repr__(self) -> str:
        clip = f", clip_norm={self.clip_norm:g}" if self.clip_norm is not None else ""
        return (
            f"DGCMemory(momentum={self.momentum:g}, nesterov={self.nesterov}, masking={self.masking}{clip})"
        )


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer with momentum next to :class:`DGCMemory`, which applies the momentum itself
    (momentum correction): the optimizer must step with the averaged sparse update as it is."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"DGC: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for i, group in enumerate(optimizer.param_groups):
        momentum, nesterov = group.get("momentum", 0), group.get("nesterov", False)
        if momentum or nesterov:
            raise InvalidArgumentError(
                f"DGC: the optimizer's parameter group {i} has momentum={momentum!r}, nesterov={nesterov!r}; "
                "DGC's memory applies the momentum (momentum correction), so the optimizer must run without "
                "it (e.g. torch.optim.SGD with momentum=0)"
            )
