"""The cost models of the strategies that have one, each called from its strategy's
:meth:`~lowband.strategies.Strategy.predict` with every option of the strategy (defaults filled in).

- ``ddp``: DDP's buckets (1 MiB first, then ``bucket_cap_mb``), each a ring allreduce overlapped with
  the rest of backward (:mod:`lowband.plan.overlap`); ``hook=fp16`` halves the bytes.
- ``powersgd``: torch's ``powerSGD_hook`` per bucket: the tensors it leaves uncompressed (vectors, and
  matrices ``n x m`` with ``(n + m) r * 2 >= n m``, its ``min_compression_rate=2``) allreduced, then P
  (``n r`` per matrix), then Q (``m r``): three allreduces in sequence, plus the measured products.
- ``compressed``: the gradient stage's buckets, each unit compressed (measured), moved by a ring
  allreduce (payloads that sum on the wire) or a ring allgather (the others; every rank decodes every
  payload), decoded; exact payload bytes of the compressor on the unit's size; ``reducer=ps``: colocated
  parameter servers (:mod:`lowband.plan.models_sparse`). Other transports: no model.
- ``localsgd``: H local steps, then one allreduce of every parameter, not overlapped.
- ``dreamddp`` (and its variants): DreamDDP's own split choice and schedule (:func:`choose_split`
  with the variant's scheduler) on the profile with the link fit, period time / H plus the step.
- ``diloco`` (``inner=local``, no topology): every H inner steps the pseudo-gradient (F fragments, one
  every H / F steps) goes through the compressed reducer; with ``delay`` tau the exchange overlaps tau
  inner steps and arrives tau steps late.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lowband.localsgd.costmodel import CostProfile
from lowband.localsgd.profiler import with_comm
from lowband.plan import collectives as coll
from lowband.plan.links import Links
from lowband.plan.overlap import MiB, layer_buckets, overlapped_exposed
from lowband.plan.prediction import Prediction
from lowband.plan.profile import PlanProfile

DDP_FIRST_BUCKET = MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
POWERSGD_MIN_RATE = 2  # the min_compression_rate PowerSGDStrategy gives torch's hook


def _split_exposed(exposed: float, compress: float) -> tuple[float, float]:
    """``(compression, communication)`` parts of the exposed time: compression counted first."""
    c = min(max(0.0, exposed), compress)
    return c, max(0.0, exposed - c)


def ddp(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction:
    cost = profile.cost
    buckets = layer_buckets([lc.nbytes for lc in cost.layers], o["bucket_cap_mb"] * MiB, DDP_FIRST_BUCKET)
    wire = 0.5 if o["hook"] == "fp16" else 1.0
    sizes = [sum(cost.layers[i].nbytes for i in b) * wire for b in buckets]
    exposed = overlapped_exposed(cost, buckets, lambda k: links.allreduce(sizes[k]))
    sent = sum(coll.allreduce_sent(int(s), links.world) for s in sizes)
    return Prediction.of(profile.compute_s, 0.0, exposed, sent, compression=1.0 / wire)


def _matrix(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def powersgd(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction:
    cost, r = profile.cost, int(o["rank"])
    buckets = layer_buckets([lc.nbytes for lc in cost.layers], o["bucket_cap_mb"] * MiB, DDP_FIRST_BUCKET)
    times, compute, sent, dense, wire = [], 0.0, 0, 0, 0
    for b in buckets:
        plain, ps, qs, mats = 0, 0, 0, []
        for i in b:
            es = profile.elem_sizes[i] or 4
            for shape in profile.shapes[i]:
                nm = _matrix(shape)
                numel = math.prod(shape)
                if nm is None or (nm[0] + nm[1]) * min(r, *nm) * POWERSGD_MIN_RATE >= nm[0] * nm[1]:
                    plain += numel * es
                else:
                    rr = min(r, *nm)
                    ps, qs = ps + nm[0] * rr * es, qs + nm[1] * rr * es
                    mats.append(nm)
        work = profile.ops.powersgd(tuple(mats), r) if mats else 0.0
        parts = [x for x in (plain, ps, qs) if x > 0]
        times.append(work + sum(links.allreduce(x) for x in parts))
        compute += work
        sent += sum(coll.allreduce_sent(x, links.world) for x in parts)
        dense += sum(cost.layers[i].nbytes for i in b)
        wire += sum(parts)
    exposed = overlapped_exposed(cost, buckets, lambda k: times[k])
    c, comm = _split_exposed(exposed, compute)
    return Prediction.of(profile.compute_s, c, comm, sent, compression=dense / max(1, wire))


def _unit_exchange(
    profile: PlanProfile, links: Links, spec: str, reducer: str, numel: int
) -> tuple[float, float, int, int] | None:
    """``(seconds, compression seconds, bytes sent, payload bytes)`` of one unit of ``numel`` float32
    values through ``spec`` and transport ``reducer``; None for a transport without a model."""
    from lowband.compress import make_compressor
    from lowband.compress.specs import resolve_transport
    from lowband.compress.wire import header_bytes

    comp = make_compressor(spec)
    transport, _ = resolve_transport(reducer, comp)
    cc = profile.ops.compressor(spec, numel)
    if transport == "allreduce":
        work = cc.compress_s + cc.decompress_s
        return work + links.allreduce(cc.nbytes), work, coll.allreduce_sent(cc.nbytes, links.world), cc.nbytes
    if transport == "allgather":
        nbytes = cc.nbytes + (0 if comp.fixed_size else header_bytes(2))
        work = cc.compress_s + links.world * cc.decompress_s
        return work + links.allgather(nbytes), work, coll.allgather_sent(nbytes, links.world), nbytes
    return None


def compressed(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction | None:
    from lowband.compress import make_compressor
    from lowband.compress.specs import resolve_transport
    from lowband.plan.models_sparse import compressed_ps

    if resolve_transport(str(o["reducer"]), make_compressor(str(o["compressor"])))[0] == "ps":
        return compressed_ps(profile, links, o)
    cost = profile.cost
    cap, first = o["bucket_mb"] * MiB, (o["first_bucket_mb"] or o["bucket_mb"]) * MiB
    buckets = layer_buckets([lc.nbytes for lc in cost.layers], cap, first)
    units = []
    for b in buckets:
        numel = sum(cost.layers[i].nbytes for i in b) // 4
        u = _unit_exchange(profile, links, str(o["compressor"]), str(o["reducer"]), numel)
        if u is None:
            return None
        units.append(u)
    exposed = overlapped_exposed(cost, buckets, lambda k: units[k][0])
    c, comm = _split_exposed(exposed, sum(u[1] for u in units))
    wire = sum(u[3] for u in units)
    return Prediction.of(
        profile.compute_s, c, comm, sum(u[2] for u in units), compression=profile.total_bytes / max(1, wire)
    )


def localsgd(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction:
    h, total = int(o["period"]), profile.total_bytes
    return Prediction.of(
        profile.compute_s, 0.0, links.allreduce(total) / h, coll.allreduce_sent(total, links.world) / h,
        local_steps=h,
    )  # fmt: skip


def dreamddp(
    profile: PlanProfile, links: Links, o: Mapping[str, Any], *, method: str, split: int | str, period: int
) -> Prediction:
    from lowband.localsgd.units import choose_split, plan_units

    h = int(o["period"] or period)
    split = o["split"] if o["split"] is not None else split
    alpha, beta = links.fit()
    cost: CostProfile = with_comm(profile.cost, alpha, beta)
    numels, sizes = profile.numels, profile.elem_sizes
    chunk, schedule = choose_split(
        cost, lambda mb: plan_units(cost, numels, sizes, mb), h, split, o["scheduler"] or method
    )
    units = plan_units(cost, numels, sizes, chunk)
    per_step = schedule.predicted_period / h + profile.step_s
    sent = sum(coll.allreduce_sent(u.nbytes, links.world) for u in units) / h
    return Prediction.of(
        profile.compute_s, 0.0, per_step - profile.compute_s, sent, local_steps=h,
        note=f"split {chunk} B" if chunk else "",
    )  # fmt: skip


def diloco(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction | None:
    if o["inner"] != "local" or o["topology"] != "none":
        return None  # a machine's DDP inner loop, or a decentralised outer step: no model yet
    if "auto" in (str(o["inner_steps"]), str(o["fragments"])):
        return None  # chosen at run time from the measured profile and speeds: no model yet
    h, f, tau = int(o["inner_steps"]), int(o["fragments"]), int(o["delay"])
    numel = profile.total_bytes // 4 // f
    u = _unit_exchange(profile, links, str(o["compressor"]), str(o["reducer"]), numel)
    if u is None:
        return None
    seconds, work, sent, wire = u
    hidden = tau * profile.compute_s
    exposed = max(0.0, seconds - hidden) * f / h
    c, comm = _split_exposed(exposed, work * f / h)
    return Prediction.of(
        profile.compute_s + profile.step_s / h, c, comm, sent * f / h, local_steps=h,
        compression=numel * 4 / max(1, wire), staleness=tau,
    )  # fmt: skip
