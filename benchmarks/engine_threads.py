"""Threads per rank that lowband starts while strategies train: the peak, sampled after every backward
and every step, of this process's ``lowband-*`` helper threads (engine workers, the completion thread,
window receivers; not the ranks), divided by the number of ranks (thread ranks of one process).

    python benchmarks/engine_threads.py [-n 2] [--steps 20] [--out DIR]

Prints one line per strategy and writes ``engine-threads.json`` to ``--out`` (if given). A report, not
a speed benchmark: it runs on a busy machine too.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowband
from lowband.strategies import make_strategy
from lowband.teardown import lowband_threads
from lowband.testing import run_threads

SPECS: list[tuple[str, dict[str, Any]]] = [
    ("localsgd", {"period": 2}),
    ("slimgc", {"comm_threshold": 0, "pre_steps": 2}),
    ("embrace", {"schedule": "2d", "overlap": True}),
    ("embrace", {"schedule": "vertical", "overlap": True}),
    ("dreamddp", {"period": 2, "trial_periods": 0}),
    ("winput", {"period": 2}),
]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 7).long() % 64
        return self.head(self.emb(ids).mean(1))  # type: ignore[no-any-return]


def _train(name: str, options: dict[str, Any], steps: int) -> int:
    torch.manual_seed(0)
    m = _Model()
    lazy = name == "embrace" and options.get("schedule") in ("vertical", "2d")
    s = make_strategy(
        name, m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.0 if lazy else 0.9), **options
    )
    peak = len(lowband_threads())
    g = torch.Generator().manual_seed(lowband.rank())
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        s.zero_grad()
        s.backward(((s.module(x) - y) ** 2).mean())
        peak = max(peak, len(lowband_threads()))
        s.step()
        peak = max(peak, len(lowband_threads()))
    s.close()
    return peak


def _pending_thens(count: int) -> int:
    """``count`` receives with a ``then`` each, pending until the peer sends (works without a future)."""
    r, peak = lowband.rank(), 0
    if r == 0:
        hs = [lowband.irecv(torch.zeros(1), 1, tag=i).then(lambda t: None) for i in range(count)]
        lowband.barrier()
        peak = len(lowband_threads())
        lowband.barrier()
        for h in hs:
            h.wait()
    else:
        lowband.barrier()
        lowband.barrier()
        for i in range(count):
            lowband.send(torch.ones(1), 0, tag=i)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="ranks (threads of this process)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="", help="folder for engine-threads.json")
    ns = ap.parse_args()
    rows = []
    for name, options in SPECS:
        peak = max(run_threads(functools.partial(_train, name, options, ns.steps), ns.n, timeout=300))
        spec = name + "".join(f":{k}={v}" for k, v in options.items())
        rows.append({"strategy": spec, "ranks": ns.n, "peak_helper_threads": peak, "per_rank": peak / ns.n})
        print(f"{spec:55s} peak lowband threads {peak} ({peak / ns.n:g} per rank)", flush=True)
    peak = max(run_threads(functools.partial(_pending_thens, 50), 2, timeout=300))
    rows.append({"strategy": "50 pending Handle.then of receives", "ranks": 2, "peak_helper_threads": peak})
    print(f"{'50 pending Handle.then of receives (2 ranks)':55s} peak lowband threads {peak}", flush=True)
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "engine-threads.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
