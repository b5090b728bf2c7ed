"""Decentralized communication (BlueFog): neighbor collectives over static and time-varying topologies,
hierarchical neighbor averaging, and the per-rank topology state.

- :mod:`~lowband.decentral.state`: ``set_topology`` / ``load_topology`` (per group), machine topology,
  neighbor ranks.
- :mod:`~lowband.decentral.peers`: the argument combinations (static, pull, push, push-pull) -> a plan.
- :mod:`~lowband.decentral.topocheck`: the send/receive consistency check (one small exchange).
- :mod:`~lowband.decentral.transport`: posting the messages (receives, then sends) and applying weights.
- :mod:`~lowband.decentral.neighbor`: ``neighbor_allreduce``, ``grouped_neighbor_allreduce`` (fusion),
  ``neighbor_allgather`` and their nonblocking ``i``-forms.
- :mod:`~lowband.decentral.hierarchical`: ``hierarchical_neighbor_allreduce``.
"""

from lowband.decentral.hierarchical import hierarchical_neighbor_allreduce, ihierarchical_neighbor_allreduce
from lowband.decentral.neighbor import (
    grouped_neighbor_allreduce,
    igrouped_neighbor_allreduce,
    ineighbor_allgather,
    ineighbor_allreduce,
    neighbor_allgather,
    neighbor_allreduce,
)
from lowband.decentral.state import (
    in_neighbor_machine_ranks,
    in_neighbor_ranks,
    load_machine_topology,
    load_topology,
    out_neighbor_machine_ranks,
    out_neighbor_ranks,
    set_machine_topology,
    set_topology,
)

# window.py (asynchronous win_* ops) and optimizers.py (decentralized optimizer wrappers) are added by
# their owners; their exports go here.

__all__ = [
    "grouped_neighbor_allreduce", "hierarchical_neighbor_allreduce", "igrouped_neighbor_allreduce",
    "ihierarchical_neighbor_allreduce", "in_neighbor_machine_ranks", "in_neighbor_ranks",
    "ineighbor_allgather", "ineighbor_allreduce", "load_machine_topology", "load_topology",
    "neighbor_allgather", "neighbor_allreduce", "out_neighbor_machine_ranks", "out_neighbor_ranks",
    "set_machine_topology", "set_topology",
]  # fmt: skip
