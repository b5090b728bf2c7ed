"""``lowband plan`` and ``-s auto`` against ``lowband bench`` on a matrix of workloads and links.

Usage: python benchmarks/plan_matrix.py OUT_DIR [--cells NAME,NAME] [--rounds 4] [--steps 20]
       [--work DIR] [--list]

For each cell (workload x links x layout; ``--list`` prints them): ``lowband plan --measure`` under
``lowband run`` on the cell's emulated links (4 ranks, profiling at once on this machine's cores as the
bench's ranks share them; ``--configured``: the plan from the configured rates, ``--shared-cores`` this
machine's cores) ranks every
spec; the three fastest predictions then run side by side with ``auto`` in one ``lowband bench`` on the
same links.
Per cell (``OUT_DIR/<cell>.json``, by ``benchmarks/plan_validation.py``'s comparison): predicted and
measured ms of the three, the prediction's error, what ``auto`` chose, its measured iteration and time
to target against the best of the three. ``OUT_DIR/summary.json`` and ``summary.md`` hold the table and
the targets' counts (every top-three prediction within 20 %; ``auto`` within 10 % of the best).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_validation import compare

WORKLOADS = {"cnn": "fmnist-cnn", "gpt": "shakespeare-gpt", "wordlm": "wordlm-sampled"}
LINKS = {"100m": ["--rate", "100mbit"], "1g": ["--rate", "1gbit"]}
LAYOUTS = {"flat": [], "2x2": ["--ranks-per-machine", "2"]}
HETERO = ["--rates", "10mbit,100mbit,100mbit,100mbit"]


def cells() -> dict[str, tuple[str, list[str]]]:
    """``name -> (workload, link and layout arguments)``: 3 x 2 x 2, and the heterogeneous links."""
    out = {
        f"{w}-{ln}-{lay}": (wl, [*la, *ya])
        for w, wl in WORKLOADS.items()
        for ln, la in LINKS.items()
        for lay, ya in LAYOUTS.items()
    }
    out.update({f"{w}-10-100-flat": (wl, HETERO) for w, wl in WORKLOADS.items() if w != "wordlm"})
    return out


def lowband(*args: str) -> None:
    code = "import sys; from lowband.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL)


def top_three(plan: dict[str, Any]) -> list[str]:
    """The three fastest predicted specs (the plan lists them ranked, those without a model last)."""
    return [s["spec"] for s in plan["strategies"] if s.get("predicted_ms") is not None][:3]


def run_cell(
    name: str, workload: str, links: list[str], work: Path, rounds: int, steps: int, measured: bool
) -> dict[str, Any]:
    cores = str(os.cpu_count() or 1)
    plan_dir, bench_dir = work / name / "plan", work / name / "bench"
    common = ["-w", workload, "--out", str(plan_dir), "--time-limit", "300"]
    if measured:  # the launcher takes the links; the plan measures them, and its ranks share the cores
        rpm = links[links.index("--ranks-per-machine") :] if "--ranks-per-machine" in links else []
        lowband("run", "-n", "4", *links, "-m", "lowband", "plan", "--measure", *rpm, *common)
    else:
        lowband("plan", "-n", "4", *links, "--shared-cores", cores, *common)
    plan = json.loads((plan_dir / "plan.json").read_text())
    specs = top_three(plan)
    lowband(
        "bench", "-w", workload, "-n", "4", *links, "-s", "+".join([*specs, "auto"]),
        "--rounds", str(rounds), "--steps-per-round", str(steps), "--out", str(bench_dir),
    )  # fmt: skip
    bench = json.loads((bench_dir / "results.json").read_text())
    cmp = compare(plan, bench)
    measured = bench["summary"]["strategies"]
    auto = measured["auto"]
    best = min(specs, key=lambda s: measured[s]["iter_time_median"])
    ttt = {s: measured[s].get("time_to_target") for s in [*specs, "auto"]}
    reached = [s for s in specs if ttt[s] is not None]
    best_ttt = min(reached, key=lambda s: ttt[s]) if reached else None
    return {
        "cell": name,
        "workload": workload,
        "links": links,
        "plan_links": plan["links"],
        "top_three": specs,
        "comparison": cmp["strategies"],
        "compute_ms": cmp["compute_ms"],
        "auto": {
            "chosen": auto["report"]["auto"]["chosen"],
            "measured_ms": auto["iter_time_median"] * 1e3,
            "range_ms": [auto["iter_time_min"] * 1e3, auto["iter_time_max"] * 1e3],
            "time_to_target_s": ttt["auto"],
            "set_up_s": auto["report"]["auto"].get("set_up_s"),
        },
        "best": {"spec": best, "measured_ms": measured[best]["iter_time_median"] * 1e3},
        "auto_over_best": auto["iter_time_median"] / measured[best]["iter_time_median"],
        "best_time_to_target": None if best_ttt is None else {"spec": best_ttt, "s": ttt[best_ttt]},
        "auto_ttt_over_best": None
        if best_ttt is None or ttt["auto"] is None
        else ttt["auto"] / ttt[best_ttt],  # type: ignore[operator]
    }


def summary_md(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| cell | top three predicted (error vs measured) | auto chose | auto / best ms | auto / best time to target |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        errs = ", ".join(
            f"{s} {c['predicted_ms']:.1f}/{c['measured_ms']:.1f} ({c['error']:+.0%})"
            for s, c in r["comparison"].items()
            if s != "auto" and c["error"] is not None
        )
        ttt = "-" if r["auto_ttt_over_best"] is None else f"{r['auto_ttt_over_best']:.2f}"
        lines.append(
            f"| {r['cell']} | {errs} | {r['auto']['chosen']} | {r['auto']['measured_ms']:.1f} / "
            f"{r['best']['measured_ms']:.1f} = {r['auto_over_best']:.2f} | {ttt} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--cells", default=None, help="comma-separated cell names (default: every cell)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--work", default=None, help="where the plans and benches go (default: a temporary folder)"
    )
    p.add_argument("--list", action="store_true", help="print the cells and exit")
    p.add_argument("--again", action="store_true", help="measure cells whose results exist in OUT_DIR again")
    p.add_argument(
        "--configured", action="store_true", help="plan from the configured rates, not measured links"
    )
    ns = p.parse_args(argv)
    all_cells = cells()
    if ns.list or ns.out is None:
        print("\n".join(f"{k}: {w} {' '.join(a)}" for k, (w, a) in all_cells.items()))
        return 0 if ns.list else 2
    chosen = ns.cells.split(",") if ns.cells else list(all_cells)
    unknown = [c for c in chosen if c not in all_cells]
    if unknown:
        print(f"unknown cells {unknown}; --list prints them", file=sys.stderr)
        return 2
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(ns.work or tempfile.mkdtemp(prefix="plan-matrix-"))
    rows = []
    for name in tqdm(chosen, desc="plan matrix", unit="cell"):
        done = out / f"{name}.json"
        if done.exists() and not ns.again:  # a cell already measured (an interrupted run resumes)
            rows.append(json.loads(done.read_text()))
            continue
        w, links = all_cells[name]
        row = run_cell(name, w, links, work, ns.rounds, ns.steps, not ns.configured)
        row["rounds"], row["steps_per_round"] = ns.rounds, ns.steps
        done.write_text(json.dumps(row, indent=1) + "\n")
        rows.append(row)
    top = [
        c["error"] for r in rows for s, c in r["comparison"].items() if s != "auto" and c["error"] is not None
    ]
    summary = {
        "cells": rows,
        "top_three_within_20pct": sum(abs(e) <= 0.2 for e in top),
        "top_three_predictions": len(top),
        "auto_within_10pct": sum(r["auto_over_best"] <= 1.1 for r in rows),
        "auto_ttt_within_10pct": sum(
            r["auto_ttt_over_best"] is not None and r["auto_ttt_over_best"] <= 1.1 for r in rows
        ),
        "n_cells": len(rows),
        "work": str(work),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(summary_md(rows))
    print(summary_md(rows))
    print(
        f"top-three predictions within 20 %: {summary['top_three_within_20pct']}/{len(top)}; auto within 10 % "
        f"of the best: {summary['auto_within_10pct']}/{len(rows)} (time to target: "
        f"{summary['auto_ttt_within_10pct']}/{len(rows)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
