"""Sampled softmax over a shared set of negatives: the training loss of "Exploring the Limits of Language
Modeling" (the LM of the EmbRace paper's evaluation), in the form of TensorFlow's ``sampled_softmax_loss``.

Proposal: the log-uniform (Zipfian) distribution over ids ranked by frequency (id 0 the most frequent),
``q(k) = log((k + 2) / (k + 1)) / log(V + 1)``, TensorFlow's ``log_uniform_candidate_sampler``. One set
of ``K`` negatives is drawn per batch, with replacement, by inverting the CDF
``P(X <= k) = log(k + 2) / log(V + 1)``: ``X = floor(exp(u log(V + 1))) - 1`` for ``u ~ U[0, 1)``.

Loss of row ``i`` with target ``t_i``, context vector ``h_i`` and output rows ``u_w``: a cross-entropy over
the candidates ``[t_i, n_1, ..., n_K]`` (the target first) whose logits are the scores ``h_i . u_w``
corrected by ``- log(K q(w))`` (the log of the candidate's expected count; ``log K`` cancels), with every
negative equal to ``t_i`` removed (an "accidental hit": its logit is ``-inf``). The mean over rows is
the batch loss; its gradient touches the output rows of the targets and the negatives only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lowband.bench.workloads.base import check_int, mix_seed
from lowband.errors import InvalidArgumentError

_NEGATIVES_TAG = 0x5A3B1E  # keeps the negatives' seeds apart from the epoch shuffles' (seed, epoch)


def log_uniform_log_q(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``log q(id)`` of the log-uniform proposal over ``vocab_size`` ids, in float64."""
    k = ids.to(torch.float64)
    return torch.log(torch.log1p(1.0 / (k + 1.0))) - math.log(math.log(vocab_size + 1.0))


def negatives_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The private generator that draws rank ``rank``'s negatives of training step ``step``."""
    for what, value in (("seed", seed), ("rank", rank), ("step", step)):
        check_int("negatives_generator", what, value, minimum=0)
    return torch.Generator().manual_seed(mix_seed(_NEGATIVES_TAG, seed, rank, step))


def draw_negatives(vocab_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids in ``[0, vocab_size)`` drawn with replacement from the log-uniform proposal (int64)."""
    check_int("draw_negatives", "vocab_size", vocab_size, minimum=1)
    check_int("draw_negatives", "count", count, minimum=0)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    ids = torch.floor(torch.exp(u * math.log(vocab_size + 1.0))).long() - 1
    return ids.clamp_(0, vocab_size - 1)


def sampled_softmax_loss(
    true_scores: torch.Tensor,
    negative_scores: torch.Tensor,
    targets: torch.Tensor,
    negatives: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Mean sampled-softmax loss (module docstring) of ``B`` rows.

    ``true_scores`` ``(B,)`` are ``h_i . u_{t_i}``; ``negative_scores`` ``(B, K)`` are ``h_i . u_{n_j}``;
    ``targets`` ``(B,)`` and ``negatives`` ``(K,)`` are the ids.
    """
    b, k = targets.numel(), negatives.numel()
    if true_scores.shape != (b,) or negative_scores.shape != (b, k):
        raise InvalidArgumentError(
            f"sampled_softmax_loss: scores of shapes {tuple(true_scores.shape)} and "
            f"{tuple(negative_scores.shape)} do not match {b} targets and {k} negatives"
        )
    dtype = true_scores.dtype
    true = true_scores - log_uniform_log_q(targets, vocab_size).to(dtype)
    neg = negative_scores - log_uniform_log_q(negatives, vocab_size).to(dtype)
    neg = neg.masked_fill(negatives.unsqueeze(0) == targets.unsqueeze(1), float("-inf"))
    logits = torch.cat([true.unsqueeze(1), neg], dim=1)
    return F.cross_entropy(logits, torch.zeros(b, dtype=torch.int64, device=logits.device))
