"""The cost models of two gradient-stage reducers whose exchange is not one allreduce or allgather,
called from their strategies' :meth:`~lowband.strategies.Strategy.predict`. Buckets as the gradient
stage forms them (``bucket_mb``, ``first_bucket_mb``: :func:`lowband.plan.overlap.layer_buckets`).

- ``gs-sgd`` (:class:`~lowband.compress.gssgd.GsSGDReducer`): per bucket of ``d`` values, the sketch of
  ``rows x cols`` float32 (measured, in the backward hook), the sketches summed over the halving/doubling
  tree (``2 ceil(log2 n)`` rounds) or a ring allreduce (``reduce="allreduce"``), the recovery of
  ``m = ceil(oversample k)`` coordinates (measured) and a ring allreduce of their ``m`` exact values.
  Only the tree's first round is posted during backward (its later rounds and the second round run when
  the bucket is waited, after backward): the model counts the whole exchange after backward, buckets in
  sequence (it overstates by at most one round per bucket). Steady state: the warm-up density, when
  given, is not modelled (its steps are few).
- ``compressed`` with ``reducer=ps`` (:mod:`lowband.compress.ps`): per bucket, each rank compresses its
  ``n`` shards (measured at the shard size), an all-to-all pushes the ``n - 1`` payloads to their owners,
  each owner decodes the ``n`` payloads of its shard and the local decode updates the memory (``2 n``
  decodes, measured), all of it waited for inside the backward hook: backward stalls for it. The pull
  (an allgather of the ``ceil(d / n)``-value full-precision shards) overlaps the rest of backward
  (:mod:`lowband.plan.overlap`; the push of a later bucket is assumed not to queue behind it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lowband.localsgd.costmodel import CostProfile, LayerCost
from lowband.plan import collectives as coll
from lowband.plan.links import Links
from lowband.plan.overlap import MiB, layer_buckets, overlapped_exposed
from lowband.plan.prediction import Prediction
from lowband.plan.profile import PlanProfile

#: the options of gs-SGD's reducer (the strategy's other options are the buckets')
GS_REDUCER_OPTIONS = (
    "rows", "cols", "density", "k", "recovery", "oversample", "reduce", "momentum", "masking", "seed",
    "warmup", "warmup_steps",
)  # fmt: skip


def _buckets(profile: PlanProfile, o: Mapping[str, Any]) -> list[list[int]]:
    cap, first = o["bucket_mb"] * MiB, (o["first_bucket_mb"] or o["bucket_mb"]) * MiB
    return layer_buckets([lc.nbytes for lc in profile.cost.layers], cap, first)


def gs_sgd(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction:
    from lowband.compress.gssgd import GsSGDReducer
    from lowband.compress.heavymix import candidates

    red = GsSGDReducer(**{k: o[k] for k in GS_REDUCER_OPTIONS})
    n = links.world
    work, comm, sent, wire = 0.0, 0.0, 0.0, 0
    for b in _buckets(profile, o):
        d = sum(profile.cost.layers[i].nbytes for i in b) // 4
        k = red.k_for(d)
        cols, m = red.cols_for(d), candidates(k, red.oversample, d)
        table = red.rows * cols * 4
        sketch_s, recover_s = profile.ops.sketch(d, red.rows, cols, m)
        if red.reduce_by == "tree":
            summed, summed_sent = links.halving_doubling(table), coll.halving_doubling_sent(table, n)
        else:
            summed, summed_sent = links.allreduce(table), coll.allreduce_sent(table, n)
        work += sketch_s + (recover_s if n > 1 else 0.0)
        comm += summed + links.allreduce(m * 4)
        sent += summed_sent + coll.allreduce_sent(m * 4, n)
        wire += table + m * 4
    return Prediction.of(
        profile.compute_s, work, comm, sent, compression=profile.total_bytes / max(1, wire),
        note=f"{red.reduce_by} of sketches",
    )  # fmt: skip


def compressed_ps(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction:
    from lowband.compress import make_compressor
    from lowband.compress.wire import header_bytes

    comp = make_compressor(str(o["compressor"]))
    cost, n = profile.cost, links.world
    buckets = _buckets(profile, o)
    stalls, pulls, work, sent, wire = [], [], 0.0, 0.0, 0
    for b in buckets:
        d = sum(cost.layers[i].nbytes for i in b) // 4
        shard = math.ceil(d / n)
        cc = profile.ops.compressor(str(o["compressor"]), shard)
        push = cc.nbytes + (0 if comp.fixed_size else header_bytes(2))
        local = n * (cc.compress_s + 2 * cc.decompress_s)
        alltoall = links.alltoall([push] * (n - 1)) if n > 1 else 0.0
        stalls.append(local + alltoall)
        pulls.append(links.allgather(shard * 4))
        work += local
        sent += coll.ps_sent(push, shard * 4, n)
        wire += n * push
    layers = list(cost.layers)
    for b, stall in zip(buckets, stalls):  # backward waits for the push where the bucket is ready
        i = min(b)
        lc = layers[i]
        layers[i] = LayerCost(lc.name, lc.fwd, lc.bwd + stall, lc.comm, lc.nbytes)
    stalled = CostProfile(tuple(layers))
    exposed = sum(stalls) + overlapped_exposed(stalled, buckets, lambda k: pulls[k])
    c = min(exposed, work)
    return Prediction.of(
        profile.compute_s, c, exposed - c, sent, compression=profile.total_bytes / max(1, wire),
        note="push to colocated servers, pull shards",
    )  # fmt: skip
