"""What the planner measures on this machine, once per ``lowband plan``: the workload's layer profile
and the cost of the operations strategies put on the critical path.

- Layers: DreamDDP's profiler (:func:`~lowband.localsgd.profiler.profile_model`) in a world of one, on one
  batch of the workload at its per-rank batch size (the CLI runs it on one torch thread, as each bench
  rank runs): per-layer
  forward and backward seconds and bytes, forward order. No links are measured (``comm = 0``): the
  planner adds them from its link model (:func:`~lowband.localsgd.profiler.with_comm`).
- The optimizer step: the workload's optimizer stepped on the model's gradients (median of a few).
- Whole steps: zero_grad, forward, loss, backward and the optimizer step timed together, every rank at
  once, each step's time the slowest rank's (a job's pace, as the bench counts it); when the layers'
  hooks plus the optimizer step add up to less (what no layer holds: the loss, the root module's own
  code, autograd's and Python's overhead), every layer's forward and backward seconds are scaled by
  ``whole_step_fit`` so that the profile's computation is the whole step's.
- ``compute_scale``: ranks sharing this machine's cores (the testbed runs every rank here) compute that
  many times slower; every computed second of the profile is multiplied by it (1: a rank per machine).
- Operations (:class:`OpCosts`): compressors' compress/decompress seconds and exact payload bytes on a
  seeded Gaussian tensor of each size asked, PowerSGD's matrix products at a rank; each measured the
  first time it is asked for and kept for the rest of the plan.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.optim.layerwise import parameter_layers
from lowband.rng import fork_rng

if TYPE_CHECKING:  # lowband.localsgd imports the strategies, and auto imports this module
    from lowband.localsgd.costmodel import CostProfile

Shape = tuple[int, ...]


def median_seconds(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@dataclass(frozen=True)
class CompressorCost:
    """One compressor on one unit size: seconds to compress, to decompress one payload, and its bytes."""

    compress_s: float
    decompress_s: float
    nbytes: int


@dataclass
class OpCosts:
    """Measured operation costs, each measured once (module doc); ``scale`` multiplies every time."""

    scale: float = 1.0
    cache: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def compressor(self, spec: str, numel: int) -> CompressorCost:
        """``spec`` (a compressor spec) on a flat float32 tensor of ``numel`` elements."""
        key = ("compressor", spec, numel)
        if key not in self.cache:
            from lowband.compress import CompressContext, make_compressor

            comp = make_compressor(spec)
            gen = torch.Generator().manual_seed(numel)
            x = torch.randn(max(1, numel), generator=gen)
            ctx = CompressContext("plan", 1)
            payload = comp.compress(x, ctx)
            c = median_seconds(lambda: comp.compress(x, ctx))
            d = median_seconds(lambda: comp.decompress(payload, ctx))
            self.cache[key] = CompressorCost(c * self.scale, d * self.scale, payload.nbytes)
        out: CompressorCost = self.cache[key]
        return out

    def sketch(self, numel: int, rows: int, cols: int, m: int) -> tuple[float, float]:
        """``(sketch seconds, recovery seconds)`` of a CountSketch of ``rows x cols`` over ``numel`` values
        and the recovery of ``m`` coordinates from it (estimates, then the ``m`` largest): gs-SGD's work."""
        key = ("sketch", numel, rows, cols, m)
        if key not in self.cache:
            from lowband.compress.heavymix import topk_indices
            from lowband.compress.sketch import CountSketch

            sk = CountSketch(max(1, numel), rows, cols, seed=numel)
            x = torch.randn(max(1, numel), generator=torch.Generator().manual_seed(numel))
            table = sk.sketch(x)
            s = median_seconds(lambda: sk.sketch(x))
            r = median_seconds(lambda: topk_indices(sk.estimate(table), m))
            self.cache[key] = (s * self.scale, r * self.scale)
        out: tuple[float, float] = self.cache[key]
        return out

    def to_json(self) -> list[dict[str, Any]]:
        """What was measured: each compressor on each unit size, PowerSGD's products per rank, sketches."""
        out: list[dict[str, Any]] = []
        for key, v in self.cache.items():
            if key[0] == "compressor":
                out.append({"compressor": key[1], "numel": key[2], "compress_ms": v.compress_s * 1e3,
                            "decompress_ms": v.decompress_s * 1e3, "payload_bytes": v.nbytes})  # fmt: skip
            elif key[0] == "sketch":
                out.append({"sketch_numel": key[1], "rows": key[2], "cols": key[3], "recover": key[4],
                            "sketch_ms": v[0] * 1e3, "recover_ms": v[1] * 1e3})  # fmt: skip
            else:
                out.append({"powersgd_rank": key[2], "matrices": len(key[1]), "products_ms": v * 1e3})
        return out

    def powersgd(self, shapes: tuple[tuple[int, int], ...], rank: int) -> float:
        """Seconds of PowerSGD's products on matrices of ``shapes`` at ``rank``: ``P = M Q``, the
        orthogonalisation of ``P``, ``Q = M^T P`` and the decompression ``P Q^T`` (torch's hook's work)."""
        key = ("powersgd", shapes, rank)
        if key not in self.cache:
            gen = torch.Generator().manual_seed(rank)
            ms = [torch.randn(n, m, generator=gen) for n, m in shapes]
            qs = [torch.randn(m, min(rank, n, m), generator=gen) for n, m in shapes]

            def run() -> None:
                for mat, q in zip(ms, qs):
                    p = mat @ q
                    p, _ = torch.linalg.qr(p)
                    q2 = mat.t() @ p
                    mat.copy_(p @ q2.t())

            self.cache[key] = median_seconds(run) * self.scale
        out: float = self.cache[key]
        return out


