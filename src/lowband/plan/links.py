"""The links a plan predicts for: the bench's layout (:func:`lowband.testbed.links.build_layout`, the
same ``--rate``/``--rates``/``--ranks-per-machine``/``--intra-rate``/``--delay-ms``) reduced to what the
collective formulas (:mod:`lowband.plan.collectives`) need: one ring's bandwidth and per-step latency.

- Bandwidth: a ring collective moves one block per step over every link of the ring at once, so its
  slowest link paces it: the slowest machine link (either direction), and, in a two-tier layout, the
  shaped rate inside a machine when slower. An unshaped link inside a machine costs nothing here.
- Latency: each step's message crosses one machine link into its receiver, delayed ``delay_ms`` there
  (the testbed's one-way delay per rank): the largest delay of any machine.
- ``alpha``/``beta``: the ring allreduce's ``alpha + beta * bytes`` (DreamDDP's link model,
  :class:`~lowband.localsgd.costmodel.CostProfile`), fitted with the profiler's own
  :func:`~lowband.localsgd.profiler.fit_comm` on the formula at the profiler's message sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lowband.errors import InvalidArgumentError
from lowband.plan import collectives as coll
from lowband.testbed.links import Layout


@dataclass(frozen=True)
class Links:
    """One ring over ``world`` ranks: ``bandwidth`` bytes/s (``inf``: unshaped) and ``latency`` s per step."""

    world: int
    bandwidth: float
    latency: float = 0.0
    label: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise InvalidArgumentError(f"Links: world must be an int >= 1, got {self.world!r}")
        if not self.bandwidth > 0:
            raise InvalidArgumentError(f"Links: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise InvalidArgumentError(f"Links: latency must be finite and >= 0, got {self.latency!r}")

    def allreduce(self, nbytes: float) -> float:
        """Seconds of a ring allreduce of ``nbytes`` bytes over these links."""
        return coll.allreduce_time(nbytes, self.world, self.bandwidth, self.latency)

    def allgather(self, nbytes: float) -> float:
        """Seconds of a ring allgather of ``nbytes`` bytes per rank over these links."""
        return coll.allgather_time(nbytes, self.world, self.bandwidth, self.latency)

    def at(self, world: int) -> Links:
        """The same per-link bandwidth and latency over ``world`` ranks (a prediction at another size)."""
        return replace(self, world=world)

    def tree_allreduce(self, nbytes: float) -> float:
        """Seconds of a recursive-doubling allreduce of ``nbytes`` bytes."""
        return coll.tree_allreduce_time(nbytes, self.world, self.bandwidth, self.latency)

    def alltoall(self, blocks: Sequence[float]) -> float:
        """Seconds of an all-to-all sending ``blocks[i]`` bytes to each other rank."""
        return coll.alltoall_time(blocks, self.world, self.bandwidth, self.latency)

    def ps(self, push: float, shard: float) -> float:
        """Seconds of a colocated parameter-server exchange (push ``push`` bytes per owner, pull shards)."""
        return coll.ps_time(push, shard, self.world, self.bandwidth, self.latency)

    def gossip(self, nbytes: float, peers: int) -> float:
        """Seconds of one neighbor averaging of ``nbytes`` bytes with ``peers`` out-neighbors."""
        return coll.gossip_time(nbytes, peers, self.world, self.bandwidth, self.latency)

    def halving_doubling(self, message: float) -> float:
        """Seconds of gs-SGD's tree (reduce and broadcast) of ``message``-byte messages."""
        return coll.halving_doubling_time(message, self.world, self.bandwidth, self.latency)

    def star(self, message: float, *, back: bool = True) -> float:
        """Seconds of every rank's ``message`` to one root (and, ``back``, the root's to every rank)."""
        return coll.star_time(message, self.world, self.bandwidth, self.latency, back=back)

    def fit(self) -> tuple[float, float]:
        """``(alpha, beta)`` of one allreduce, ``seconds = alpha + beta * bytes`` (0, 0 in a world of one)."""
        from lowband.localsgd.profiler import (  # (lowband.localsgd imports the strategies)
            COMM_SIZES,
            fit_comm,
        )

        return fit_comm([(s, self.allreduce(s)) for s in COMM_SIZES])


def links_from_layout(layout: Layout) -> Links:
    """The ring model of ``layout`` (module doc); its inter-machine links must be shaped."""
    slowest = layout.bottleneck()
    if slowest is None and layout.n_machines > 1:
        raise InvalidArgumentError(
            "lowband plan: the links between machines are unshaped; give their rate (--rate or --rates)"
        )
    rates = [r for r in (slowest, layout.intra if layout.ranks_per_machine > 1 else None) if r is not None]
    bandwidth = min(rates) / 8.0 if rates else math.inf
    latency = max(m.delay_ms for m in layout.machines) / 1000.0
    return Links(layout.world_size, bandwidth, latency, layout.describe())
