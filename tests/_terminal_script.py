"""A user's script for the terminal-output tests: ``python _terminal_script.py MODE OUTDIR``.

``typo``: every rank asks ``make_strategy`` for a strategy that does not exist. ``kill``: ranks train
DDP; rank 1 kills itself with SIGKILL after a few steps. ``wait``: every rank writes its pid to
``OUTDIR/pidR``, then allreduces in a loop (a test stops one from outside); ``stop``: the same, and
rank 1 stops itself (SIGSTOP). ``threads``: every rank writes the threads it computes with to
``OUTDIR/threadsR.json``.

``wait`` and ``stop`` meet on files before ``lowband.init``, so that a short ``--timeout`` (the tests'
3 s, which init's rendezvous obeys too) is not spent on ranks still importing torch on a busy machine.
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


def _meet(out: Path) -> None:
    """Wait (bounded) until every rank has started: its pid file is there."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (out / f"pid{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not all((out / f"pid{r}").exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode in ("wait", "stop"):
        _meet(out)
    lowband.init()
    r = lowband.rank()
    print(f"rank {r} started", flush=True)
    if mode == "typo":
        model = torch.nn.Linear(4, 1)
        make_strategy("ddpp", model, torch.optim.SGD(model.parameters(), lr=0.1))
    elif mode == "kill":
        model = torch.nn.Linear(4, 1)
        s = make_strategy("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(8, 4)
        for step in range(100_000):
            s.train_step(lambda m: m(x).square().mean())
            if step == 3 and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
    elif mode in ("wait", "stop"):
        lowband.barrier()
        (out / f"ready{r}").write_text("")
        if mode == "stop" and r == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lowband.allreduce(torch.ones(4), op="sum")
            time.sleep(0.02)
    elif mode == "threads":
        info = {"omp": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}
        (out / f"threads{r}.json").write_text(json.dumps(info))
    lowband.shutdown()


if __name__ == "__main__":
    main()
