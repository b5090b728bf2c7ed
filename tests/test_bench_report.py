"""The bench's tables and plots on a synthetic results set with long strategy specs and on saved runs of
benchmarks/results: every plot renders with no text overlapping other text or leaving the figure, and
every legend inside the figure and off every axes' data area; long specs are numbered with shortened
legend entries (the full spec in results.md); identical curves get distinct styles; training time goes
on a log axis when one strategy trains far longer; tables name strategies as typed, cap the efficiency at
1, compare with the first strategy when no baseline ran, and write '-' where a figure does not apply;
``replot`` redraws a saved run."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox, BboxBase

from lowband.bench.metrics import COMPUTE, summarize
from lowband.bench.plots import LOG_TIME_RATIO, figures, plot_all, step_parts, wrap_spec
from lowband.bench.report import legend, markdown_table, replot, results_markdown, sweep_table, terminal_table
from lowband.bench.styles import LABEL_WIDTH, plot_labels, shorten, styles

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

LONG = [
    "ddp",
    "localsgd:period=5",
    "compressed:compressor=onebit:threshold=0.5;scale=1.0,reducer=ps,bucket_mb=0.0",
    "slimgc:compressor=onebit:scale=32,reducer=ps,comm_threshold=auto,pre_steps=10,offload=True,backup=True",
    "slimgc:compressor=twobit:scale=32,reducer=ps,comm_threshold=0,pre_steps=10,offload=False,backup=False",
    "dreamddp:period=5,split=auto",
]


def _run(i: int, n: int, rounds: int = 3, per: int = 6, measured: bool = False) -> dict[str, Any]:
    """Strategy ``i``'s records: steps of (30 + 25 i) ms on every rank, losses falling, 1 MB per step."""
    step = 0.03 + 0.025 * i
    segs, t = [], 0.0
    for r in range(rounds):
        starts = [[t + k * step + 0.001 * q for k in range(per)] for q in range(n)]
        segs.append(
            {
                "round": r,
                "first_step": r * per,
                "step_times": [step] * per,
                "loss": [2.0 / (1 + 0.1 * (r * per + k) * (1 + 0.1 * i)) for k in range(per)],
                "wall_end": (r + 1) * per * step,
                "items": 32 * n * per,
                "starts": starts,
                "ends": [[s + step * 0.95 for s in row] for row in starts],
                "tx_bytes": [1e6 * per] * n,
                "rx_bytes": [1e6 * per] * n,
            }
        )
        t += per * step + 1.0
    evals = [{"round": r, "step": (r + 1) * per, "wall": (r + 1) * per * step, "loss": 1.0 / (r + 1),
              "accuracy": 0.5 + 0.1 * r + 0.01 * i} for r in range(rounds)]  # fmt: skip
    run: dict[str, Any] = {"label": f"label{i}(H=5)", "segments": segs, "evals": evals, "in_sync": True,
                           "replica_spread": 0.0}  # fmt: skip
    if measured:
        bd = {"first_step": 0, "compute_s": [0.02] * rounds * per, "compression_s": [0.005] * rounds * per,
              "comm_s": [step - 0.025] * rounds * per}  # fmt: skip
        run["report_ranks"] = [{"breakdown": bd} for _ in range(n)]
        run["report"] = run["report_ranks"][0]
    return run


def _results(n: int = 4, specs: list[str] = LONG) -> tuple[dict[str, Any], dict[str, Any]]:
    runs = {k: _run(i, n, measured=k.startswith(("slimgc", "compressed"))) for i, k in enumerate(specs)}
    runs[COMPUTE] = _run(0, n)
    for seg in runs[COMPUTE]["segments"]:
        seg["step_times"] = [0.035] * len(seg["step_times"])  # slower than ddp's 30 ms: ddp below bound
    raw = {"world_size": n, "runs": runs}
    s = summarize(raw, warmup_rounds=1, rank_rates=[(1e9, 1e9)] * n, bytes_sharing=1,
                  baselines=["ddp", "localsgd"], smooth=3)  # fmt: skip
    return raw, s


def _undrawn_ticks(fig: Figure) -> set[int]:
    """Tick labels matplotlib keeps but does not draw (their tick lies outside the view limits)."""
    out = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            eps = (hi - lo) * 1e-9
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if not lo - eps <= tick.get_loc() <= hi + eps:
                    out |= {id(tick.label1), id(tick.label2)}
    return out


