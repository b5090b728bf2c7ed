"""Word-level language modelling on Shakespeare with a small transformer and an untied input table.

The nanoGPT-style model of :mod:`lowband.bench.workloads.text` on words: the token table ``wte``
(``nn.Embedding``, read only by lookup, so its gradient touches only the batch's rows), a position
table ``wpe`` (every row read every step), a few pre-norm blocks and a dense linear head over the whole
vocabulary, untied from ``wte``. With the defaults (24,000 words, 128 dimensions, 3 blocks, windows of
32 words) the token table holds ~46% of the ~6.7 M parameters and the dense part (blocks and head) the
rest: the hybrid of sparse table and dense blocks that block scheduling works on.

Samples are non-overlapping windows of ``block_size + 1`` words; every position predicts the next word.
Optimizer: Adagrad, which leaves a row without gradient exactly unchanged (dense and sparse updates of
the token table agree).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from lowband.bench.workloads.base import Batch, resolve_lr
from lowband.bench.workloads.shakespeare import word_data
from lowband.bench.workloads.text import CharLMWorkload


class WordGPTWorkload(CharLMWorkload):
    """Next-word prediction at every position of a window; accuracy is next-word top-1."""

    default_batch_size = 16
    default_lr = 0.02

    def __init__(
        self,
        *,
        vocab_size: int = 24000,
        block_size: int = 32,
        n_layer: int = 3,
        n_head: int = 4,
        n_embd: int = 128,
        lr: float = 0.02,
    ) -> None:
        load = functools.partial(word_data, vocab_size)
        self._setup("wordgpt", load, block_size, n_layer, n_head, n_embd, lr, tied=False)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        lr = resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr)
        return torch.optim.Adagrad(params, lr=lr)

    def lookup_ids(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The ids each embedding table (by module name) is called on for ``batch``."""
        return {"wte": batch[0], "wpe": torch.arange(batch[0].shape[1])}
