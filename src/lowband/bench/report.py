"""Tables of a bench run: the compact one printed in the terminal, the full one in ``results.md`` with
its legend, and the sweep table. Strategies are shown as typed on the command line (``-s``), with the
numbers the plots give them when their specs are too long for a plot legend
(:mod:`lowband.bench.styles`); a figure that does not apply reads ``-``. The plots are
:mod:`lowband.bench.plots`. :func:`replot` redraws a finished run's plots and ``results.md`` from its
``results.json`` (``lowband bench --replot DIR``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowband.bench.metrics import speedups
from lowband.bench.plots import plot_all, plot_breakdown
from lowband.bench.styles import numbers
from lowband.errors import InvalidArgumentError

__all__ = ["bench_title", "legend", "markdown_table", "plot_all", "plot_breakdown", "replot",
           "results_markdown", "sweep_table", "terminal_table"]  # fmt: skip


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _num(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def _bytes(v: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _spec(key: str, row: dict[str, Any]) -> str:
    return str(row.get("spec", key))


def _eff(r: dict[str, Any]) -> str:
    return _num(r["efficiency"], "{:.2f}") + ("*" if r.get("below_bound") else "")


def _acc(r: dict[str, Any]) -> str:
    acc = r["eval_accuracy"]
    return "-" if acc is None else f"{acc * 100:.1f}%"


def baselines_of(summary: dict[str, Any]) -> list[str]:
    """The strategies (keys) some row's speed-up is computed against, in the order of the rows."""
    used = {b for r in summary["strategies"].values() for b in r["speedup_vs"]}
    return [k for k in summary["strategies"] if k in used]


def _speedup(key: str, r: dict[str, Any], base: str | None) -> str:
    if base is None:
        return "-"
    return "1.00x" if key == base else _num(r["speedup_vs"].get(base), "{:.2f}x")


