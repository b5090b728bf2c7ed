"""lowband: training PyTorch models over slow links.

Quick use::

    import lowband
    lowband.init()                       # under torchrun / `lowband run`, or a world of one
    avg = lowband.allreduce(t)           # average over all ranks
    h = lowband.iallreduce(t, op="sum")  # nonblocking: a Handle
    t = h.wait()
"""

from lowband.comm import (
    Handle,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    grouped_allreduce,
    iallgather,
    iallreduce,
    ialltoall,
    ibarrier,
    ibroadcast,
    igrouped_allreduce,
    irecv,
    ireduce_scatter,
    isend,
    recv,
    reduce_scatter,
    send,
    wait_all,
)
from lowband.errors import (
    CollectiveMismatchError,
    CommFailedError,
    CommTimeoutError,
    InvalidArgumentError,
    LowbandError,
    NonFiniteError,
    NotInitializedError,
)
from lowband.group import Group
from lowband.launcher import launch
from lowband.optim.ddp_hook import ddp_comm_hook
from lowband.runtime import (
    destroy_group,
    device,
    init,
    is_initialized,
    local_group,
    local_rank,
    local_size,
    machine_group,
    machine_rank,
    machine_size,
    new_group,
    rank,
    set_check,
    shutdown,
    size,
    world,
)
from lowband.tracing import chrome_trace, counters, gather_counters, reset_trace, set_trace

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError", "CommFailedError", "CommTimeoutError", "Group", "Handle",
    "InvalidArgumentError", "LowbandError", "NonFiniteError", "NotInitializedError", "__version__", "allgather",
    "allreduce", "alltoall", "barrier", "broadcast", "chrome_trace", "counters", "ddp_comm_hook", "destroy_group", "device", "gather_counters", "grouped_allreduce",
    "iallgather", "iallreduce", "ialltoall", "ibarrier", "ibroadcast", "igrouped_allreduce", "init",
    "irecv", "ireduce_scatter", "is_initialized", "isend", "launch", "local_group", "local_rank",
    "local_size", "machine_group", "machine_rank", "machine_size", "new_group", "rank", "recv",
    "reduce_scatter", "reset_trace", "send", "set_check", "set_trace", "shutdown", "size", "wait_all", "world",
]  # fmt: skip
