"""The communication core: collectives, point-to-point, fusion, handles, tracing."""

from lowband.comm.base import host_value
from lowband.comm.collectives import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    iallgather,
    iallreduce,
    ialltoall,
    ibarrier,
    ibroadcast,
    ireduce_scatter,
    reduce_scatter,
)
from lowband.comm.fusion import grouped_allreduce, igrouped_allreduce
from lowband.comm.handle import Handle, wait_all
from lowband.comm.p2p import irecv, isend, recv, send

__all__ = [
    "Handle", "allgather", "allreduce", "alltoall", "barrier", "broadcast", "grouped_allreduce", "host_value",
    "iallgather", "iallreduce", "ialltoall", "ibarrier", "ibroadcast", "igrouped_allreduce",
    "irecv", "ireduce_scatter", "isend", "recv", "reduce_scatter", "send", "wait_all",
]  # fmt: skip
