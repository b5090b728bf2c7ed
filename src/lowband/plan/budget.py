"""How long ``lowband plan`` will profile, bounded before it starts (``--time-limit``).

The plan measures, in one process, the workload's layers (a few forward and backward passes) and, for
each strategy spec, the operations it puts on the critical path (each compressor on each unit size,
PowerSGD's products: :class:`~lowband.plan.profile.OpCosts`, seven runs apiece). The bound is counted,
not timed, so every rank of a launched job (``--measure``) computes the same figure and refuses alike:

- a pass: the floating-point operations of one forward and backward on the workload's batch (torch's
  :class:`~torch.utils.flop_counter.FlopCounterMode`) at :data:`FLOPS` per second, plus
  :data:`LAYER_S` per layer; the layer profile takes :data:`PROFILE_PASSES` of them;
- a spec: :data:`OP_RUNS` runs over every parameter at :data:`ELEMENT_S` per element plus
  :data:`LAYER_S` per layer (its units partition the parameters; specs that measure nothing count too).

The constants are deliberately slow (a fmnist-cnn plan of the 34 default specs: bound about 10 s, run
about 5 s on one core), so a refusal means a plan far beyond the limit, not one near it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lowband.errors import InvalidArgumentError
from lowband.rng import fork_rng

#: floating-point operations per second of one torch thread, low
FLOPS = 5e9
#: forward and backward passes of the layer profile (warm-up, order probe and timed repeats)
PROFILE_PASSES = 10
#: runs of each measured operation (a warm-up, three compressions, three decompressions)
OP_RUNS = 7
#: seconds per parameter of one run of a compressor or PowerSGD's products, high
ELEMENT_S = 50e-9
#: seconds of fixed cost per layer (hooks, a call per unit), high
LAYER_S = 1e-4


def estimate_seconds(workload: str, n_specs: int, *, batch_size: int | None = None, seed: int = 0) -> float:
    """The bound (module doc) of profiling ``workload`` for ``n_specs`` strategy specs."""
    from torch.utils.flop_counter import FlopCounterMode

    from lowband.bench.workloads import get_workload
    from lowband.optim.layerwise import parameter_layers

    w = get_workload(workload)
    model = w.build_model(seed=seed)
    batch = next(iter(w.batches(0, 1, batch_size or w.default_batch_size, seed)))
    with fork_rng(), FlopCounterMode(display=False) as flops:
        w.loss(model, batch).backward()  # type: ignore[no-untyped-call]
    params = sum(p.numel() for p in model.parameters())
    layers = len(parameter_layers(model))
    passes = PROFILE_PASSES * (flops.get_total_flops() / FLOPS + layers * LAYER_S)
    return float(passes + n_specs * OP_RUNS * (params * ELEMENT_S + layers * LAYER_S))


def check_time_limit(
    workload: str, specs: Sequence[str], limit_s: float, *, batch_size: int | None = None, seed: int = 0
) -> float:
    """The bound of :func:`estimate_seconds`; refuses (one error) when it exceeds ``limit_s``."""
    est = estimate_seconds(workload, len(specs), batch_size=batch_size, seed=seed)
    if est > limit_s:
        raise InvalidArgumentError(
            f"lowband plan: profiling {workload} for {len(specs)} strategy specs may take up to {est:.3g} s, "
            f"over the time limit of {limit_s:g} s: give fewer specs (-s) or a larger --time-limit"
        )
    return est
