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
- :mod:`~lowband.decentral.window` (+ ``window_service``, ``mutex``): one-sided windows, ``win_*``
  (a receiver thread per neighbor on a dedicated gloo group; consistency model in its docstring).
- :mod:`~lowband.decentral.optimizers` (``atc``, ``awc``, ``gradient_allreduce``, ``winput``,
  ``combine``, ``knobs``, ``optim_base``): decentralized optimizer wrappers around torch optimizers.
- :mod:`~lowband.decentral.strategies`: those optimizers as lowband strategies (atc, awc,
  hierarchical-atc, gradient-allreduce; winput in :mod:`~lowband.decentral.winput_strategy`).
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
from lowband.decentral.optimizers import (
    AdaptThenCombineOptimizer,
    AdaptWithCombineOptimizer,
    CommunicationType,
    DecentralizedOptimizer,
    GradientAllreduceOptimizer,
    WinPutOptimizer,
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
from lowband.decentral.window import (
    get_win_version,
    win_accumulate,
    win_accumulate_nonblocking,
    win_create,
    win_free,
    win_get,
    win_get_nonblocking,
    win_load_state_dict,
    win_lock,
    win_mutex,
    win_poll,
    win_put,
    win_put_nonblocking,
    win_state_dict,
    win_update,
    win_update_then_collect,
    win_wait,
    window_names,
)

__all__ = [
    "AdaptThenCombineOptimizer",
    "AdaptWithCombineOptimizer",
    "CommunicationType",
    "DecentralizedOptimizer",
    "GradientAllreduceOptimizer",
    "WinPutOptimizer",
    "get_win_version",
    "grouped_neighbor_allreduce",
    "hierarchical_neighbor_allreduce",
    "igrouped_neighbor_allreduce",
    "ihierarchical_neighbor_allreduce",
    "in_neighbor_machine_ranks",
    "in_neighbor_ranks",
    "ineighbor_allgather",
    "ineighbor_allreduce",
    "load_machine_topology",
    "load_topology",
    "neighbor_allgather",
    "neighbor_allreduce",
    "out_neighbor_machine_ranks",
    "out_neighbor_ranks",
    "set_machine_topology",
    "set_topology",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_create",
    "win_free",
    "win_get",
    "win_get_nonblocking",
    "win_load_state_dict",
    "win_lock",
    "win_mutex",
    "win_poll",
    "win_put",
    "win_put_nonblocking",
    "win_state_dict",
    "win_update",
    "win_update_then_collect",
    "win_wait",
    "window_names",
]  # fmt: skip
