"""A user's script for ``lowband run --keep-going --replacements 1`` (tests/test_peer_join.py): local
SGD (or ``STRATEGY=diloco``, ``flsgd-overlap``, ``atc``, ``awc``) with ``on_peer_loss=continue`` on a linear model; rank ``DIE`` kills itself at step 6 of the first
incarnation; its replacement (``LOWBAND_JOIN=1``) goes on from the step it was admitted at
(``strategy.steps``). ``JOIN_PERIOD`` gives the replacement another period, ``JOIN_OUT`` another model
(refused joins); ``STEPS`` the steps of the run; ``CKPT`` a folder for the checkpoint loop. Every rank
that ends writes ``OUT/rankR.json``: its parameters, its peer-loss events, the step it started at."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

import lowband
from lowband.checkpoint import Checkpointer
from lowband.strategies import make_strategy

folder = sys.argv[1]
lowband.init()
r = lowband.rank()
joining = os.environ.get("LOWBAND_JOIN") == "1"
torch.manual_seed(0)
m = torch.nn.Linear(8, int(os.environ.get("JOIN_OUT", "1")) if joining else 1)
period = int(os.environ.get("JOIN_PERIOD", "4")) if joining else 4
name = os.environ.get("STRATEGY", "localsgd")
opts: dict[str, Any] = {"on_peer_loss": "continue", "peer_settle": 0.5}
if name == "diloco":
    opts["inner_steps"] = period
elif name in ("atc", "awc"):  # neighbor averaging at every step, a global allreduce every 4th
    opts.update(allreduce_every=period, topology="ring")
else:
    opts["period"] = period
s = make_strategy(name, m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), **opts)
start = s.steps  # 0, or where a replacement was admitted
ckpt = Checkpointer(os.environ["CKPT"], every=8) if os.environ.get("CKPT") else None
if ckpt is not None:  # the documented loop: a replacement's resume returns where it was admitted
    start = ckpt.resume(s)
    assert start == s.steps, (start, s.steps)
# the last step averages: torch's averager after steps 1, 5, 9, ..., 101; diloco and flsgd-overlap after
# 4, 8, ..., 100; atc and awc allreduce after 4, 8, ..., 100
for step in range(start, int(os.environ.get("STEPS", "101" if name == "localsgd" else "100"))):
    if r == int(os.environ.get("DIE", "-1")) and step == 6 and not joining:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * r + step)
    x = torch.randn(4, 8, generator=g)

    def loss(mm: torch.nn.Module, x: torch.Tensor = x) -> torch.Tensor:
        out: torch.Tensor = mm(x).pow(2).mean()
        return out

    s.train_step(loss)
    if ckpt is not None:
        ckpt.maybe_save(s, step + 1)
    if s.group.size < lowband.size():  # the replacement needs a few seconds to start: the others train
        time.sleep(0.1)  # meanwhile (once it joined, or before the loss, no wait)
s.synchronize()
with open(os.path.join(folder, f"rank{r}.json"), "w") as f:
    json.dump({"params": [p.detach().flatten().tolist() for p in m.parameters()], "start": start,
               "events": s.report().get("peer_loss")}, f)  # fmt: skip
lowband.shutdown()
