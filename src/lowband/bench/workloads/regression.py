"""Seeded linear regression, ``y = X w* + noise`` with Gaussian ``X``, for decentralized optimization.

:func:`linreg_problem` gives the per-rank least-squares problems ``(A_r, b_r)`` (float64) that the
decentralized-optimization examples and their oracles use; :class:`LinRegWorkload` trains
``nn.Linear(dim, 1, bias=False)`` on the same kind of data like any other workload.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lowband.bench.workloads.base import Batch, DatasetWorkload, check_int, resolve_lr, seeded_init, to_device
from lowband.errors import InvalidArgumentError

NOISE_STD = 0.1


def linreg_data(
    seed: int, rows: int, dim: int, noise: float = NOISE_STD
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, b, w_star)`` in float64: Gaussian ``A`` (rows x dim) and ``w_star``, ``b = A w* + noise``.

    ``A`` has N(0, 1) entries and ``w_star`` N(0, 1/dim) entries, so ``b`` has about unit variance.
    """
    check_int("linreg_data", "seed", seed, minimum=0)
    check_int("linreg_data", "rows", rows, minimum=1)
    check_int("linreg_data", "dim", dim, minimum=1)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0:
        raise InvalidArgumentError(f"linreg_data: noise must be a number >= 0, got {noise!r}")
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(dim, generator=gen, dtype=torch.float64) / dim**0.5
    a = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    b = a @ w_star + noise * torch.randn(rows, generator=gen, dtype=torch.float64)
    return a, b, w_star


def linreg_problem(
    seed: int, n_ranks: int, rows_per_rank: int, dim: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-rank float64 problems ``[(A_r, b_r)]``: ``A_r`` is ``rows_per_rank x dim``, ``b_r`` a vector.

    Rank ``r`` holds rows ``r * rows_per_rank ...`` of one seeded data set of ``n_ranks * rows_per_rank``
    rows; the global objective is ``sum_r ||A_r x - b_r||^2`` (see :func:`least_squares`).
    """
    check_int("linreg_problem", "n_ranks", n_ranks, minimum=1)
    check_int("linreg_problem", "rows_per_rank", rows_per_rank, minimum=1)
    a, b, _ = linreg_data(seed, n_ranks * rows_per_rank, dim)
    m = rows_per_rank
    return [(a[r * m : (r + 1) * m].clone(), b[r * m : (r + 1) * m].clone()) for r in range(n_ranks)]


def least_squares(problem: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The minimiser of ``sum_r ||A_r x - b_r||^2`` over all ranks' rows (float64, shape ``(dim,)``)."""
    if not problem:
        raise InvalidArgumentError("least_squares: the problem has no ranks")
    a = torch.cat([a_r for a_r, _ in problem]).double()
    b = torch.cat([b_r for _, b_r in problem]).double()
    if a.dim() != 2 or b.shape != (a.shape[0],):
        raise InvalidArgumentError(
            f"least_squares: A must be 2-D and b match its rows, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    solution: torch.Tensor = torch.linalg.lstsq(a, b.unsqueeze(1), driver="gelsd").solution
    return solution.squeeze(1)


class LinRegWorkload(DatasetWorkload):
    """Linear regression: ``nn.Linear(dim, 1, bias=False)``, mean squared error, SGD with momentum 0.9.

    ``rows`` training rows and ``test_rows`` held-out rows come from one seeded data set
    (:func:`linreg_data` with ``data_seed``).
    """

    name = "linreg"
    unit = "samples"
    default_batch_size = 32

    def __init__(
        self, *, dim: int = 64, rows: int = 8192, test_rows: int = 2048, data_seed: int = 0, lr: float = 0.02
    ) -> None:
        self.default_lr = float(lr)  # options checked by the workload's schema (get_workload)
        self.dim = dim
        a, b, self.w_star = linreg_data(data_seed, rows + test_rows, dim)
        self.train_a, self.train_b = a[:rows], b[:rows]
        self.test_a, self.test_b = a[rows:], b[rows:]

    def full_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All training rows ``(A, b)`` in float64 (for an oracle)."""
        return self.train_a, self.train_b

    def optimum(self) -> torch.Tensor:
        """The least-squares weights on the whole training set, float64 ``(dim,)``."""
        return least_squares([self.full_data()])

    def describe(self) -> str:
        return (
            f"synthetic linear regression ({len(self.train_b)} train / {len(self.test_b)} test rows, "
            f"dim {self.dim}, "
            f"noise {NOISE_STD}), linear model {self.dim} params"
        )

    def build_model(self, seed: int) -> nn.Module:
        return seeded_init(f"{self.name}.build_model", lambda: nn.Linear(self.dim, 1, bias=False), seed)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params, lr=resolve_lr(f"{self.name}.make_optimizer", lr, self.default_lr), momentum=0.9
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = to_device(model, batch)
        return F.mse_loss(model(x), y)

    def items(self, batch: Batch) -> int:
        return int(batch[1].shape[0])

    def _num_train(self) -> int:
        return len(self.train_b)

    def _num_test(self) -> int:
        return len(self.test_b)

    def _train_batch(self, idx: torch.Tensor) -> Batch:
        return self.train_a[idx].float(), self.train_b[idx].float().unsqueeze(1)

    def _test_batch(self, idx: torch.Tensor) -> Batch:
        return self.test_a[idx].float(), self.test_b[idx].float().unsqueeze(1)

    def _eval_batch(self, model: nn.Module, batch: Batch) -> tuple[float, int | None]:
        x, y = to_device(model, batch)
        return float(F.mse_loss(model(x), y, reduction="sum")), None
