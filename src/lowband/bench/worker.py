"""One rank of a ``lowband bench`` run: ``python -m lowband.bench.worker CONFIG.json``.

Started by the runner on every rank (inside the testbed's network namespaces when shaped). All
strategies train side by side in this one process: each keeps its own model, optimizer and data
stream, and they take turns in rounds of ``steps_per_round`` steps (strategy A, B, C, compute-only, A,
B, C, ...), so slow drifts of the machine hit every strategy alike. Per step it records the step time
of every rank and the loss; per round the bytes that crossed this rank's link (kernel interface
counters) and a held-out evaluation (time excluded); at the end every rank's :meth:`Strategy.report`.
Rank 0 writes everything to ``raw.json``.

Device and precision (:mod:`lowband.bench.precision`): each rank computes on ``lowband.device()`` (bound
by ``lowband.init(device=--device)``); every model, the compute-only copy included, is moved there before
its strategy is made, batches inside the timed step; forward and loss run under autocast for bf16/fp16,
each strategy gets its own GradScaler for fp16; step times are taken with the device synchronised.
Evaluation runs in float32 (the parameters are float32: it measures the model, not the arithmetic).

Sharded strategies (parameters living on one rank only, :attr:`Strategy.shards`) shard the workload's
dense model themselves, so the compute-only copy is that dense model trained on the rank's own batches
with no communication; their evaluation is of the assembled model
(:meth:`Strategy.average_model`, collective, outside the timed steps), and the replica spread covers
the replicated parameters only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import lowband
from lowband.bench.config import BenchConfig
from lowband.bench.precision import autocast_loss, check_model_device, grad_scaler, move_batch, timed
from lowband.bench.workloads import Workload, get_workload
from lowband.errors import InvalidArgumentError
from lowband.strategies import Strategy, make_strategy, parse_strategy_spec
from lowband.strategies.registry import wants_probe
from lowband.testbed import read_iface_bytes

COMPUTE = "compute-only"
_BAD = "__not_json_able__"


class ComputeOnly(Strategy):
    """The same training step with no communication at all: measures computation time."""

    name = COMPUTE
    # fp16: torch's own scaler path on local gradients; the ranks never communicate, so no agreement
    no_grad_scaler_reason = None
    agree_found_inf = False

    def in_sync(self) -> bool:
        return False


@dataclass
class Run:
    key: str
    strategy: Strategy
    batches: Any
    segments: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    wall: float = 0.0  # training time so far (sum of step times of the slowest rank)


def _progress(done: int, total: int, what: str) -> None:
    if lowband.rank() == 0:
        print(f"@@progress {done} {total} {what}", flush=True)


def _iface_bytes() -> tuple[int, int]:
    return read_iface_bytes(os.environ.get("LOWBAND_TESTBED_IFNAME", "lo"))


def _gather(values: list[float]) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64)
    return lowband.allgather(t.unsqueeze(0)).tolist()  # type: ignore[no-any-return]


def gather_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective: every rank's :meth:`Strategy.report`, in rank order (as JSON, so it must be JSON-able)."""
    try:
        data = json.dumps(report).encode()
    except (TypeError, ValueError) as exc:  # still take part in the gather, then fail on every rank
        data = json.dumps({_BAD: f"{exc}"}).encode()
    mine = torch.tensor(list(data), dtype=torch.uint8)
    sizes = lowband.allgather(torch.tensor([mine.numel()], dtype=torch.int64)).tolist()
    flat = lowband.allgather(mine, sizes=sizes)
    out, pos = [], 0
    for n in sizes:
        out.append(json.loads(bytes(flat[pos : pos + n].tolist()).decode()))
        pos += n
    bad = [(r, rep[_BAD]) for r, rep in enumerate(out) if _BAD in rep]
    if bad:
        r, why = bad[0]
        raise InvalidArgumentError(f"Strategy.report on rank {r}: the report is not JSON-able: {why}")
    return out


