"""Training strategies: one protocol (:class:`Strategy`), a registry, and PyTorch's own baselines.

Registered here: ``ddp`` (S-SGD with torch DDP), ``powersgd`` (DDP + PowerSGD hook), ``localsgd``
(FLSGD: torch's PostLocalSGDOptimizer + PeriodicModelAverager), ``stage`` and ``compressed`` (any
compressor through any transport on the gradient stage). Each paper's system registers itself
from its own package the same way.
"""

from lowband.decentral import strategies as _decentral  # noqa: F401  (registers atc, awc, hierarchical-atc, gradient-allreduce, winput)
from lowband.localsgd import strategy as _partial_sync  # noqa: F401  (registers "dreamddp", "plsgd-enp", "flsgd-overlap")
from lowband.strategies import auto as _auto  # noqa: F401  (registers "auto")
from lowband.strategies import compressed as _compressed  # noqa: F401  (registers "compressed")
from lowband.strategies import ddp as _ddp  # noqa: F401  (registers "ddp", "powersgd")
from lowband.strategies import diloco as _diloco  # noqa: F401  (registers "diloco")
from lowband.strategies import embedding_baselines as _emb  # noqa: F401  (registers "ddp-sparse", "sparse-allgather")
from lowband.strategies import embedding_baselines_priority as _emb_prio  # noqa: F401  (registers "dense-priority")
from lowband.strategies import embedding_baselines_ps as _emb_ps  # noqa: F401  (registers "embedding-ps")
from lowband.strategies import embrace as _embrace  # noqa: F401  (registers "embrace")
from lowband.strategies import localsgd as _localsgd  # noqa: F401  (registers "localsgd")
from lowband.strategies import sketch as _sketch  # noqa: F401  (registers "gs-sgd", "sketched-sgd", "gtopk", "topk-allgather")
from lowband.strategies import slimgc as _slimgc  # noqa: F401  (registers "slimgc")
from lowband.strategies import stage as _stage  # noqa: F401  (registers "stage")
from lowband.strategies.base import LossFn, OptimizerFactory, Strategy
from lowband.strategies.compressed import CompressedStrategy
from lowband.strategies.compressed_state import reshard_checkpoints
from lowband.strategies.ddp import DDPStrategy, PowerSGDStrategy
from lowband.strategies.localsgd import LocalSGDStrategy
from lowband.strategies.registry import (
    describe_strategies,
    make_strategy,
    parse_strategy_spec,
    register_strategy,
    strategy_names,
)
from lowband.strategies.sharded_state import assemble_state_dicts

__all__ = [
    "CompressedStrategy", "DDPStrategy", "LocalSGDStrategy", "LossFn", "OptimizerFactory", "PowerSGDStrategy", "Strategy",
    "assemble_state_dicts", "describe_strategies", "make_strategy", "parse_strategy_spec",
    "register_strategy", "reshard_checkpoints", "strategy_names",
]  # fmt: skip