@dataclass(frozen=True)
class PlanProfile:
    """A workload measured for planning (module doc): ``cost`` has ``comm = 0`` on every layer."""

    workload: str
    batch_size: int
    cost: CostProfile
    shapes: tuple[tuple[Shape, ...], ...]
    elem_sizes: tuple[int, ...]
    step_s: float
    ops: OpCosts = field(default_factory=OpCosts, compare=False)
    #: the factor the layers' measured seconds were scaled by to make up a whole timed step (1: none)
    whole_step_fit: float = 1.0

    @property
    def compute_s(self) -> float:
        """One local iteration without communication: forward, backward, optimizer step."""
        return self.cost.fwd_total + self.cost.bwd_total + self.step_s

    @property
    def total_bytes(self) -> int:
        return sum(lc.nbytes for lc in self.cost.layers)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(lc.nbytes // es if es else 0 for lc, es in zip(self.cost.layers, self.elem_sizes))

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "batch_size": self.batch_size,
            "compute_ms": self.compute_s * 1e3,
            "forward_ms": self.cost.fwd_total * 1e3,
            "backward_ms": self.cost.bwd_total * 1e3,
            "step_ms": self.step_s * 1e3,
            "whole_step_fit": self.whole_step_fit,
            "compute_scale": self.ops.scale,
            "parameter_bytes": self.total_bytes,
            "layers": [lc.to_json() for lc in self.cost.layers],
            "shapes": [[list(sh) for sh in layer] for layer in self.shapes],
            "elem_sizes": list(self.elem_sizes),
            "kappa": self.cost.kappa,
            "sigma": self.cost.sigma,
            "operations": self.ops.to_json(),
        }

    @classmethod
    def from_json(cls, d: Any, where: str = "PlanProfile.from_json") -> PlanProfile:
        """The profile :meth:`to_json` wrote (``lowband plan``'s ``plan.json`` holds it as ``profile``);
        the operations are measured again when asked (their costs are this machine's)."""
        from lowband.localsgd.costmodel import CostProfile, LayerCost

        try:
            layers = tuple(LayerCost.from_json(x) for x in d["layers"])
            shapes = tuple(tuple(tuple(int(v) for v in sh) for sh in layer) for layer in d["shapes"])
            elem = tuple(int(v) for v in d["elem_sizes"])
            out = cls(
                workload=str(d["workload"]), batch_size=int(d["batch_size"]),
                cost=CostProfile(layers, 0.0, 0.0, float(d.get("kappa", 0.0)), float(d.get("sigma", 0.0))),
                shapes=shapes, elem_sizes=elem,
                step_s=float(d["step_ms"]) / 1e3, ops=OpCosts(scale=float(d.get("compute_scale", 1.0))),
                whole_step_fit=float(d.get("whole_step_fit", 1.0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"{where}: not a plan profile (lowband plan's plan.json 'profile', written by this "
                f"version): {e!r}"
            ) from None
        if not (len(shapes) == len(elem) == len(layers)):
            raise InvalidArgumentError(
                f"{where}: the profile's layers, shapes and element sizes differ in number"
            )
        return out


def scaled(cost: CostProfile, factor: float) -> CostProfile:
    """``cost`` with every layer's forward and backward seconds multiplied by ``factor``."""
    from lowband.localsgd.costmodel import CostProfile, LayerCost

    layers = tuple(
        LayerCost(lc.name, lc.fwd * factor, lc.bwd * factor, lc.comm, lc.nbytes) for lc in cost.layers
    )
    return CostProfile(layers, cost.alpha, cost.beta, cost.kappa, cost.sigma)


def measure_profile(
    workload: str,
    *,
    batch_size: int | None = None,
    seed: int = 0,
    compute_scale: float = 1.0,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    group: Group | None = None,
) -> PlanProfile:
    """Profile ``workload`` (a registered name or ``module:factory``) in this process (module doc).
    ``group``: the profiler's group when lowband is initialised (collective: every rank of it profiles at
    once, as the ranks of a job compute, and with more than one rank the interference is measured too);
    without lowband, a world of one."""
    import lowband
    from lowband.bench.workloads import get_workload
    from lowband.runtime import is_initialized

    if not compute_scale >= 1.0:
        raise InvalidArgumentError(f"measure_profile: compute_scale must be >= 1, got {compute_scale!r}")
    say = progress or (lambda _: None)
    say("building the model")
    w = get_workload(workload)
    bs = batch_size or w.default_batch_size
    model = w.build_model(seed=seed)
    batch = next(iter(w.batches(0, 1, bs, seed)))
    started = is_initialized()
    if not started:
        lowband.init()  # a world of one: the profiler's collectives are no-ops
    try:
        return profile_module(
            model, lambda m: w.loss(m, batch), w.make_optimizer, name=workload, batch_size=bs,
            group=group, compute_scale=compute_scale, repeats=repeats, progress=say, own_model=True,
            interference=group is not None and group.size > 1,
        )  # fmt: skip
    finally:
        if not started:
            lowband.shutdown()


def profile_module(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    name: str,
    batch_size: int,
    group: Group | None = None,
    compute_scale: float = 1.0,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    own_model: bool = False,
    interference: bool = False,
) -> PlanProfile:
    """The plan profile of ``model`` on the batch of ``loss_fn`` (module doc). Every rank of ``group``
    calls it: the ranks compute at once and the layer times are the slowest rank's
    (:func:`~lowband.localsgd.profiler.profile_model`), the link fit is dropped (the planner's links come
    from elsewhere); with ``interference`` the slowdown of computation and communication running at once
    (``kappa``, ``sigma``: large where ranks share cores) is measured and kept. The model is left
    unchanged: the optimizer step is timed on a copy of it unless ``own_model`` (a model made for
    profiling only)."""
    from lowband.localsgd.costmodel import CostProfile, LayerCost
    from lowband.localsgd.profiler import profile_model

    say = progress or (lambda _: None)
    say("profiling the layers")
    layers = parameter_layers(model)
    cost = profile_model(model, loss_fn, group=group, repeats=repeats, interference=interference)
    cost = CostProfile(
        tuple(LayerCost(lc.name, lc.fwd, lc.bwd, 0.0, lc.nbytes) for lc in cost.layers),
        0.0, 0.0, cost.kappa, cost.sigma,
    )  # fmt: skip
    say("timing the optimizer step and whole steps")
    timed = model if own_model else copy.deepcopy(model)
    opt = make_optimizer(timed.parameters())
    gpus = sorted({p.device.index or 0 for p in timed.parameters() if p.device.type == "cuda"})
    with fork_rng(devices=gpus):  # the training run's dropout streams stay where they were
        loss_fn(timed).backward()  # type: ignore[no-untyped-call]
        step_s = median_seconds(opt.step, repeats=repeats)
        whole_s = whole_step_seconds(timed, loss_fn, opt, group=group, repeats=repeats)
    layer_s = cost.fwd_total + cost.bwd_total
    fit = max(1.0, (whole_s - step_s) / layer_s) if layer_s > 0 else 1.0
    by_name = dict(layers)
    shapes = tuple(tuple(tuple(p.shape) for p in by_name[lc.name]) for lc in cost.layers)
    elem = tuple(
        by_name[lc.name][0].element_size() if len({p.dtype for p in by_name[lc.name]}) == 1 else 0
        for lc in cost.layers
    )
    return PlanProfile(
        workload=name,
        batch_size=batch_size,
        cost=scaled(cost, compute_scale * fit),
        shapes=shapes,
        elem_sizes=elem,
        step_s=step_s * compute_scale,
        ops=OpCosts(scale=compute_scale),
        whole_step_fit=fit,
    )


def whole_step_seconds(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    opt: torch.optim.Optimizer,
    *,
    group: Group | None = None,
    repeats: int = 5,
) -> float:
    """The median over ``repeats`` training steps (zero_grad, ``loss_fn``'s forward, backward, ``opt``'s
    step; one untimed first) of each step's seconds on the slowest rank of ``group`` (collective: every
    rank steps at once and the ranks' times are gathered; a world of one without it)."""
    from lowband.comm.base import host_value
    from lowband.comm.collectives import allgather

    dev = next((p.device for p in model.parameters()), torch.device("cpu"))

    def now() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    ts = []
    for k in range(repeats + 1):
        t0 = now()
        opt.zero_grad(set_to_none=True)
        loss_fn(model).backward()  # type: ignore[no-untyped-call]
        opt.step()
        if k:
            ts.append(now() - t0)
    mine = torch.tensor([ts], dtype=torch.float64, device="cpu")
    rows = allgather(host_value(mine, group), group=group) if group is not None and group.size > 1 else mine
    return float(statistics.median(rows.max(dim=0).values.tolist()))
