"""Cost formulas of the collectives the planner predicts with (pure: no torch, no communication).

The link model is alpha-beta: a message of ``b`` bytes between two ranks takes ``latency + b / bandwidth``
seconds, ``bandwidth`` in bytes/s (``math.inf``: an unshaped link, whose bytes cost nothing here) and
``latency`` in seconds. Each algorithm is a number of sequential steps and the bytes each rank sends in
a step; every rank sends and receives at once in a step, so the slowest link of the ring paces it.

- ring allreduce of ``b`` bytes over ``n`` ranks: ``2 (n - 1)`` steps of ``b / n`` bytes (reduce-scatter
  then allgather): each rank sends ``2 (n - 1) / n * b`` bytes (:func:`lowband.comm.reduce.ring_bytes`);
- ring allgather of ``b`` bytes per rank: ``n - 1`` steps of ``b`` bytes: ``(n - 1) * b`` sent per rank;
- recursive-doubling ("tree") allreduce of ``b`` bytes: ``log2 p`` exchanges of the whole buffer over the
  largest power of two ``p <= n``, plus, when ``n`` is not one, a step folding the other ``n - p`` ranks
  in and one handing them the result (not monotone in ``n``: 5 ranks take 4 steps, 8 take 3);
- all-to-all (pairwise exchange, uneven blocks allowed): ``n - 1`` steps; the rank's link carries every
  block it sends to the others, so ``(n - 1) latency + sum(blocks) / bandwidth``;
- colocated parameter servers (lowband's ``ps`` transport, :mod:`lowband.compress.ps`): each rank owns a
  shard; push = an all-to-all of every rank's per-shard payloads to the owners, pull = an allgather of the
  ``ceil(b / n)``-byte shards (the padded block lowband's uneven allgather sends);
- one-peer gossip (``atc``/``awc`` on ``dynamic-exp2``), or ``d`` peers of a static graph: every rank sends
  ``d`` copies of ``b`` bytes and receives ``d`` at once: ``latency + d b / bandwidth``;
- gs-SGD's recursive halving/doubling tree (:mod:`lowband.compress.tree`): ``2 ceil(log2 n)`` rounds of
  one message each; every non-root rank sends one message up and the root's receivers one each down, so
  the ranks send ``2 (n - 1) / n`` messages on average (:func:`lowband.compress.sparse_costs.schedule_bytes`);
- a star (Sketched-SGD's rank 0): the root's link receives ``n - 1`` messages, then sends ``n - 1``;
- a world of one communicates nothing and costs nothing.

The byte counts are logical (what lowband's byte counters record), headers aside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


def _world(where: str, n: int) -> None:
    _check(where, 0, n, 1.0, 0.0)


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


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def tree_allreduce_steps(n: int) -> int:
    """Exchanges of a recursive-doubling allreduce over ``n`` ranks (module doc)."""
    _world("tree_allreduce_steps", n)
    p = 1 << (n.bit_length() - 1)
    return (p.bit_length() - 1) + (2 if n != p else 0)


def tree_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of a recursive-doubling allreduce of ``nbytes`` bytes over ``n`` ranks."""
    _check("tree_allreduce_time", nbytes, n, bandwidth, latency)
    return _steps(tree_allreduce_steps(n), nbytes, bandwidth, latency)


def tree_allreduce_sent(nbytes: int, n: int) -> int:
    """Bytes the busiest rank sends in a recursive-doubling allreduce (one buffer per exchange)."""
    _check("tree_allreduce_sent", nbytes, n, 1.0, 0.0)
    p = 1 << (n.bit_length() - 1)
    return ((p.bit_length() - 1) + (1 if n != p else 0)) * int(nbytes)


def _blocks(where: str, blocks: Sequence[float], n: int) -> float:
    _world(where, n)
    if len(blocks) != n - 1:
        raise InvalidArgumentError(f"{where}: give one block per other rank ({n - 1}), got {len(blocks)}")
    for b in blocks:
        _check(where, b, n, 1.0, 0.0)
    return float(sum(blocks))


def alltoall_time(blocks: Sequence[float], n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of an all-to-all in which this rank sends ``blocks[i]`` bytes to each of the ``n - 1``
    others (uneven allowed; every rank assumed to send as much as it receives)."""
    total = _blocks("alltoall_time", blocks, n)
    _check("alltoall_time", total, n, bandwidth, latency)
    return (n - 1) * latency + (total / bandwidth if math.isfinite(bandwidth) else 0.0)


def alltoall_sent(blocks: Sequence[float], n: int) -> float:
    """Bytes this rank sends in an all-to-all of ``blocks`` (one per other rank)."""
    return _blocks("alltoall_sent", blocks, n)


def ps_time(push: float, shard: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of one colocated parameter-server exchange: ``push`` bytes of payload to each of the other
    ``n - 1`` owners (all-to-all), then the ``shard``-byte shards back to everyone (allgather)."""
    _check("ps_time", push, n, bandwidth, latency)
    if n == 1:
        return 0.0
    return alltoall_time([push] * (n - 1), n, bandwidth, latency) + allgather_time(
        shard, n, bandwidth, latency
    )


def ps_sent(push: float, shard: float, n: int) -> float:
    """Bytes each rank sends in :func:`ps_time`'s exchange: ``(n - 1) (push + shard)``."""
    _check("ps_sent", push, n, 1.0, 0.0)
    _check("ps_sent", shard, n, 1.0, 0.0)
    return (n - 1) * (push + shard)


def gossip_time(nbytes: float, peers: int, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of one neighbor averaging: ``peers`` copies of ``nbytes`` sent (and as many received) at once."""
    _check("gossip_time", nbytes, n, bandwidth, latency)
    if n == 1 or peers == 0:
        return 0.0
    if not 0 < peers < n:
        raise InvalidArgumentError(f"gossip_time: peers must be in [0, {n - 1}], got {peers!r}")
    return _steps(1, peers * nbytes, bandwidth, latency)


def gossip_sent(nbytes: float, peers: int, n: int) -> float:
    """Bytes each rank sends in one neighbor averaging with ``peers`` out-neighbors."""
    _check("gossip_sent", nbytes, n, 1.0, 0.0)
    return 0.0 if n == 1 else peers * nbytes


def halving_doubling_rounds(n: int) -> int:
    """Rounds of gs-SGD's halving/doubling tree over ``n`` ranks: ``2 ceil(log2 n)``."""
    _world("halving_doubling_rounds", n)
    return 2 * _log2_ceil(n)


def halving_doubling_time(message: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of a reduce then broadcast of one ``message``-byte message per round over the tree."""
    _check("halving_doubling_time", message, n, bandwidth, latency)
    return _steps(halving_doubling_rounds(n), message, bandwidth, latency)


def halving_doubling_sent(message: float, n: int) -> float:
    """Mean bytes a rank sends over the tree: ``2 (n - 1) / n`` messages (module doc)."""
    _check("halving_doubling_sent", message, n, 1.0, 0.0)
    return 2 * (n - 1) * message / n


def star_time(message: float, n: int, bandwidth: float, latency: float = 0.0, *, back: bool = True) -> float:
    """Seconds of every rank's ``message`` to a root (whose link takes ``n - 1``), and (``back``) the
    root's ``message`` to every rank."""
    _check("star_time", message, n, bandwidth, latency)
    if n == 1:
        return 0.0
    return (2 if back else 1) * _steps(1, (n - 1) * message, bandwidth, latency)
