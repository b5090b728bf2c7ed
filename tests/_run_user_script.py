"""A user's training script for the ``lowband run`` tests: ``python _run_user_script.py MODE OUTDIR``.

MODE ``allreduce``: allreduce a 4 MiB float32 tensor twice (the bytes test). ``fail``: rank 1 raises
after init while rank 0 waits in a collective. ``stop``: rank 1 stops itself (SIGSTOP) while rank 0
waits. ``sleep``: every rank writes a marker, then sleeps (interrupted by the test). ``twohost``: the
two-machine layout (local and machine groups) and a few steps of a hierarchical strategy.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import lowband
from lowband.strategies import make_strategy

MIB = 2**20


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    lowband.init()
    r = lowband.rank()
    if mode == "allreduce":
        t = torch.ones(4 * MIB // 4, dtype=torch.float32)
        for _ in range(2):
            got = lowband.allreduce(t, op="sum")
            assert bool((got == lowband.size()).all())
    elif mode in ("fail", "stop"):
        if r == 1:
            if mode == "fail":
                raise RuntimeError("rank 1 fails on purpose")
            os.kill(os.getpid(), signal.SIGSTOP)
        lowband.allreduce(torch.ones(4), op="sum")
    elif mode == "sleep":
        (out / f"ready{r}").write_text(str(os.getpid()))
        time.sleep(300)
    elif mode == "twohost":
        twohost(out)
    lowband.shutdown()


def twohost(out: Path) -> None:
    r = lowband.rank()
    local = lowband.allreduce(torch.tensor([float(r)]), op="sum", group=lowband.local_group())
    mg = lowband.machine_group()
    across = lowband.allreduce(torch.tensor([float(r)]), op="sum", group=mg) if mg is not None else None
    g = torch.Generator().manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    s = make_strategy("hierarchical-atc", model, lambda p: torch.optim.SGD(p, lr=0.05))
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    losses = [s.train_step(lambda m: torch.nn.functional.mse_loss(m(x), y)) for _ in range(5)]
    s.close()
    info = {
        "rank": r,
        "local_rank": lowband.local_rank(),
        "local_size": lowband.local_size(),
        "machine_rank": lowband.machine_rank(),
        "machine_size": lowband.machine_size(),
        "addr": os.environ.get("LOWBAND_TESTBED_ADDR"),
        "local_sum": float(local[0]),
        "across_sum": None if across is None else float(across[0]),
        "losses": losses,
    }
    (out / f"rank{r}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
