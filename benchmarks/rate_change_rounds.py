"""Per-round iteration times of a ``lowband bench --rate-change`` run, before and after each change.

``python benchmarks/rate_change_rounds.py RESULTS_DIR OUT.json``: reads ``RESULTS_DIR/results.json``
and writes a small JSON (the command's settings, the changes applied, and per strategy per round the
mean iteration time and where the round lay relative to the first change), and prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def rounds(results: dict[str, Any]) -> dict[str, Any]:
    changes = results.get("rate_changes", [])
    at = changes[0].get("at_bench_s") if changes else None
    out: dict[str, Any] = {}
    for key, run in results["raw"]["runs"].items():
        rows = []
        for seg in run["segments"]:
            start = min(s[0] for s in seg["starts"])
            end = max(e[-1] for e in seg["ends"])
            where = "before" if at is None or end <= at else ("after" if start >= at else "across")
            steps = seg["step_times"]
            rows.append(
                {
                    "round": seg["round"],
                    "start_s": round(start, 2),
                    "end_s": round(end, 2),
                    "iteration_ms": round(1000 * (sum(steps) + seg.get("sync_tail", 0.0)) / len(steps), 1),
                    "tx_bytes_per_step_rank1": round(seg["tx_bytes"][1] / len(steps)),
                    "change": where,
                }
            )
        out[key] = rows
    return out


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    res = json.loads((src / "results.json").read_text())
    per = rounds(res)
    cfg = res["config"]
    keep = ("workload", "strategies", "world_size", "rate", "rate_change", "rounds", "steps_per_round")
    data = {
        "testbed": res["testbed"],
        "started": res["started"],
        "config": {k: cfg[k] for k in keep},
        "rate_changes": res.get("rate_changes", []),
        "rounds": per,
    }
    dst.write_text(json.dumps(data, indent=1) + "\n")
    for key, rows in per.items():
        print(f"{key}:")
        for side in ("before", "across", "after"):
            ms = [r["iteration_ms"] for r in rows if r["change"] == side and r["round"] > 0]
            if ms:
                print(f"  {side:7s} rounds {len(ms):2d}  median {statistics.median(ms):8.1f} ms  {ms}")


if __name__ == "__main__":
    main()
