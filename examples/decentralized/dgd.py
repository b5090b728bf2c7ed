"""Decentralized gradient descent (DGD) for linear regression, paper §IV-A, Listing 1, Eq. (16)-(17).

    x_i <- sum_j w_ij (x_j - gamma * A_j^T (A_j x_j - b_j))

over the static exponential-2 graph. With a constant step DGD does not reach the centralized optimum: it
converges to a nearby fixed point (its bias shrinks with ``gamma``); Exact Diffusion and gradient tracking
remove that bias.

    torchrun --nproc-per-node 4 examples/decentralized/dgd.py     # or: python examples/decentralized/dgd.py
"""

from __future__ import annotations

from typing import Any

import torch
from common import DIM, ROWS, SEED, local_data, main, optimum, parser, relative_error, say

import lowband.compat.bluefog.torch as bf


def run(
    maxite: int = 150,
    step: float = 0.01,
    *,
    seed: int = SEED,
    rows: int = ROWS,
    dim: int = DIM,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run DGD on this rank (after ``bf.init()``). Returns ``x`` (``dim x 1``), every iterate
    (``maxite x dim``), the relative error to the centralized optimum per iteration and at the end."""
    A, b = local_data(bf.rank(), bf.size(), seed=seed, rows=rows, dim=dim)
    x_opt = optimum(bf.size(), seed=seed, rows=rows, dim=dim)
    gamma = step

    # Set topology as static exponential graph.
    G = bf.ExponentialTwoGraph(bf.size())
    bf.set_topology(G)

    x = torch.zeros(dim, 1, dtype=torch.float64)
    iterates, errors = [], []
    # DGD implementation
    for ite in range(maxite):
        grad_local = A.t().mm(A.mm(x) - b)  # compute local grad
        y = x - gamma * grad_local  # local update
        x = bf.neighbor_allreduce(y)  # partial averaging
        iterates.append(x.flatten())
        errors.append(relative_error(x, x_opt))
        if verbose and ite % max(1, maxite // 10) == 0:
            say(f"DGD iteration {ite:4d}: relative error on rank 0 {errors[-1]:.3e}")
    return {"x": x, "iterates": torch.stack(iterates), "errors": errors, "rel_error": errors[-1]}


if __name__ == "__main__":
    raise SystemExit(main(run, parser("DGD on decentralized linear regression", 150, 0.01).parse_args()))
