"""BlueFog's PyTorch API (``bluefog.torch``, version 0.3) on lowband.

Code written for BlueFog runs with one change, its import::

    import bluefog.torch as bf                       # before
    import lowband.compat.bluefog.torch as bf        # after
    from lowband.compat.bluefog.common import topology_util   # for bluefog.common.topology_util

Same function names, argument names, defaults and return types as BlueFog: ``init``, ranks and sizes,
topologies, ``allreduce``/``broadcast``/``allgather`` (nonblocking ``_nonblocking`` and in-place ``_``
forms), ``neighbor_allreduce``, ``neighbor_allgather``, ``hierarchical_neighbor_allreduce``, ``poll``/
``synchronize``/``wait``/``barrier``, the ``win_*`` ops, the ``Distributed*Optimizer`` factories with
``CommunicationType``, ``broadcast_parameters``/``broadcast_optimizer_state``/``allreduce_parameters`` and
the ``timeline_*`` calls. There is deliberately no top-level ``bluefog`` package (it would shadow a real
BlueFog install).

Differences from BlueFog
========================

=========================  ===========================================================================
topic                      here
=========================  ===========================================================================
launcher                   ``torchrun --nproc-per-node 4 train.py`` or ``lowband run -n 4 train.py``
                           instead of ``bfrun``/``mpirun``; a plain ``python`` run is a world of one.
                           No MPI and no C++ extension: torch.distributed (gloo on CPU).
``init``                   joins torch.distributed (env://), reuses an existing lowband context (the
                           test harness's); default topology ``ExponentialTwoGraph(size)``, default
                           machine topology ``ExponentialTwoGraph(machine_size)``.
machines                   ``local_size`` comes from torchrun's ``LOCAL_WORLD_SIZE`` or
                           ``LOWBAND_LOCAL_SIZE``; layouts are always homogeneous (``is_homogeneous``).
handles                    integers, as in BlueFog; ``poll``/``synchronize``/``wait``/``win_wait``/
                           ``win_poll`` also accept lowband ``Handle`` objects. Each can be waited once.
                           Every wait is bounded by lowband's timeout (``CommTimeoutError``).
errors                     bad arguments raise ``lowband.errors.InvalidArgumentError`` (a
                           ``ValueError``; BlueFog raises ``ValueError``/``TypeError`` or asserts),
                           ranks that disagree ``CollectiveMismatchError``. ``win_wait`` of an unknown
                           handle logs a warning and returns False, as in BlueFog.
``name``                   a label for lowband's traces; ops are matched by call order (every rank
                           calls the same collectives in the same order), not negotiated by name.
``set_skip_negotiate_``    maps to lowband's cross-rank argument check: ``True`` = ``set_check(False)``.
``stage``
neighbor weights           keyword-only, as in BlueFog 0.3 (the paper's Listings 5 and 7 pass them
                           positionally; pass them by keyword). Pull calls (``self_weight`` +
                           ``src_weights``) send to the ranks that list this rank in their
                           ``src_weights`` (discovered), where BlueFog sends to every static
                           out-neighbor. ``dst_weights`` may be a dict or a list of ranks (scale 1).
``enable_topo_check``      calls with ``dst_weights`` run lowband's send/receive check when True; static
                           calls follow lowband's runtime check setting unless it is False.
neighbor order             ``in_neighbor_ranks``/``out_neighbor_ranks`` are ascending;
                           ``neighbor_allgather`` concatenates in ascending source rank (first
                           dimensions may differ).
``set_topology``           a non-DiGraph raises ``InvalidArgumentError`` (BlueFog: ``TypeError``);
                           returns False while windows exist, as BlueFog does. An equivalent graph is a
                           no-op only with the same ``is_weighted`` (BlueFog ignores a changed
                           ``is_weighted`` then). The graph is also set as
                           lowband's world topology (:mod:`lowband.decentral.state`).
windows                    lowband's window service instead of MPI RMA: receiver threads per neighbor on
                           a process group of their own. Consistency: a put/accumulate/get completes
                           once applied at the destination; each op is atomic under the destination's
                           window lock; ops from one rank to another apply in order; ``require_mutex``
                           waits for the destination's distributed mutex (first come, first served);
                           ``win_lock`` holds this rank's mutex and holds back incoming ops. CPU,
                           floating-point tensors only. ``win_update``'s ``neighbor_weights`` is
                           lowband's ``src_weights``.
associated p               ``win_associated_p`` and ``turn_on_win_ops_with_associated_p`` raise: carry p
                           in the window tensor (Listing 3 does); ``turn_off_...`` is a no-op.
optimizers                 the factories return lowband's wrappers (:mod:`lowband.decentral.optimizers`)
                           around new optimizers of the given optimizer's class (see
                           :func:`optimizer_factory`), not instances of that class made at run time; any
                           torch optimizer works with adapt-then-combine (no ``register_step_function``).
                           State starts fresh as in BlueFog; ``param_groups`` are new dicts (set the LR
                           on, and attach schedulers to, the returned optimizer). Knobs have BlueFog's
                           names. ``model`` may be a list (wrapped in a ``ModuleList``).
                           ``DistributedWinPutOptimizer`` ignores ``window_prefix``; free its windows
                           with ``close()``. ``DistributedPullGetOptimizer`` and the push-sum optimizer
                           are not provided.
``broadcast_optimizer_``   sends the root's whole ``state_dict()`` (serialised), so other ranks' state
``state``                  need not be initialised; BlueFog broadcasts tensor by tensor after a dummy step.
timeline                   ``$BLUEFOG_TIMELINE`` turns lowband's tracing on at ``init``; ``shutdown``
                           writes ``$BLUEFOG_TIMELINE<rank>.json`` (Chrome trace); ``timeline_*`` add
                           activities to lowband's timeline while tracing is on (else return False).
MPI queries                ``mpi_threads_supported()`` is False, ``unified_mpi_window_model_supported()``
                           True, ``nccl_built()`` is torch's NCCL availability.
graph builders             ``bf.ExponentialTwoGraph`` etc. are re-exported from ``topology_util`` (as the
                           paper's Listing 1 writes them); BlueFog has them in ``topology_util`` only.
=========================  ===========================================================================
"""

from lowband.compat.bluefog.torch import topology_util
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
