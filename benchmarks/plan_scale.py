"""``lowband plan`` at several world sizes against ``lowband bench`` at the sizes this machine can run.

Usage: python benchmarks/plan_scale.py OUT_DIR [--sizes 2,3,4] [--rate 100mbit] [--strategies S]
       [--workload fmnist-cnn] [--work DIR]

For each size ``n``: ``lowband plan -n n --shared-cores CORES`` (the bench's ranks share this machine's
cores) and ``lowband bench -n n --rounds 2 --steps-per-round 10`` on the same specs and links, compared
by ``benchmarks/plan_validation.py`` (``validation-n{n}.json``). Then ``summary.json``: per strategy,
per size, predicted and measured ms and the error, and the median and range of the errors. The plans'
and benches' own folders stay in ``--work`` (default: a temporary folder); only the comparisons are
written to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT = "ddp+atc+winput+gs-sgd+compressed:compressor=fp16,reducer=ps"


def lowband(*args: str) -> None:
    code = "import sys; from lowband.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True)


def summarise(by_size: dict[int, dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for n, v in by_size.items():
        plan = next(iter(v["plans"].values()))
        for spec, r in plan["strategies"].items():
            rows.setdefault(spec, {})[str(n)] = {
                k: r[k] for k in ("predicted_ms", "measured_ms", "error", "predicted_bytes_per_rank_step",
                                  "measured_bytes_sent_per_rank_step")
            }  # fmt: skip
        rows.setdefault("compute only", {})[str(n)] = plan["compute_ms"]
    errors = [c["error"] for spec, r in rows.items() if spec != "compute only" for c in r.values()]
    errors = [e for e in errors if e is not None]
    return {
        "strategies": rows,
        "abs_error_median": statistics.median(abs(e) for e in errors) if errors else None,
        "error_range": [min(errors), max(errors)] if errors else None,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--sizes", default="2,3,4")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--strategies", default=DEFAULT)
    p.add_argument("--workload", default="fmnist-cnn")
    p.add_argument("--work", default=None)
    ns = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import plan_validation

    out = Path(ns.out)
    work = Path(ns.work or tempfile.mkdtemp(prefix="plan-scale-"))
    cores = str(os.cpu_count() or 1)
    by_size: dict[int, dict[str, Any]] = {}
    for n in (int(s) for s in ns.sizes.split(",")):
        common = ["-w", ns.workload, "-n", str(n), "--rate", ns.rate, "-s", ns.strategies]
        plan_dir, bench_dir = work / f"plan-n{n}", work / f"bench-n{n}"
        lowband("plan", *common, "--shared-cores", cores, "--out", str(plan_dir))
        lowband(
            "bench", *common, "--rounds", "2", "--steps-per-round", "10", "--out", str(bench_dir), "--force"
        )
        target = out / f"validation-n{n}.json"
        plan_validation.main([str(plan_dir), str(bench_dir), str(target)])
        by_size[n] = json.loads(target.read_text())
    summary = {"rate": ns.rate, "workload": ns.workload, "shared_cores": int(cores), **summarise(by_size)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("abs_error_median", "error_range")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
