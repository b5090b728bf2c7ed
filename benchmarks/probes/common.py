"""What the probes' two sides share: outcome names, the case type, the models and state helpers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]

#: one case: JSON-able, ``family`` (1-6), ``id`` (unique), ``kind`` (what the ranks run), ``ranks``
Case = dict[str, Any]

OK_ERROR, OK_TRAINED = "ok-error", "ok-trained"
SILENT, GLOO_ABORT, HANG, WRONG_BLAME = "SILENT", "GLOO-ABORT", "HANG", "WRONG-BLAME"
#: an error, but not the clear one the family demands on every rank (or not on every rank)
WRONG_ERROR = "WRONG-ERROR"
#: the expected error on every rank, but a non-finite value reached a model
NAN_MODEL = "NAN-MODEL"
#: a rank died otherwise (a signal other than an abort, an exit without a report)
CRASH = "CRASH"
#: family 6: the right rank named first, but a survivor took longer than SURVIVOR_EXIT_S to exit
SLOW_EXIT = "SLOW-EXIT"
OUTCOMES = [
    OK_ERROR,
    OK_TRAINED,
    SILENT,
    GLOO_ABORT,
    HANG,
    WRONG_BLAME,
    WRONG_ERROR,
    NAN_MODEL,
    CRASH,
    SLOW_EXIT,
]
OK = {OK_ERROR, OK_TRAINED}
SURVIVOR_EXIT_S = 1.0

#: errors the ranks agree on before anything is left in flight: a batch goes on after them
AGREED_ERRORS = {"NonFiniteError", "CollectiveMismatchError", "InvalidArgumentError"}


class TiedLM(nn.Module):
    """Token table -> a dense layer -> an output layer tied to the table (issue 29's family 2)."""

    VOCAB, DIM = 11, 4

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(self.VOCAB, self.DIM, dtype=torch.float64)
        self.mid = nn.Linear(self.DIM, self.DIM, dtype=torch.float64)
        self.dec = nn.Linear(self.DIM, self.VOCAB, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        self.dec.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dec(torch.tanh(self.mid(self.emb(ids))))
        return out


def tied_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, TiedLM.VOCAB - 2, (3, 5), generator=g)
    return F.cross_entropy(m(ids[:, :-1]).reshape(-1, TiedLM.VOCAB), ids[:, 1:].reshape(-1))


def tied_opt(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def tied_oracle(ranks: int, steps: int) -> list[float]:
    """The single-process model trained on every rank's batch (the losses averaged)."""
    m = TiedLM()
    opt = tied_opt(m.parameters())
    for k in range(steps):
        opt.zero_grad()
        loss = torch.stack([tied_loss(m, r, k) for r in range(ranks)]).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return flat(m)


def flat(m: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).double() for p in m.parameters()]).tolist()


def finite(values: Iterable[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def tensors(state: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state (dicts, lists, tuples) with its path."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from tensors(state[k], f"{path}.{k}" if path else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensors(v, f"{path}[{i}]")


def state_finite(state: Any) -> list[str]:
    """The paths of floating tensors in ``state`` that hold a non-finite value."""
    return [p for p, t in tensors(state) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
