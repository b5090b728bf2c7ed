"""A small model with an embedding table and dense layers, its seeded per-rank batches and the
single-process oracle (test fixtures for the ``embrace`` strategy)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

M = TypeVar("M", bound=nn.Module)

VOCAB, DIM, CLASSES = 13, 5, 3


class Net(nn.Module):
    """Ids ``[B, 3]`` -> mean of their embeddings -> two dense layers."""

    def __init__(self, dim: int = DIM, padding_idx: int | None = 0, seed: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, dim, padding_idx=padding_idx, dtype=torch.float64)
        self.hidden = nn.Linear(dim, 4, dtype=torch.float64)
        self.head = nn.Linear(4, CLASSES, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.hidden(self.emb(ids).mean(1))))
        return out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven batches (rank r: 2 + (r + step) % 3 rows), Zipf-like ids with duplicates and padding."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    b = 2 + (rank + step) % 3
    ids = (torch.rand((b, 3), generator=g) ** 2 * VOCAB).long()
    return ids, torch.randint(0, CLASSES, (b,), generator=g)


def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def make_optimizer(kind: str) -> object:
    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "adam":
            return torch.optim.Adam(params, lr=0.05)
        return torch.optim.SGD(params, lr=0.3)

    return make


def oracle(n: int, steps: int, kind: str, *, lazy: bool, dim: int = DIM) -> Net:
    """The single-process model on every rank's batch, the ranks' losses averaged. ``lazy``: the
    table as a sparse-gradient table stepped by torch's SparseAdam (lazy Adam)."""
    return train_oracle(Net(dim), n, steps, kind, lazy=lazy, loss_fn=loss, batch_fn=batch)


def train_oracle(
    m: M, n: int, steps: int, kind: str, *, lazy: bool, loss_fn: Callable[[Any, Any], torch.Tensor],
    batch_fn: Callable[[int, int], Any],
) -> M:  # fmt: skip
    """Train ``m`` (its table ``m.emb``) as one process on every rank's batch ``batch_fn(rank, step)``,
    the ranks' losses averaged; ``lazy``: the table stepped by torch's SparseAdam."""
    table = [m.emb.weight]
    dense = [p for p in m.parameters() if p is not m.emb.weight]
    make = make_optimizer(kind)
    opt_dense = make(dense)  # type: ignore[operator]
    if lazy and kind == "adam":
        m.emb.sparse = True
        opt_table: torch.optim.Optimizer = torch.optim.SparseAdam(table, lr=0.05)
    else:
        opt_table = make(table)  # type: ignore[operator]
    for k in range(steps):
        opt_dense.zero_grad()
        opt_table.zero_grad()
        (sum(loss_fn(m, batch_fn(r, k)) for r in range(n)) / n).backward()  # type: ignore[union-attr]
        opt_dense.step()
        opt_table.step()
    m.emb.sparse = False
    return m
