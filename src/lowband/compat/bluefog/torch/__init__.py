"""BlueFog's PyTorch API (``bluefog.torch``, version 0.3) on lowband.

Code written for BlueFog runs with one change, its import::

    import bluefog.torch as bf                       # before
    import lowband.compat.bluefog.torch as bf        # after
    from lowband.compat.bluefog.common import topology_util   # for bluefog.common.topology_util

Every public name of ``bluefog.torch`` (and of ``bluefog.torch.topology_util`` and
``bluefog.common.topology_util``) exists with BlueFog's arguments, defaults, return types, numerics
(uniform neighbor averaging is ``(x + sum_j x_j) / (n + 1)``), dtypes (int16 included), exception classes
(``ValueError``/``TypeError`` subclasses keeping lowband's messages), optimizer semantics
(``num_steps_per_communication`` counted in forward/backward passes; the win-put optimizer puts during
the forward and combines at ``step``), window ops with an associated p, collective ``Infer*`` calls,
``BLUEFOG_NODES_PER_MACHINE`` and a ``BLUEFOG_TIMELINE`` file written while the program runs.
docs/BLUEFOG_COMPAT.md lists every name, same or different and why. There is deliberately no top-level
``bluefog`` package (it would shadow a real BlueFog install).

What cannot be the same
=======================

=========================  ===========================================================================
topic                      here
=========================  ===========================================================================
launcher                   ``torchrun --nproc-per-node 4 train.py`` or ``lowband run -n 4 train.py``
                           instead of ``bfrun``/``mpirun``; a plain ``python`` run is a world of one.
                           ``init`` joins torch.distributed (env://) or reuses an existing lowband
                           context (the test harness's thread-ranks).
MPI                        no MPI and no C++ extension: torch.distributed (gloo on CPU, NCCL for CUDA
                           tensors). ``mpi_threads_supported()`` is False,
                           ``unified_mpi_window_model_supported()`` True, ``nccl_built()`` is torch's
                           NCCL availability. Ops are matched by call order, not negotiated by
                           ``name`` (a label in traces); ``set_skip_negotiate_stage(True)`` turns
                           lowband's cross-rank argument check off. Every wait is bounded
                           (``CommTimeoutError``). Windows are lowband's window service (a receiver
                           thread per neighbor) instead of MPI RMA: CPU floating-point tensors, an op
                           completes once applied at its destination, ops from one rank to another
                           apply in order; ``win_lock`` holds back incoming ops instead of opening an
                           MPI epoch; ``suspend``/``resume`` have no background thread to pause.
run-time classes           the optimizer factories return lowband's wrappers (torch optimizers around
                           new optimizers of the given class, :func:`optimizer_factory`), not instances
                           of a class made at run time: set the LR on the returned optimizer. Any torch
                           optimizer works with adapt-then-combine.
=========================  ===========================================================================
"""

