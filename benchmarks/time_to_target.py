"""Time to a target loss from a ``lowband bench`` run: the target is the baseline's training loss
(10-step moving mean) after a fraction of its steps (default DDP after 60 %), and each strategy's
time is its summed step times until its own 10-step mean first reaches it (evaluation excluded).

Usage::

    python benchmarks/time_to_target.py benchmarks/results/diloco/gpt-100mbit [--baseline ddp] [--fraction 0.6]
    python benchmarks/time_to_target.py OUT --target 2.1184   # a run without the baseline: its target given

Prints a table and writes ``time_to_target.json`` into the run's folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TORCH = ("ddp", "ddp:hook=fp16", "powersgd", "localsgd")  # torch's own strategies (prefixes)


def _series(run: dict[str, Any]) -> tuple[list[float], list[float]]:
    losses, times, t = [], [], 0.0
    for seg in sorted(run["segments"], key=lambda s: s["first_step"]):
        for st, lo in zip(seg["step_times"], seg["loss"], strict=True):
            t += st
            losses.append(lo)
            times.append(t)
    return losses, times


def _smooth(x: list[float], w: int = 10) -> list[float]:
    return [sum(x[max(0, i - w + 1) : i + 1]) / len(x[max(0, i - w + 1) : i + 1]) for i in range(len(x))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a lowband bench output folder (results.json)")
    ap.add_argument("--baseline", default="ddp")
    ap.add_argument("--fraction", type=float, default=0.6)
    ap.add_argument(
        "--target", type=float, help="the target loss itself (e.g. the baseline's in another run)"
    )
    ns = ap.parse_args()
    runs = json.loads((ns.run / "results.json").read_text())["raw"]["runs"]
    if ns.target is not None:
        target, baseline, fraction = ns.target, None, None
        print(f"target: {target:.4f} (given)")
    else:
        baseline, fraction = ns.baseline, ns.fraction
        if baseline not in runs:
            ap.error(
                f"{ns.run}: no run of the baseline {baseline!r} (give --baseline, or the target with --target)"
            )
        base = _smooth(_series(runs[baseline])[0])
        k = max(0, int(fraction * len(base)) - 1)
        target = base[k]
        print(f"target: {baseline}'s 10-step mean training loss at step {k + 1} of {len(base)}: {target:.4f}")
    out: dict[str, Any] = {"baseline": baseline, "fraction": fraction, "target": target, "strategies": {}}
    for name, run in runs.items():
        if name == "compute-only":
            continue
        losses, times = _series(run)
        s = _smooth(losses)
        hit = next((i for i, v in enumerate(s) if v <= target), None)
        out["strategies"][name] = {
            "seconds": None if hit is None else times[hit],
            "step": None if hit is None else hit + 1,
            "final_loss": s[-1],
        }
        got = "not reached" if hit is None else f"{times[hit]:7.1f} s at step {hit + 1}"
        print(f"  {name[:80]:80s} {got}; final 10-step loss {s[-1]:.4f}")
    reached = {n: v["seconds"] for n, v in out["strategies"].items() if v["seconds"] is not None}
    torch_reached = [(s, n) for n, s in reached.items() if n.startswith(TORCH)]
    others = [(s, n) for n, s in reached.items() if not n.startswith(TORCH)]
    if torch_reached and others:  # (else no ratio: the strategies that reached it are listed above)
        torch_best, best = min(torch_reached), min(others)
        out["best_torch"], out["best_other"] = torch_best[1], best[1]
        out["speedup_vs_best_torch"] = torch_best[0] / best[0]
        print(
            f"best of torch's: {torch_best[1]} {torch_best[0]:.1f} s; best other: {best[1]} {best[0]:.1f} s; "
            f"{torch_best[0] / best[0]:.2f}x sooner"
        )
    (ns.run / "time_to_target.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