def _texts(fig: Figure) -> list[tuple[str, Bbox]]:
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    hidden = _undrawn_ticks(fig)
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.get_alpha() != 0 and id(t) not in hidden:
            out.append((t.get_text(), t.get_window_extent(renderer)))
    return out


def _outside(b: BboxBase, box: BboxBase) -> bool:
    return bool(b.x0 < box.x0 - 1 or b.y0 < box.y0 - 1 or b.x1 > box.x1 + 1 or b.y1 > box.y1 + 1)


def layout_problems(fig: Figure) -> list[str]:
    """Pairs of text artists whose boxes overlap, texts reaching outside the figure, and legends (their
    frames) reaching outside the figure or lying over an axes' data area."""
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    box = fig.bbox
    texts = _texts(fig)
    problems = [f"outside the figure: {s!r}" for s, b in texts if _outside(b, box)]
    for (s1, b1), (s2, b2) in itertools.combinations(texts, 2):
        if b1.shrunk(0.98, 0.9).overlaps(b2.shrunk(0.98, 0.9)):
            problems.append(f"overlap: {s1!r} / {s2!r}")
    legends: list[Legend] = [*fig.legends]
    legends += [leg for ax in fig.axes if (leg := ax.get_legend()) is not None]
    for i, leg in enumerate(legends):
        lb = leg.get_window_extent(renderer)
        if _outside(lb, box):
            problems.append(f"legend {i} outside the figure: {lb.bounds}")
        for j, ax in enumerate(fig.axes):
            if lb.shrunk(0.99, 0.99).overlaps(ax.get_window_extent(renderer)):
                problems.append(f"legend {i} over axes {j}'s data area")
    return problems


@pytest.mark.parametrize("n", [2, 4])
def test_every_plot_renders_without_overlapping_text(n: int) -> None:
    raw, s = _results(n)
    figs = figures(
        raw, s, "a long title: workload, 4 ranks, netns+tbf: 4 ranks, 100 Mbit/s per rank, MTU 9000"
    )
    assert set(figs) == {"loss.png", "accuracy.png", "iteration.png", "breakdown.png", "timeline.png"}
    for name, fig in figs.items():
        assert layout_problems(fig) == [], name


def test_the_checker_sees_overlaps() -> None:
    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.text(0.5, 0.5, "one label")
    ax.text(0.52, 0.5, "another label")
    ax.set_title("a title far too long to fit in a four-inch figure, cut on both sides")
    problems = layout_problems(fig)
    assert any(p.startswith("overlap") for p in problems)
    assert any(p.startswith("outside") for p in problems)


def test_the_checker_sees_a_legend_over_an_axes_or_cut_off() -> None:
    """The saved SlimGC GPT loss plot had its legend over the left panel and cut at the figure's left
    edge: both are layout problems."""
    fig = Figure(figsize=(8, 3))
    ax1, _ = fig.subplots(1, 2)
    for k in range(6):
        ax1.plot([0, 1], [k, k + 1], label=f"strategy {k}")
    fig.legend(loc="center right", bbox_to_anchor=(0.45, 0.5))
    problems = layout_problems(fig)
    assert any(p.startswith("legend 0 over axes 0") for p in problems), problems
    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], label="a label long enough to leave the figure on the left")
    fig.legend(loc="center right", bbox_to_anchor=(0.05, 0.5))
    assert any(p.startswith("legend 0 outside the figure") for p in layout_problems(fig))


def test_legend_names_the_target_and_strategies_as_typed(tmp_path: Path) -> None:
    specs = ["ddp", "localsgd:period=5", "compressed:compressor=fp16"]
    raw, s = _results(3, specs)
    figs = figures(raw, s, "t")
    texts = [t for t, _ in _texts_drawn(figs["loss.png"])]
    assert any(t.startswith("target loss") for t in texts)
    assert set(specs) <= set(texts) and not any("H=5" in t for t in texts)
    assert any(t.startswith("target accuracy") for t in _drawn(figs["accuracy.png"]))
    paths = plot_all(raw, s, tmp_path, "t")
    assert [p.name for p in paths] == list(figs) and all(p.stat().st_size > 1000 for p in paths)


