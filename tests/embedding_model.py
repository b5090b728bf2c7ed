"""A small model with two embedding tables and dense layers, each rank's seeded batches, and the
single-process oracle that trains one model on the concatenation of every rank's batches (float64).

The model reads a context through the input table and scores candidates through the output table
(sampled-softmax shape: the candidates travel in the batch), so both tables get sparse gradients with
duplicate ids; the MLP between them is dense.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, OUT_DIM, CONTEXT, CANDIDATES, BATCH = 30, 6, 5, 3, 4, 4
LR = 0.02


class TwoTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(CONTEXT * DIM, 8), nn.Tanh(), nn.Linear(8, OUT_DIM))
        self.out_emb = nn.Embedding(VOCAB + 3, OUT_DIM)

    def forward(self, ctx: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.emb(ctx).flatten(1))
        w = self.out_emb(cand)
        return (w @ h.unsqueeze(-1)).squeeze(-1)


def model(seed: int = 11) -> TwoTables:
    g = torch.Generator().manual_seed(seed)
    m = TwoTables().double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return m


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: context ids and candidate ids (the first is the target)."""
    g = torch.Generator().manual_seed(7919 * rank + 104_729 * step + 5)
    # ids from a small range half of the time: duplicates within and across ranks
    ctx = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g) % (8 if step % 2 else VOCAB)
    cand = torch.randint(0, VOCAB + 3, (BATCH, CANDIDATES), generator=g)
    return ctx, cand


def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = m(*b)
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device))


def loss_fn(rank: int, step: int) -> Callable[[nn.Module], torch.Tensor]:
    """The loss of rank ``rank``'s batch at ``step`` (what ``Strategy.train_step`` takes)."""
    b = batch(rank, step)
    return lambda m: loss(m, b)


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def oracle(
    n: int,
    steps: int,
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = adam,
) -> torch.Tensor:
    """Single-process training on the concatenation of the ``n`` ranks' batches (equal sizes: the
    mean loss over all of them is the average of the ranks' mean losses)."""
    m = model()
    opt = make_opt(m.parameters())
    for k in range(steps):
        bs = [batch(r, k) for r in range(n)]
        b = (torch.cat([x[0] for x in bs]), torch.cat([x[1] for x in bs]))
        opt.zero_grad()
        loss(m, b).backward()
        opt.step()
    return flat(m)
