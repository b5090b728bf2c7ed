"""Six families of adversarial probes of the README's "Nothing silent" guarantees, as real multi-process runs.

Each family's cases run on ranks started by ``lowband run`` (lowband's launcher: real processes, so
gloo aborts, hangs and exit times are real), watched with a per-probe wall-clock bound, and each
probe is classified from its ranks' reports and the launch's exit status and stderr
(:mod:`benchmarks.probes.classify`):

- ``ok-error``: the expected clear lowband error on every rank, naming what the issue demands;
- ``ok-trained``: trained, and as expected (parameters moved after a skipped step, the tie kept, the
  checkpoint restored or its residuals' sums kept, ...);
- ``SILENT``: a rank trained on with corrupt or diverged state and no error;
- ``GLOO-ABORT``: a rank died of SIGABRT, or ``EnforceNotMet`` in its output;
- ``HANG``: past the per-probe bound (killed);
- ``WRONG-BLAME`` (family 6): the first rank named is not the killed or stopped one;
- ``SLOW-EXIT`` (family 6): named right, but a survivor took more than 1 s from raising to exiting;
- ``WRONG-ERROR``, ``NAN-MODEL``, ``CRASH``: an error, but not the expected one on every rank; the
  expected error but a non-finite model; a rank died another way.

Families: 1 training goes on after a non-finite step (skip); 2 tied weights; 3 ranks built with
different options; 4 checkpoints at another world size or options; 5 non-finite values (raise); 6 the
dead or stopped rank named first, survivors out within 1 s.

Usage::

    python benchmarks/probe_families.py --out DIR [--family N ...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.probes import cases as grid
from benchmarks.probes.common import OK, OUTCOMES, Case
from benchmarks.probes.orchestrate import Probe, Settings, run_batch, run_signal

#: communication timeout of families 1-5 (a peer left waiting raises after it) and of family 6 (a
#: stopped rank is found when its peers time out: the blame tests' 3 s)
COMM_TIMEOUT, SIGNAL_TIMEOUT = 30.0, 3.0


def plan(families: list[int], quick: bool, work: Path) -> list[tuple[str, list[Case]]]:
    """The batches to run, in order: ``(label, cases)``; a label ``signal`` is one launch per case."""
    names = grid.strategies(quick)
    batches: list[tuple[str, list[Case]]] = []
    for f in families:
        if f == 1:
            batches.append(("batch", grid.family1(names)))
        elif f == 2:
            batches.append(("batch", grid.family2(names)))
        elif f == 3:
            batches.append(("batch", grid.family3(names, quick)))
        elif f == 4:
            saves, loads = grid.family4(names, str(work / "checkpoints"))
            for c in saves:
                Path(c["folder"]).mkdir(parents=True, exist_ok=True)
            batches += [("batch", saves), ("batch", loads)]
        elif f == 5:
            batches.append(("batch", grid.family5(names, quick)))
        elif f == 6:
            batches.append(("signal", grid.family6(quick)))
    return batches


def run(families: list[int], quick: bool, work: Path, bound: float) -> list[Probe]:
    batches = plan(families, quick, work)
    total = sum(len(cs) for _, cs in batches)
    try:
        from tqdm import tqdm

        bar: Any = tqdm(total=total, unit="probe", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        bar = None
    count = [0]

    def done(p: Probe) -> None:
        count[0] += 1
        flag = "" if p.outcome in OK else f"  <-- {p.outcome}"
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"family {p.case['family']}: {p.case['id'][:40]}")
            if flag:
                bar.write(f"family {p.case['family']} {p.case['id']}: {p.outcome}: {p.detail[:200]}")
        else:
            print(
                f"[{count[0]}/{total}] family {p.case['family']} {p.case['id']}: {p.outcome}{flag}",
                flush=True,
            )

    st = Settings(work, COMM_TIMEOUT, bound, done)
    probes: list[Probe] = []
    for label, cs in batches:
        if label == "signal":
            probes += [run_signal(c, st, SIGNAL_TIMEOUT) for c in cs]
        else:
            probes += run_batch(cs, st)
    if bar is not None:
        bar.close()
    return probes


def summary(probes: list[Probe]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for p in probes:
        out.setdefault(str(p.case["family"]), Counter())[p.outcome] += 1  # type: ignore[index]
    return {f: dict(sorted(c.items())) for f, c in sorted(out.items())}


def delays(probes: list[Probe]) -> dict[str, Any]:
    values = [float(v) for p in probes for v in p.extra.get("exit_delays", {}).values()]
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_s": round(statistics.median(values), 3), "max_s": round(max(values), 3)}


def table(probes: list[Probe], wall: float) -> str:
    s = summary(probes)
    used = [o for o in OUTCOMES if any(o in c for c in s.values())]
    lines = ["| family | probes | " + " | ".join(used) + " |", "|---|---|" + "---|" * len(used)]
    for f, c in s.items():
        lines.append(f"| {f} | {sum(c.values())} | " + " | ".join(str(c.get(o, 0)) for o in used) + " |")
    d = delays(probes)
    lines += ["", f"Survivors' exit delay after raising (family 6): {d}", f"Wall time: {wall:.0f} s", ""]
    bad = [p for p in probes if p.outcome not in OK]
    lines.append(f"Not ok: {len(bad)}")
    for p in bad:
        lines.append(f"- family {p.case['family']}, {p.case['id']}: **{p.outcome}**: {p.detail[:500]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="writes probes.json and table.md here")
    ap.add_argument(
        "--family", type=int, action="append", choices=range(1, 7), help="only this family (repeatable)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="a few strategies, fewer options, one signalled strategy"
    )
    ap.add_argument(
        "--bound", type=float, default=120.0, help="per-probe wall-clock bound, seconds (a HANG past it)"
    )
    ap.add_argument("--work", type=Path, help="the launches' folders (default: a temporary one, kept)")
    ns = ap.parse_args(argv)
    families = sorted(set(ns.family or range(1, 7)))
    work = ns.work or Path(tempfile.mkdtemp(prefix="probe-families-"))
    t0 = time.monotonic()
    probes = run(families, ns.quick, work, ns.bound)
    wall = time.monotonic() - t0
    text = table(probes, wall)
    print(text)
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        data = {"command": " ".join(sys.argv), "families": families, "quick": ns.quick, "wall_s": round(wall, 1),
                "summary": summary(probes), "exit_delays": delays(probes), "probes": [p.row() for p in probes]}  # fmt: skip
        (ns.out / "probes.json").write_text(json.dumps(data, indent=1) + "\n")
        (ns.out / "table.md").write_text(text)
    print(f"launch folders: {work}", file=sys.stderr)
    return 0 if all(p.outcome in OK for p in probes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
