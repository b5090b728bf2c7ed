"""Push-sum gradient tracking (Push-DIGing) over a time-varying directed graph, paper Appendix B,
Listing 7, Eq. (27)-(31).

At step ``k`` every rank sends to one out-neighbor of the 2-D mesh grid, in turn (the one-peer dynamic
topology), with column-stochastic push weights: it keeps ``1 / (1 + #destinations)`` of each quantity
and sends the same share to each destination. ``v`` corrects the bias of the non-doubly-stochastic
weights, so ``x = u / v`` reaches the centralized optimum on every rank.

    torchrun --nproc-per-node 4 examples/decentralized/push_sum_gradient_tracking.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from common import DIM, ROWS, SEED, local_data, main, optimum, parser, relative_error, say

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util


def Gradient_tracking_one_step(
    x: torch.Tensor,
    y: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    prev_grad_local: torch.Tensor,
    dynamic_neighbor_gen: Iterator[tuple[list[int], list[int]]],
    A: torch.Tensor,
    b: torch.Tensor,
    alpha: float = 1e-2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One iteration of Listing 7."""
    # Get the update weights
    dst_neighbors, src_neighbors = next(dynamic_neighbor_gen)
    src_weights = {r: 1.0 for r in src_neighbors}
    self_weight = 1 / (len(dst_neighbors) + 1)
    dst_weights = {r: self_weight for r in dst_neighbors}
    weights = {"self_weight": self_weight, "src_weights": src_weights, "dst_weights": dst_weights}

    # u update step: u_{k+1} = W^k (u_k - alpha * y_k)
    w = u - alpha * y
    u_new = bf.neighbor_allreduce(w, **weights)
    # v update: v_{k+1} = W^k v_{k} --- (correction weights)
    v_new = bf.neighbor_allreduce(v, **weights)
    # x update: x_{k+1} = u_{k+1} / v_{k+1} (element-wise division)
    x_new = u_new / v_new
    # y update step: y_{k+1} = W^k (y_k + grad f(x_{k+1}) - grad f(x_k))
    grad_local = A.t().mm(A.mm(x_new) - b)
    q = y + grad_local - prev_grad_local
    y_new = bf.neighbor_allreduce(q, **weights)
    return x_new, y_new, u_new, v_new, grad_local


def run(
    maxite: int = 150,
    step: float = 0.01,
    *,
    seed: int = SEED,
    rows: int = ROWS,
    dim: int = DIM,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run push-sum gradient tracking on this rank (after ``bf.init()``). Returns ``x``, ``v`` and the
    relative error to the centralized optimum per iteration and at the end."""
    A, b = local_data(bf.rank(), bf.size(), seed=seed, rows=rows, dim=dim)
    x_opt = optimum(bf.size(), seed=seed, rows=rows, dim=dim)

    # Set up grid topology
    bf.set_topology(topology_util.MeshGrid2DGraph(bf.size()))
    # Set up one-peer variant of the grid topology
    dynamic_neighbor_gen = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())

    x = torch.zeros(dim, 1, dtype=torch.float64)
    u, y, prev_grad_local = x.clone(), x.clone(), x.clone()
    v = torch.ones(dim, 1, dtype=torch.float64)
    errors = []
    for ite in range(maxite):
        x, y, u, v, prev_grad_local = Gradient_tracking_one_step(
            x, y, u, v, prev_grad_local, dynamic_neighbor_gen, A, b, alpha=step
        )
        errors.append(relative_error(x, x_opt))
        if verbose and ite % max(1, maxite // 10) == 0:
            say(f"push-sum gradient tracking iteration {ite:4d}: relative error on rank 0 {errors[-1]:.3e}")
    return {"x": x, "v": v, "errors": errors, "rel_error": errors[-1]}


if __name__ == "__main__":
    description = "Push-sum gradient tracking over a time-varying directed graph"
    raise SystemExit(main(run, parser(description, 150, 0.01).parse_args()))
