"""The rank script of ``benchmarks/checkpoint_kills.py``: a workload trained with the documented
checkpoint loop (:class:`lowband.checkpoint.Checkpointer`) under ``lowband run --max-restarts``, in
which one rank SIGKILLs itself once per attempt at a moment drawn from ``(seed, attempt)``: during a
step's backward, half-way through writing its own checkpoint file, or (rank 0) with the manifest
written to its temporary file but not renamed. Every rank draws the same plan.

``OUT/attempts.jsonl`` gets one line per rank and attempt: the complete sets on disk when it started,
the step it resumed from, its start and resume times; the killer writes ``OUT/kill-A.json`` (attempt
``A``: rank, step, where, time) just before it dies; every rank writes its final parameters to
``OUT/final-rankR.pt``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowband
import lowband.checkpoint as ckpt_mod
from lowband.bench.workloads import get_workload
from lowband.checkpoint import Checkpointer, complete_sets
from lowband.strategies import make_strategy
from lowband.strategies.registry import parse_strategy_spec

WHERE = ("backward", "backward", "backward", "backward", "rank-file", "manifest")


def _die(out: Path, attempt: int, what: dict[str, Any]) -> None:
    with open(out / f"kill-{attempt}.json", "w") as f:
        json.dump({**what, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    began = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("-s", "--strategy", default="localsgd:period=20")
    ap.add_argument("-w", "--workload", default="shakespeare-gpt")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--kills", type=int, default=20, help="attempts that end in a kill (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lowband.init()
    rank, size = lowband.rank(), lowband.size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    wl = get_workload(args.workload)
    model = wl.build_model(args.seed)
    name, options = parse_strategy_spec(args.strategy)
    s = make_strategy(name, model, lambda ps: wl.make_optimizer(ps), **options)
    ckpt = Checkpointer(args.out / "ckpt", every=args.every)
    on_disk = complete_sets(ckpt.folder)
    start = ckpt.resume(s)
    with open(args.out / "attempts.jsonl", "a") as f:
        f.write(json.dumps({"attempt": attempt, "rank": rank, "complete_sets": on_disk, "resumed": start,
                            "began": began, "resumed_at": time.time()}) + "\n")  # fmt: skip

    plan: dict[str, Any] = {}
    if attempt < args.kills:
        pick = random.Random(args.seed * 1000 + attempt)
        where = pick.choice(WHERE)
        plan = {"rank": 0 if where == "manifest" else pick.randrange(size), "where": where,
                "step": min(args.steps, start + pick.randint(1, 25)), "attempt": attempt}  # fmt: skip
    killer = plan.get("rank") == rank
    if killer and plan["where"] == "rank-file":
        save = torch.save

        def half_then_die(obj: Any, f: Any, *a: Any, **k: Any) -> None:
            if s.steps < plan["step"]:
                save(obj, f, *a, **k)
                return
            buf = io.BytesIO()
            save(obj, buf, *a, **k)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            _die(args.out, attempt, plan)

        torch.save = half_then_die
    if killer and plan["where"] == "manifest":
        write = ckpt_mod._write_atomic

        def manifest_then_die(path: Path, text: str) -> None:
            if s.steps < plan["step"]:
                write(path, text)
                return
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            _die(args.out, attempt, plan)

        ckpt_mod._write_atomic = manifest_then_die  # type: ignore[assignment]

    data = iter(wl.batches(rank, size, args.batch, args.seed))
    for _ in range(start):  # the batches of the steps already done
        next(data)
    for k in range(start, args.steps):
        batch = next(data)
        handle = None
        if killer and plan["where"] == "backward" and k + 1 == plan["step"]:
            first = next(p for p in model.parameters() if p.requires_grad)
            handle = first.register_hook(lambda g: _die(args.out, attempt, plan))  # type: ignore[no-untyped-call]

        def loss_fn(m: nn.Module, batch: Any = batch) -> torch.Tensor:
            return wl.loss(m, batch)

        s.train_step(loss_fn)
        if handle is not None:
            handle.remove()
        ckpt.maybe_save(s, k + 1)
    s.synchronize()
    torch.save([p.detach().clone() for p in model.parameters()], args.out / f"final-rank{rank}.pt")
    lowband.shutdown()


if __name__ == "__main__":
    main()