def _segment(run: Run, wl: Workload, cfg: BenchConfig, rnd: int, epoch0: float) -> None:
    lowband.barrier()
    tx0, rx0 = _iface_bytes()
    starts, ends, losses, items = [], [], [], 0
    ahead = getattr(wl, "lookup_ids", None)  # the next batch's table ids, for strategies that prefetch
    nxt = next(run.batches) if cfg.steps_per_round else None
    dev = lowband.device()
    for k in range(cfg.steps_per_round):
        batch, nxt = nxt, (next(run.batches) if k + 1 < cfg.steps_per_round else None)
        with timed(dev) as t:
            on_dev = move_batch(batch, dev)
            loss = run.strategy.train_step(autocast_loss(wl.loss, on_dev, dev, cfg.precision))
            if ahead is not None and nxt is not None:
                run.strategy.lookahead(ahead(move_batch(nxt, dev)))
        starts.append(t[0] - epoch0)
        ends.append(t[1] - epoch0)
        losses.append(loss)
        items += wl.items(batch)
    run.strategy.synchronize()  # the last steps' overlapped communication: part of the round's work
    synced = time.perf_counter() - epoch0
    lowband.barrier()
    tx1, rx1 = _iface_bytes()
    all_starts, all_ends = _gather(starts), _gather(ends)
    all_synced = _gather([synced])
    all_losses = _gather(losses)
    wire = _gather([float(tx1 - tx0), float(rx1 - rx0)])
    n = lowband.size()
    # the job's pace: step k ends when the last rank ends it; the segment starts when the first rank
    # leaves the barrier, so the step times add up to the segment's wall-clock time
    prev = min(all_starts[r][0] for r in range(n)) if starts else 0.0
    step_times = []
    for k in range(len(starts)):
        end = max(all_ends[r][k] for r in range(n))
        step_times.append(max(0.0, end - prev))
        prev = max(prev, end)
    # what synchronize() waited for after the last step ended on the last rank (the tail of communication
    # a strategy overlaps with its next step; 0 for strategies with nothing in flight between steps)
    tail = max(0.0, max(s[0] for s in all_synced) - prev) if starts else 0.0
    mean_loss = [sum(all_losses[r][k] for r in range(n)) / n for k in range(len(starts))]
    first_step = run.strategy.steps - len(starts)
    run.segments.append(
        {
            "round": rnd,
            "first_step": first_step,
            "step_times": step_times,
            "loss": mean_loss,
            "sync_tail": tail,
            "wall_end": run.wall + sum(step_times) + tail,
            "items": items * n,
            "starts": all_starts,
            "ends": all_ends,
            "tx_bytes": [w[0] for w in wire],
            "rx_bytes": [w[1] for w in wire],
        }
    )
    run.wall += sum(step_times) + tail


def _evaluate(run: Run, wl: Workload, cfg: BenchConfig, rnd: int) -> None:
    s = run.strategy
    model = s.average_model(wl.build_model(cfg.seed).to(lowband.device())) if s.shards else s.local_module
    res = wl.evaluate(model, max_items=cfg.eval_items or 2**62)  # 0: the whole test set
    if res is None:  # the workload has no held-out evaluation (the same on every rank)
        return
    acc = -1.0 if res.accuracy is None else res.accuracy
    vals = lowband.allreduce(torch.tensor([res.loss, acc], dtype=torch.float64)).tolist()
    run.evals.append(
        {
            "round": rnd,
            "step": run.strategy.steps,
            "wall": run.wall,
            "loss": vals[0],
            "accuracy": None if res.accuracy is None else vals[1],
        }
    )


