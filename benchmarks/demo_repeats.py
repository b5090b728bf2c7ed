"""``lowband demo`` run several times in a row: how DreamDDP's figures repeat from run to run.

Each run profiles DreamDDP afresh (its own first step), so its chosen synchronisation units, its
predicted step time and its fitted interference can differ between runs; this script puts the runs side
by side: FLSGD's (``localsgd:period=5``) and DreamDDP's iteration time, DreamDDP's pace against FLSGD
and DDP, the split it kept (after its online trial when candidates were predicted too close to call),
predicted and measured/predicted, kappa/sigma, the profile's seconds and the time to the target loss
with and without it. Then the median [min-max] over runs and the count of runs meeting each target.

Usage::

    python benchmarks/demo_repeats.py --runs 5                 # 5 x lowband demo (~2-3 min each)
    python benchmarks/demo_repeats.py --runs 5 --out DIR -n 4  # further arguments go to lowband demo
    python benchmarks/demo_repeats.py --summarize DIR [DIR...] # only the table, from finished demos

Writes ``--out``/runK/ (each demo's own results) and ``--out``/repeats.json
(default ``benchmarks/results/dreamddp/demo-repeats``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

FLSGD, DREAM, DDP, POWERSGD = "localsgd:period=5", "dreamddp:period=5", "ddp", "powersgd"


def summarize(folder: Path) -> dict[str, Any]:
    """One demo's figures from its results.json."""
    res = json.loads((folder / "results.json").read_text())
    s = res["summary"]["strategies"]
    d, f, ddp = s[DREAM], s[FLSGD], s[DDP]
    rep = d.get("report", {})
    trials = rep.get("trials", [])
    return {
        "folder": str(folder),
        "started": res.get("started"),
        "version": res.get("lowband_version"),
        "compute_ms": 1e3 * res["summary"]["compute_time"],
        "ddp_ms": 1e3 * ddp["iter_time_median"],
        "powersgd_ms": 1e3 * s[POWERSGD]["iter_time_median"] if POWERSGD in s else None,
        "flsgd_ms": 1e3 * f["iter_time_median"],
        "dreamddp_ms": 1e3 * d["iter_time_median"],
        "vs_flsgd": f["iter_time_median"] / d["iter_time_median"],
        "vs_ddp": ddp["iter_time_median"] / d["iter_time_median"],
        "split_bytes": rep.get("split_bytes"),
        "candidates": rep.get("candidates"),
        "trials": trials,
        "predicted_ms": 1e3 * d["predicted_iter_time"] if d.get("predicted_iter_time") else None,
        "measured_over_predicted": d.get("measured_over_predicted"),
        "kappa": rep.get("kappa"),
        "sigma": rep.get("sigma"),
        "profile_s": d.get("setup_time"),
        "dreamddp_to_target_s": d.get("time_to_target"),
        "dreamddp_to_target_wo_profile_s": d.get("time_to_target_excl_setup"),
        "flsgd_to_target_s": f.get("time_to_target"),
        "dreamddp_acc": d.get("eval_accuracy"),
        "flsgd_acc": f.get("eval_accuracy"),
    }


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | ddp ms | powersgd ms | localsgd:period=5 ms | dreamddp:period=5 ms | vs FLSGD | vs DDP "
        "| split kept | trial: split: measured ms per period | predicted ms | measured/predicted | kappa / sigma "
        "| profile s | to target s: DreamDDP (w/o profile) / FLSGD |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows, 1):
        trial = "; ".join(
            ", ".join(f"{sp}: {1e3 * m:.1f}" for sp, m in zip(t["splits"], t["measured_s"], strict=False))
            for t in r["trials"]
        )
        out.append(
            f"| {i} | {r['ddp_ms']:.1f} | {_f(r['powersgd_ms'], '.1f')} | {r['flsgd_ms']:.1f} | {r['dreamddp_ms']:.1f} "
            f"| {r['vs_flsgd']:.2f}x | {r['vs_ddp']:.2f}x | {r['split_bytes']} | {trial or 'none'} "
            f"| {_f(r['predicted_ms'], '.1f')} | {_f(r['measured_over_predicted'], '.2f')} "
            f"| {_f(r['kappa'], '.2f')} / {_f(r['sigma'], '.2f')} | {_f(r['profile_s'], '.1f')} "
            f"| {_f(r['dreamddp_to_target_s'], '.1f')} ({_f(r['dreamddp_to_target_wo_profile_s'], '.1f')}) "
            f"/ {_f(r['flsgd_to_target_s'], '.1f')} |"
        )
    return "\n".join(out)


def spread(rows: list[dict[str, Any]], key: str) -> str:
    xs = [r[key] for r in rows if r.get(key) is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def targets(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Runs meeting each of the headline's targets."""
    return {
        "vs_flsgd>=1.15": sum(r["vs_flsgd"] >= 1.15 for r in rows),
        "vs_ddp>=2": sum(r["vs_ddp"] >= 2.0 for r in rows),
        "measured/predicted in [0.85,1.15]": sum(
            r["measured_over_predicted"] is not None and 0.85 <= r["measured_over_predicted"] <= 1.15
            for r in rows
        ),
        "profile<3s": sum(r["profile_s"] is not None and r["profile_s"] < 3.0 for r in rows),
        "to target incl. profile <= FLSGD": sum(
            r["dreamddp_to_target_s"] is not None
            and r["flsgd_to_target_s"] is not None
            and r["dreamddp_to_target_s"] <= r["flsgd_to_target_s"]
            for r in rows
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dreamddp/demo-repeats"))
    ap.add_argument(
        "--summarize", type=Path, nargs="+", help="finished demo folders: no runs, only the table"
    )
    ns, demo_args = ap.parse_known_args()
    folders: list[Path] = list(ns.summarize or [])
    if not folders:
        for k in range(1, ns.runs + 1):
            folder = ns.out / f"run{k}"
            print(f"run {k}/{ns.runs}: lowband demo --out {folder} {' '.join(demo_args)}", flush=True)
            cmd = [sys.executable, "-m", "lowband.cli", "demo", "--out", str(folder), *demo_args]
            done = subprocess.run(cmd, check=False)
            if done.returncode != 0:
                print(f"run {k} failed (exit status {done.returncode})", file=sys.stderr)
                return 1
            folders.append(folder)
    rows = [summarize(f) for f in folders]
    met = targets(rows)
    text = table(rows)
    keys = (
        "flsgd_ms",
        "dreamddp_ms",
        "vs_flsgd",
        "vs_ddp",
        "measured_over_predicted",
        "kappa",
        "sigma",
        "profile_s",
    )
    spreads = {k: spread(rows, k) for k in keys}
    print(text)
    print("median [min-max]: " + ", ".join(f"{k} {v}" for k, v in spreads.items()))
    print("runs meeting: " + ", ".join(f"{k}: {v}/{len(rows)}" for k, v in met.items()))
    out = ns.out if not ns.summarize else Path(ns.summarize[0]).parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeats.json").write_text(json.dumps({"runs": rows, "spread": spreads, "met": met}, indent=1))
    (out / "repeats.md").write_text(text + "\n")
    print(f"written: {out / 'repeats.json'}  {out / 'repeats.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
