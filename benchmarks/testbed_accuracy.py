"""How closely the emulated links deliver their rates: the accuracy the unit tests only bound.

``sudo python benchmarks/testbed_accuracy.py OUT.json [--repeats 3]`` (root: network namespaces and tbf)
builds the same testbeds as ``tests/test_testbed.py``'s shaping tests and runs their helpers
(``tests/_testbed_probe.py``: one TCP stream per peer; ``tests/_testbed_worker.py``: timed gloo
allreduces of 16 MiB on 4 ranks at 100 Mbit/s), ``--repeats`` times each, and prints per case the
measured value against the rate (or the ring model's time): median, range, ratio. Run it on a quiet
machine; a loaded or CPU-stolen host shows up here as ratios well below 1 (the unit tests allow down to
``LOADED_HOST_FLOOR``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lowband.testbed import Layout, LinkSpec, Testbed

TESTS = Path(__file__).resolve().parent.parent / "tests"
PY = sys.executable


def _run(tb: Testbed, script: str, *args: str, timeout: float = 120) -> list[str]:
    procs = tb.spawn([PY, str(TESTS / script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    codes = tb.wait(procs, timeout=timeout, grace=5)
    if codes != [0] * len(procs):
        errs = [p.stderr.read().decode()[-1000:] for p in procs]  # type: ignore[union-attr]
        raise SystemExit(f"{script} {' '.join(args)}: exit codes {codes}: {errs}")
    return [p.stdout.read().decode().strip() for p in procs]  # type: ignore[union-attr]


def _tput(layout: Layout, nbytes: int) -> dict[str, float]:
    with Testbed(layout, mode="netns") as tb:
        outs = _run(tb, "_testbed_probe.py", "tput", "--bytes", str(nbytes), "--peers", "1,2")
    return {k: float(v) for k, v in json.loads(next(o for o in outs if o)).items()}


def _allreduce_s(reps: int) -> list[float]:
    with Testbed(Layout.flat(4, "100mbit"), mode="netns") as tb:
        res = [json.loads(o) for o in _run(tb, "_testbed_worker.py", "--mib", "16", "--reps", str(reps))]
    return [max(r["times"][i] for r in res) for i in range(reps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hetero = Layout(
        machines=(LinkSpec.of("100mbit", down="30mbit"), LinkSpec.of("100mbit"), LinkSpec.of("10mbit"))
    )
    two_tier = Layout.two_tier(2, 2, "50mbit", intra="200mbit")
    ring_s = 2 * 3 / 4 * 16 * 2**20 * 8 / 1e8
    samples: dict[str, list[float]] = {}
    expected = {"down 30 Mbit/s": 30.0, "up 10 Mbit/s": 10.0, "inter 50 Mbit/s": 50.0,
                "intra 200 Mbit/s": 200.0, "allreduce 16 MiB, 4 ranks, 100 Mbit/s (s)": ring_s}  # fmt: skip
    for k in range(args.repeats):
        print(f"repeat {k + 1}/{args.repeats}", flush=True)
        got = _tput(hetero, 2 << 20)
        samples.setdefault("down 30 Mbit/s", []).append(got["1"])
        samples.setdefault("up 10 Mbit/s", []).append(got["2"])
        got = _tput(two_tier, 4 << 20)
        samples.setdefault("inter 50 Mbit/s", []).append(got["2"])
        samples.setdefault("intra 200 Mbit/s", []).append(got["1"])
        samples.setdefault("allreduce 16 MiB, 4 ranks, 100 Mbit/s (s)", []).extend(_allreduce_s(5))
    rows: list[dict[str, Any]] = []
    print(f"{'case':44} {'expected':>9} {'median':>9} {'min':>9} {'max':>9} {'ratio':>6}")
    for case, xs in samples.items():
        med = statistics.median(xs)
        row = {"case": case, "expected": expected[case], "median": med, "min": min(xs), "max": max(xs),
               "ratio": med / expected[case], "n": len(xs)}  # fmt: skip
        rows.append(row)
        print(
            f"{case:44} {row['expected']:9.3f} {med:9.3f} {min(xs):9.3f} {max(xs):9.3f} {row['ratio']:6.3f}"
        )
    meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "repeats": args.repeats,
            "note": "Mbit/s of goodput for the probes (TCP, one stream); seconds for the allreduce "
                    "(slowest rank per repetition) against the ring model 2(n-1)/n*M at the rate"}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
