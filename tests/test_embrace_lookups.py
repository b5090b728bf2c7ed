"""EmbRace with a model that reads one embedding table twice per forward (a query and its context):
every schedule trains as the single-process oracle, with both lookups of each step prefetched by
``lookahead`` (one ids tensor per call, in call order) under the horizontal and 2D schedules, and with
Adam on the delayed rows of the overlapped vertical schedules (a row both calls read gets its summed
gradient in one step); the lookahead's misuse is named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from embrace_model import CLASSES, DIM, VOCAB, make_optimizer, train_oracle
from torch import nn

import lowband
from lowband.errors import InvalidArgumentError
from lowband.strategies import make_strategy
from lowband.testing import run_threads

STEPS = 12
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TwiceNet(nn.Module):
    """Query ids ``[B, 3]`` and context ids ``[B, 2]``, both looked up in ``emb`` (in that order) ->
    their mean embeddings, the context's halved, summed -> two dense layers."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0, dtype=torch.float64)
        self.hidden = nn.Linear(DIM, 4, dtype=torch.float64)
        self.head = nn.Linear(4, CLASSES, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(1) + 0.5 * self.emb(context).mean(1)
        out: torch.Tensor = self.head(torch.tanh(self.hidden(h)))
        return out


def batch(rank: int, step: int) -> Batch:
    """Uneven batches (2 + (rank + step) % 3 rows), Zipf-like ids with duplicates and padding; the
    context shares rows with the query."""
    g = torch.Generator().manual_seed(500 * rank + step)
    b = 2 + (rank + step) % 3
    ids = (torch.rand((b, 3), generator=g) ** 2 * VOCAB).long()
    context = (torch.rand((b, 2), generator=g) ** 3 * VOCAB).long()
    return ids, context, torch.randint(0, CLASSES, (b,), generator=g)


def loss(m: nn.Module, b: Batch) -> torch.Tensor:
    return F.cross_entropy(m(b[0], b[1]), b[2])


def oracle(n: int, steps: int, kind: str, *, lazy: bool) -> TwiceNet:
    """The single-process model on every rank's batch, the ranks' losses averaged (``lazy``: the table
    stepped by torch's SparseAdam, as the vertical and 2D schedules step it)."""
    return train_oracle(TwiceNet(), n, steps, kind, lazy=lazy, loss_fn=loss, batch_fn=batch)


def _run(schedule: str, kind: str) -> dict[str, Any]:
    name, _, extra = schedule.partition("+")
    s = make_strategy("embrace", TwiceNet(), make_optimizer(kind), schedule=name, overlap=extra == "overlap")  # type: ignore[arg-type]
    r = lowband.rank()
    table = s.tables["emb"]  # type: ignore[attr-defined]
    prefetched = []
    for k in range(STEPS):
        b = batch(r, k)
        s.train_step(lambda m, b=b: loss(m, b))
        assert table.prefetched == 0  # the forward read every lookup prefetched for it
        nxt = batch(r, k + 1)
        s.lookahead({"emb": [nxt[0], nxt[1]]})  # both calls of the next forward, in call order
        prefetched.append(table.prefetched)
    s.synchronize()
    return {"model": s.average_state_dict(), "prefetched": prefetched, "spread": s.replica_spread()}


@pytest.mark.parametrize(
    ("schedule", "kind"),
    [("hybrid", "sgd"), ("horizontal", "sgd"), ("horizontal", "adam"), ("vertical", "adam"),
     ("vertical+overlap", "adam"), ("2d", "sgd"), ("2d", "adam"), ("2d+overlap", "adam")],
)  # fmt: skip
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_a_table_read_twice_trains_as_the_oracle(n: int, schedule: str, kind: str) -> None:
    res = run_threads(_run, n, schedule, kind, timeout=120)
    lazy = schedule.startswith(("vertical", "2d"))
    ref = oracle(n, STEPS, kind, lazy=lazy).state_dict()
    prefetches = 2 if schedule.startswith(("horizontal", "2d")) else 0  # the others ignore lookahead
    for out in res:
        assert sorted(out["model"]) == sorted(ref)
        for key in ref:
            torch.testing.assert_close(out["model"][key], ref[key], rtol=0, atol=1e-10, msg=key)
        assert out["spread"] == 0.0
        assert out["prefetched"] == [prefetches] * STEPS


def test_lookahead_misuse_is_named() -> None:
    """A lookahead value that is not a tensor or a list of tensors; more lookups prefetched than the
    forward read (every rank raises alike)."""

    def fn() -> None:
        s = make_strategy("embrace", TwiceNet(), make_optimizer("sgd"), schedule="2d")  # type: ignore[arg-type]
        r = lowband.rank()
        with pytest.raises(InvalidArgumentError, match="a tensor or a list of tensors"):
            s.lookahead({"emb": [batch(r, 0)[0], "ids"]})  # type: ignore[list-item]
        b = batch(r, 0)
        s.lookahead({"emb": [b[0], b[1], b[0]]})  # three, where the forward calls the table twice
        s.train_step(lambda m: loss(m, b))
        with pytest.raises(InvalidArgumentError, match=r"not read by the step \(\{'emb': 1\}"):
            s.lookahead({"emb": [b[0], b[1]]})
        s.synchronize()  # drops the unread one
        s.lookahead({"emb": [b[0], b[1]]})
        s.train_step(lambda m: loss(m, b))

    run_threads(fn, 2, timeout=60)
