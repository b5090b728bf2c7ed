"""Asynchronous push-sum average consensus with windows, paper §IV-C, Listing 3, Eq. (19)-(21).

Every rank holds ``x_ext = [x, p]`` (``p`` the push-sum weight, initially 1) in a window. Without any
synchronization between ranks, each iteration accumulates ``x_ext / (outdegree + 1)`` into every
out-neighbor's window, keeps the same share (``self_weight``), and collects whatever has arrived in its own
window (``win_update_then_collect`` adds the buffers into ``x_ext`` and zeroes them, atomically). The total
of ``x_ext`` over all tensors and buffers never changes, so ``x / p`` converges to the exact average on
every rank, even though ranks run at different speeds (``--delay``: rank ``r`` sleeps ``r * delay``
seconds per iteration).

    torchrun --nproc-per-node 4 examples/decentralized/async_push_sum.py --delay 0.001
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import lowband.compat.bluefog.torch as bf


def initial_value(rank: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s seeded starting vector (float64)."""
    return torch.randn(dim, generator=torch.Generator().manual_seed(1000 * seed + rank), dtype=torch.float64)


def run(
    max_iters: int = 200, dim: int = 4, *, delay: float = 0.0, seed: int = 0, verbose: bool = False
) -> dict[str, Any]:
    """Run asynchronous push-sum on this rank (after ``bf.init()``). Returns this rank's estimate
    ``x / p``, ``x``, ``p`` and the iterations it made."""
    x = initial_value(bf.rank(), dim, seed)
    p = torch.DoubleTensor([1.0]).to(x.device)  # associated p for correction
    x_ext = torch.cat([x, p], 0)
    bf.win_create(x_ext, name="x_ext", zero_init=True)

    # Set up the weights through the push-style.
    outdegree = len(bf.out_neighbor_ranks())
    dst_weights = {rank: 1.0 / (outdegree + 1) for rank in bf.out_neighbor_ranks()}
    self_weight = 1 / (1 + outdegree)

    pause = delay * bf.rank()
    for i in range(max_iters):
        bf.win_accumulate(
            x_ext, name="x_ext", self_weight=self_weight, dst_weights=dst_weights, require_mutex=True
        )
        bf.win_update_then_collect(name="x_ext")
        x, associated_p = x_ext[:-1], x_ext[-1]
        if pause:
            time.sleep(pause)  # ranks run at different speeds
        if verbose and bf.rank() == 0 and i % max(1, max_iters // 10) == 0:
            print(f"iteration {i:4d}: rank 0 estimate {(x / associated_p).tolist()}", flush=True)

    bf.barrier()  # Because different processes may end in different time.
    bf.win_update_then_collect(name="x_ext")
    bf.win_free(name="x_ext")
    x, associated_p = x_ext[:-1], x_ext[-1]
    return {"estimate": x / associated_p, "x": x.clone(), "p": float(associated_p), "iterations": max_iters}


def main() -> int:
    ap = argparse.ArgumentParser(description="Asynchronous push-sum average consensus with windows")
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--dim", type=int, default=4)
    ap.add_argument("--delay", type=float, default=0.0, help="rank r sleeps r * delay s per iteration")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bf.init()
    try:
        res = run(args.max_iters, args.dim, delay=args.delay, seed=args.seed, verbose=True)
        exact = torch.stack([initial_value(r, args.dim, args.seed) for r in range(bf.size())]).mean(0)
        err = bf.allgather((res["estimate"] - exact).abs().max().view(1))
        if bf.rank() == 0:
            print(f"exact average {exact.tolist()}")
            print(f"max |x/p - average| per rank: {', '.join(f'{e:.2e}' for e in err.tolist())}")
    finally:
        bf.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
