"""Word-level language modelling with a sampled softmax: two embedding tables hold the parameters.

The model reads a window of ``context`` words through the input table ``embed``, mixes them with a
one-hidden-layer MLP into a vector ``h`` of the table's width and scores a word ``w`` as ``h . u_w``,
``u_w`` a row of the output table ``out_emb``. Both tables are plain ``nn.Embedding`` modules, called as
modules on id tensors, so a training step reads (and its gradient touches) only the rows of the
batch's context words in ``embed`` and of its targets and negatives in ``out_emb``. With the defaults
(24,000 words, 192 dimensions, context 8, hidden 256) the tables hold 95% of the 9.66 M parameters.

Training loss: the sampled softmax of :mod:`lowband.bench.workloads.sampled_softmax` (log-uniform
proposal with the log-q correction, accidental hits removed) over ``K`` negatives shared by the batch.
The negatives are drawn in :meth:`SampledWordLMWorkload.batches` from ``(seed, rank, step)`` and travel
in the batch, so :meth:`SampledWordLMWorkload.loss` is a deterministic function of the model and the
batch. Evaluation: the full softmax over the whole vocabulary.

Batches: ``(context ids (B, context), output ids)``; for training the output ids are the ``B`` targets
followed by the ``K`` negatives (exactly the ids the output table is called on), for evaluation the
targets alone. There is no output bias: a width-1 bias table could not be split by columns over several
ranks, and the constant component the MLP's last bias gives ``h`` lets each ``u_w`` carry one.

Optimizer: Adagrad (the optimizer of the sampled-softmax LM paper), with TensorFlow's initial accumulator
0.1 (from 0, each coordinate's first step is ``lr`` whatever its gradient, and the model diverges in its
first steps at this learning rate). A row without gradient is left exactly unchanged by Adagrad, so
dense and sparse (lazy) updates of the tables are the same update.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.workloads.base import Batch, count_params, resolve_lr, seeded_init, to_device
from lowband.bench.workloads.sampled_softmax import draw_negatives, negatives_generator, sampled_softmax_loss
from lowband.bench.workloads.wordlm import WordWindowWorkload


class SampledWordLM(nn.Module):
    """Input table ``embed`` -> concatenated context -> MLP -> ``h``; output table ``out_emb`` scores ``h``."""

    def __init__(self, vocab_size: int, embed_dim: int, context: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(context * embed_dim, hidden), nn.GELU(), nn.Linear(hidden, embed_dim)
        )
        self.out_emb = nn.Embedding(vocab_size, embed_dim)
        nn.init.normal_(self.embed.weight, std=0.1)
        nn.init.normal_(self.out_emb.weight, std=0.1)

    def forward(self, words: torch.Tensor, out_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Scores ``(B, len(out_ids))`` of context word ids ``(B, context)`` against the output rows of
        ``out_ids`` (1-D); with ``out_ids`` None, the full-softmax logits ``(B, vocab)``."""
        h = self.mlp(self.embed(words).flatten(1))
        rows = self.out_emb.weight if out_ids is None else self.out_emb(out_ids)
        scores: torch.Tensor = h @ rows.T
        return scores

    def embedding_parameters(self) -> int:
        """Parameters in the two embedding tables."""
        return self.embed.weight.numel() + self.out_emb.weight.numel()


class SampledWordLMWorkload(WordWindowWorkload):
    """Next-word prediction trained with a sampled softmax over ``negatives`` shared negatives per batch.

    Accuracy is next-word top-1 under the full softmax.
    """

    name = "wordlm-sampled"
    default_batch_size = 128

    def __init__(
        self,
        *,
        vocab_size: int = 24000,
        embed_dim: int = 192,
        context: int = 8,
        hidden: int = 256,
        negatives: int = 512,
        lr: float = 0.5,
    ) -> None:
        super().__init__(vocab_size, context)  # options checked by the workload's schema (get_workload)
        self.default_lr = float(lr)
        self.num_negatives = negatives
        self._shape = (self.vocab_size, embed_dim, context, hidden)

    def _new_model(self) -> SampledWordLM:
        return SampledWordLM(*self._shape)

    def describe(self) -> str:
        model = seeded_init(self.name, self._new_model, 0)
        total = count_params(model)
        _, dim, context, hidden = self._shape
        return (
            f"{self._data_description()}, sampled-softmax word LM context {context} embed {dim} "
            f"hidden {hidden}, {self.num_negatives} log-uniform negatives per batch, "
            f"{total / 1e6:.2f} M params ({100 * model.embedding_parameters() / total:.1f}% in embedding "
            f"tables)"
        )

    def build_model(self, seed: int) -> nn.Module:
        return seeded_init(f"{self.name}.build_model", self._new_model, seed)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        lr = resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr)
        return torch.optim.Adagrad(params, lr=lr, initial_accumulator_value=0.1)

    def negatives(self, seed: int, rank: int, step: int) -> torch.Tensor:
        """The negatives of rank ``rank``'s ``step``-th batch (0-based) of a run seeded ``seed`` (int64)."""
        return draw_negatives(self.vocab_size, self.num_negatives, negatives_generator(seed, rank, step))

    def batches(self, rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        """The word windows of :meth:`Workload.batches`, each with its negatives after the targets."""
        windows = super().batches(rank, world, batch_size, seed)  # checks the arguments now
        return self._with_negatives(windows, rank, seed)

    def _with_negatives(self, windows: Iterator[Batch], rank: int, seed: int) -> Iterator[Batch]:
        for step, (context, targets) in enumerate(windows):
            yield context, torch.cat([targets, self.negatives(seed, rank, step)])

    def lookup_ids(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The ids each embedding table (by module name) is called on for a training ``batch``."""
        return {"embed": batch[0], "out_emb": batch[1]}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        context, out_ids = to_device(model, batch)
        b = context.shape[0]
        scores = model(context, out_ids)  # (B, B + K): every row against every target and negative
        true_scores = scores[:, :b].diagonal()
        return sampled_softmax_loss(true_scores, scores[:, b:], out_ids[:b], out_ids[b:], self.vocab_size)

    def _eval_batch(self, model: nn.Module, batch: Batch) -> tuple[float, int | None]:
        context, targets = to_device(model, batch)
        logits = model(context)  # full softmax over the vocabulary
        loss = F.cross_entropy(logits, targets, reduction="sum")
        return float(loss), int((logits.argmax(dim=1) == targets).sum())
