"""Shared pieces of the decentralized examples: the seeded linear-regression data of paper Eq. (15), its
centralized optimum, command-line options, and a launcher for torchrun or a plain ``python`` run.

Rank ``r`` of ``n`` holds rows ``r * rows ... (r + 1) * rows - 1`` of one seeded data set
(:func:`lowband.bench.workloads.linreg_problem`), as a ``rows x dim`` matrix ``A`` and a ``rows x 1`` column
``b`` (float64). Every algorithm minimises ``sum_r 1/2 ||A_r x - b_r||^2``, whose local gradient is
``A.t().mm(A.mm(x) - b)`` as in the paper's listings.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import lowband.compat.bluefog.torch as bf
from lowband.bench.workloads import least_squares, linreg_problem

SEED = 0
ROWS = 40
DIM = 5


def local_data(
    rank: int, size: int, *, seed: int = SEED, rows: int = ROWS, dim: int = DIM
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(A, b)``: ``A`` is ``rows x dim``, ``b`` a ``rows x 1`` column (float64)."""
    a, b = linreg_problem(seed, size, rows, dim)[rank]
    return a, b.unsqueeze(1)


def optimum(size: int, *, seed: int = SEED, rows: int = ROWS, dim: int = DIM) -> torch.Tensor:
    """The centralized least-squares solution over all ranks' rows, a ``dim x 1`` column (the oracle the
    examples measure their error against; every rank can rebuild it from the seed)."""
    return least_squares(linreg_problem(seed, size, rows, dim)).unsqueeze(1)


def relative_error(x: torch.Tensor, x_opt: torch.Tensor) -> float:
    """``||x - x_opt|| / ||x_opt||``."""
    return float(torch.linalg.norm(x - x_opt) / torch.linalg.norm(x_opt))


def say(message: str) -> None:
    """Print on rank 0 only."""
    if bf.rank() == 0:
        print(message, flush=True)


def parser(description: str, maxite: int, step: float) -> argparse.ArgumentParser:
    """Options shared by the linear-regression examples."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--maxite", type=int, default=maxite, help=f"iterations (default {maxite})")
    p.add_argument("--step", type=float, default=step, help=f"step size (default {step})")
    p.add_argument("--seed", type=int, default=SEED, help=f"data seed (default {SEED})")
    p.add_argument("--rows", type=int, default=ROWS, help=f"rows of A per rank (default {ROWS})")
    p.add_argument("--dim", type=int, default=DIM, help=f"unknowns (default {DIM})")
    return p


def main(run: Callable[..., dict[str, Any]], args: argparse.Namespace) -> int:
    """Initialise BlueFog (under torchrun every process is a rank; a plain ``python`` run is a world of
    one), run ``run(**vars(args))`` with progress printed, report, shut down."""
    bf.init()
    try:
        result = run(**vars(args), verbose=True)
        errs = bf.allgather(torch.tensor([result["rel_error"]], dtype=torch.float64))
        say(f"final relative error per rank: {', '.join(f'{e:.3e}' for e in errs.tolist())}")
    finally:
        bf.shutdown()
    return 0
