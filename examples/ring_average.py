"""Example: gossip averaging over a ring with nonblocking send/recv, checked against an oracle.

Run it with ``python examples/ring_average.py`` (4 local ranks).

Each rank starts from its own seeded tensor and repeatedly averages with its two ring neighbours
(nonblocking send/recv), i.e. ``x <- W x`` with the ring's doubly stochastic mixing matrix ``W``. Every
rank also rebuilds every rank's seeded inputs and computes ``W^k x`` itself (the single-process
oracle), and the job fails unless the distributed result matches it, the ranks approach consensus,
and an allreduce-average of the result equals the (preserved) global mean.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import lowband


def _initial(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)


def ring_matrix(n: int) -> torch.Tensor:
    """Mixing matrix of ``x_r <- mean(x_{r-1}, x_r, x_{r+1})`` on a ring of ``n`` (``n>=1``)."""
    w = torch.zeros(n, n, dtype=torch.float64)
    for r in range(n):
        for q in {(r - 1) % n, r, (r + 1) % n}:
            w[r, q] += 1.0
        w[r] /= w[r].sum()
    return w


def ring_average(steps: int, numel: int) -> dict[str, Any]:
    """Run on every rank (after ``lowband.init``): ``steps`` rounds of ring averaging, checked."""
    r, n = lowband.rank(), lowband.size()
    x = _initial(r, numel)
    left, right = (r - 1) % n, (r + 1) % n
    dists: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        if n > 1:
            # tag 0 travels rightwards, tag 1 leftwards (with n=2 both neighbours are the same rank)
            from_left = lowband.irecv(torch.empty_like(x), left, tag=0, name="ring.from_left")
            from_right = lowband.irecv(torch.empty_like(x), right, tag=1, name="ring.from_right")
            sends = [lowband.isend(x, right, tag=0), lowband.isend(x, left, tag=1)]
            xl, xr = from_left.wait(), from_right.wait()
            lowband.wait_all(sends)
            x = (xl + x + xr) / 3.0 if n > 2 else (xl + x) / 2.0
        mean = lowband.allreduce(x, name="ring.mean")
        dists.append(lowband.allreduce((x - mean).norm().pow(2), op="sum").sqrt().item())
    elapsed = time.perf_counter() - t0
    # the oracle: every rank's seeded input, mixed in one process
    x0 = torch.stack([_initial(q, numel) for q in range(n)])
    expect = torch.linalg.matrix_power(ring_matrix(n), steps) @ x0
    err = (x - expect[r]).abs().max().item()
    global_mean = x0.mean(0)
    mean_err = (lowband.allreduce(x) - global_mean).abs().max().item()
    return {"rank": r, "max_err_vs_oracle": err, "mean_err": mean_err, "consensus": dists, "seconds": elapsed}


def main(nprocs: int = 4, steps: int = 30, numel: int = 1 << 16) -> int:
    print(
        f"ring averaging: {nprocs} local ranks average float64 vectors of {numel} elements over a ring, {steps} rounds"
    )
    t0 = time.perf_counter()
    results = lowband.launch(ring_average, nprocs, (steps, numel))
    wall = time.perf_counter() - t0
    dists = results[0]["consensus"]
    for k in sorted({0, steps // 4, steps // 2, steps - 1}):
        print(f"  round {k + 1:3d}: distance to consensus {dists[k]:.3e}")
    worst = max(res["max_err_vs_oracle"] for res in results)
    worst_mean = max(res["mean_err"] for res in results)
    secs = max(res["seconds"] for res in results)
    ok = worst < 1e-9 and worst_mean < 1e-9 and (nprocs < 3 or dists[-1] < dists[0])
    print(f"  max |x - oracle W^k x0| over ranks: {worst:.2e}; max |mean - global mean|: {worst_mean:.2e}")
    print(f"  communication rounds took {secs:.2f} s; whole job (incl. start-up) {wall:.1f} s")
    print("  result: " + ("OK, every rank matches the single-process oracle" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
