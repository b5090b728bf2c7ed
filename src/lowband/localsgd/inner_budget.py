"""Inner steps per machine under a common time budget, and the sample weights of the outer average (pure).

``inner_steps=auto`` (the ``diloco`` strategy) on machines of different speeds: every machine gets the
inner steps that fit the period the slowest machine takes for ``base`` steps, so nobody waits idle at the
outer exchange and the period lasts as long as with ``base`` steps everywhere:
``H_m = min(cap * base, floor(base * t_max / t_m))`` (``t_m`` a machine's seconds per inner step, the
slowest of its ranks; ``H_m >= base`` as ``t_m <= t_max``). A layout whose machines are within
``tolerance`` of each other (``t_max <= (1 + tolerance) * t_min``) is homogeneous: every machine keeps
``base`` (the documented fallback; measurement noise then changes nothing).

The outer average then weights each machine's pseudo-gradient by the samples it saw, ``H_m`` times its
batch (equal batches assumed: the weights are the ``H_m``): ``sum_m H_m * delta_m / sum_m H_m``. A
transport that averages (``sum / n``) gets it when each machine scales its pseudo-gradient by
:func:`sample_scales` first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lowband.errors import InvalidArgumentError

#: machines within this fraction of the slowest's seconds per step keep ``base`` steps (homogeneous)
TOLERANCE = 0.1
#: no machine takes more than this many times ``base`` steps (a stalled rank's timing cannot run away)
CAP = 8


def machine_times(rank_times: Sequence[float], local_size: int) -> list[float]:
    """Per machine (``local_size`` consecutive ranks), the slowest rank's seconds per step."""
    if local_size < 1 or len(rank_times) % local_size != 0:
        raise InvalidArgumentError(
            f"inner_steps=auto: {len(rank_times)} ranks' timings cannot form machines of {local_size} ranks"
        )
    return [max(rank_times[i : i + local_size]) for i in range(0, len(rank_times), local_size)]


def budget_steps(
    times: Sequence[float], base: int, *, tolerance: float = TOLERANCE, cap: int = CAP
) -> list[int]:
    """Inner steps per machine (module doc) from its seconds per inner step."""
    if base < 1:
        raise InvalidArgumentError(f"inner_steps=auto: base_steps must be >= 1, got {base}")
    if not times or any(not (t > 0.0 and math.isfinite(t)) for t in times):
        raise InvalidArgumentError(
            f"inner_steps=auto: seconds per step must be finite and > 0, got {list(times)}"
        )
    slow, fast = max(times), min(times)
    if slow <= (1.0 + tolerance) * fast:
        return [base] * len(times)
    return [min(cap * base, max(base, math.floor(base * slow / t))) for t in times]


def parse_machine_steps(spec: str, machines: int, base: int = 1) -> list[int]:
    """``"5,7,3"``: fixed inner steps per machine, one int >= ``base`` each (``base_steps``: the least
    any machine takes, against which the fragments and the delay were checked)."""
    try:
        steps = [int(x) for x in spec.split(",")]
    except ValueError:
        steps = []
    if len(steps) != machines or any(h < max(1, base) for h in steps):
        raise InvalidArgumentError(
            f"machine_steps={spec!r}: must be {machines} comma-separated ints >= base_steps={base}, one per "
            "machine of the outer loop"
        )
    return steps


def sample_scales(steps: Sequence[int]) -> list[float]:
    """Per machine, the factor on its pseudo-gradient so that the transport's plain average
    (``sum / n``) is the sample-weighted one: ``n * H_m / sum(H)``."""
    n, total = len(steps), sum(steps)
    return [n * h / total for h in steps]


__all__ = ["CAP", "TOLERANCE", "budget_steps", "machine_times", "parse_machine_steps", "sample_scales"]
