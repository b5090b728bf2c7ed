"""Synchronisation units: the layers DreamDDP schedules, with large layers split into chunks.

The paper schedules whole layers. A model whose bytes sit in one layer (a CNN's first fully connected
layer, an embedding table) then leaves the scheduler nothing to spread over the H local iterations: that
layer's averaging lands in one iteration and exceeds the backward it could hide behind. lowband's
extension (``split`` on the strategies) cuts such a layer into contiguous chunks of its flattened
parameters, each a unit the scheduler places on its own. Every chunk of a layer becomes ready when the
layer's backward ends and must be averaged before the layer's next forward, so in the unit profile the
layer's last chunk (in forward order) carries the layer's forward and backward time and the others
carry none; each chunk's communication is ``alpha + beta * bytes`` from the profile's fit (the layer's
time pro rata when there is no fit). With no layer split, the unit profile is the layer profile and the
schedule is the paper's.

Algorithm 1 is unchanged in kind: each rank updates every parameter locally and averages the
parameters its schedule names for this iteration; the sets are now chunks of layers, and a layer counts
as synchronised once every chunk of it was averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowband.errors import InvalidArgumentError
from lowband.localsgd.costmodel import CostProfile, LayerCost
from lowband.localsgd.schedule import Schedule
from lowband.localsgd.schedulers import make_schedule

#: smallest chunk ``split="auto"`` considers (bytes): below it the per-message latency dominates
MIN_AUTO_CHUNK = 16 << 10
#: chunks per period ``split="auto"`` tries: max chunk = total bytes / (k * H) for k in these
AUTO_FACTORS = (1, 2, 4)


@dataclass(frozen=True)
class UnitSpec:
    """One unit: elements ``[start, stop)`` of layer ``layer``'s parameters, flattened and concatenated
    in parameter order (a whole layer when ``start == 0`` and ``stop`` is its element count)."""

    name: str
    layer: str
    start: int
    stop: int
    nbytes: int


def chunk_bounds(numel: int, elem_size: int, max_bytes: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into the fewest near-equal contiguous chunks of at most ``max_bytes``
    bytes each (one chunk when ``max_bytes <= 0`` or the whole fits)."""
    if numel <= 0:
        return [(0, 0)]
    total = numel * elem_size
    k = 1 if max_bytes <= 0 or total <= max_bytes else math.ceil(total / max(max_bytes, elem_size))
    k = min(k, numel)
    return [(numel * i // k, numel * (i + 1) // k) for i in range(k)]


def plan_units(
    profile: CostProfile, numels: Sequence[int], elem_sizes: Sequence[int], max_bytes: int
) -> list[UnitSpec]:
    """Units in forward order: each of ``profile``'s layers (forward order; ``numels[f]`` elements of
    ``elem_sizes[f]`` bytes) cut by :func:`chunk_bounds`. Layers whose parameters cannot be viewed as
    one flat range (mixed dtypes: ``elem_sizes[f] == 0``) stay whole."""
    if len(numels) != profile.L or len(elem_sizes) != profile.L:
        raise InvalidArgumentError(
            f"plan_units: the profile has {profile.L} layers, got {len(numels)} element counts and "
            f"{len(elem_sizes)} element sizes"
        )
    out: list[UnitSpec] = []
    for lc, numel, es in zip(profile.layers, numels, elem_sizes):
        bounds = chunk_bounds(numel, es, max_bytes) if es > 0 else [(0, numel)]
        for k, (a, b) in enumerate(bounds):
            name = lc.name if len(bounds) == 1 else f"{lc.name}[{k}/{len(bounds)}]"
            nbytes = (b - a) * es if es > 0 else lc.nbytes
            out.append(UnitSpec(name, lc.name, a, b, nbytes))
    return out


def unit_profile(profile: CostProfile, units: Sequence[UnitSpec]) -> CostProfile:
    """The cost profile of ``units`` (from :func:`plan_units` on ``profile``), see the module doc."""
    by_name = {lc.name: lc for lc in profile.layers}
    counts: dict[str, int] = {}
    for u in units:
        counts[u.layer] = counts.get(u.layer, 0) + 1
    seen: dict[str, int] = {}
    out: list[LayerCost] = []
    for u in units:
        lc = by_name.get(u.layer)
        if lc is None:
            raise InvalidArgumentError(f"unit_profile: unit {u.name!r} names unknown layer {u.layer!r}")
        k = counts[u.layer]
        seen[u.layer] = seen.get(u.layer, 0) + 1
        if k == 1:
            out.append(lc)
            continue
        last = seen[u.layer] == k
        if profile.beta > 0.0:
            comm = profile.alpha + profile.beta * u.nbytes
        else:
            comm = lc.comm * (u.nbytes / lc.nbytes if lc.nbytes > 0 else 1.0 / k)
        out.append(LayerCost(u.name, lc.fwd if last else 0.0, lc.bwd if last else 0.0, comm, u.nbytes))
    return CostProfile(tuple(out), profile.alpha, profile.beta, profile.kappa, profile.sigma)


def auto_candidates(total_bytes: int, H: int) -> list[int]:
    """The chunk limits ``split="auto"`` compares: 0 (whole layers, the paper's) and total / (k H)."""
    out = [0]
    for f in AUTO_FACTORS:
        c = math.ceil(total_bytes / (f * H))
        if c >= MIN_AUTO_CHUNK and c not in out:
            out.append(c)
    return out


def unit_tensors(params: Sequence[torch.Tensor], start: int, stop: int) -> list[torch.Tensor]:
    """Views of elements ``[start, stop)`` of ``params`` flattened and concatenated (detached; writing
    to them writes the parameters). Every parameter must be contiguous."""
    out: list[torch.Tensor] = []
    off = 0
    for p in params:
        n = p.numel()
        a, b = max(start, off), min(stop, off + n)
        if a < b:
            if a == off and b == off + n:
                out.append(p.detach())
            else:
                out.append(p.detach().view(-1)[a - off : b - off])
        off += n
    return out


def layer_geometry(params: Sequence[torch.Tensor]) -> tuple[int, int]:
    """``(numel, elem_size)`` of a layer; ``elem_size`` 0 when it cannot be split (mixed dtypes or a
    non-contiguous parameter)."""
    numel = sum(p.numel() for p in params)
    sizes = {p.element_size() for p in params}
    ok = len(sizes) == 1 and all(p.is_contiguous() for p in params)
    return numel, (sizes.pop() if ok else 0)


def specs_from_checkpoint(
    where: str, state: Mapping[str, Any], layers: Sequence[tuple[str, Sequence[torch.Tensor]]]
) -> list[UnitSpec]:
    """A checkpoint's units (``state["units"]``; checkpoints without them hold whole layers named by
    ``state["order"]``), checked against the model's ``layers``: every unit inside a layer, every layer
    covered exactly once."""
    names = [n for n, _ in layers]
    numel = {n: sum(p.numel() for p in ps) for n, ps in layers}
    if "units" in state:
        specs = [UnitSpec(str(a), str(b), int(c), int(d), int(e)) for a, b, c, d, e in state["units"]]
    else:
        nb = {n: sum(p.numel() * p.element_size() for p in ps) for n, ps in layers}
        specs = [UnitSpec(n, n, 0, numel.get(n, 0), nb.get(n, 0)) for n in state["order"]]
    covered: dict[str, int] = {}
    for u in specs:
        if u.layer not in numel or not 0 <= u.start <= u.stop <= numel[u.layer]:
            raise InvalidArgumentError(
                f"{where}: checkpoint unit {u.name!r} ({u.layer}[{u.start}:{u.stop}]) does not fit the "
                f"model's layers {names}"
            )
        covered[u.layer] = covered.get(u.layer, 0) + u.stop - u.start
    if covered != numel:
        raise InvalidArgumentError(
            f"{where}: checkpoint units do not cover the model's layers {names} exactly once"
        )
    return specs


def candidate_splits(
    profile: CostProfile,
    plan: Callable[[int], Sequence[UnitSpec]],
    H: int,
    split: int | str,
    method: str,
) -> list[tuple[int, Schedule]]:
    """Every chunk limit ``split`` allows with its schedule (scheduler ``method``, period ``H``): ``split``
    itself when it is a number of bytes; for ``"auto"`` each of :func:`auto_candidates` whose units differ
    from a smaller limit's (``plan(limit)`` gives the units). Whole layers first."""
    total = sum(lc.nbytes for lc in profile.layers)
    limits = auto_candidates(total, H) if split == "auto" else [int(split)]
    out: list[tuple[int, Schedule]] = []
    seen: set[tuple[UnitSpec, ...]] = set()
    for c in limits:
        units = tuple(plan(c))
        if units in seen:
            continue
        seen.add(units)
        out.append((c, make_schedule(method, unit_profile(profile, units), H)))
    return out


def choose_split(
    profile: CostProfile,
    plan: Callable[[int], Sequence[UnitSpec]],
    H: int,
    split: int | str,
    method: str,
) -> tuple[int, Schedule]:
    """The candidate of :func:`candidate_splits` whose schedule predicts the shortest period (whole layers
    on ties)."""
    best: tuple[int, Schedule] | None = None
    for c, sched in candidate_splits(profile, plan, H, split, method):
        if best is None or sched.predicted_period < best[1].predicted_period * (1.0 - 1e-9):
            best = (c, sched)
    assert best is not None
    return best
