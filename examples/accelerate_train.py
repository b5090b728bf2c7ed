"""Accelerate with a lowband strategy: an MLP on scikit-learn's digits, Accelerate's data loader,
autocast and checkpoints, lowband's loop.

    lowband run -n 2 examples/accelerate_train.py --strategy dreamddp:period=5     # + --rate 100mbit
    torchrun --nproc-per-node 2 examples/accelerate_train.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py   # torchrun inside; CPU ranks here
    (`accelerate launch --cpu` starts one process)

``--hook COMPRESSOR:TRANSPORT`` (e.g. ``onebit:twostage``) takes the comm-hook route instead: Accelerate
prepares the model (torch DDP) and its own loop runs, lowband's compressed reducer as the DDP comm hook.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowband.integrations.accelerate import prepare_strategy, register_comm_hook
from lowband.strategies import parse_strategy_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="dreamddp:period=5", help="a lowband strategy spec")
    p.add_argument(
        "--hook", default=None, help="COMPRESSOR:TRANSPORT: the comm-hook route (e.g. onebit:twostage)"
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt", default="accelerate-state")
    args = p.parse_args()
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data).float() / 16, torch.tensor(digits.target))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = accelerator.prepare(DataLoader(data, batch_size=32, shuffle=True))
    loss = torch.zeros(())
    if args.hook is None:  # every strategy: lowband's loop
        name, options = parse_strategy_spec(args.strategy)
        s = prepare_strategy(accelerator, name, model, optimizer, **options)
        for _ in range(args.epochs):
            for x, y in loader:
                s.zero_grad()
                with accelerator.autocast():
                    loss = F.cross_entropy(s.module(x), y)
                s.backward(loss)
                s.step()
        label = s.label()
    else:  # the comm-hook route: Accelerate's DDP model and loop
        compressor, _, transport = args.hook.partition(":")
        model, optimizer = accelerator.prepare(model, optimizer)
        register_comm_hook(accelerator, model, compressor=compressor, reducer=transport or "auto")
        for _ in range(args.epochs):
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
        label = f"DDP + {args.hook}"
    accelerator.save_state(args.ckpt)  # every rank: lowband's state in ckpt/lowband/
    if accelerator.is_main_process:
        print(f"accelerate_train: {label} trained to loss {float(loss.detach()):.4f}")


if __name__ == "__main__":
    main()
