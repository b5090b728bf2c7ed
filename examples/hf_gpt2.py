"""A Hugging Face GPT-2 (built from a config: no weights downloaded) on Shakespeare's characters, two ways.

The transformers Trainer with a lowband strategy (``LowbandTrainer``)::

    lowband run -n 2 examples/hf_gpt2.py --strategy dreamddp:period=5 --steps 50   # + --rate 100mbit
    torchrun --nproc-per-node 2 examples/hf_gpt2.py --strategy powersgd

A workload for ``lowband bench`` (every strategy side by side on the same GPT-2)::

    lowband bench -w examples/hf_gpt2.py:make_workload -n 2 -s "ddp+powersgd+dreamddp:period=5"
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from lowband.bench.workloads.text import CharLMWorkload


def gpt2(vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)  # type: ignore[no-any-return]


class Logits(nn.Module):
    """The Hugging Face model as the bench's text workloads call a model: ids in, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits  # type: ignore[no-any-return]


class HFGPT2Workload(CharLMWorkload):
    """The bench's character-level Shakespeare workload with a Hugging Face GPT-2 as the model."""

    def __init__(self, block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 64) -> None:
        super().__init__(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        self.name = "hf-gpt2"
        self.shape = (n_layer, n_head, n_embd)

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the same model for the same seed (rank 0's is broadcast anyway)
        return Logits(gpt2(self.cfg.vocab_size, self.cfg.block_size, *self.shape))

    def describe(self) -> str:
        n_layer, _, n_embd = self.shape
        return f"Shakespeare characters, Hugging Face GPT-2 {n_layer}x{n_embd} block {self.cfg.block_size}"


def make_workload() -> HFGPT2Workload:
    return HFGPT2Workload()


class Windows(Dataset[dict[str, torch.Tensor]]):
    """Training windows of the workload's corpus as the Trainer reads them (the model shifts labels)."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block = ids, block_size

    def __len__(self) -> int:
        return len(self.ids) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.ids[i * self.block : (i + 1) * self.block]
        return {"input_ids": x, "labels": x}


def main() -> None:
    import transformers

    from lowband.integrations.transformers import LowbandTrainer
    from lowband.strategies import parse_strategy_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="dreamddp:period=5", help="a lowband strategy spec")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="hf-gpt2-run", help="the Trainer's output folder (checkpoints)")
    args = p.parse_args()
    w = make_workload()
    torch.manual_seed(0)
    model = gpt2(w.cfg.vocab_size, w.cfg.block_size)
    name, options = parse_strategy_spec(args.strategy)
    training: dict[str, Any] = {"max_grad_norm": 0.0}  # strategies stepping in backward cannot clip
    trainer = LowbandTrainer(
        model=model, train_dataset=Windows(w.data.train, w.cfg.block_size),
        args=transformers.TrainingArguments(
            output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=16, learning_rate=1e-3,
            save_steps=args.steps, logging_steps=10, report_to="none", use_cpu=True, **training,
        ),
        lowband_strategy=name, lowband_options=options,
    )  # fmt: skip
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"hf_gpt2: {name} trained {args.steps} steps, mean loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
