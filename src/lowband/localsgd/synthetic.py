"""Random but plausible cost profiles, for tests and the scheduler benchmark (no measurement)."""

from __future__ import annotations

import random

from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, LayerCost, _check_time


def random_profile(
    L: int,
    seed: int,
    *,
    comm_ratio: float = 1.0,
    alpha_share: float = 0.1,
) -> CostProfile:
    """A random but plausible profile for tests and benchmarks (``random.Random(seed)``, portable).

    Backward times are log-normal around 1 ms, forward times about half of them; layer sizes log-normal
    (median ~440 KB); ``comm = alpha + beta * nbytes`` with ``alpha`` taking ``alpha_share`` of the total
    and ``beta`` scaled so that ``sum(comm) == comm_ratio * sum(bwd)``."""
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise InvalidArgumentError(f"random_profile: L must be an int >= 1, got {L!r}")
    ratio = _check_time("random_profile", "comm_ratio", comm_ratio)
    share = _check_time("random_profile", "alpha_share", alpha_share)
    if share > 1.0:
        raise InvalidArgumentError(f"random_profile: alpha_share must be in [0, 1], got {alpha_share!r}")
    rng = random.Random(seed)
    bwd = [1e-3 * rng.lognormvariate(0.0, 0.6) for _ in range(L)]
    fwd = [b * rng.uniform(0.3, 0.7) for b in bwd]
    nbytes = [max(4, int(rng.lognormvariate(13.0, 1.5))) for _ in range(L)]
    total_comm = ratio * sum(bwd)
    alpha = share * total_comm / L
    beta = (total_comm - L * alpha) / sum(nbytes)
    comm = [alpha + beta * n for n in nbytes]
    layers = tuple(LayerCost(f"layer{i}", fwd[i], bwd[i], comm[i], nbytes[i]) for i in range(L))
    return CostProfile(layers, alpha, beta)
