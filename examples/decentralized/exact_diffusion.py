"""Exact Diffusion for linear regression, paper Appendix A, Listing 6, Eq. (24)-(26).

    psi_i = x_i - gamma * A_i^T (A_i x_i - b_i)        (local update)
    phi_i = psi_i + x_i - psi_i_prev                    (bias correction)
    x_i   = sum_j w_ij phi_j                            (partial averaging)

over the static ring. The bias correction makes every rank reach the centralized least-squares optimum.

    torchrun --nproc-per-node 4 examples/decentralized/exact_diffusion.py
"""

from __future__ import annotations

from typing import Any

import torch
from common import DIM, ROWS, SEED, local_data, main, optimum, parser, relative_error, say

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util


def run(
    maxite: int = 100,
    step: float = 0.012,
    *,
    seed: int = SEED,
    rows: int = ROWS,
    dim: int = DIM,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run Exact Diffusion on this rank (after ``bf.init()``). Returns ``x`` and the relative error to
    the centralized optimum per iteration and at the end."""
    A, b = local_data(bf.rank(), bf.size(), seed=seed, rows=rows, dim=dim)
    x_opt = optimum(bf.size(), seed=seed, rows=rows, dim=dim)
    gamma = step

    # Set topology as static ring graph.
    G = topology_util.RingGraph(bf.size())
    bf.set_topology(G)

    x = torch.zeros(dim, 1, dtype=torch.float64)
    pre_psi = x.clone()  # so that the first phi is psi
    errors = []
    # ED implementation
    for ite in range(maxite):
        grad_local = A.t().mm(A.mm(x) - b)  # compute local grad
        psi = x - gamma * grad_local  # local update
        phi = psi + x - pre_psi  # bias correction
        x = bf.neighbor_allreduce(phi)  # partial averaging
        pre_psi = psi.clone()
        errors.append(relative_error(x, x_opt))
        if verbose and ite % max(1, maxite // 10) == 0:
            say(f"Exact Diffusion iteration {ite:4d}: relative error on rank 0 {errors[-1]:.3e}")
    return {"x": x, "errors": errors, "rel_error": errors[-1]}


if __name__ == "__main__":
    raise SystemExit(
        main(run, parser("Exact Diffusion on decentralized linear regression", 100, 0.012).parse_args())
    )