def run_worker(cfg: BenchConfig) -> dict[str, Any] | None:
    torch.set_num_threads(cfg.threads)
    if cfg.collectives is not None:
        from lowband.bench.collectives import run_collectives

        res = run_collectives(
            cfg.collectives,
            cfg.sizes,
            rounds=cfg.rounds,
            reps=cfg.reps,
            iface_bytes=_iface_bytes,
            progress=_progress,
        )
        res["testbed_shaped"] = os.environ.get("LOWBAND_TESTBED_SHAPED", "0") == "1"
        return res if lowband.rank() == 0 else None
    r, n = lowband.rank(), lowband.size()
    wl = get_workload(cfg.workload)
    bs = cfg.batch_size or wl.default_batch_size
    epoch0 = float(lowband.broadcast(torch.tensor([time.perf_counter()], dtype=torch.float64), root=0)[0])

    def make_opt(params: Any) -> torch.optim.Optimizer:
        return wl.make_optimizer(params, lr=cfg.lr)

    dev = lowband.device()
    runs: list[Run] = []
    for spec in [*cfg.strategies, COMPUTE]:
        model = wl.build_model(cfg.seed)
        check_model_device(f"lowband bench on rank {r}", model, dev.type)
        model.to(dev)  # before the strategy: DDP, hooks and state are made on the rank's device
        if spec == COMPUTE:
            strat: Strategy = ComputeOnly(model, make_opt(model.parameters()), lowband.world())
        else:
            name, options = parse_strategy_spec(spec)
            if wants_probe(name, options):  # auto profiles the model on the workload's first batch
                probe_batch = next(iter(wl.batches(r, n, bs, cfg.seed)))
                options["probe"] = lambda m, b=probe_batch: wl.loss(m, b)
            strat = make_strategy(name, model, make_opt, **options)
        scaler = grad_scaler(dev, cfg.precision)
        if scaler is not None:
            strat.set_grad_scaler(scaler)
        runs.append(Run(spec, strat, wl.batches(r, n, bs, cfg.seed)))
    total = cfg.rounds * len(runs) * cfg.steps_per_round  # progress counts training steps
    done = 0
    for rnd in range(cfg.rounds):  # the bar says what is being done now
        for run in runs:
            _progress(done, total, f"round {rnd + 1}/{cfg.rounds}: {run.key}")
            _segment(run, wl, cfg, rnd, epoch0)
            done += cfg.steps_per_round
            if run.key != COMPUTE:
                _progress(done, total, f"round {rnd + 1}/{cfg.rounds}: {run.key}: evaluating")
                _evaluate(run, wl, cfg, rnd)
    _progress(done, total, "training done: gathering the reports, closing the strategies")
    out: dict[str, Any] = {"runs": {}}
    for run in runs:
        in_sync = run.strategy.in_sync()
        reports = gather_reports(run.strategy.report())
        out["runs"][run.key] = {
            "name": run.strategy.name,
            "label": run.strategy.label(),
            "hparams": run.strategy.hparams(),
            "report": reports[0],
            "report_ranks": reports,
            "segments": run.segments,
            "evals": run.evals,
            "in_sync": in_sync,
            "replica_spread": run.strategy.replica_spread(),
            "params": sum(p.numel() for p in run.strategy.local_module.parameters()),
        }
        run.strategy.close()
    out.update(
        {
            "world_size": n,
            "batch_size": bs,
            "unit": wl.unit,
            "workload": wl.describe(),
            "workload_name": wl.name,
            "device": str(dev),
            "precision": cfg.precision,
            "testbed_shaped": os.environ.get("LOWBAND_TESTBED_SHAPED", "0") == "1",
            "iface": os.environ.get("LOWBAND_TESTBED_IFNAME", "lo"),
            "epoch0": epoch0,  # rank 0's perf_counter (CLOCK_MONOTONIC) at time 0 of starts/ends
        }
    )
    return out if r == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lowband.bench.worker CONFIG.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    cfg = BenchConfig.load(path)
    lowband.init(timeout=cfg.comm_timeout, device=cfg.device)
    try:
        out = run_worker(cfg)
        if out is not None:
            (path.parent / "raw.json").write_text(json.dumps(out))
    finally:
        lowband.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