def terminal_table(summary: dict[str, Any]) -> str:
    """The compact table for the terminal: aligned columns, one row per strategy as typed."""
    rows = summary["strategies"]
    bases = baselines_of(summary)
    base = bases[0] if bases else None
    head = ["strategy", "iter ms", f"vs {base}" if base else "speed-up", "sent/step", "efficiency",
            "to target s", "accuracy"]  # fmt: skip
    body = [
        [
            _spec(k, r),
            _ms(r["iter_time_median"]),
            _speedup(k, r, base),
            _bytes(r["bytes_sent_per_rank_step"]),
            _eff(r),
            _secs(r["time_to_target"]),
            _acc(r),
        ]
        for k, r in rows.items()
    ]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def fmt(line: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

    out = [fmt(head), "  ".join("-" * w for w in widths), *(fmt(line) for line in body)]
    notes = [f"target: training loss {summary['target_loss']:.3f}; details and legend in results.md"]
    if any(r.get("below_bound") for r in rows.values()):
        notes.append("* measured below the bound (noise in the compute-only run): efficiency read as 1")
    return "\n".join(out + notes)


def markdown_table(summary: dict[str, Any], unit: str) -> str:
    """The full table of ``results.md`` (its columns are explained by :func:`legend`)."""
    rows = summary["strategies"]
    bases = baselines_of(summary)
    tacc = summary.get("target_accuracy")
    with_pred = any(r.get("predicted_iter_time") for r in rows.values())
    with_bd = any((r.get("breakdown") or {}).get("source") == "measured" for r in rows.values())
    nums = numbers(list(rows))
    head = [*(["plot"] if nums else []), "strategy", "iter ms median [min-max]", *[f"speed-up vs {b}" for b in bases], f"{unit}/s",
            "sent/rank/step", "received/rank/step", "compute ms", "comm not overlapped ms", "bound ms",
            "efficiency", "final train loss", "eval loss", "eval acc",
            f"time to loss {summary['target_loss']:.3f} (s)"]  # fmt: skip
    if tacc is not None:
        head.append(f"time to acc {tacc * 100:.1f}% (s)")
    if with_pred:
        head += ["predicted ms", "measured/predicted", "set-up s", "time to loss w/o set-up (s)"]
    if with_bd:
        head.append("compute / compression / comm ms (* inferred)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, r in rows.items():
        cells = [
            *([nums[k]] if nums else []),
            f"`{_spec(k, r)}`",
            f"{_ms(r['iter_time_median'])} [{_ms(r['iter_time_min'])}-{_ms(r['iter_time_max'])}]",
            *[_speedup(k, r, b) for b in bases],
            f"{r['throughput']:.0f}",
            _bytes(r["bytes_sent_per_rank_step"]),
            _bytes(r.get("bytes_received_per_rank_step", 0.0)),
            _ms(r["compute_time"]),
            _ms(r["comm_not_overlapped"]),
            _ms(r["bound"]),
            _eff(r),
            _num(r["final_train_loss"]),
            _num(r.get("eval_loss")),
            _acc(r),
            _secs(r["time_to_target"]),
        ]
        if tacc is not None:
            cells.append(_secs(r.get("time_to_target_accuracy")))
        if with_pred:
            cells += [_ms(r.get("predicted_iter_time")), _num(r.get("measured_over_predicted"), "{:.2f}")]
            cells += [_secs(r.get("setup_time")), _secs(r.get("time_to_target_excl_setup"))]
        if with_bd:
            cells.append(_breakdown_cell(r.get("breakdown")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _breakdown_cell(b: dict[str, Any] | None) -> str:
    if b is None:
        return "-"
    star = "" if b["source"] == "measured" else "*"
    return f"{_ms(b['compute_s'])}{star} / {_ms(b['compression_s'])} / {_ms(b['comm_s'])}{star}"


def legend(summary: dict[str, Any], unit: str, *, target_given: bool, shaped: bool) -> str:
    """What each column of :func:`markdown_table` is, how the targets were chosen, what ``-`` means."""
    tl, ta = summary["target_loss"], summary.get("target_accuracy")
    why = (
        "given by --target-loss"
        if target_given
        else "the worst final training loss, so every strategy reaches it"
    )
    items = [
        ("plot", "the strategy's number in the plots, whose legends shorten specs this long"),
        ("strategy", "as typed with -s; options not typed take their defaults (results.json has them all)"),
        ("iter ms", "the job's pace per training step: step k ends when the last rank ends it; median of "
                    "the timed rounds' means [min-max], a round's mean counting every step and the "
                    "synchronize() after its last (the communication a strategy overlaps with its next step)"),
        ("speed-up vs B", "B's iteration time / this strategy's (> 1: faster than B); B: the baselines "
                          "found in the run (--baselines), else its first strategy"),
        (f"{unit}/s", f"{unit} of all ranks trained per second"),
        ("sent, received /rank/step", "bytes through a rank's link per step (the kernel's counters, "
                                      "headers included, synchronize() at the round's end too; "
                                      "unshaped loopback: all ranks' bytes / ranks)"),
        ("compute ms", "the same step without any communication (the compute-only run)"),
        ("comm not overlapped ms", "iter ms - compute ms (>= 0)"),
        ("bound ms", "the fastest a step could be: max(compute ms, the busiest link's time for its bytes)"
                     + ("" if shaped else "; unshaped links have no rate, so the bound is compute ms")),
        ("efficiency", "bound / iter ms, at most 1 (1.00*: measured below the bound, noise in the "
                       "compute-only run)"),
        ("final train loss", "moving average of the training loss over the last steps, mean over ranks"),
        ("eval loss, eval acc", "held-out loss and accuracy of the (averaged) model after the last round"),
        (f"time to loss {tl:.3f}", f"training seconds until the moving-average loss first reaches the "
                                   f"target {tl:.3f} ({why})"),
    ]  # fmt: skip
    if ta is not None:
        items.append((f"time to acc {ta * 100:.1f}%", "training seconds until a held-out evaluation (one "
                      "per round) reaches the worst final accuracy of the strategies"))  # fmt: skip
    rows = summary["strategies"].values()
    with_pred = any(r.get("predicted_iter_time") for r in rows)
    with_bd = any((r.get("breakdown") or {}).get("source") == "measured" for r in rows)
    items += [
        ("predicted ms, set-up s", "a strategy's own cost model's step time, and its one-time set-up "
                                   "inside the first step (e.g. a profile); other strategies: -"),
        ("compute / compression / comm ms", "per step, measured on the training thread by strategies that "
                                            "can (* inferred from the compute-only run for the others)"),
        ("-", "the figure does not apply (no baseline, no accuracy for the workload, target not reached)"),
    ]  # fmt: skip
    nums = numbers(list(summary["strategies"]))
    items = [it for it in items if (with_pred or not it[0].startswith("predicted"))
             and (with_bd or not it[0].startswith("compute /")) and (nums or it[0] != "plot")]  # fmt: skip
    return "**Columns.**\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in items)


def sweep_table(points: list[dict[str, Any]], baseline: str) -> str:
    """Speed-up over ``baseline`` per strategy (rows) and setting (columns), like the papers' Table 1;
    when no setting has ``baseline``, over the first strategy."""
    settings = [p["setting"] for p in points]
    keys: list[str] = []
    for p in points:
        keys += [k for k in p["summary"]["strategies"] if k not in keys]
    if keys and not any(_find_base(p["summary"]["strategies"], baseline) for p in points):
        baseline = keys[0]
    lines = [
        f"| strategy (speed-up vs {baseline}) | " + " | ".join(settings) + " |",
        "|" + "---|" * (len(settings) + 1),
    ]
    for k in keys:
        cells = []
        for p in points:
            rows = p["summary"]["strategies"]
            base = _find_base(rows, baseline)
            if k not in rows or base is None:
                cells.append("-")
            else:
                cells.append(f"{rows[base]['iter_time_median'] / rows[k]['iter_time_median']:.2f}x")
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _find_base(rows: dict[str, Any], baseline: str) -> str | None:
    return next((b for b in rows if b.split(":")[0] == baseline or b == baseline), None)


def bench_title(results: dict[str, Any]) -> str:
    """The title of a run's plots and ``results.md``: workload, ranks, testbed."""
    cfg, raw = results["config"], results["raw"]
    return f"{raw.get('workload_name', cfg['workload'])}, {cfg['world_size']} ranks, {results['testbed']}"


def drift_note(changes: list[dict[str, Any]]) -> str:
    """The rate changes of a ``--rate-change`` run, for results.md (the table's bounds and efficiency
    use the links' initial rates, and its figures mix rounds before and after the changes)."""
    if not changes:
        return ""
    said = "; ".join(
        f"at {c['applied_s']:.1f} s after the launch"
        + (f" ({c['at_bench_s']:.1f} s on the steps' axis)" if "at_bench_s" in c else "")
        + f" machine m{c['machine']} {c['old']} -> {c['new']}"
        + (f" FAILED: {c['error']}" if "error" in c else "")
        for c in changes
    )
    return (
        f"\n\n**Link drift** (--rate-change): {said}. The table mixes rounds before and after; its bounds "
        "and efficiency use the initial rates (per-round times: results.json, raw segments)."
    )


def results_markdown(results: dict[str, Any], *, redrawn: bool = False) -> str:
    """``results.md`` of a training run: what was run, the table (:func:`markdown_table`) and its legend;
    ``results`` is what ``results.json`` holds. ``redrawn``: written by :func:`replot`, which says so
    (the figures are the run's, computed with the definitions of its day)."""
    cfg, raw, summary = results["config"], results["raw"], results["summary"]
    shaped = bool(results["shaped"])
    note = (
        f"\n\nRedrawn from results.json by `lowband bench --replot`: the figures are those of the run "
        f"started {results.get('started', '?')}, computed with the definitions of that day "
        "(src/lowband/bench/metrics.py dates each change); the column notes below are today's."
        if redrawn
        else ""
    )
    header = (
        f"### {bench_title(results)}\n\n{raw['workload']}; batch {raw['batch_size']}/rank; {cfg['rounds']} "
        f"rounds x {cfg['steps_per_round']} steps per strategy, alternated, first {cfg['warmup_rounds']} "
        f"round(s) untimed; on {results.get('device', 'cpu')} in {results.get('precision', 'fp32')}; "
        + (
            "evaluated on the whole test set"
            if cfg["eval_items"] == 0
            else f"evaluated on {cfg['eval_items']} held-out items"
        )
        + (
            ""
            if shaped
            else "\n\n**UNSHAPED** (loopback): " + results.get("testbed_reason", results["testbed"])
        )
        + note
        + drift_note(results.get("rate_changes") or [])
    )
    notes = legend(summary, raw["unit"], target_given=cfg.get("target_loss") is not None, shaped=shaped)
    return f"{header}\n\n{markdown_table(summary, raw['unit'])}\n\n{notes}\n"


def replot(out: Path) -> list[Path]:
    """Redraws the plots of the finished run in ``out`` from its ``results.json`` (measured figures as
    saved; the speed-ups rebuilt from them, :func:`lowband.bench.metrics.speedups`) and rewrites its
    ``results.md``; returns the files written. Nothing is run."""
    path = Path(out) / "results.json"
    if not path.is_file():
        raise InvalidArgumentError(
            f"lowband bench --replot: {path} not found; give the folder of a finished run (its --out)"
        )
    results = json.loads(path.read_text())
    cfg = results["config"]
    if cfg.get("collectives") is not None:
        from lowband.bench.collectives import plot_collectives

        plot = Path(out) / "collectives.png"
        plot_collectives(results["summary"], cfg["sizes"], plot, f"collectives, {cfg['world_size']} ranks, "
                         f"{results['testbed']}")  # fmt: skip
        return [plot]
    summary = results["summary"]
    speedups(summary["strategies"], cfg.get("baselines") or [])
    smooth = min(10, cfg["steps_per_round"])  # as the run's summary (lowband.bench.runner)
    paths = plot_all(results["raw"], summary, Path(out), bench_title(results), smooth=smooth)
    (Path(out) / "results.md").write_text(results_markdown(results, redrawn=True))
    return [*paths, Path(out) / "results.md"]
