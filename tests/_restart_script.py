"""A training loop written the documented way (``lowband.checkpoint.Checkpointer``), for the restart tests:
``python _restart_script.py MODE OUTDIR``, launched by ``lowband run --max-restarts``.

MODE ``none``: train 12 steps. ``step``: in the first attempt, rank 1 kills itself (SIGKILL) after
step 7's training. ``save``: in the first attempt, rank 0 kills itself while writing step 6's manifest
(the ranks' files are on disk, the set is incomplete). Each rank writes its final parameters to
``OUTDIR/final-rank{r}.pt``, the steps it started from to ``OUTDIR/starts-rank{r}.txt`` (with the wall
times at which each attempt's process began and had resumed, ``resumed-rank{r}.txt``), and the killed rank the time of its
death (``killed-at.txt``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import lowband
import lowband.checkpoint as ckpt_mod
from lowband.checkpoint import Checkpointer
from lowband.strategies import make_strategy

STEPS, EVERY = 12, 3


def main() -> None:
    began = time.time()
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    lowband.init()
    r, attempt = lowband.rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    s = make_strategy("compressed", model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                      compressor="topk:ratio=0.3")  # fmt: skip
    ckpt = Checkpointer(out / "ckpt", every=EVERY)
    if mode == "save" and attempt == 0 and r == 0:
        write = ckpt_mod._write_atomic

        def dies_at_step_6(path: Path, text: str) -> None:
            if path.parent.name == "step-000000006":
                os.kill(os.getpid(), signal.SIGKILL)
            write(path, text)

        ckpt_mod._write_atomic = dies_at_step_6  # type: ignore[assignment]
    start = ckpt.resume(s)
    with open(out / f"starts-rank{r}.txt", "a") as f:
        f.write(f"{start}\n")
    with open(out / f"resumed-rank{r}.txt", "a") as f:
        f.write(f"{start} {began} {time.time()}\n")
    for k in range(start, STEPS):
        data = torch.Generator().manual_seed(1000 * r + k)
        x, y = torch.randn(5, 6, generator=data), torch.randn(5, 2, generator=data)
        s.train_step(lambda m, x=x, y=y: ((m(x) - y) ** 2).mean())
        if mode == "step" and attempt == 0 and r == 1 and k + 1 == 7:
            (out / "killed-at.txt").write_text(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(s, k + 1)
    s.synchronize()
    torch.save([p.detach().clone() for p in model.parameters()], out / f"final-rank{r}.pt")
    lowband.shutdown()


if __name__ == "__main__":
    main()
