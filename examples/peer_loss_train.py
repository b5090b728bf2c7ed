"""Example: training that goes on without a lost rank (``on_peer_loss=continue`` under ``lowband run
--keep-going``), on one of the bench's workloads.

    lowband run -n 4 --rate 100mbit --keep-going examples/peer_loss_train.py --out /tmp/pl --die-rank 2 --die-step 120
    lowband run -n 4 --keep-going examples/peer_loss_train.py --out /tmp/pl          # nobody dies
    lowband run -n 4 --rate 100mbit --keep-going --replacements 1 examples/peer_loss_train.py --out /tmp/pl \
        --die-rank 2 --die-step 120                                                  # and it is replaced

When a rank dies the survivors agree on the new membership at their next exchange and train on (the
strategy's group, ``strategy.group``, is then theirs); this script re-splits the data among them (the
lost rank's shard is shared out) as soon as it sees the group change. ``--die-rank R --die-step K``
makes rank R SIGKILL itself at the start of step K (after writing the time it died), so that
``benchmarks/peer_loss.py`` can measure how long the survivors take to go on. Each rank that ends
writes ``OUT/rankR.json``: its step end times and losses, the samples it trained on, the peer-loss
events, and the held-out loss of the members' averaged model (at the end, and at the steps of
``--eval-at``). Under ``lowband run --keep-going --replacements 1`` the lost rank's replacement joins
the others at their next exchange with a live member's state and trains on from ``strategy.steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowband
from lowband.bench.workloads import get_workload
from lowband.bench.workloads.base import Workload, mix_seed
from lowband.strategies import make_strategy
from lowband.strategies.base import Strategy
from lowband.strategies.registry import parse_strategy_spec


def averaged_eval(s: Strategy, wl: Workload, items: int) -> float:
    """The held-out loss of the members' averaged model (the model itself is left as it is). Averagings
    in flight are waited first: dreamddp's write into the parameters until the next forward."""
    s.synchronize()
    model = s.module
    saved = [p.detach().clone() for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat, group=s.group.pg)
    flat /= s.group.size
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    result = wl.evaluate(model, max_items=items)
    with torch.no_grad():
        for p, old in zip(model.parameters(), saved, strict=True):
            p.copy_(old)
    return float(result.loss) if result is not None else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-s", "--strategy", default="localsgd:period=20")
    ap.add_argument("-w", "--workload", default="shakespeare-gpt")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-items", type=int, default=2000)
    ap.add_argument(
        "--eval-at", default="", help="comma-separated steps to evaluate the averaged model after"
    )
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-step", type=int, default=-1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    began = time.time()
    lowband.init()
    rank = lowband.rank()
    torch.manual_seed(args.seed)
    wl = get_workload(args.workload)
    model = wl.build_model(args.seed)
    name, options = parse_strategy_spec(args.strategy)
    options.setdefault("on_peer_loss", "continue")
    s = make_strategy(name, model, lambda ps: wl.make_optimizer(ps), **options)
    eval_at = {int(x) for x in args.eval_at.split(",") if x}

    def shard(step: int) -> Iterator[Any]:  # this member's batches among the current members
        return iter(wl.batches(s.group.rank, s.group.size, args.batch, mix_seed(args.seed, step)))

    joining = os.environ.get("LOWBAND_JOIN") == "1"  # a replacement (lowband run --replacements)
    start = s.steps  # 0, or the step a replacement was admitted at
    members = s.group.ranks
    data = shard(start)
    ends, losses, items, evals = [], [], 0, {}
    for step in range(start, args.steps):
        if s.group.ranks != members:  # the membership changed: re-split the data among the members
            members = s.group.ranks
            data = shard(step)
        if rank == args.die_rank and step == args.die_step and not joining:
            with open(os.path.join(args.out, f"death{rank}.json"), "w") as f:
                json.dump({"rank": rank, "step": step, "time": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        batch = next(data)

        def loss_fn(m: nn.Module, batch: Any = batch) -> torch.Tensor:
            return wl.loss(m, batch)

        losses.append(s.train_step(loss_fn))
        ends.append(time.time())
        items += wl.items(batch)
        if step + 1 in eval_at:
            evals[step + 1] = averaged_eval(s, wl, args.eval_items)
    s.synchronize()
    final = averaged_eval(s, wl, args.eval_items)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"rank": rank, "members": list(s.group.ranks), "began": began, "start": start, "step_ends": ends,
             "losses": losses, "items": items, "evals": evals, "final_eval": final,
             "peer_loss": s.report().get("peer_loss", [])},
            f,
        )  # fmt: skip
    lowband.shutdown()


if __name__ == "__main__":
    main()
