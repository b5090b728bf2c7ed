"""wordgpt with the GPT's AdamW (lr 1e-3) as its optimizer: does the inner optimizer explain local steps' loss?"""

from collections.abc import Iterable

import torch
from torch import nn

from lowband.bench.workloads.wordgpt import WordGPTWorkload


class AdamWordGPT(WordGPTWorkload):
    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3 if lr is None else lr, betas=(0.9, 0.99), weight_decay=0.01)


def make() -> AdamWordGPT:
    return AdamWordGPT()
