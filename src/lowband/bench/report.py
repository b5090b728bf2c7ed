"""Reports of a bench run: the Markdown table printed at the end, and the PNG plots."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from lowband.bench.metrics import COMPUTE, loss_curve, smoothed


def tick_label(label: str, width: int = 22) -> str:
    """A strategy's label for a bar's tick: the name on one line, its options below, one per line,
    long options (nested specs) cut after their ``:`` and ``;``."""
    name, paren, rest = label.partition("(")
    lines = [name]
    opts = rest.rstrip(")").split(", ") if paren else []
    for i, opt in enumerate(opts):
        line = ""
        for part in opt.replace(";", ";\x00").replace(":", ":\x00").split("\x00"):
            if line and len(line) + len(part) > width:
                lines.append(line)
                line = ""
            line += part
        lines.append(line + ("," if i < len(opts) - 1 else ""))
    if paren:
        lines[1] = "(" + lines[1]
        lines[-1] += ")"
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _num(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _bytes(v: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def markdown_table(summary: dict[str, Any], unit: str) -> str:
    rows = summary["strategies"]
    baselines = sorted({b for r in rows.values() for b in r["speedup_vs"]})
    head = [
        "strategy", "iter ms median [min-max]", f"{unit}/s", "sent/rank/step", "compute ms",
        "comm not overlapped ms", "bound ms", "efficiency", "final loss", "eval acc",
        f"time to loss {summary['target_loss']:.3f} (s)",
    ] + [f"speed-up vs {b}" for b in baselines]  # fmt: skip
    tacc = summary.get("target_accuracy")
    with_pred = any(r.get("predicted_iter_time") for r in rows.values())
    with_acc = tacc is not None
    if tacc is not None:
        head.append(f"time to acc {tacc * 100:.1f}% (s)")
    if with_pred:
        head += ["predicted ms", "measured/predicted", "profiling s", "time to loss w/o profiling (s)"]
    with_bd = any((r.get("breakdown") or {}).get("source") == "measured" for r in rows.values())
    if with_bd:
        head.append("compute / compression / comm ms (* inferred)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.values():
        acc = r["eval_accuracy"]
        cells = [
            r["label"],
            f"{_ms(r['iter_time_median'])} [{_ms(r['iter_time_min'])}-{_ms(r['iter_time_max'])}]",
            f"{r['throughput']:.0f}",
            _bytes(r["bytes_sent_per_rank_step"]),
            _ms(r["compute_time"]),
            _ms(r["comm_not_overlapped"]),
            _ms(r["bound"]),
            _num(r["efficiency"], "{:.2f}"),
            _num(r["final_train_loss"]),
            "-" if acc is None else f"{acc * 100:.1f}%",
            _num(r["time_to_target"], "{:.1f}"),
        ] + [_num(r["speedup_vs"].get(b), "{:.2f}x") for b in baselines]  # fmt: skip
        if with_acc:
            cells.append(_num(r.get("time_to_target_accuracy"), "{:.1f}"))
        if with_pred:
            cells += [_ms(r.get("predicted_iter_time")), _num(r.get("measured_over_predicted"), "{:.2f}")]
            cells += [_num(r.get("setup_time"), "{:.1f}"), _num(r.get("time_to_target_excl_setup"), "{:.1f}")]
        if with_bd:
            cells.append(_breakdown_cell(r.get("breakdown")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _breakdown_cell(b: dict[str, Any] | None) -> str:
    if b is None:
        return "-"
    star = "" if b["source"] == "measured" else "*"
    return f"{_ms(b['compute_s'])}{star} / {_ms(b['compression_s'])} / {_ms(b['comm_s'])}{star}"


def plot_breakdown(summary: dict[str, Any], path: Path, title: str) -> None:
    """Stacked bars per strategy: computation, compression on the critical path, communication not
    overlapped (measured on the training thread), or, for strategies that cannot measure it, the
    compute-only run and the rest of the iteration (hatched: inferred); a tick marks the job's
    iteration time (the slowest rank's pace, which a rank's own breakdown may fall short of)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["strategies"].values() if r.get("breakdown")]
    # horizontal bars: one row per strategy, its whole label readable beside it (first strategy on top)
    labels = [textwrap.fill(str(r["label"]), 64, break_long_words=False) for r in rows]
    height = sum(0.16 * (lab.count("\n") + 1) + 0.3 for lab in labels) + 1.6
    fig, ax = plt.subplots(figsize=(12, max(3.5, height)))
    ys = list(range(len(rows)))[::-1]
    colors = {"compute_s": "tab:green", "compression_s": "tab:orange", "comm_s": "tab:red"}
    names = {"compute_s": "computation", "compression_s": "compression (critical path)",
             "comm_s": "communication not overlapped"}  # fmt: skip
    left = [0.0] * len(rows)
    for part in ("compute_s", "compression_s", "comm_s"):
        for measured in (True, False):
            yy, ws, ls = [], [], []
            for i, r in enumerate(rows):
                b = r["breakdown"]
                if (b["source"] == "measured") != measured or b[part] is None:
                    continue
                yy.append(ys[i])
                ws.append(b[part] * 1e3)
                ls.append(left[i])
                left[i] += b[part] * 1e3
            if yy:
                ax.barh(yy, ws, left=ls, height=0.7, color=colors[part], alpha=1.0 if measured else 0.45,
                        hatch=None if measured else "//", edgecolor="white" if measured else "grey",
                        label=names[part] + ("" if measured else " (inferred: compute-only run)"))  # fmt: skip
    ax.scatter([r["iter_time_median"] * 1e3 for r in rows], ys, color="black", marker="|", s=400,
               zorder=3, label="iteration time (job pace, median)")  # fmt: skip
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel("ms per step")
    ax.set_title(f"where a step's time goes\n{title}", fontsize=9)
    handles, names_ = ax.get_legend_handles_labels()
    fig.legend(handles, names_, fontsize=7, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.9 / max(3.5, height), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_table(points: list[dict[str, Any]], baseline: str) -> str:
    """Speed-up over ``baseline`` per strategy (rows) and setting (columns), like the papers' Table 1."""
    settings = [p["setting"] for p in points]
    keys: list[str] = []
    for p in points:
        keys += [k for k in p["summary"]["strategies"] if k not in keys]
    lines = [
        f"| strategy (speed-up vs {baseline}) | " + " | ".join(settings) + " |",
        "|" + "---|" * (len(settings) + 1),
    ]
    for k in keys:
        cells = []
        for p in points:
            rows = p["summary"]["strategies"]
            base = next((b for b in rows if b.split(":")[0] == baseline or b == baseline), None)
            if k not in rows or base is None:
                cells.append("-")
            else:
                cells.append(f"{rows[base]['iter_time_median'] / rows[k]['iter_time_median']:.2f}x")
        label = next(
            p["summary"]["strategies"][k]["label"] for p in points if k in p["summary"]["strategies"]
        )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_all(
    raw: dict[str, Any], summary: dict[str, Any], out: Path, title: str, smooth: int = 10
) -> list[Path]:
    """loss.png (training loss vs time and vs steps), accuracy.png (held-out accuracy vs time, when the
    workload has one), iteration.png (bars), breakdown.png (stacked bars: computation, compression,
    communication per step), timeline.png (per rank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    runs = {k: v for k, v in raw["runs"].items() if k != COMPUTE}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs.values():
        curve = loss_curve(run)
        sm = smoothed([c[2] for c in curve], smooth)
        ax1.plot([c[1] for c in curve], sm, label=run["label"])
        ax2.plot([c[0] for c in curve], sm, label=run["label"])
    for ax, xl in ((ax1, "training time (s)"), (ax2, "step")):
        ax.axhline(summary["target_loss"], color="grey", ls=":", lw=1)
        ax.set_xlabel(xl)
        ax.set_ylabel(f"training loss (moving average of {smooth})")
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if any(ev.get("accuracy") is not None for run in runs.values() for ev in run["evals"]):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run in runs.values():
            pts = [
                (ev["wall"], ev["accuracy"] * 100) for ev in run["evals"] if ev.get("accuracy") is not None
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run["label"])
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(title)
        fig.tight_layout()
        paths.append(out / "accuracy.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    rows = summary["strategies"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    # the name on one line, its options below (long labels would run into each other)
    labels = [tick_label(str(r["label"])) for r in rows.values()]
    med = [r["iter_time_median"] * 1e3 for r in rows.values()]
    lo = [m - r["iter_time_min"] * 1e3 for m, r in zip(med, rows.values())]
    hi = [r["iter_time_max"] * 1e3 - m for m, r in zip(med, rows.values())]
    ax.bar(labels, med, yerr=[lo, hi], capsize=4, color="tab:blue", label="iteration (median, min-max)")
    if summary["compute_time"] is not None:
        ax.axhline(summary["compute_time"] * 1e3, color="tab:green", ls="--", label="computation only")
    bounds = [(r["bound"] or 0) * 1e3 for r in rows.values()]
    ax.scatter(labels, bounds, color="tab:red", marker="_", s=900, zorder=3, label="physical bound")
    ax.set_ylabel("ms per iteration")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, framealpha=0.9)
    fig.tight_layout()
    paths.append(out / "iteration.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if any(r.get("breakdown") for r in rows.values()):
        paths.append(out / "breakdown.png")
        plot_breakdown(summary, paths[-1], title)

    n = raw["world_size"]
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * n))
    colors = plt.get_cmap("tab10")
    allruns = list(raw["runs"].items())
    last_round = max(s["round"] for _, run in allruns for s in run["segments"])
    for i, (_, run) in enumerate(allruns):
        for seg in run["segments"]:
            if seg["round"] != last_round:
                continue
            for r in range(n):
                spans = [(s, e - s) for s, e in zip(seg["starts"][r], seg["ends"][r])]
                ax.broken_barh(
                    spans, (r - 0.4, 0.8), color=colors(i % 10), label=run["label"] if r == 0 else None
                )
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xlabel("time (s) - each bar is one training step; gaps are barriers and evaluation")
    ax.set_title(f"per-rank timeline of the last round - {title}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    paths.append(out / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
