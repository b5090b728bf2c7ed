"""The PNG plots of a bench run, laid out to be read at a glance: strategies named as typed (wrapped at
their commas; numbered ``S1``, ``S2``, ... with shortened legend entries when specs are long, see
:mod:`lowband.bench.styles`), one colour, line style and marker per strategy in every plot (curves that
coincide stay visible), legends below the axes and inside the figure, target lines in the legend, titles
wrapped to the figure's width (matplotlib's constrained layout keeps text apart). Training time is on a
log axis when one strategy trains more than :data:`LOG_TIME_RATIO` times longer than another.

:func:`figures` builds them (for tests: nothing written); :func:`plot_all` writes them:

- ``loss.png``: training loss (moving average) against training time and against steps;
- ``accuracy.png``: held-out accuracy after each round (workloads that have one);
- ``iteration.png``: iteration time per strategy (median, min-max), its bound and the computation;
- ``breakdown.png``: where a step's time goes (computation, compression, communication);
- ``timeline.png``: the last round, one panel per strategy, one row per rank, each step split into
  computation, compression and communication (measured by strategies on the gradient stage, else
  inferred from the compute-only run: hatched).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowband.bench.metrics import COMPUTE, loss_curve, smoothed
from lowband.bench.styles import colors, full_labels, mark_every, plot_labels, styles, wrap_spec

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PARTS = {"compute_s": ("computation", "tab:green"), "compression_s": ("compression", "tab:orange"),
         "comm_s": ("communication", "tab:red")}  # fmt: skip
_BD_NAMES = {"compute_s": "computation", "compression_s": "compression (critical path)",
             "comm_s": "communication not overlapped"}  # fmt: skip
_WIDE = 12.0  # inches
#: training time on a log axis when the longest training is more than this many times the shortest
LOG_TIME_RATIO = 4.0

__all__ = ["LOG_TIME_RATIO", "colors", "fig_loss", "figures", "plot_all", "plot_breakdown", "step_parts",
           "wrap_spec"]  # fmt: skip


def _title(text: str, width_in: float, fontsize: float = 10) -> str:
    return textwrap.fill(text, max(20, int(width_in * 110 / fontsize)), break_long_words=False)


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained", dpi=110)


def _legend_below(fig: Figure, ax: Axes | None = None, width: int = 60) -> None:
    axes = [ax] if ax is not None else fig.axes
    seen: dict[str, Any] = {}
    for a in axes:
        for h, lab in zip(*a.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if not seen:
        return
    labels = [wrap_spec(lab, width) for lab in seen]
    longest = max(len(line) for lab in labels for line in lab.split("\n"))
    ncol = max(1, min(len(labels), int(fig.get_figwidth() * 11 / max(longest, 12))))
    fig.legend(list(seen.values()), labels, loc="outside lower center", ncol=ncol, fontsize=8)


def _legend_rows(n: int, keys: list[str], width: float) -> float:
    """Inches a legend of ``keys`` (plus ``n`` extra short entries) needs below the axes."""
    longest = max([len(line) for k in keys for line in wrap_spec(k, 60).split("\n")] + [12])
    ncol = max(1, min(len(keys) + n, int(width * 11 / longest)))
    lines = sum(wrap_spec(k, 60).count("\n") + 1 for k in keys) + n
    return 0.2 * (lines / ncol + 1) + 0.3


def _time_axis(ax: Axes, ends: list[float]) -> None:
    """Training time on ``ax``'s x axis, on a log scale when the longest of the strategies' training
    times (``ends``) is more than :data:`LOG_TIME_RATIO` times the shortest."""
    log = bool(ends) and min(ends) > 0 and max(ends) / min(ends) > LOG_TIME_RATIO
    if log:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.5, 2, 50: plain seconds
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("training time (s, log scale)" if log else "training time (s)")


def fig_loss(raw: dict[str, Any], summary: dict[str, Any], title: str, smooth: int) -> Figure:
    runs = {k: v for k, v in raw["runs"].items() if k != COMPUTE}
    keys = list(runs)
    st, names = styles(keys), plot_labels(keys)
    fig = _figure(_WIDE, 4.2 + _legend_rows(1, list(names.values()), _WIDE))
    ax1, ax2 = fig.subplots(1, 2)
    ends, seen = [], set()
    same = False  # whether some strategies' losses are identical at every step
    for key, run in runs.items():
        curve = loss_curve(run)
        sm = smoothed([c[2] for c in curve], smooth)
        same |= tuple(sm) in seen
        seen.add(tuple(sm))
        s = st[key]
        look = {"color": s.color, "ls": s.linestyle, "marker": s.marker, "ms": 4, "lw": 1.4,
                "markevery": mark_every(s, len(keys), len(curve))}  # fmt: skip
        ax1.plot([c[1] for c in curve], sm, label=names[key], **look)
        ax2.plot([c[0] for c in curve], sm, **look)
        ends += [curve[-1][1]] if curve else []
    target = summary["target_loss"]
    ax1.axhline(target, color="black", ls=":", lw=1.2, label=f"target loss {target:.3f}")
    ax2.axhline(target, color="black", ls=":", lw=1.2)
    _time_axis(ax1, ends)
    ax2.set_xlabel("step")
    for ax in (ax1, ax2):
        ax.set_ylabel(f"training loss (moving avg. of {smooth})")
        ax.grid(alpha=0.3)
    if same:
        ax2.set_title("strategies with identical losses share a curve (markers staggered)", fontsize=8)
    fig.suptitle(_title(title, _WIDE))
    _legend_below(fig, ax1)
    return fig


def fig_accuracy(raw: dict[str, Any], summary: dict[str, Any], title: str) -> Figure | None:
    runs = {k: v for k, v in raw["runs"].items() if k != COMPUTE}
    if not any(ev.get("accuracy") is not None for run in runs.values() for ev in run["evals"]):
        return None
    st, names = styles(list(runs)), plot_labels(list(runs))
    ends: list[float] = []
    width = 9.0
    fig = _figure(width, 4.2 + _legend_rows(1, list(names.values()), width))
    ax = fig.subplots()
    for key, run in runs.items():
        pts = [(ev["wall"], ev["accuracy"] * 100) for ev in run["evals"] if ev.get("accuracy") is not None]
        s = st[key]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=s.color, ls=s.linestyle, marker=s.marker,
                ms=5, label=names[key])  # fmt: skip
        ends += [pts[-1][0]] if pts else []
    if summary.get("target_accuracy") is not None:
        t = summary["target_accuracy"] * 100
        ax.axhline(t, color="black", ls=":", lw=1.2, label=f"target accuracy {t:.1f}%")
    _time_axis(ax, ends)
    ax.set_ylabel("held-out accuracy (%)")
    ax.grid(alpha=0.3)
    ax.set_title(_title(title, width), fontsize=10)
    _legend_below(fig, ax)
    return fig


def _rows_height(labels: list[str]) -> float:
    return sum(0.17 * (lab.count("\n") + 1) + 0.25 for lab in labels)


def fig_iteration(summary: dict[str, Any], title: str) -> Figure:
    rows = summary["strategies"]
    keys = list(rows)
    full = full_labels(keys)
    labels = [wrap_spec(full[k]) for k in keys]
    fig = _figure(_WIDE, _rows_height(labels) + 2.2)
    ax = fig.subplots()
    ys = list(range(len(keys)))[::-1]
    med = [rows[k]["iter_time_median"] * 1e3 for k in keys]
    lo = [m - rows[k]["iter_time_min"] * 1e3 for m, k in zip(med, keys)]
    hi = [rows[k]["iter_time_max"] * 1e3 - m for m, k in zip(med, keys)]
    ax.barh(ys, med, xerr=[lo, hi], capsize=3, height=0.6, color=[colors(keys)[k] for k in keys],
            label="iteration time (median, min-max over rounds)")  # fmt: skip
    bounded = [(rows[k]["bound"] * 1e3, y) for k, y in zip(keys, ys) if rows[k]["bound"] is not None]
    if bounded:
        bx, by = [b[0] for b in bounded], [b[1] for b in bounded]
        ax.scatter(bx, by, color="black", marker="|", s=300, zorder=3, label="bound (fastest possible)")
    if summary["compute_time"] is not None:
        ax.axvline(summary["compute_time"] * 1e3, color="tab:green", ls="--", label="computation only")
    right = max(m + h for m, h in zip(med, hi))
    for y, m in zip(ys, med):  # the medians in a column at the right, clear of bars and lines
        ax.text(right * 1.04, y, f"{m:.1f} ms", va="center", fontsize=8)
    ax.set_xlim(0, right * 1.16)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlabel("ms per training step")
    ax.set_title(_title(f"iteration time - {title}", _WIDE), fontsize=10)
    _legend_below(fig, ax)
    return fig


def fig_breakdown(summary: dict[str, Any], title: str) -> Figure | None:
    """Stacked bars per strategy: computation, compression on the critical path, communication not
    overlapped (measured on the training thread), or, for strategies that cannot measure it, the
    compute-only run and the rest of the iteration (hatched: inferred); a tick marks the job's
    iteration time (the slowest rank's pace, which a rank's own breakdown may fall short of)."""
    rows = {k: r for k, r in summary["strategies"].items() if r.get("breakdown")}
    if not rows:
        return None
    keys = list(rows)
    full = full_labels(list(summary["strategies"]))  # numbered as in the other plots
    labels = [wrap_spec(full[k]) for k in keys]
    fig = _figure(_WIDE, _rows_height(labels) + 2.4)
    ax = fig.subplots()
    ys = list(range(len(keys)))[::-1]
    left = [0.0] * len(keys)
    for part, (_, color) in PARTS.items():
        for measured in (True, False):
            yy, ws, ls = [], [], []
            for i, k in enumerate(keys):
                b = rows[k]["breakdown"]
                if (b["source"] == "measured") != measured or b[part] is None:
                    continue
                yy.append(ys[i])
                ws.append(b[part] * 1e3)
                ls.append(left[i])
                left[i] += b[part] * 1e3
            if yy:
                ax.barh(yy, ws, left=ls, height=0.6, color=color, alpha=1.0 if measured else 0.45,
                        hatch=None if measured else "//", edgecolor="white" if measured else "grey",
                        label=_BD_NAMES[part] + ("" if measured else " (inferred from the compute-only run)"))  # fmt: skip
    ax.scatter([rows[k]["iter_time_median"] * 1e3 for k in keys], ys, color="black", marker="|", s=300,
               zorder=3, label="iteration time (job pace, median)")  # fmt: skip
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlabel("ms per training step")
    ax.set_title(_title(f"where a step's time goes - {title}", _WIDE), fontsize=10)
    _legend_below(fig, ax)
    return fig


def plot_breakdown(summary: dict[str, Any], path: Path, title: str) -> None:
    """``breakdown.png`` alone (see :func:`fig_breakdown`); nothing is written without a breakdown."""
    fig = fig_breakdown(summary, title)
    if fig is not None:
        fig.savefig(path)


def _rank_breakdown(run: dict[str, Any], r: int) -> dict[str, Any] | None:
    reports = run.get("report_ranks") or []
    b = reports[r].get("breakdown") if r < len(reports) and isinstance(reports[r], dict) else None
    ok = isinstance(b, dict) and all(isinstance(b.get(k), list) for k in PARTS)
    return b if ok else None


def step_parts(
    run: dict[str, Any], seg: dict[str, Any], r: int, compute: float | None, is_compute: bool
) -> list[tuple[float, float, str, bool]]:
    """Rank ``r``'s steps in ``seg`` as (start, duration, part, measured) pieces, in seconds: the
    rank's own breakdown where it reported one, else the compute-only run's step time as computation
    and the rest of the step as communication (inferred)."""
    b = _rank_breakdown(run, r)
    out = []
    for k, (s, e) in enumerate(zip(seg["starts"][r], seg["ends"][r])):
        span = max(0.0, e - s)
        i = seg["first_step"] + k - int(b.get("first_step", 0)) if b else -1
        if b is not None and 0 <= i < len(b["compute_s"]):
            c = min(span, float(b["compute_s"][i]))
            z = min(span - c, float(b["compression_s"][i]))
            pieces = [("compute_s", c, True), ("compression_s", z, True), ("comm_s", span - c - z, True)]
        elif is_compute or compute is None:
            pieces = [("compute_s", span, is_compute)]
        else:
            c = min(span, compute)
            pieces = [("compute_s", c, False), ("comm_s", span - c, False)]
        t = s
        for part, d, measured in pieces:
            if d > 0:
                out.append((t, d, part, measured))
            t += d
    return out


def fig_timeline(raw: dict[str, Any], summary: dict[str, Any], title: str) -> Figure:
    n = raw["world_size"]
    runs = list(raw["runs"].items())
    last = max(s["round"] for _, run in runs for s in run["segments"])
    panel = 0.32 * n + 0.55
    fig = _figure(_WIDE, panel * len(runs) + 1.6)
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    drawn: set[tuple[str, bool]] = set()
    full = full_labels([k for k, _ in runs if k != COMPUTE])
    for ax, (key, run) in zip(axes, runs):
        seg = next((s for s in run["segments"] if s["round"] == last), None)
        if seg is None or not seg["starts"][0]:
            continue
        t0 = min(seg["starts"][r][0] for r in range(n))
        for r in range(n):
            groups: dict[tuple[str, bool], list[tuple[float, float]]] = {}
            for s, d, part, measured in step_parts(run, seg, r, summary["compute_time"], key == COMPUTE):
                groups.setdefault((part, measured), []).append((s - t0, d))
            for (part, measured), spans in groups.items():
                name, color = PARTS[part]
                first = (part, measured) not in drawn
                drawn.add((part, measured))
                ax.broken_barh(spans, (r - 0.38, 0.76), color=color, alpha=1.0 if measured else 0.45,
                               hatch=None if measured else "//", edgecolor="white" if measured else "grey",
                               linewidth=0.3,
                               label=(name + ("" if measured else " (inferred)")) if first else None)  # fmt: skip
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_title(full.get(key, key), fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("seconds since the strategy's turn began (last round); each bar is one step")
    fig.suptitle(_title(f"per-rank timeline - {title}", _WIDE))
    _legend_below(fig)
    return fig


def figures(raw: dict[str, Any], summary: dict[str, Any], title: str, smooth: int = 10) -> dict[str, Figure]:
    """Every plot of a run, by file name (those that do not apply are left out)."""
    out: dict[str, Figure | None] = {
        "loss.png": fig_loss(raw, summary, title, smooth),
        "accuracy.png": fig_accuracy(raw, summary, title),
        "iteration.png": fig_iteration(summary, title),
        "breakdown.png": fig_breakdown(summary, title),
        "timeline.png": fig_timeline(raw, summary, title),
    }
    return {k: v for k, v in out.items() if v is not None}


def plot_all(
    raw: dict[str, Any], summary: dict[str, Any], out: Path, title: str, smooth: int = 10
) -> list[Path]:
    """Writes every plot of :func:`figures` into ``out``; returns their paths."""
    paths = []
    for name, fig in figures(raw, summary, title, smooth).items():
        paths.append(out / name)
        fig.savefig(paths[-1])
    return paths
