"""From a bench run's raw per-step records to the figures reported (pure: no communication, no I/O).

Definitions (all per strategy, over the timed rounds, i.e. after ``warmup_rounds``):

- iteration time: the job's pace. Step k ends when the last rank ends it, and lasts from the end of
  step k-1 (the first from the moment the first rank leaves the round's barrier), so a round's step
  times add up to its wall-clock time. (Before 2026-11-23, commit 78648d9, it was the slowest rank's own
  step duration, which on oversubscribed cores counts every rank's scheduling jitter as the job's; DDP
  reads the same under both.) A round's mean is one sample (periodic strategies
  communicate in some steps only, so a per-step median would hide their synchronizations);
  reported as the median, min and max over rounds, and the overall mean. Every step of a round is
  counted, and so is the round's tail: the communication a strategy overlaps with its next step (a
  layer averaged or stepped in its next forward, delayed embedding rows) of the round's last step
  completes in ``synchronize()`` after it; that wait (``sync_tail``, from the last rank's last step end
  to the last rank's return from ``synchronize()``) is added to the round's time. A round's mean is
  (sum of its step times + its tail) / its steps, unbiased for periodic strategies whatever step of
  their period a round starts at. (2026-11-24 to 2026-11-26, from commit bc21209, a round's first step
  was left out instead, and no tail was counted: a periodic strategy whose rounds start with an
  averaging step, ``localsgd`` among them, had one averaging in every round uncounted, 3 in 19 steps
  instead of 4 in 20 at H = 5. Before 2026-11-24 every step was counted and no tail. Results saved
  before 2026-11-26 have no ``sync_tail``: they are read with every step counted, tail 0.)
- throughput: items (samples or tokens, all ranks) per second of training, over the same steps.
- bytes per rank per step: what crossed the rank's link according to the kernel's interface counters
  (IP packets, headers included); on unshaped loopback the counters of ``lo`` are shared by all ranks
  and are divided by the world size.
- computation time: the iteration time of the same training step with no communication at all.
- non-overlapped communication: iteration time - computation time (>= 0).
- physical bound: max(computation time, wire time), where the wire time is the longest any rank's link
  needs for that rank's bytes: max over ranks r of max(sent_r * 8 / up_r, received_r * 8 / down_r),
  each rank at its own link's rates (on heterogeneous links the busiest rank need not be the slowest);
  efficiency = bound / iteration time, at most 1: a step measured faster than the bound (the
  compute-only run, a separate measurement, was slower that time: noise) reads 1 and is flagged
  ``below_bound``.
- time to target loss: training time until the moving average of the training loss (window =
  ``smooth`` steps) first reaches the target; the default target is the worst of the strategies' final
  moving averages, so that every strategy reaches it.
- set-up time: a strategy's one-time work inside its first step (DreamDDP's lazy profile, from its
  report's ``profile_s``); the time to target loss is also given without it.
- time to target accuracy: training time at the first held-out evaluation (one per round) reaching the
  target accuracy; default target: the worst of the strategies' final accuracies.
- predicted vs measured: strategies with a cost model report ``predicted_step_s``; the table shows it and
  measured / predicted.
- speed-up vs B: B's iteration time / the strategy's, for each baseline B of the run found among its
  strategies (``--baselines``, default ddp and localsgd); a run with none of them is compared with its
  first strategy (:func:`speedups`).
- report: the strategy's own :meth:`lowband.strategies.Strategy.report` (rank 0's), carried unchanged.
- breakdown (seconds per step): for strategies that measure it on their training thread (those on the
  gradient stage report ``breakdown``: :mod:`lowband.strategies.breakdown`), computation, compression on
  the critical path and communication not overlapped, each the mean over the timed steps and over the
  ranks (``source = "measured"``); their sum is a rank's own step time, at most the job's pace. For the
  others (DDP and its hooks, whose communication runs inside torch's backward) only the split of the
  iteration time into the compute-only run's time and the rest is known (``source = "inferred"``,
  compression unknown: ``None``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

COMPUTE = "compute-only"

#: one rank's link rates in bits/s, (up, down); None where unshaped
Rates = tuple[float | None, float | None]


def _timed(run: dict[str, Any], warmup_rounds: int) -> list[dict[str, Any]]:
    segs = [s for s in run["segments"] if s["round"] >= warmup_rounds]
    return segs or run["segments"]


def round_seconds(seg: dict[str, Any]) -> float:
    """A round's training time: its step times plus its ``synchronize()`` tail (module docstring)."""
    return float(sum(seg["step_times"])) + float(seg.get("sync_tail", 0.0))