def test_long_specs_are_numbered_in_the_plots_and_the_table() -> None:
    """A spec longer than LABEL_WIDTH numbers every strategy: legends show the number and the spec cut
    after a whole option, bar charts and timeline panels the number and the whole spec, and results.md
    a column of the numbers beside the full specs."""
    raw, s = _results(3, LONG[:4])
    labels = plot_labels(LONG[:4])
    assert labels["ddp"] == "S1 ddp" and labels[LONG[1]] == "S2 localsgd:period=5"
    assert labels[LONG[3]] == "S4 slimgc:compressor=onebit:scale=32,…"
    assert all(len(lab) <= LABEL_WIDTH + 4 for lab in labels.values())
    figs = figures(raw, s, "t")
    loss = _drawn(figs["loss.png"])
    assert labels[LONG[3]] in loss and LONG[3] not in loss
    bars = [t.replace("\n", "") for t in _drawn(figs["iteration.png"])]
    assert "S4 " + LONG[3] in bars and "S1 ddp" in bars
    assert "S4 " + LONG[3] in _drawn(figs["timeline.png"])
    md = markdown_table(s, "samples")
    assert md.startswith("| plot | strategy |") and f"| S4 | `{LONG[3]}` |" in md
    assert "**plot**" in legend(s, "samples", target_given=False, shaped=True)
    short = ["ddp", "localsgd:period=5"]
    assert plot_labels(short) == {k: k for k in short}
    assert "| plot |" not in markdown_table(_results(2, short)[1], "samples")
    assert "**plot**" not in legend(_results(2, short)[1], "samples", target_given=False, shaped=True)
    assert shorten("x" * 60, 20) == "x" * 19 + "…"


def test_identical_curves_get_distinct_styles() -> None:
    """Strategies with identical losses: each curve has its own colour, line style and marker, markers at
    staggered steps, and the step panel says that curves coincide."""
    specs = ["ddp", "embrace", "ddp-sparse", "sparse-allgather"]
    raw, s = _results(2, specs)
    for k in specs[1:]:  # the same losses at every step (different step times)
        for seg, ref in zip(raw["runs"][k]["segments"], raw["runs"]["ddp"]["segments"]):
            seg["loss"] = list(ref["loss"])
    st = styles(specs)
    assert len({(x.linestyle, x.marker) for x in st.values()}) == len(specs)
    assert len({x.color for x in st.values()}) == len(specs)
    fig = figures(raw, s, "t")["loss.png"]
    lines = [ln for ln in fig.axes[1].get_lines() if np.size(ln.get_xdata()) > 2]
    assert len(lines) == len(specs)
    assert len({(ln.get_linestyle(), ln.get_marker()) for ln in lines}) == len(specs)
    assert len({str(ln.get_markevery()) for ln in lines}) == len(specs)  # staggered
    assert any("identical losses" in t for t in _drawn(fig))
    assert not any("identical losses" in t for t in _drawn(figures(*_results(2, specs), "t")["loss.png"]))


def test_time_axis_is_logarithmic_when_one_strategy_is_far_slower() -> None:
    raw, s = _results(2, ["ddp", "fast"])
    fig = figures(raw, s, "t")["loss.png"]
    assert fig.axes[0].get_xscale() == "linear" and fig.axes[1].get_xscale() == "linear"
    slow = copy.deepcopy(raw)
    for seg in slow["runs"]["ddp"]["segments"]:
        seg["step_times"] = [t * 5 * LOG_TIME_RATIO for t in seg["step_times"]]
        seg["wall_end"] *= 5 * LOG_TIME_RATIO
    for ev in slow["runs"]["ddp"]["evals"]:
        ev["wall"] *= 5 * LOG_TIME_RATIO
    figs = figures(slow, s, "t")
    assert (
        figs["loss.png"].axes[0].get_xscale() == "log" and figs["loss.png"].axes[1].get_xscale() == "linear"
    )
    assert figs["accuracy.png"].axes[0].get_xscale() == "log"
    assert "training time (s, log scale)" in _drawn(figs["loss.png"])
    for name in ("loss.png", "accuracy.png"):
        assert layout_problems(figs[name]) == [], name


