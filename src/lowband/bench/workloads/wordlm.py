"""Word-level language modelling on Shakespeare with a model whose embedding tables hold the parameters.

The model (Bengio-style neural LM) reads a window of ``context`` words through an input embedding
table, mixes them with a one-hidden-layer MLP and predicts the next word through an output table over
the same vocabulary. With the defaults (24,000 words, 48 dimensions) the two tables hold ~95% of the
~2.4 M parameters while one step costs little compute: the workload for sparse-embedding
communication. The input table ``model.embed`` is read only by lookup, so its gradient touches only
the rows of the batch's context words; ``tied=True`` shares it with the output layer instead (fewer
parameters, but then every row gets a gradient).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.workloads.base import (
    Batch,
    DatasetWorkload,
    count_params,
    resolve_lr,
    seeded_init,
    to_device,
)
from lowband.bench.workloads.shakespeare import TokenData, word_data


class WordLM(nn.Module):
    """Input table -> concatenated context -> MLP -> output table (``out``), tied to ``embed`` if asked."""

    def __init__(self, vocab_size: int, embed_dim: int, context: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(context * embed_dim, hidden), nn.GELU(), nn.Linear(hidden, embed_dim)
        )
        self.out = nn.Linear(embed_dim, vocab_size)
        nn.init.normal_(self.embed.weight, std=0.1)
        if tied:
            self.out.weight = self.embed.weight
        else:
            nn.init.normal_(self.out.weight, std=0.1)
        nn.init.zeros_(self.out.bias)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        """Next-word logits ``(B, vocab)`` for context word ids ``(B, context)``."""
        logits: torch.Tensor = self.out(self.mlp(self.embed(words).flatten(1)))
        return logits

    def embedding_parameters(self) -> int:
        """Parameters in the embedding tables (input table + output weight, counted once if tied)."""
        tables = {id(p): p for p in (self.embed.weight, self.out.weight)}
        return sum(p.numel() for p in tables.values())


class WordWindowWorkload(DatasetWorkload):
    """Shakespeare words as samples of ``context`` consecutive words and the word after (stride 1).

    The data half of the word-level workloads: batches are ``(context ids (B, context), next ids (B,))``
    and :attr:`unit` is tokens (predicted words, one per sample). Subclasses add the model and the loss.
    """

    unit = "tokens"

    def __init__(self, vocab_size: int, context: int) -> None:
        self.data: TokenData = word_data(vocab_size)
        self.context = context

    @property
    def vocab_size(self) -> int:
        """The vocabulary the text gives (at most the ``vocab_size`` asked for), ``<unk>`` included."""
        return len(self.data.vocab)

    def _data_description(self) -> str:
        return (
            f"Shakespeare words ({len(self.data.train) / 1e6:.2f} M train / "
            f"{len(self.data.test) / 1e6:.2f} M test tokens, vocab {self.vocab_size})"
        )

    def items(self, batch: Batch) -> int:
        return int(batch[0].shape[0])

    def _samples(self, ids: torch.Tensor, idx: torch.Tensor) -> Batch:
        pos = idx.unsqueeze(1) + torch.arange(self.context + 1)
        w = ids[pos]
        return w[:, :-1].contiguous(), w[:, -1].contiguous()

    def _num_train(self) -> int:
        return len(self.data.train) - self.context

    def _num_test(self) -> int:
        return len(self.data.test) - self.context

    def _train_batch(self, idx: torch.Tensor) -> Batch:
        return self._samples(self.data.train, idx)

    def _test_batch(self, idx: torch.Tensor) -> Batch:
        return self._samples(self.data.test, idx)


class WordLMWorkload(WordWindowWorkload):
    """Next-word prediction with a full softmax (:class:`WordWindowWorkload` samples).

    AdamW optimizer; accuracy is next-word top-1.
    """

    name = "wordlm"
    default_batch_size = 64

    def __init__(
        self,
        *,
        vocab_size: int = 24000,
        embed_dim: int = 48,
        context: int = 8,
        hidden: int = 256,
        tied: bool = False,
        lr: float = 1e-2,
    ) -> None:
        super().__init__(vocab_size, context)  # options checked by the workload's schema (get_workload)
        self.default_lr = float(lr)
        self._shape = (self.vocab_size, embed_dim, context, hidden, tied)

    def _new_model(self) -> WordLM:
        return WordLM(*self._shape)

    def describe(self) -> str:
        model = seeded_init(self.name, self._new_model, 0)
        total = count_params(model)
        _, dim, context, hidden, tied = self._shape
        return (
            f"{self._data_description()}, word LM context {context} embed {dim} hidden {hidden}"
            f"{' tied' if tied else ''} {total / 1e6:.2f} M params "
            f"({100 * model.embedding_parameters() / total:.0f}% in embedding tables)"
        )

    def build_model(self, seed: int) -> nn.Module:
        return seeded_init(f"{self.name}.build_model", self._new_model, seed)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        lr = resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = to_device(model, batch)
        return F.cross_entropy(model(x), y)

    def _eval_batch(self, model: nn.Module, batch: Batch) -> tuple[float, int | None]:
        x, y = to_device(model, batch)
        logits = model(x)
        return float(F.cross_entropy(logits, y, reduction="sum")), int((logits.argmax(dim=1) == y).sum())
