"""Predicted (``lowband plan``) vs measured (``lowband bench``) iteration time, side by side.

Usage: python benchmarks/plan_validation.py PLAN_DIR [PLAN_DIR ...] BENCH_DIR OUT.json

Reads each plan's ``plan.json`` and the bench's ``results.json`` and writes, per strategy the bench ran,
the predicted and measured iteration milliseconds, bytes per rank per step, and the prediction's error
``(predicted - measured) / measured``; also the predicted and measured compute-only time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def compare(plan: dict[str, Any], bench: dict[str, Any]) -> dict[str, Any]:
    summary = bench["summary"]
    predicted = {s["spec"]: s for s in plan["strategies"]}
    rows = {}
    for spec, m in summary["strategies"].items():
        p = predicted.get(spec)
        measured_ms = m["iter_time_median"] * 1e3
        pred_ms = p["predicted_ms"] if p else None
        rows[spec] = {
            "predicted_ms": pred_ms,
            "measured_ms": measured_ms,
            "error": None if pred_ms is None else (pred_ms - measured_ms) / measured_ms,
            "predicted_bytes_per_rank_step": p.get("bytes_per_rank_step") if p else None,
            "measured_bytes_sent_per_rank_step": m["bytes_sent_per_rank_step"],
        }
    return {
        "compute_ms": {
            "predicted": plan["profile"]["compute_ms"],
            "measured": summary["compute_time"] * 1e3 if summary["compute_time"] else None,
            "compute_scale": plan["profile"]["compute_scale"],
        },
        "strategies": rows,
    }


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    *plans, bench_dir, out = argv
    bench = json.loads((Path(bench_dir) / "results.json").read_text())
    result = {
        "bench": {"dir": bench_dir, "config": bench["config"], "testbed": bench.get("testbed")},
        "plans": {p: compare(json.loads((Path(p) / "plan.json").read_text()), bench) for p in plans},
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    for p, r in result["plans"].items():
        c = r["compute_ms"]
        print(f"{p}: compute predicted {c['predicted']:.1f} ms, measured {c['measured']:.1f} ms")
        for spec, row in r["strategies"].items():
            err = "" if row["error"] is None else f"{row['error']:+.0%}"
            pred = "no model" if row["predicted_ms"] is None else f"{row['predicted_ms']:.1f}"
            print(f"  {spec:40s} predicted {pred:>8s}  measured {row['measured_ms']:7.1f}  {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
