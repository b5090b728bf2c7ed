"""The workload protocol every bench workload implements (the built-in ones and a user's own), and the
sharding, batching and evaluation the built-in data sets share.

A workload is a model family, a stream of batches per rank and a loss. :class:`Workload` asks for three
methods and has defaults for everything else::

    class MyWorkload(Workload):
        name = "my-mlp"            # optional: titles (default: the spec's module or file name)
        unit = "samples"           # optional: what items() counts ("samples" or "tokens")
        default_batch_size = 32    # optional: per rank, unless --batch-size
        default_lr = 0.05          # optional: the default optimizer's, unless --lr

        def build_model(self, seed): ...                      # an nn.Module, same for same seed
        def batches(self, rank, world, batch_size, seed): ...  # this rank's endless seeded batches
        def loss(self, model, batch): ...                      # mean loss, a scalar with a graph
        # optional, with defaults:
        def evaluate(self, model, max_items): ...    # EvalResult(loss, accuracy) or None (default)
        def make_optimizer(self, params, lr=None): ...  # default: SGD, momentum 0.9
        def items(self, batch): ...                  # default: rows of the batch's first tensor
        def describe(self): ...                      # default: name, class, parameter count

``lowband bench -w module:factory`` (or ``-w path/to/file.py:factory``) calls ``factory()`` and trains
the :class:`Workload` it returns (:mod:`lowband.bench.workloads.loader`). :func:`tensor_batches` turns
in-memory tensors into the sharded, seeded stream :meth:`Workload.batches` yields.

The built-in workloads derive from :class:`DatasetWorkload`: rank ``r`` of ``n`` trains only on its
shard, items ``perm[r::n]`` of a permutation of the training set that is fixed per dataset (it depends on
neither the rank count nor the training seed), so the shards of any world size are disjoint and cover
the training set; each epoch walks the shard in a fresh order drawn from ``(seed, epoch)``. Subclasses
provide the data through hooks (:meth:`DatasetWorkload._num_train`, :meth:`DatasetWorkload._train_batch`,
:meth:`DatasetWorkload._test_batch`) and the per-batch metric (:meth:`DatasetWorkload._eval_batch`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from lowband.errors import InvalidArgumentError
from lowband.rng import fork_rng

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
    with fork_rng():
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
    """What the bench trains: a seeded model, each rank's batches and a loss (see the module docstring).

    Only :meth:`build_model`, :meth:`batches` and :meth:`loss` must be written. A batch is whatever
    :meth:`batches` yields and :meth:`loss` takes (a tuple of tensors, a dict, ...); the stream must be
    deterministic in ``(rank, world, batch_size, seed)``, and ranks should see different data.
    """

    name: str = "workload"  # titles; the loader names a user's workload after its spec when left so
    unit: str = "samples"  # what items() counts: "samples" or "tokens"
    default_batch_size: int = 32  # per rank
    default_lr: float = 0.01  # the default optimizer's learning rate

    @abc.abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """A fresh model, identical for identical seeds (every rank builds it with the same seed)."""

    @abc.abstractmethod
    def batches(self, rank: int, world: int, batch_size: int, seed: int) -> Iterator[Any]:
        """Rank ``rank`` of ``world``'s training batches of ``batch_size`` items: endless, seeded by
        ``seed``, from that rank's own part of the data (:func:`tensor_batches` does this for tensors)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The mean training loss of ``model`` on ``batch`` (a scalar with a graph)."""

    def evaluate(self, model: nn.Module, max_items: int = 2000) -> EvalResult | None:
        """Held-out mean loss and accuracy (None for a regression) on up to ``max_items`` items, run on
        every rank after each round with gradients off; None (the default): no held-out evaluation."""
        return None

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer every strategy wraps; default: SGD, momentum 0.9, ``lr`` or :attr:`default_lr`."""
        return torch.optim.SGD(
            params, lr=resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr), momentum=0.9
        )

    def items(self, batch: Any) -> int:
        """Samples or tokens (:attr:`unit`) in ``batch``, for throughput; default: the rows of its first
        tensor (the batch itself, its first element or its first value, recursively)."""
        first = batch
        while not isinstance(first, torch.Tensor):
            if isinstance(first, (tuple, list)) and first:
                first = first[0]
            elif isinstance(first, dict) and first:
                first = next(iter(first.values()))
            else:
                raise InvalidArgumentError(
                    f"{self.name}.items: cannot count the items of a {type(batch).__name__} batch; "
                    "override Workload.items"
                )
        return int(first.shape[0]) if first.dim() else 1

    def describe(self) -> str:
        """One line for the report: the data used and the model with its parameter count."""
        params = count_params(self.build_model(0))
        return f"{self.name} ({type(self).__name__}), model {params / 1e6:.3g} M params"


def tensor_batches(
    tensors: Sequence[torch.Tensor], rank: int, world: int, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless batches ``tuple(t[idx] for t in tensors)`` from rank ``rank`` of ``world``'s shard of the
    rows (:func:`shard_order`: disjoint shards covering the rows, reshuffled each epoch from ``seed``)."""
    rows = [tuple(t.shape[:1]) for t in tensors]
    if not tensors or any(r != rows[0] or not r for r in rows):
        raise InvalidArgumentError(f"tensor_batches: give tensors with the same number of rows, got {rows}")
    order = shard_order("tensor_batches", int(tensors[0].shape[0]), rank, world, batch_size, seed)
    return (tuple(t[idx] for t in tensors) for idx in order)


