"""Lightning's Trainer training with a lowband strategy: an MLP on scikit-learn's digits.

Launch it as any Lightning script (the Trainer's ``devices`` must match the ranks per machine)::

    lowband run -n 2 examples/lightning_train.py --strategy dreamddp:period=5      # + --rate 100mbit
    torchrun --nproc-per-node 2 examples/lightning_train.py --strategy powersgd
    python examples/lightning_train.py --devices 2                               # Lightning's launcher

Each rank saves ``--ckpt`` (default ``lightning.ckpt``: Lightning's file, the consensus model) and its own
strategy state into ``lightning.ckpt.lowband/``; ``--resume`` continues from them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowband.integrations.lightning import LowbandStrategy
from lowband.strategies import parse_strategy_spec


class DigitsClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)  # through self(...): the strategy's forward hooks see it
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="dreamddp:period=5", help="a lowband strategy spec")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    p.add_argument("--ckpt", default="lightning.ckpt")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    args = p.parse_args()
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data).float() / 16, torch.tensor(digits.target))
    torch.manual_seed(0)
    model = DigitsClassifier()
    name, options = parse_strategy_spec(args.strategy)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=LowbandStrategy(name, **options),
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(
        model, DataLoader(data, batch_size=32, shuffle=True), ckpt_path=args.ckpt if args.resume else None
    )
    trainer.save_checkpoint(args.ckpt)  # every rank: the strategy's state beside Lightning's file
    if trainer.is_global_zero:
        print(f"lightning_train: {name} trained to loss {float(trainer.callback_metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