from lowband.compat.bluefog.torch import _needs_init, topology_util
from lowband.compat.bluefog.torch._basics import (
    get_skip_negotiate_stage,
    in_neighbor_machine_ranks,
    in_neighbor_ranks,
    init,
    is_homogeneous,
    is_machine_topo_weighted,
    is_topo_weighted,
    load_machine_topology,
    load_topology,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    mpi_threads_supported,
    nccl_built,
    out_neighbor_machine_ranks,
    out_neighbor_ranks,
    rank,
    set_machine_topology,
    set_skip_negotiate_stage,
    set_topology,
    shutdown,
    size,
    timeline_context,
    timeline_end_activity,
    timeline_start_activity,
    unified_mpi_window_model_supported,
)
from lowband.compat.bluefog.torch._errors import TopologyMismatchError, TopologyTypeError
from lowband.compat.bluefog.torch._extras import pair_gossip, pair_gossip_nonblocking, resume, suspend
from lowband.compat.bluefog.torch._ops import (
    allgather,
    allgather_nonblocking,
    allreduce,
    allreduce_,
    allreduce_nonblocking,
    allreduce_nonblocking_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_nonblocking,
    broadcast_nonblocking_,
    hierarchical_neighbor_allreduce,
    hierarchical_neighbor_allreduce_nonblocking,
    neighbor_allgather,
    neighbor_allgather_nonblocking,
    neighbor_allreduce,
    neighbor_allreduce_nonblocking,
    poll,
    synchronize,
    wait,
)
from lowband.compat.bluefog.torch._optimizers import (
    BlueFogWinPutOptimizer,
    CommunicationType,
    DistributedAdaptThenCombineOptimizer,
    DistributedAdaptWithCombineOptimizer,
    DistributedAllreduceOptimizer,
    DistributedGradientAllreduceOptimizer,
    DistributedHierarchicalNeighborAllreduceOptimizer,
    DistributedNeighborAllreduceOptimizer,
    DistributedWinPutOptimizer,
    optimizer_factory,
)
from lowband.compat.bluefog.torch._utility import (
    allreduce_parameters,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from lowband.compat.bluefog.torch._windows import (
    get_current_created_window_names,
    get_win_version,
    turn_off_win_ops_with_associated_p,
    turn_on_win_ops_with_associated_p,
    win_accumulate,
    win_accumulate_nonblocking,
    win_associated_p,
    win_create,
    win_free,
    win_get,
    win_get_nonblocking,
    win_lock,
    win_mutex,
    win_poll,
    win_put,
    win_put_nonblocking,
    win_update,
    win_update_then_collect,
    win_wait,
)
from lowband.compat.bluefog.torch.topology_util import (
    ExponentialGraph,
    ExponentialTwoGraph,
    FullyConnectedGraph,
    GetDynamicOnePeerSendRecvRanks,
    GetExp2DynamicSendRecvMachineRanks,
    GetInnerOuterExpo2DynamicSendRecvRanks,
    GetInnerOuterRingDynamicSendRecvRanks,
    GetRecvWeights,
    GetSendWeights,
    InferDestinationFromSourceRanks,
    InferSourceFromDestinationRanks,
    IsRegularGraph,
    IsTopologyEquivalent,
    MeshGrid2DGraph,
    RingGraph,
    StarGraph,
    SymmetricExponentialGraph,
)

__all__ = [
    "BlueFogWinPutOptimizer",
    "CommunicationType",
    "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer",
    "DistributedAllreduceOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "DistributedWinPutOptimizer",
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "FullyConnectedGraph",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetRecvWeights",
    "GetSendWeights",
    "InferDestinationFromSourceRanks",
    "InferSourceFromDestinationRanks",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "MeshGrid2DGraph",
    "RingGraph",
    "StarGraph",
    "SymmetricExponentialGraph",
    "TopologyMismatchError",
    "TopologyTypeError",
    "allgather",
    "allgather_nonblocking",
    "allreduce",
    "allreduce_",
    "allreduce_nonblocking",
    "allreduce_nonblocking_",
    "allreduce_parameters",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_nonblocking",
    "broadcast_nonblocking_",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "get_current_created_window_names",
    "get_skip_negotiate_stage",
    "get_win_version",
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_nonblocking",
    "in_neighbor_machine_ranks",
    "in_neighbor_ranks",
    "init",
    "is_homogeneous",
    "is_machine_topo_weighted",
    "is_topo_weighted",
    "load_machine_topology",
    "load_topology",
    "local_rank",
    "local_size",
    "machine_rank",
    "machine_size",
    "mpi_threads_supported",
    "nccl_built",
    "neighbor_allgather",
    "neighbor_allgather_nonblocking",
    "neighbor_allreduce",
    "neighbor_allreduce_nonblocking",
    "neighbor_win_accumulate",
    "neighbor_win_accumulate_nonblocking",
    "neighbor_win_get",
    "neighbor_win_get_nonblocking",
    "neighbor_win_put",
    "neighbor_win_put_nonblocking",
    "optimizer_factory",
    "out_neighbor_machine_ranks",
    "out_neighbor_ranks",
    "pair_gossip",
    "pair_gossip_nonblocking",
    "poll",
    "rank",
    "resume",
    "set_machine_topology",
    "set_skip_negotiate_stage",
    "set_topology",
    "shutdown",
    "size",
    "suspend",
    "synchronize",
    "timeline_context",
    "timeline_end_activity",
    "timeline_start_activity",
    "topology_util",
    "turn_off_win_ops_with_associated_p",
    "turn_on_win_ops_with_associated_p",
    "unified_mpi_window_model_supported",
    "wait",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_associated_p",
    "win_create",
    "win_free",
    "win_get",
    "win_get_nonblocking",
    "win_lock",
    "win_mutex",
    "win_poll",
    "win_put",
    "win_put_nonblocking",
    "win_update",
    "win_update_then_collect",
    "win_wait",
]  # fmt: skip

# the window ops under their neighbor_win_* names as well (some BlueFog material calls them so; the
# BlueFog sources stored up to commit d5fae5b export only win_*): the same functions, either name works
neighbor_win_accumulate = win_accumulate
neighbor_win_accumulate_nonblocking = win_accumulate_nonblocking
neighbor_win_get = win_get
neighbor_win_get_nonblocking = win_get_nonblocking
neighbor_win_put = win_put
neighbor_win_put_nonblocking = win_put_nonblocking

# an op called before bf.init() says to call bf.init() (not lowband.init())
_needs_init.wrap_public(globals(), __all__)
