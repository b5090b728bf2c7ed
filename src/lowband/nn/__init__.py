"""Autograd over communication: differentiable collectives (:mod:`lowband.nn.functional`) and the
description of parameters that live sharded across ranks (:mod:`lowband.nn.sharding`)."""

from lowband.nn import functional
from lowband.nn.sharding import ShardSpec, shard_range, shard_specs

__all__ = ["ShardSpec", "functional", "shard_range", "shard_specs"]
