"""BlueFog's ``bluefog.torch.topology_util``: the collective ``InferSourceFromDestinationRanks`` /
``InferDestinationFromSourceRanks`` next to the re-exported graph builders, weight queries and dynamic
generators of :mod:`lowband.compat.bluefog.common.topology_util` (the same functions)."""

from lowband.compat.bluefog.common.topology_util import (
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
    "ExponentialGraph", "ExponentialTwoGraph", "FullyConnectedGraph", "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks", "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks", "GetRecvWeights", "GetSendWeights",
    "InferDestinationFromSourceRanks", "InferSourceFromDestinationRanks", "IsRegularGraph",
    "IsTopologyEquivalent", "MeshGrid2DGraph", "RingGraph", "StarGraph", "SymmetricExponentialGraph",
]  # fmt: skip
