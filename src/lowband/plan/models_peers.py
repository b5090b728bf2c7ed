"""The cost models of the decentralised strategies (BlueFog's optimizers), called from each strategy's
:meth:`~lowband.strategies.Strategy.predict`: neighbor averagings of the parameters over a topology
built by lowband's own builders (:data:`lowband.topology.names.TOPOLOGIES`) at the links' world size.

- Peers: a rank sends one copy of what it averages to each out-neighbor and receives one from each
  in-neighbor, all at once (:func:`~lowband.plan.collectives.gossip_time`): the bytes are the mean
  out-degree (``dynamic-exp2``: 1 at every size; ``exp2``: ``ceil(log2 n)``; ``ring``: 2 from 3 ranks on;
  ``full``: ``n - 1``), the time is paced by the largest. A dynamic topology is read over
  ``2 ceil(log2 n)`` rounds (its exponential-2 cycle).
- ``atc``: each layer's combination starts when its backward (and layer step) ends, in backward order,
  one at a time on the link; it must be complete at that layer's forward in the next step: what is late
  stalls that forward (steady state: one step's stall).
- ``awc``: each layer's combination starts at its forward pre-hook, in forward order; :meth:`step`
  waits for all of them after backward.
- ``winput``: every parameter is put to the out-neighbors after the forward; :meth:`step` waits for the
  puts after backward (one message per parameter tensor).
- ``period = H``: one step in H communicates; ``allreduce_every = k``: every k-th communication is a
  ring allreduce of each layer instead (same overlap); averaged over the steps.
- ``gradient-allreduce``: one ring allreduce per layer from the backward hooks (DDP's event model with
  a bucket per layer, :mod:`lowband.plan.overlap`).

Not modelled (None): ``inner-outer-exp2`` (its inner and outer peers cross different links: the
one-ring link model has no machines), a :class:`Topology` object given as the option (no name to build
at another size), and ``hierarchical-atc`` (a machine average over the links inside a machine, then
machines: two tiers the one-ring model does not hold).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lowband.plan import collectives as coll
from lowband.plan.links import Links
from lowband.plan.overlap import layer_buckets, overlapped_exposed
from lowband.plan.prediction import Prediction
from lowband.plan.profile import PlanProfile

#: topologies whose peers cross links the one-ring model does not hold (module doc)
UNMODELLED_TOPOLOGIES = frozenset({"inner-outer-exp2"})


def peers(topology: object, n: int) -> tuple[float, int] | None:
    """``(mean out-degree, largest out-degree)`` of the named ``topology`` over ``n`` ranks (None: not
    modelled, module doc)."""
    from lowband.topology import DynamicTopology
    from lowband.topology.names import TOPOLOGIES

    if not isinstance(topology, str) or topology in UNMODELLED_TOPOLOGIES:
        return None
    if n == 1:
        return 0.0, 0
    topo = TOPOLOGIES.get(topology, "lowband plan")(n, 1)
    if isinstance(topo, DynamicTopology):
        rounds = [[len(s) for s in topo.send_ranks(k)] for k in range(2 * coll.halving_doubling_rounds(n))]
    else:
        rounds = [[len(topo.out_neighbors(r)) for r in range(n)]]
    return sum(sum(r) for r in rounds) / (n * len(rounds)), max(max(r) for r in rounds)


def _layer_times(profile: PlanProfile, each: Callable[[int], float]) -> list[float]:
    return [each(lc.nbytes) for lc in profile.cost.layers]


def _atc_exposed(profile: PlanProfile, times: Sequence[float]) -> float:
    """Stall of the next step's forward waiting for combinations queued from the end of each layer's
    backward (module doc)."""
    layers = profile.cost.layers
    fwd = profile.cost.fwd_total
    link, ends = 0.0, [0.0] * len(layers)
    done = fwd
    for i in reversed(range(len(layers))):
        done += layers[i].bwd
        link = max(link, done) + times[i]
        ends[i] = link
    start, stall = profile.compute_s, 0.0
    for i, lc in enumerate(layers):
        stall = max(stall, ends[i] - (start + stall))
        start += lc.fwd
    return max(0.0, stall)


def _awc_exposed(profile: PlanProfile, times: Sequence[float]) -> float:
    """Combinations queued from each layer's forward, waited after backward (module doc)."""
    link, start = 0.0, 0.0
    for lc, t in zip(profile.cost.layers, times):
        link = max(link, start) + t
        start += lc.fwd
    return max(0.0, link - profile.cost.fwd_total - profile.cost.bwd_total)


EXPOSED: dict[str, Callable[[PlanProfile, Sequence[float]], float]] = {
    "atc": _atc_exposed,
    "awc": _awc_exposed,
}


def neighbor(name: str, profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction | None:
    """``atc`` or ``awc`` (``name``) with options ``o`` (module doc)."""
    deg = peers(o["topology"], links.world)
    if deg is None:
        return None
    mean, most = deg
    h, every = int(o["period"]), int(o["allreduce_every"])
    exposed = EXPOSED[name]
    gossip = exposed(profile, _layer_times(profile, lambda b: links.gossip(b, most)))
    sent = coll.gossip_sent(profile.total_bytes, 1, links.world) * mean
    if every > 0:
        ar = exposed(profile, _layer_times(profile, links.allreduce))
        ar_sent = sum(coll.allreduce_sent(lc.nbytes, links.world) for lc in profile.cost.layers)
        gossip = ((every - 1) * gossip + ar) / every
        sent = ((every - 1) * sent + ar_sent) / every
    note = f"{mean:.3g} copies per communication"
    return Prediction.of(profile.compute_s, 0.0, gossip / h, sent / h, local_steps=h, note=note)


def winput(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction | None:
    deg = peers(o["topology"], links.world)
    if deg is None:
        return None
    mean, most = deg
    h = int(o["period"])
    tensors = [
        math.prod(s) * (es or 4) for shapes, es in zip(profile.shapes, profile.elem_sizes) for s in shapes
    ]
    puts = sum(links.gossip(b, most) for b in tensors)
    exposed = max(0.0, puts - profile.cost.bwd_total)
    sent = coll.gossip_sent(profile.total_bytes, 1, links.world) * mean
    note = f"{mean:.3g} copies per put"
    return Prediction.of(profile.compute_s, 0.0, exposed / h, sent / h, local_steps=h, note=note)


def gradient_allreduce(profile: PlanProfile, links: Links, o: Mapping[str, Any]) -> Prediction:
    cost = profile.cost
    buckets = layer_buckets([lc.nbytes for lc in cost.layers], 0, 0)
    exposed = overlapped_exposed(cost, buckets, lambda k: links.allreduce(cost.layers[buckets[k][0]].nbytes))
    sent = sum(coll.allreduce_sent(lc.nbytes, links.world) for lc in cost.layers)
    return Prediction.of(profile.compute_s, 0.0, exposed, sent)
