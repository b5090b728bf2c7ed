"""The non-finite check's own time inside training: each strategy trains the fmnist-cnn on N ranks
(processes, gloo, loopback, one thread each) with the guard's two entry points timed, its per-unit
check (``NonFiniteGuard.check_``: before the average) and its per-step decision
(``NonFiniteGuard.decide``: the averages read, the flags exchanged where they must be).

A difference of a percent between two bench runs is below their noise on a small machine; the time
spent in the check itself is not. Prints, per strategy (the mean over ranks): ms per step, ms in
``check_`` and in ``decide`` per step, and their share of the step.

Usage::

    python benchmarks/nonfinite_insitu.py -n 4 ddp stage compressed ddp:on_nonfinite=off
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from lowband.bench.workloads import get_workload
from lowband.strategies import make_strategy
from lowband.testing import run_processes

WARMUP, STEPS = 5, 60


def _timed(spec: str) -> dict[str, float]:
    torch.set_num_threads(1)
    model = get_workload("fmnist-cnn").build_model(seed=0)
    name, _, opts = spec.partition(":")
    options: dict[str, Any] = dict(kv.split("=", 1) for kv in opts.split(",")) if opts else {}
    s = make_strategy(name, model, lambda ps: torch.optim.SGD(ps, lr=0.01), **options)
    spent = {"check": 0.0, "decide": 0.0}
    guard = s.nonfinite
    if guard is not None:

        def timed(fn: Any, key: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[key] += time.perf_counter() - t0

            return call

        guard.check_ = timed(guard.check_, "check")  # type: ignore[method-assign]
        guard.decide = timed(guard.decide, "decide")  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)

    def loss_fn(mod: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(mod(x), y)

    for _ in range(WARMUP):
        s.train_step(loss_fn)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        s.train_step(loss_fn)
    s.synchronize()
    total = time.perf_counter() - t0
    s.close()
    steps = WARMUP + STEPS
    return {
        "step": total / STEPS * 1e3,
        "check": spent["check"] / steps * 1e3,
        "decide": spent["decide"] / steps * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="ranks (processes)")
    ap.add_argument("specs", nargs="+", help="strategy specs, e.g. ddp or compressed:on_nonfinite=off")
    args = ap.parse_args()
    for spec in args.specs:
        res = run_processes(_timed, args.n, spec, timeout=600, backend="gloo", device="cpu")
        mean = {k: sum(r[k] for r in res) / len(res) for k in res[0]}
        share = (mean["check"] + mean["decide"]) / mean["step"] * 100
        print(
            f"{spec}: step {mean['step']:.1f} ms, check_ {mean['check']:.2f} ms, decide {mean['decide']:.2f} ms "
            f"per step ({share:.2f} % of the step)"
        )


if __name__ == "__main__":
    main()
