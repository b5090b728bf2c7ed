"""Decentralized optimizers (BlueFog paper §V): wrappers of any torch optimizer (never re-implemented)
that add the communication of decentralized training, overlapped with computation.

- :class:`AdaptThenCombineOptimizer` (ATC, Eq. 23): each layer stepped in backward, then its
  parameters combined with the neighbors' (launched from backward hooks, completed at the layer's next
  forward).
- :class:`AdaptWithCombineOptimizer` (AWC, Eq. 22): each layer's parameters combined from its forward
  pre-hook while forward and backward run; the step applies the local gradient to the combined value.
- :class:`GradientAllreduceOptimizer`: gradients averaged by allreduce launched from backward hooks.
- :class:`WinPutOptimizer`: asynchronous; after each local step the parameters are put into the
  out-neighbors' windows and combined with whatever has arrived, never waiting for neighbors.

:class:`CommunicationType` selects, per iteration, neighbor averaging, hierarchical neighbor averaging,
global allreduce or nothing; the weights, static or dynamic topologies and the number of local steps
per communication are attributes settable before every step, as in BlueFog.
"""

from lowband.decentral.atc import AdaptThenCombineOptimizer
from lowband.decentral.awc import AdaptWithCombineOptimizer
from lowband.decentral.gradient_allreduce import GradientAllreduceOptimizer
from lowband.decentral.optim_base import CommunicationType, DecentralizedOptimizer
from lowband.decentral.winput import WinPutOptimizer

__all__ = [
    "AdaptThenCombineOptimizer",
    "AdaptWithCombineOptimizer",
    "CommunicationType",
    "DecentralizedOptimizer",
    "GradientAllreduceOptimizer",
    "WinPutOptimizer",
]