def round_means(run: dict[str, Any], warmup_rounds: int) -> list[float]:
    return [round_seconds(s) / len(s["step_times"]) for s in _timed(run, warmup_rounds) if s["step_times"]]


def loss_curve(run: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, training time in s, mean training loss over ranks) for every step."""
    out: list[tuple[int, float, float]] = []
    for seg in run["segments"]:
        wall = seg["wall_end"] - round_seconds(seg)
        for k, (dt, loss) in enumerate(zip(seg["step_times"], seg["loss"])):
            wall += dt
            out.append((seg["first_step"] + k + 1, wall, loss))
    return out


def smoothed(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def time_to_target(run: dict[str, Any], target: float, window: int) -> float | None:
    curve = loss_curve(run)
    for (_, wall, _), s in zip(curve, smoothed([c[2] for c in curve], window)):
        if s <= target:
            return wall
    return None


def time_to_accuracy(run: dict[str, Any], target: float | None) -> float | None:
    """Training time at the first evaluation whose accuracy reaches ``target`` (None if never)."""
    if target is None:
        return None
    for ev in run["evals"]:
        if ev.get("accuracy") is not None and ev["accuracy"] >= target - 1e-12:
            return float(ev["wall"])
    return None


def summarize(
    raw: dict[str, Any],
    *,
    warmup_rounds: int,
    rank_rates: Sequence[Rates] | None,
    bytes_sharing: int,
    baselines: list[str],
    target_loss: float | None = None,
    smooth: int = 10,
    target_accuracy: float | None = None,
) -> dict[str, Any]:
    """Every reported figure for every strategy of one run (see the module docstring).

    ``rank_rates[r]`` is the (up, down) rate available to rank ``r``'s counted bytes (its link's, or
    its share of a machine link its machine's ranks share); None when the links are unshaped.
    """
    runs = raw["runs"]
    if rank_rates is not None and len(rank_rates) != raw["world_size"]:
        raise ValueError(f"summarize: {len(rank_rates)} rank rates for {raw['world_size']} ranks")
    compute = statistics.median(round_means(runs[COMPUTE], warmup_rounds)) if COMPUTE in runs else None
    keys = [k for k in runs if k != COMPUTE]
    finals = {k: smoothed([c[2] for c in loss_curve(runs[k])], smooth)[-1] for k in keys}
    target = target_loss if target_loss is not None else max(finals.values())
    accs = [runs[k]["evals"][-1]["accuracy"] for k in keys if runs[k]["evals"]]
    if target_accuracy is None and accs and all(a is not None for a in accs):
        target_accuracy = min(accs)
    rows: dict[str, dict[str, Any]] = {}
    for k in keys:
        run = runs[k]
        segs = _timed(run, warmup_rounds)
        means = round_means(run, warmup_rounds)
        steps = sum(len(s["step_times"]) for s in segs)  # for the bytes (their counters span the round)
        seconds = sum(round_seconds(s) for s in segs)
        items = sum(s["items"] for s in segs)
        per_rank_tx = [
            sum(s["tx_bytes"][r] for s in segs) / steps / bytes_sharing for r in range(raw["world_size"])
        ]
        per_rank_rx = [
            sum(s["rx_bytes"][r] for s in segs) / steps / bytes_sharing for r in range(raw["world_size"])
        ]
        it = statistics.median(means)
        wire = wire_time(per_rank_tx, per_rank_rx, rank_rates)
        bound = max(compute or 0.0, wire)
        last_eval = run["evals"][-1] if run["evals"] else {}
        predicted = run.get("report", {}).get("predicted_step_s")
        setup = float(run.get("report", {}).get("profile_s") or 0.0)
        ttt = time_to_target(run, target, smooth)
        rows[k] = {
            "spec": k,  # the strategy as typed (-s)
            "label": run["label"],
            "iter_time_median": it,
            "iter_time_min": min(means),
            "iter_time_max": max(means),
            "iter_time_mean": seconds / steps,
            "throughput": items / seconds,
            "bytes_sent_per_rank_step": statistics.fmean(per_rank_tx),
            "bytes_received_per_rank_step": statistics.fmean(per_rank_rx),
            "compute_time": compute,
            "comm_not_overlapped": None if compute is None else max(0.0, it - compute),
            "wire_time": wire if rank_rates is not None else None,
            "bound": bound if bound > 0 else None,
            "efficiency": min(1.0, bound / it) if bound > 0 else None,
            "below_bound": bound > it,
            "final_train_loss": finals[k],
            "eval_loss": last_eval.get("loss"),
            "eval_accuracy": last_eval.get("accuracy"),
            "time_to_target": ttt,
            # one-time set-up inside the first step (DreamDDP's lazy profile), and the time to target
            # without it: in a long training run it is negligible, in a 100-step bench it is not
            "setup_time": setup,
            "time_to_target_excl_setup": None if ttt is None else max(0.0, ttt - setup),
            "train_time": run["segments"][-1]["wall_end"],
            "steps": run["segments"][-1]["first_step"] + len(run["segments"][-1]["step_times"]),
            "in_sync": run["in_sync"],
            "predicted_iter_time": predicted,
            "measured_over_predicted": it / predicted if predicted else None,
            "time_to_target_accuracy": time_to_accuracy(run, target_accuracy),
            "replica_spread": run["replica_spread"],
            "report": run.get("report", {}),
            "breakdown": breakdown(run, warmup_rounds, it, compute),
        }
    speedups(rows, baselines)
    return {
        "target_loss": target,
        "target_accuracy": target_accuracy,
        "compute_time": compute,
        "strategies": rows,
    }


def speedups(rows: dict[str, dict[str, Any]], baselines: Sequence[str]) -> list[str]:
    """Sets each row's ``speedup_vs`` (baseline's iteration time / the row's) and
    ``time_to_target_ratio_vs`` (baseline's time to target / the row's) against every baseline found
    among the rows (by key or strategy name); when none is, against the first row, so that a run
    without ``ddp`` still compares its strategies. Returns the baselines' keys. Pure: derived from the
    rows' ``iter_time_median`` and ``time_to_target`` (a saved summary's ratios can be rebuilt)."""
    found = [bk for bk in (_find(rows, b) for b in baselines) if bk is not None]
    bases = list(dict.fromkeys(found)) or list(rows)[:1]
    for k, row in rows.items():
        row["speedup_vs"] = {}
        row["time_to_target_ratio_vs"] = {}
        for bk in bases:
            if bk == k:
                continue
            row["speedup_vs"][bk] = rows[bk]["iter_time_median"] / row["iter_time_median"]
            t, tb = row["time_to_target"], rows[bk]["time_to_target"]
            row["time_to_target_ratio_vs"][bk] = tb / t if t and tb else None
    return bases


BREAKDOWN = ("compute_s", "compression_s", "comm_s")


def timed_mean(breakdowns: Sequence[dict[str, Any]], steps: Sequence[int]) -> dict[str, float] | None:
    """Each part's mean over the given step indices and over ranks (``breakdowns``: every rank's
    ``report["breakdown"]``: ``first_step`` and one value per step from it); None when no rank
    recorded any of those steps."""
    sums = dict.fromkeys(BREAKDOWN, 0.0)
    count = 0
    for b in breakdowns:
        k0 = int(b.get("first_step", 0))
        for s in steps:
            i = s - k0
            if 0 <= i < len(b.get("compute_s", [])):
                for k in BREAKDOWN:
                    sums[k] += float(b[k][i])
                count += 1
    return {k: v / count for k, v in sums.items()} if count else None


def breakdown(
    run: dict[str, Any], warmup_rounds: int, it: float, compute: float | None
) -> dict[str, Any] | None:
    """The row's breakdown (module docstring): measured if the strategy reports one, else inferred."""
    reports = run.get("report_ranks") or [run.get("report", {})]
    parts = [
        r["breakdown"]
        for r in reports
        if isinstance(r, dict)
        and isinstance(r.get("breakdown"), dict)
        and all(isinstance(r["breakdown"].get(k), list) for k in BREAKDOWN)
    ]
    if parts:
        steps = [s["first_step"] + k for s in _timed(run, warmup_rounds) for k in range(len(s["step_times"]))]
        mean = timed_mean(parts, steps)
        if mean is not None:
            return {"source": "measured", **mean}
    if compute is None:
        return None
    return {
        "source": "inferred",
        "compute_s": compute,
        "compression_s": None,
        "comm_s": max(0.0, it - compute),
    }


def wire_time(sent: Sequence[float], received: Sequence[float], rates: Sequence[Rates] | None) -> float:
    """Seconds the busiest link needs: max over ranks of that rank's bytes at that rank's rates."""
    if rates is None:
        return 0.0
    times = [0.0]
    for tx, rx, (up, down) in zip(sent, received, rates, strict=True):
        times += [tx * 8 / up] if up else []
        times += [rx * 8 / down] if down else []
    return max(times)


def _find(rows: dict[str, Any], name: str) -> str | None:
    """A baseline given by key ("localsgd:period=5") or by strategy name ("localsgd")."""
    if name in rows:
        return name
    matches = [k for k in rows if k.split(":")[0] == name]
    return matches[0] if matches else None
