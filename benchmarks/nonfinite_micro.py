"""The non-finite check's variants timed in one process on the fmnist-cnn's gradients (532,458 float32
in 8 tensors; the stage's two units, DDP's one bucket), one thread, microseconds per call, median of
``-n`` calls. ``warm``: the gradients in cache; ``cold``: a 64 MB buffer written between calls (as a
step's activations evict them). Each variant is timed with the pass it can ride (a division by the
group size, 4) where it rides one, so "check" rows compare with the plain reduction rows.

Usage::

    python benchmarks/nonfinite_micro.py -n 400
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from lowband.optim.finite import any_nonfinite, poison_
from lowband.optim.scaling import check_scaled_

SIZES = [360, 40, 28800, 80, 501760, 128, 1280, 10]  # conv1, conv2, fc1, fc2 (weight, bias)
ONE = torch.ones(1)


def variants(grads: list[torch.Tensor], flat: torch.Tensor) -> dict[str, Callable[[], object]]:
    def isfinite_all() -> bool:
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def sums() -> bool:  # the CPU path before and after (per-tensor sums, read once on the host)
        return not any_nonfinite(grads)

    def amp_inv1() -> bool:  # torch's GradScaler kernel with a scale of 1: a read and a write
        f = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, f, ONE)
        return f.item() == 0

    def norm2() -> bool:  # can overflow (squares) like a sum
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))

    def norm_inf() -> bool:
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf)).sum()))

    def stack_sums() -> bool:
        return bool(torch.isfinite(torch.stack([g.sum() for g in grads]).sum()))

    def div_only() -> None:  # what DDP's hook / the plain average does anyway (no check)
        flat.div_(4)

    def old_ddp() -> None:  # before: a read (the sum) for the check, then the hook's division
        bad = any_nonfinite([flat])
        poison_(flat, torch.full((1,), float(bad)))
        flat.div_(4)

    def new_ddp() -> None:  # after: the division is the check
        poison_(flat, check_scaled_([flat], 0.25))

    def old_stage() -> None:  # before: read, fuse, (sum), divide, copy back, read the average
        any_nonfinite(grads)
        buf = torch.cat([g.reshape(-1) for g in grads])
        buf.div_(4)
        torch._foreach_copy_(grads, [a.view(g.shape) for a, g in zip(torch.split(buf, SIZES), grads)])
        any_nonfinite(grads)

    def new_stage() -> None:  # after: fuse, divide with the check, (sum), copy back, one element
        buf = torch.cat([g.reshape(-1) for g in grads])
        poison_(buf, check_scaled_([buf], 0.25))
        torch._foreach_copy_(grads, [a.view(g.shape) for a, g in zip(torch.split(buf, SIZES), grads)])
        any_nonfinite([buf[:1]])

    def plain_stage() -> None:  # the reduction's own passes, no check
        buf = torch.cat([g.reshape(-1) for g in grads])
        buf.div_(4)
        torch._foreach_copy_(grads, [a.view(g.shape) for a, g in zip(torch.split(buf, SIZES), grads)])

    return {
        "isfinite(g).all() per tensor": isfinite_all,
        "sum per tensor, one host read": sums,
        "torch.stack of sums": stack_sums,
        "_amp_foreach_..._unscale_ (scale 1)": amp_inv1,
        "_foreach_norm (2)": norm2,
        "_foreach_norm (inf)": norm_inf,
        "ddp bucket: div_ alone (no check)": div_only,
        "ddp bucket: before (sum, div_)": old_ddp,
        "ddp bucket: after (check_scaled_)": new_ddp,
        "stage units: plain (no check)": plain_stage,
        "stage units: before (read, avg, read)": old_stage,
        "stage units: after (fused, 1 element)": new_stage,
    }


def timed(fn: Callable[[], object], n: int, evict: torch.Tensor | None) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        if evict is not None:
            evict.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=400, help="calls per variant")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * 1e-3 for n in SIZES]
    flat = torch.cat(grads)
    evict = torch.zeros(16 * 1024 * 1024)
    print(f"{'variant':40s} {'warm us':>9s} {'cold us':>9s}")
    for name, fn in variants(grads, flat).items():
        warm, cold = timed(fn, args.n, None), timed(fn, args.n, evict)
        print(f"{name:40s} {warm:9.1f} {cold:9.1f}")
        flat.fill_(1e-3)  # (the divisions shrink it: keep it normal)
        for t in grads:
            t.fill_(1e-3)


if __name__ == "__main__":
    main()