def shard_indices(op: str, num: int, rank: int, world: int) -> torch.Tensor:
    """The row indices rank ``rank`` of ``world`` owns out of ``num``: ``perm[rank::world]`` of a
    permutation fixed per ``num`` (int64)."""
    check_int(op, "world", world, minimum=1)
    check_int(op, "rank", rank, minimum=0)
    if rank >= world:
        raise InvalidArgumentError(f"{op}: rank {rank} is out of range for world {world}")
    gen = torch.Generator().manual_seed(_SHARD_PERM_SEED)
    perm = torch.randperm(num, generator=gen)
    return perm[rank::world].clone()


def shard_order(
    op: str, num: int, rank: int, world: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless index batches over rank ``rank``'s shard of ``num`` rows, in a fresh order each epoch
    drawn from ``(seed, epoch)``; an epoch yields ``len(shard) // batch_size`` full batches (the items
    left over differ from epoch to epoch, so every item is seen). Checks the arguments at once."""
    check_int(op, "batch_size", batch_size, minimum=1)
    check_int(op, "seed", seed, minimum=0)
    shard = shard_indices(op, num, rank, world)
    if batch_size > len(shard):
        raise InvalidArgumentError(
            f"{op}: batch_size {batch_size} exceeds the {len(shard)} training samples of rank {rank} "
            f"of {world}"
        )
    return _epochs(shard, batch_size, seed)


def _epochs(shard: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    epoch = 0
    while True:
        gen = torch.Generator().manual_seed(mix_seed(seed, epoch))
        order = shard[torch.randperm(len(shard), generator=gen)]
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        epoch += 1


class DatasetWorkload(Workload):
    """A :class:`Workload` over an offline dataset with a training and a held-out part, through hooks."""

    eval_items_per_sample: int = 1  # items (unit) in one held-out sample, for evaluate(max_items)
    eval_batch_size: int = 256  # held-out samples per forward pass in evaluate

    # ----------------------------------------------------------------- what subclasses implement
    @abc.abstractmethod
    def describe(self) -> str:
        """One line: the dataset actually used (with sizes) and the model with its parameter count."""

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
        return shard_indices(f"{self.name}.shard_indices", self._num_train(), rank, world)

    def batches(self, rank: int, world: int, batch_size: int, seed: int) -> Iterator[Batch]:
        """Endless deterministic batches from this rank's shard, reshuffled each epoch (:func:`shard_order`)."""
        order = shard_order(f"{self.name}.batches", self._num_train(), rank, world, batch_size, seed)
        return (self._train_batch(idx) for idx in order)

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
