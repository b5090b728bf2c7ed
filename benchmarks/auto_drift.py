"""``auto`` against fixed strategies over a run whose link changes (``lowband bench --rate-change``).

Usage: python benchmarks/auto_drift.py RESULTS_DIR OUT.json

Reads ``RESULTS_DIR/results.json`` and writes, per strategy, the training time summed over every round
but the first (the bench's warm-up round), split before and after the first rate change (a round across
it counts as after), the ratio to ``auto``'s, and ``auto``'s decisions (reason, step, choice, predicted
ms, what was carried over). Per-round figures: ``benchmarks/rate_change_rounds.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def totals(results: dict[str, Any]) -> dict[str, Any]:
    changes = results.get("rate_changes", [])
    at = changes[0].get("at_bench_s") if changes else None
    out: dict[str, Any] = {}
    for key, run in results["raw"]["runs"].items():
        before = after = 0.0
        steps = 0
        for seg in run["segments"]:
            if seg["round"] == 0:
                continue
            end = max(e[-1] for e in seg["ends"])
            t = sum(seg["step_times"])
            steps += len(seg["step_times"])
            if at is not None and end > at:
                after += t
            else:
                before += t
        out[key] = {"before_s": before, "after_s": after, "total_s": before + after, "steps": steps}
    key = next((k for k in out if k.partition(":")[0] == "auto"), None)
    auto = None if key is None else out[key]["total_s"]
    for row in out.values():
        row["over_auto"] = None if not auto else row["total_s"] / auto
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = json.loads((Path(argv[0]) / "results.json").read_text())
    rows = totals(results)
    key = next((k for k in results["summary"]["strategies"] if k.partition(":")[0] == "auto"), "auto")
    report = results["summary"]["strategies"].get(key, {}).get("report", {}).get("auto", {})
    keep = (
        "reason",
        "step",
        "spec",
        "recommended",
        "predicted_ms",
        "current_ms",
        "why",
        "carried",
        "replan_s",
        "switch_s",
    )
    decisions = [{k: d[k] for k in keep if k in d} for d in report.get("history", [])]
    doc = {"rate_changes": results.get("rate_changes", []), "strategies": rows, "auto_decisions": decisions}
    Path(argv[1]).write_text(json.dumps(doc, indent=1) + "\n")
    print("| strategy | before the change s | after s | total s | / auto |")
    print("|---|---:|---:|---:|---:|")
    for k, r in sorted(rows.items(), key=lambda kv: kv[1]["total_s"]):
        ratio = "-" if r["over_auto"] is None else f"{r['over_auto']:.2f}"
        print(f"| {k} | {r['before_s']:.1f} | {r['after_s']:.1f} | {r['total_s']:.1f} | {ratio} |")
    for d in decisions:
        print(f"step {d.get('step')}: {d.get('reason')}: {d.get('why')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
