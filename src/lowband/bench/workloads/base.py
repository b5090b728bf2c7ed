"""The interface every reference workload implements, and the sharding/batching/evaluation they share.

A workload is a dataset (train and held-out parts, loaded offline), a model family and a loss. Rank
``r`` of ``n`` trains only on its shard: items ``perm[r::n]`` of a permutation of the training set that
is fixed per dataset (it depends on neither the rank count nor the training seed), so the shards of
any world size are disjoint and cover the training set. :meth:`Workload.batches` walks the shard in a
fresh order each epoch, drawn from ``(seed, epoch)``: deterministic, and the same for every world size.

Subclasses provide the data through three hooks (:meth:`Workload._num_train`,
:meth:`Workload._train_batch`, :meth:`Workload._test_batch`) and the per-batch metric
(:meth:`Workload._eval_batch`); the rest is here.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from lowband.errors import InvalidArgumentError

Batch = tuple[torch.Tensor, torch.Tensor]

M = TypeVar("M", bound=nn.Module)

_SHARD_PERM_SEED = 0x10BA4D  # the per-dataset permutation that shards are cut from


@dataclass(frozen=True)
class EvalResult:
    """Held-out metrics: mean loss per item and top-1 accuracy (next-token for LMs, None for regression)."""

    loss: float
    accuracy: float | None


def mix_seed(*parts: int) -> int:
    """A 63-bit seed derived from several non-negative integers (e.g. ``(seed, epoch)``), well spread."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0]) >> 1


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(model: nn.Module, batch: Batch) -> Batch:
    """``batch`` moved to the model's device (a no-op on CPU)."""
    device = model_device(model)
    return batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)


def seeded_init(op: str, factory: Callable[[], M], seed: int) -> M:
    """Build ``factory()`` with torch's global RNG seeded to ``seed``; the caller's RNG state is restored."""
    check_int(op, "seed", seed, minimum=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def resolve_lr(op: str, lr: float | None, default: float) -> float:
    """``lr`` checked to be a positive finite number, or ``default`` when None."""
    if lr is None:
        return default
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise InvalidArgumentError(f"{op}: lr must be a positive finite number, got {lr!r}")
    return float(lr)


def check_int(op: str, what: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{op}: {what} must be an int >= {minimum}, got {value!r}")


class Workload(abc.ABC):
    """A reference training task: offline data sharded per rank, a seeded model, a loss and a metric."""

    name: str  # registry key
    unit: str  # "samples" or "tokens"
    default_batch_size: int  # per rank
    default_lr: float
    eval_items_per_sample: int = 1  # items (unit) in one held-out sample, for evaluate(max_items)
    eval_batch_size: int = 256  # held-out samples per forward pass in evaluate

    # ----------------------------------------------------------------- what subclasses implement
    @abc.abstractmethod
    def describe(self) -> str:
        """One line: the dataset actually used (with sizes) and the model with its parameter count."""

    @abc.abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """A fresh model, identical for identical seeds."""

    @abc.abstractmethod
    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        """The workload's torch optimizer over ``params`` (``lr`` defaults to :attr:`default_lr`)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The mean training loss of ``model`` on ``batch`` (a scalar with a graph)."""

    @abc.abstractmethod
    def items(self, batch: Batch) -> int:
        """Samples or tokens (see :attr:`unit`) in ``batch``, for throughput."""

    @abc.abstractmethod
    def _num_train(self) -> int:
        """Number of training samples."""

    @abc.abstractmethod
    def _num_test(self) -> int:
        """Number of held-out samples."""

    @abc.abstractmethod
    def _train_batch(self, idx: torch.Tensor) -> Batch:
        """The training samples at indices ``idx`` (int64) as a CPU batch."""

    @abc.abstractmethod
    def _test_batch(self, idx: torch.Tensor) -> Batch:
        """The held-out samples at indices ``idx`` (int64) as a CPU batch."""

    @abc.abstractmethod
    def _eval_batch(self, model: nn.Module, batch: Batch) -> tuple[float, int | None]:
        """(sum of per-item losses, number of correct top-1 predictions or None) on a held-out batch."""

    # ----------------------------------------------------------------- shared machinery
    @property
    def num_train(self) -> int:
        """Number of training samples (the set the shards partition)."""
        return self._num_train()

    @property
    def num_test(self) -> int:
        """Number of held-out samples."""
        return self._num_test()

    def shard_indices(self, rank: int, world: int) -> torch.Tensor:
        """The training-sample indices rank ``rank`` of ``world`` owns (int64, in a fixed order)."""
        check_int(f"{self.name}.shard_indices", "world", world, minimum=1)
        check_int(f"{self.name}.shard_indices", "rank", rank, minimum=0)
        if rank >= world:
            raise InvalidArgumentError(
                f"{self.name}.shard_indices: rank {rank} is out of range for world {world}"
            )
        gen = torch.Generator().manual_seed(_SHARD_PERM_SEED)
        perm = torch.randperm(self._num_train(), generator=gen)
        return perm[rank::world].clone()

    def batches(self, rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        """Infinite deterministic batches from this rank's shard, reshuffled each epoch from (seed, epoch).

        Each epoch yields ``len(shard) // batch_size`` full batches; the items left over differ from
        epoch to epoch, so every item is seen.
        """
        op = f"{self.name}.batches"
        check_int(op, "batch_size", batch_size, minimum=1)
        check_int(op, "seed", seed, minimum=0)
        shard = self.shard_indices(rank, world)
        if batch_size > len(shard):
            raise InvalidArgumentError(
                f"{op}: batch_size {batch_size} exceeds the {len(shard)} training samples of rank {rank} "
                f"of {world}"
            )
        return self._iterate(shard, batch_size, seed)

    def _iterate(self, shard: torch.Tensor, batch_size: int, seed: int) -> Iterator[Batch]:
        epoch = 0
        while True:
            gen = torch.Generator().manual_seed(mix_seed(seed, epoch))
            order = shard[torch.randperm(len(shard), generator=gen)]
            for start in range(0, len(order) - batch_size + 1, batch_size):
                yield self._train_batch(order[start : start + batch_size])
            epoch += 1

    def evaluate(self, model: nn.Module, max_items: int = 2000) -> EvalResult:
        """Mean loss (and accuracy) on the first held-out samples, up to ``max_items`` items.

        Runs without gradients in ``model.eval()`` mode and restores the model's previous mode.
        """
        check_int(f"{self.name}.evaluate", "max_items", max_items, minimum=1)
        n = min(self._num_test(), max(1, max_items // self.eval_items_per_sample))
        chunk = self.eval_batch_size
        was_training = model.training
        model.eval()
        loss_sum, correct, items = 0.0, 0, 0
        has_accuracy = True
        try:
            with torch.no_grad():
                for start in range(0, n, chunk):
                    batch = self._test_batch(torch.arange(start, min(n, start + chunk)))
                    batch_loss, batch_correct = self._eval_batch(model, batch)
                    loss_sum += batch_loss
                    items += self.items(batch)
                    if batch_correct is None:
                        has_accuracy = False
                    else:
                        correct += batch_correct
        finally:
            model.train(was_training)
        return EvalResult(loss=loss_sum / items, accuracy=correct / items if has_accuracy else None)


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
