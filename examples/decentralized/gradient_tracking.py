"""Gradient tracking (adapt-then-combine DIGing) for linear regression over a static graph.

    x_i <- sum_j w_ij (x_j - alpha * y_j)
    y_i <- sum_j w_ij (y_j + grad_j(x_j new) - grad_j(x_j old)),      y_i(0) = grad_i(x_i(0))

``y_i`` tracks the average gradient, so with a doubly stochastic ``W`` (the exponential-2 graph with
uniform weights) every rank reaches the centralized optimum. The ``y`` update is started nonblocking and
overlapped with the error bookkeeping (paper §V-A, Listing 5).

    torchrun --nproc-per-node 4 examples/decentralized/gradient_tracking.py
"""

from __future__ import annotations

from typing import Any

import torch
from common import DIM, ROWS, SEED, local_data, main, optimum, parser, relative_error, say

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util


def run(
    maxite: int = 120,
    step: float = 0.01,
    *,
    seed: int = SEED,
    rows: int = ROWS,
    dim: int = DIM,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run gradient tracking on this rank (after ``bf.init()``). Returns ``x`` and the relative error to
    the centralized optimum per iteration and at the end."""
    A, b = local_data(bf.rank(), bf.size(), seed=seed, rows=rows, dim=dim)
    x_opt = optimum(bf.size(), seed=seed, rows=rows, dim=dim)
    alpha = step

    bf.set_topology(topology_util.ExponentialTwoGraph(bf.size()))

    x = torch.zeros(dim, 1, dtype=torch.float64)
    prev_grad_local = A.t().mm(A.mm(x) - b)
    y = prev_grad_local.clone()
    errors = []
    for ite in range(maxite):
        x = bf.neighbor_allreduce(x - alpha * y, name="x")
        grad_local = A.t().mm(A.mm(x) - b)
        handle = bf.neighbor_allreduce_nonblocking(y + grad_local - prev_grad_local, name="y")
        errors.append(relative_error(x, x_opt))  # overlapped with the communication of y
        prev_grad_local = grad_local
        y = bf.wait(handle)
        if verbose and ite % max(1, maxite // 10) == 0:
            say(f"gradient tracking iteration {ite:4d}: relative error on rank 0 {errors[-1]:.3e}")
    return {"x": x, "errors": errors, "rel_error": errors[-1]}


if __name__ == "__main__":
    raise SystemExit(
        main(run, parser("Gradient tracking on decentralized linear regression", 120, 0.01).parse_args())
    )
