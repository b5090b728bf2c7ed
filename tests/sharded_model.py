"""A small sharded model and a minimal strategy for it (test fixtures).

:class:`ColumnShardedEmbedding` holds the columns ``shard_range(dim, rank, n)`` of an embedding table;
its forward gathers every rank's ids, looks up its columns for all of them and returns each rank its
rows with :func:`lowband.nn.functional.alltoall` (whose backward sends the column gradients back to
their owners). :class:`ShardedSGD` (registered as ``sharded-test``) turns every ``nn.Embedding`` of a
dense model into one, averages the replicated gradients and scales the shards' gradients (the sum of
every rank's loss gradient) by 1/n: the same steps as the dense model on all ranks' batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

import lowband
from lowband.group import Group
from lowband.nn import ShardSpec, shard_range
from lowband.nn import functional as nnf
from lowband.strategies import OptimizerFactory, Strategy, register_strategy, strategy_names


class ColumnShardedEmbedding(nn.Module):
    def __init__(self, dense: nn.Embedding, group: Group) -> None:
        super().__init__()
        self.group = group
        self.spec = ShardSpec.even(tuple(dense.weight.shape), 1, group.rank, group.size)
        self.weight = nn.Parameter(self.spec.slice(dense.weight.detach()))

    def shard_specs(self) -> Mapping[str, ShardSpec]:
        return {"weight": self.spec}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g, dim = self.group, self.spec.global_shape[1]
        flat = ids.reshape(-1)
        counts = [int(c) for c in lowband.allgather(torch.tensor([flat.numel()]), group=g).tolist()]
        every_id = lowband.allgather(flat, sizes=counts, group=g)
        mine = F.embedding(every_id, self.weight)  # [all ids, my columns], rows grouped by asking rank
        widths = [shard_range(dim, q, g.size)[1] for q in range(g.size)]
        back = [counts[g.rank] * w for w in widths]
        got = nnf.alltoall(
            mine.reshape(-1), [c * self.spec.length for c in counts], recv_splits=back, group=g
        )
        cols = [b.view(counts[g.rank], w) for b, w in zip(got.split(back), widths, strict=True)]
        return torch.cat(cols, dim=1).view(*ids.shape, dim)


class ShardedSGD(Strategy):
    name = "sharded-test"

    def __init__(self, model: nn.Module, make_optimizer: OptimizerFactory, group: Group) -> None:
        for name, m in list(model.named_modules()):
            if isinstance(m, nn.Embedding):
                model.set_submodule(name, ColumnShardedEmbedding(m, group))
        super().__init__(model, make_optimizer(model.parameters()), group)

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]
        grads = [p.grad for _, p in self.replicated_parameters() if p.grad is not None]
        if grads:
            lowband.grouped_allreduce(grads, inplace=True, group=self.group)
        for name, p in self.local_module.named_parameters():
            if name in self.shards and p.grad is not None:
                p.grad.div_(self.group.size)


if "sharded-test" not in strategy_names():
    register_strategy("sharded-test", "test fixture: column-sharded embeddings, replicated rest")(ShardedSGD)


class Net(nn.Module):
    """Ids ``[B, 2]`` -> mean of their embeddings -> linear head."""

    def __init__(self, vocab: int = 7, dim: int = 5, classes: int = 3, seed: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim, dtype=torch.float64)
        self.head = nn.Linear(dim, classes, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(ids).mean(1))
        return out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 7, (3, 2), generator=g), torch.randint(0, 3, (3,), generator=g)


def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)  # type: ignore[arg-type]


def dense_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, steps: range) -> None:
    """The oracle: the dense model on every rank's batch, loss averaged over ranks."""
    for k in steps:
        opt.zero_grad()
        (sum(loss(model, batch(r, k)) for r in range(n)) / n).backward()  # type: ignore[union-attr]
        opt.step()


def bench_worker(cfg: object) -> object:
    """One bench rank (a process: the workloads seed torch's global RNG to build their models)."""
    from lowband.bench.config import BenchConfig
    from lowband.bench.worker import run_worker

    assert isinstance(cfg, BenchConfig)
    return run_worker(cfg)