def test_speedups_against_the_first_strategy_without_ddp() -> None:
    specs = ["localsgd:period=5", "compressed:compressor=fp16", "dreamddp:period=5"]
    runs = {k: _run(i, 2) for i, k in enumerate(specs)}
    runs[COMPUTE] = _run(0, 2)
    raw = {"world_size": 2, "runs": runs}
    s = summarize(raw, warmup_rounds=1, rank_rates=None, bytes_sharing=2, baselines=["ddp"], smooth=3)
    rows = s["strategies"]
    assert rows[specs[1]]["speedup_vs"] == {specs[0]: pytest.approx(0.03 / 0.055)}
    assert rows[specs[0]]["speedup_vs"] == {}
    assert terminal_table(s).splitlines()[0].split()[3:5] == ["vs", "localsgd:period=5"]
    assert "speed-up vs localsgd:period=5" in markdown_table(s, "samples")
    points = [{"setting": "n=2", "summary": s}]
    assert "speed-up vs localsgd:period=5" in sweep_table(points, "ddp")
    s2 = summarize(raw, warmup_rounds=1, rank_rates=None, bytes_sharing=2, baselines=["localsgd"], smooth=3)
    assert s2["strategies"][specs[2]]["speedup_vs"] == {specs[0]: pytest.approx(0.03 / 0.08)}


@pytest.mark.parametrize("run", ["slimgc/gpt-100mbit", "embrace/n4-100mbit"])
def test_saved_runs_replot_readably(run: str, tmp_path: Path) -> None:
    """Two saved runs of benchmarks/results (14 long SlimGC specs; EmbRace's 15x spread of training
    times and identical curves) redrawn by ``replot``: every plot passes the layout check and
    results.md is the one a run writes."""
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(RESULTS / run / "results.json", out / "results.json")
    paths = replot(out)
    assert {p.name for p in paths} >= {"loss.png", "iteration.png", "timeline.png", "results.md"}
    results = json.loads((out / "results.json").read_text())
    figs = figures(results["raw"], results["summary"], "a title")
    for name, fig in figs.items():
        assert layout_problems(fig) == [], (run, name)
    md = (out / "results.md").read_text()
    assert md == results_markdown(results, redrawn=True) and md.startswith("### ")
    assert "Redrawn from results.json" in md and "Redrawn" not in results_markdown(results)
    assert "speed-up vs ddp" in md
    committed = (RESULTS / run / "results.md").read_text()
    assert committed == md, f"results.md is stale: run lowband bench --replot benchmarks/results/{run}"


def _drawn(fig: Figure) -> list[str]:
    return [t for t, _ in _texts_drawn(fig)]


def _texts_drawn(fig: Figure) -> list[tuple[str, Bbox]]:
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return _texts(fig)


def test_timeline_splits_each_step_into_computation_and_communication() -> None:
    raw, s = _results(2)
    seg = raw["runs"][LONG[3]]["segments"][-1]
    parts = step_parts(raw["runs"][LONG[3]], seg, 1, s["compute_time"], False)
    assert [p[2] for p in parts[:3]] == ["compute_s", "compression_s", "comm_s"] and parts[0][3]
    span = seg["ends"][1][0] - seg["starts"][1][0]
    assert sum(p[1] for p in parts[:3]) == pytest.approx(span)
    inferred = step_parts(raw["runs"]["localsgd:period=5"], raw["runs"]["localsgd:period=5"]["segments"][-1],
                          0, s["compute_time"], False)  # fmt: skip
    assert [(p[2], p[3]) for p in inferred[:2]] == [("compute_s", False), ("comm_s", False)]
    assert inferred[0][1] == pytest.approx(s["compute_time"])


def test_tables() -> None:
    _, s = _results(2)
    ddp = s["strategies"]["ddp"]
    assert ddp["below_bound"] and ddp["efficiency"] == 1.0  # 30 ms measured, 35 ms compute-only
    assert all(0 < r["efficiency"] <= 1 for r in s["strategies"].values())
    term = terminal_table(s)
    lines = term.splitlines()
    assert lines[0].split() == ["strategy", "iter", "ms", "vs", "ddp", "sent/step", "efficiency", "to",
                                "target", "s", "accuracy"]  # fmt: skip
    assert any(line.startswith("localsgd:period=5 ") for line in lines) and "H=5" not in term
    assert "1.00*" in term and "1.00x" in term
    md = markdown_table(s, "samples")
    assert "| `slimgc:compressor=onebit:scale=32,reducer=ps," in md and "label" not in md
    assert "speed-up vs ddp | speed-up vs localsgd:period=5 |" in md
    notes = legend(s, "samples", target_given=False, shaped=True)
    assert "the worst final training loss" in notes and "**-**" in notes
    assert "given by --target-loss" in legend(s, "samples", target_given=True, shaped=True)


def test_wrap_spec() -> None:
    spec = LONG[3]
    lines = wrap_spec(spec, 40).split("\n")
    assert "".join(lines) == spec and all(len(line) <= 40 for line in lines)
    assert wrap_spec("ddp") == "ddp"
