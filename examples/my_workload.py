"""Your own model, data and loss in ``lowband bench``: a 3-layer MLP on scikit-learn's digits.

Compare strategies on it over emulated 100 Mbit/s links (the file's path or an importable module)::

    lowband bench -w examples/my_workload.py:make_workload -n 4 --rate 100mbit \\
        -s "ddp+powersgd+localsgd:period=5+dreamddp:period=5"

A workload subclasses :class:`lowband.bench.workloads.Workload` and writes three methods:
``build_model(seed)``, ``batches(rank, world, batch_size, seed)`` and ``loss(model, batch)``.
``evaluate`` (held-out loss and accuracy), ``make_optimizer`` (default: SGD with momentum 0.9),
``items`` and ``describe`` are optional. Each rank process loads this file again and calls
``make_workload()``, so it must be importable without side effects.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.workloads import EvalResult, Workload, tensor_batches


class DigitsMLP(Workload):
    """A 64-128-64-10 MLP on scikit-learn's bundled 8x8 digits (1,797 images; the last 297 held out)."""

    name = "digits-mlp"
    unit = "samples"
    default_batch_size = 32
    default_lr = 0.05

    def __init__(self, hidden: int = 128, test_rows: int = 297) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.from_numpy(digits.data).float() / 16.0
        y = torch.from_numpy(digits.target).long()
        self.hidden = hidden
        self.train_x, self.train_y = x[:-test_rows], y[:-test_rows]
        self.test_x, self.test_y = x[-test_rows:], y[-test_rows:]

    def build_model(self, seed: int) -> nn.Module:
        gen = torch.Generator().manual_seed(seed)
        model = nn.Sequential(
            nn.Linear(64, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 64), nn.ReLU(), nn.Linear(64, 10)
        )
        with torch.no_grad():  # seeded from a private generator: the same model on every rank
            for p in model.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[-1] ** 0.5)
        return model

    def batches(
        self, rank: int, world: int, batch_size: int, seed: int
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        # rank's own shard of the training rows, endless, reshuffled each epoch from the seed
        return tensor_batches([self.train_x, self.train_y], rank, world, batch_size, seed)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, max_items: int = 2000) -> EvalResult:
        x, y = self.test_x[:max_items], self.test_y[:max_items]
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(x)
        model.train(was_training)
        accuracy = float((logits.argmax(dim=1) == y).float().mean())
        return EvalResult(loss=float(F.cross_entropy(logits, y)), accuracy=accuracy)

    def describe(self) -> str:
        params = sum(p.numel() for p in self.build_model(0).parameters())
        return (
            f"scikit-learn digits ({len(self.train_y)} train / {len(self.test_y)} test), "
            f"3-layer MLP {params / 1e3:.1f} K params"
        )


def make_workload(hidden: int = 128) -> DigitsMLP:
    """The factory ``lowband bench -w examples/my_workload.py:make_workload`` calls."""
    return DigitsMLP(hidden=hidden)
