"""The non-finite check's cost, paired round by round, from a finished ``lowband bench`` run.

The bench alternates its strategies round by round, so a strategy with the check on (``S``) and the
same one with ``S:on_nonfinite=off`` train side by side in every round. Their medians over the run
move with the machine's noise by more than the check costs; this script divides each timed round's
mean step time (every step and the synchronize() tail, as the bench counts) with the check on by the
same round's with it off, and prints the median and range of those ratios per strategy.

Usage::

    lowband bench -w fmnist-cnn -n 4 --rate 1gbit --rounds 9 --steps-per-round 20 \\
      -s "ddp+ddp:on_nonfinite=off+stage+stage:on_nonfinite=off+compressed+compressed:on_nonfinite=off" \\
      --out DIR
    python benchmarks/nonfinite_paired.py DIR [DIR...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

OFF = ":on_nonfinite=off"


def round_means(run: dict[str, Any]) -> list[float]:
    """Each timed round's mean step time in seconds (the first round is the bench's untimed one)."""
    return [(sum(s["step_times"]) + s["sync_tail"]) / len(s["step_times"]) for s in run["segments"]][1:]


def paired(folder: Path) -> dict[str, tuple[float, float, float]]:
    """Per strategy with an ``on_nonfinite=off`` twin: median, min and max of on/off per round."""
    runs = json.loads((folder / "results.json").read_text())["raw"]["runs"]
    out = {}
    for name in runs:
        if name.endswith(OFF) or name + OFF not in runs:
            continue
        ratios = [a / b for a, b in zip(round_means(runs[name]), round_means(runs[name + OFF]), strict=True)]
        out[name] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="lowband bench --out folders")
    args = ap.parse_args()
    for folder in args.folders:
        parts = [f"{n} {m:.3f} [{lo:.3f}-{hi:.3f}]" for n, (m, lo, hi) in paired(folder).items()]
        print(f"{folder}: check on / off per round, median [min-max]: " + "; ".join(parts))


if __name__ == "__main__":
    main()
