"""The links of a launched job, measured: the ring model (:class:`~lowband.plan.links.Links`) fitted to
timed allreduces between the job's ranks (``lowband plan --measure``).

:func:`~lowband.localsgd.profiler.measure_comm` (DreamDDP's profiler) times blocking allreduces of
several sizes on the group and fits ``seconds = alpha + beta * bytes`` (the slowest rank's timings, so
every rank has the same fit). The ring allreduce of ``b`` bytes over ``n`` ranks is ``2 (n - 1)`` steps of
``latency + b / n / bandwidth`` (:mod:`lowband.plan.collectives`), i.e. ``alpha = 2 (n - 1) latency`` and
``beta = 2 (n - 1) / (n bandwidth)``; so ``latency = alpha / (2 (n - 1))`` and
``bandwidth = 2 (n - 1) / (n beta)`` (``beta = 0``: no measurable bandwidth cost, ``inf``).

Latency while the ranks compute. A quiet probe finds a rank waiting for its message awake at once; in
training the message of a collective issued during backward reaches ranks that are computing, and where
ranks share cores (the testbed: 4 ranks on 2) a woken rank waits for a core, so a small collective costs
scheduler ticks, not the network's latency. :func:`loaded_latency` times tiny allreduces each issued
right after a burst of computation on every rank (the slowest rank's median); the ring's per-step
latency is the larger of the quiet fit's and that time over the ring's ``2 (n - 1)`` steps. With a core
per rank the two agree; on the testbed the loaded one is several times larger.

The probe's sizes (:data:`PROBE_SIZES`, 4 KiB to 64 MiB by fours) stop after the first size whose
allreduce took :data:`~lowband.localsgd.profiler.COMM_TIME_CAP` or more: at 10 Mbit/s the probe ends at
256 KiB in about two seconds, at 1 Gbit/s at 16 MiB, and only links faster than a few Gbit/s reach 64 MiB.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowband.errors import InvalidArgumentError
from lowband.group import Group
from lowband.localsgd.profiler import measure_comm
from lowband.plan.links import Links
from lowband.runtime import world_group

#: default probe sizes (bytes): 4 KiB, 16 KiB, ..., 64 MiB; the probe stops early on a slow link
PROBE_SIZES: tuple[int, ...] = tuple(4096 * 4**k for k in range(8))


def links_from_fit(n: int, alpha: float, beta: float, label: str | None = None) -> Links:
    """The ring :class:`Links` over ``n`` ranks whose allreduce costs ``alpha + beta * bytes`` seconds
    (module doc; a world of one: ``Links(1, inf, 0)``). ``label`` defaults to :func:`describe`'s."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"links_from_fit: world size must be an int >= 1, got {n!r}")
    for what, v in (("alpha", alpha), ("beta", beta)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise InvalidArgumentError(f"links_from_fit: {what} must be finite and >= 0, got {v!r}")
    if n == 1:
        bandwidth, latency = math.inf, 0.0
    else:
        steps = 2 * (n - 1)
        latency = alpha / steps
        bandwidth = steps / (n * beta) if beta > 0 else math.inf
        if bandwidth <= 0 or math.isnan(bandwidth):  # beta so small the quotient overflows: unshaped
            bandwidth = math.inf
    return Links(n, bandwidth, latency, describe(bandwidth, latency) if label is None else label)


def describe(bandwidth: float, latency: float) -> str:
    """``"measured: 95.1 Mbit/s, 0.3 ms per step"`` (bandwidth in bytes/s, latency in s)."""
    if math.isinf(bandwidth):
        rate = "no measurable bandwidth cost"
    elif bandwidth * 8 >= 1e9:
        rate = f"{bandwidth * 8 / 1e9:.2f} Gbit/s"
    else:
        rate = f"{bandwidth * 8 / 1e6:.1f} Mbit/s"
    return f"measured: {rate}, {latency * 1e3:.2g} ms per step"


@dataclass(frozen=True)
class Probe:
    """One measurement: the ring model and the fit it comes from (``samples``: ``(bytes, seconds)``;
    ``loaded_s``: a tiny allreduce after computation, :func:`loaded_latency`)."""

    links: Links
    alpha: float
    beta: float
    samples: list[tuple[int, float]]
    loaded_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """What plan.json records of the links."""
        return {
            "measured": True,
            "alpha_s": self.alpha,
            "beta_s_per_byte": self.beta,
            "samples": [[b, t] for b, t in self.samples],
            "loaded_allreduce_s": self.loaded_s,
        }


#: computation before each timed allreduce of :func:`loaded_latency`, and the allreduces timed
BURST_S, LOADED_REPEATS = 0.005, 15


def loaded_latency(group: Group, *, repeats: int = LOADED_REPEATS, burst_s: float = BURST_S) -> float:
    """Seconds of a 4-byte allreduce issued right after ``burst_s`` seconds of computation on every rank
    (module doc): the median of ``repeats``, the slowest rank's (collective; identical on every rank).
    The computation and the timed allreduce run on the rank's device (on a GPU the time ends when the
    device has finished, as :func:`~lowband.localsgd.profiler.measure_comm` times)."""
    import statistics
    import time

    import torch

    from lowband.comm.collectives import allreduce
    from lowband.localsgd.profiler import _sync

    ctx, g = world_group(group, "loaded_latency")
    if g.size == 1:
        return 0.0
    dev = ctx.device
    a = torch.randn(96, 96, device=dev)
    x = torch.zeros(1, device=dev)
    allreduce(x, inplace=True, group=g)
    times = []
    for _ in range(repeats):
        end = time.perf_counter() + burst_s
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
            _sync(dev)
        t0 = _sync(dev)
        allreduce(x, inplace=True, group=g)
        times.append(_sync(dev) - t0)
    # host-side timings: a CPU tensor (as measure_comm's)
    red = allreduce(torch.tensor([statistics.median(times)], dtype=torch.float64), "max", group=g)
    return float(red.item())


def probe(group: Group | None = None, *, sizes: Sequence[int] | None = None, repeats: int = 3) -> Probe:
    """:func:`measure_links` with the fit's own figures (collective; identical on every rank)."""
    _, g = world_group(group, "measure_links")
    alpha, beta, samples = measure_comm(g, PROBE_SIZES if sizes is None else sizes, repeats)
    loaded = loaded_latency(g)
    quiet = links_from_fit(g.size, alpha, beta)
    if g.size == 1 or loaded / (2 * (g.size - 1)) <= quiet.latency:
        return Probe(quiet, alpha, beta, samples, loaded)
    latency = loaded / (2 * (g.size - 1))
    label = f"{describe(quiet.bandwidth, latency)} while computing ({quiet.latency * 1e3:.2g} quiet)"
    return Probe(Links(g.size, quiet.bandwidth, latency, label), alpha, beta, samples, loaded)


def measure_links(
    group: Group | None = None, *, sizes: Sequence[int] | None = None, repeats: int = 3
) -> Links:
    """Time ``group``'s allreduce (collective: every rank of ``group`` calls it; default the world) and
    return its ring :class:`Links`, identical on every rank. ``sizes`` default: :data:`PROBE_SIZES`;
    ``repeats`` timings per size (their median)."""
    return probe(group, sizes=sizes, repeats=repeats).links


def launched_world() -> int | None:
    """The world size of the job this process was launched in (``WORLD_SIZE`` and ``RANK`` set by
    ``lowband run`` or torchrun), else None."""
    import os

    size, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if size is None or rank is None:
        return None
    try:
        return int(size)
    except ValueError as e:
        raise InvalidArgumentError(f"lowband plan --measure: WORLD_SIZE={size!r} is not an int") from e


def run_measured(work: Callable[[Probe, Group, bool], int], *, wait_s: float) -> int:
    """In a launched job: every rank joins (:func:`lowband.init`, every wait bounded by ``wait_s`` s)
    and probes the links (:func:`probe`), then runs ``work(probe, world, lead)`` with the others
    (``world``: the job's group, on which the profile is collective, every rank computing at once;
    ``lead``: rank 0, which writes the plan), and waits for the others at a barrier (bounded too).
    Returns ``work``'s status (rank 0's is the plan's)."""
    import lowband

    lowband.init(timeout=wait_s)
    try:
        p = probe()
        status = 0
        try:
            status = work(p, lowband.world(), lowband.rank() == 0)
        finally:
            lowband.barrier(name="plan-measure-done")
        return status
    finally:
        lowband.shutdown()
