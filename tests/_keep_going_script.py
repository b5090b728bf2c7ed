"""A user's script for ``lowband run --keep-going`` (tests/test_run_keep_going.py): local SGD with
``on_peer_loss=continue`` on a linear model; rank ``DIE`` kills itself (SIGKILL) or stops (SIGSTOP,
``HOW=stop``) at step 6; every rank that ends writes its parameters and its peer-loss report to
``OUT/rankR.json``."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch

import lowband
from lowband.strategies import make_strategy

folder = sys.argv[1]
lowband.init()
r = lowband.rank()
torch.manual_seed(0)
m = torch.nn.Linear(8, 1)
opts: dict[str, Any] = {"period": 4, "on_peer_loss": "continue", "peer_settle": 0.5}
if os.environ.get("HEARTBEAT"):
    opts["heartbeat"] = float(os.environ["HEARTBEAT"])
s = make_strategy("localsgd", m, torch.optim.SGD(m.parameters(), lr=0.1), **opts)
g = torch.Generator().manual_seed(r)
for step in range(17):  # torch's averager averages after steps 1, 5, 9, 13 and 17
    if r == int(os.environ.get("DIE", "-1")) and step == 6:
        os.kill(os.getpid(), signal.SIGSTOP if os.environ.get("HOW") == "stop" else signal.SIGKILL)
    x = torch.randn(4, 8, generator=g)

    def loss(mm: torch.nn.Module, x: torch.Tensor = x) -> torch.Tensor:
        out: torch.Tensor = mm(x).pow(2).mean()
        return out

    s.train_step(loss)
s.synchronize()
with open(os.path.join(folder, f"rank{r}.json"), "w") as f:
    json.dump({"params": [p.detach().flatten().tolist() for p in m.parameters()],
               "peer_loss": s.report().get("peer_loss")}, f)  # fmt: skip
lowband.shutdown()
