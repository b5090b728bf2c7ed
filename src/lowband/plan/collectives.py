"""Cost formulas of the collectives the planner predicts with (pure: no torch, no communication).

The link model is alpha-beta: a message of ``b`` bytes between two ranks takes ``latency + b / bandwidth``
seconds, ``bandwidth`` in bytes/s (``math.inf``: an unshaped link, whose bytes cost nothing here) and
``latency`` in seconds. Each algorithm is a number of sequential steps and the bytes each rank sends in
a step; every rank sends and receives at once in a step, so the slowest link of the ring paces it.

- ring allreduce of ``b`` bytes over ``n`` ranks: ``2 (n - 1)`` steps of ``b / n`` bytes (reduce-scatter
  then allgather): each rank sends ``2 (n - 1) / n * b`` bytes (:func:`lowband.comm.reduce.ring_bytes`);
- ring allgather of ``b`` bytes per rank: ``n - 1`` steps of ``b`` bytes: ``(n - 1) * b`` sent per rank;
- a world of one communicates nothing and costs nothing.

The byte counts are logical (what lowband's byte counters record), headers aside.
"""

from __future__ import annotations

import math

from lowband.comm.reduce import ring_bytes
from lowband.errors import InvalidArgumentError


def _check(where: str, nbytes: float, n: int, bandwidth: float, latency: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"{where}: world size must be an int >= 1, got {n!r}")
    if not (isinstance(nbytes, (int, float)) and math.isfinite(nbytes) and nbytes >= 0):
        raise InvalidArgumentError(f"{where}: bytes must be finite and >= 0, got {nbytes!r}")
    if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise InvalidArgumentError(
            f"{where}: bandwidth must be > 0 bytes/s (inf: unshaped), got {bandwidth!r}"
        )
    if not (isinstance(latency, (int, float)) and math.isfinite(latency) and latency >= 0):
        raise InvalidArgumentError(f"{where}: latency must be finite and >= 0 seconds, got {latency!r}")


def _steps(steps: int, chunk: float, bandwidth: float, latency: float) -> float:
    return steps * (latency + (chunk / bandwidth if math.isfinite(bandwidth) else 0.0))


def allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of a ring allreduce of ``nbytes`` bytes over ``n`` ranks."""
    _check("allreduce_time", nbytes, n, bandwidth, latency)
    if n == 1:
        return 0.0
    return _steps(2 * (n - 1), nbytes / n, bandwidth, latency)


def allgather_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of a ring allgather of ``nbytes`` bytes from each of ``n`` ranks."""
    _check("allgather_time", nbytes, n, bandwidth, latency)
    if n == 1:
        return 0.0
    return _steps(n - 1, nbytes, bandwidth, latency)


def allreduce_sent(nbytes: int, n: int) -> int:
    """Bytes each rank sends in a ring allreduce of ``nbytes`` bytes (0 in a world of one)."""
    _check("allreduce_sent", nbytes, n, 1.0, 0.0)
    return ring_bytes(int(nbytes), n)


def allgather_sent(nbytes: int, n: int) -> int:
    """Bytes each rank sends in a ring allgather of ``nbytes`` bytes per rank (each forwards n - 1 blocks)."""
    _check("allgather_sent", nbytes, n, 1.0, 0.0)
    return (n - 1) * int(nbytes)
