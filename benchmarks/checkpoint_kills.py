"""Twenty kills, checkpoints never torn: a 4-rank run on the testbed with the documented checkpoint loop
under ``lowband run --max-restarts``, in which a rank SIGKILLs itself once per attempt
(``benchmarks/_ckpt_kill_rank.py``: during a backward, half-way through writing its checkpoint file,
or between writing the manifest and renaming it), then the same run undisturbed.

Checked and reported:

- every attempt resumed from the newest complete set on disk when it started (``complete_sets``);
- every set left on disk with a manifest is complete: each rank's file has the manifest's size and
  SHA-256 and loads with ``weights_only=True`` (zero torn or unloadable sets);
- the final parameters of every rank equal the undisturbed run's, bit for bit;
- per kill, the time from the death to every rank resumed (new processes started, checkpoint loaded).

Usage::

    python benchmarks/checkpoint_kills.py --out benchmarks/results/checkpoint-kills/gpt-100mbit [--kills 20]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "_ckpt_kill_rank.py"


def _run(out: Path, ns: argparse.Namespace, kills: int) -> float:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "lowband.cli", "run", "-n", str(ns.ranks), "--rate", ns.rate,
        "--max-restarts", str(kills), "--log-dir", str(out / "logs"), str(SCRIPT), "--out", str(out),
        "-s", ns.strategy, "-w", ns.workload, "--steps", str(ns.steps), "--every", str(ns.every),
        "--kills", str(kills), "--seed", str(ns.seed),
    ]  # fmt: skip
    began = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.run_timeout)
    took = time.monotonic() - began
    (out / "stderr.txt").write_text(proc.stderr)
    print(f"  {kills} kills planned: exit {proc.returncode} in {took:.0f} s", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"lowband run failed; see {out / 'stderr.txt'}")
    return took


def _sets(folder: Path) -> dict[str, Any]:
    """Every set folder on disk: complete and loadable, or why not."""
    out: dict[str, Any] = {}
    for d in sorted(folder.iterdir()):
        man_path = d / "manifest.json"
        if not man_path.exists():
            out[d.name] = "no manifest (an interrupted save: never loaded)"
            continue
        man = json.loads(man_path.read_text())
        problems = []
        for f in man["files"]:
            p = d / f["file"]
            if not p.exists() or p.stat().st_size != f["bytes"]:
                problems.append(f"{f['file']}: missing or wrong size")
                continue
            if hashlib.sha256(p.read_bytes()).hexdigest() != f["sha256"]:
                problems.append(f"{f['file']}: SHA-256 differs")
                continue
            torch.load(p, weights_only=True)
        out[d.name] = "complete, every file loads" if not problems else "TORN: " + "; ".join(problems)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("-s", "--strategy", default="localsgd:period=20")
    ap.add_argument("-w", "--workload", default="shakespeare-gpt")
    ap.add_argument("-n", "--ranks", type=int, default=4)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-timeout", type=float, default=1800.0)
    ap.add_argument("--keep-files", action="store_true", help="keep the checkpoint sets and final parameters")
    ns = ap.parse_args()
    killed_s = _run(ns.out / "killed", ns, ns.kills)
    whole_s = _run(ns.out / "undisturbed", ns, 0)

    attempts = [json.loads(line) for line in (ns.out / "killed" / "attempts.jsonl").read_text().splitlines()]
    kills = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (ns.out / "killed").glob("kill-*.json")
    }
    resumed_wrong = [
        a for a in attempts if a["resumed"] != (a["complete_sets"][0] if a["complete_sets"] else 0)
    ]
    recoveries = []
    for a, k in sorted(kills.items()):
        nxt = [x for x in attempts if x["attempt"] == a + 1]
        if nxt:
            all_resumed = max(x["resumed_at"] for x in nxt) - k["time"]
            recoveries.append(
                {**k, "attempt": a, "resumed_step": nxt[0]["resumed"], "all_resumed_s": all_resumed}
            )
    sets = _sets(ns.out / "killed" / "ckpt")
    torn = [n for n, v in sets.items() if v.startswith("TORN")]
    equal = []
    for r in range(ns.ranks):
        a = torch.load(ns.out / "killed" / f"final-rank{r}.pt", weights_only=True)
        b = torch.load(ns.out / "undisturbed" / f"final-rank{r}.pt", weights_only=True)
        equal.append(all(torch.equal(x, y) for x, y in zip(a, b, strict=True)))
    where = {
        w: sum(1 for k in kills.values() if k["where"] == w) for w in ("backward", "rank-file", "manifest")
    }
    rec = sorted(x["all_resumed_s"] for x in recoveries)
    result = {
        "config": {k: str(v) for k, v in vars(ns).items()},
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "kills": len(kills),
        "kills_by_where": where,
        "attempts": len({a["attempt"] for a in attempts}),
        "resumed_not_from_newest": resumed_wrong,
        "sets_on_disk": sets,
        "torn_sets": torn,
        "final_equal_per_rank": equal,
        "recoveries": recoveries,
        "all_resumed_s": {"min": rec[0], "median": rec[len(rec) // 2], "max": rec[-1]} if rec else None,
        "run_s": {"killed": killed_s, "undisturbed": whole_s},
    }
    if not ns.keep_files:  # the checkpoints and final parameters (~130 MB) were only needed for the checks
        for run in ("killed", "undisturbed"):
            shutil.rmtree(ns.out / run / "ckpt", ignore_errors=True)
            for pt in (ns.out / run).glob("final-rank*.pt"):
                pt.unlink()
    (ns.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"kills: {len(kills)} ({where['backward']} in a backward, {where['rank-file']} inside a rank's checkpoint "
        f"file, {where['manifest']} between the manifest's write and rename), {result['attempts']} attempts",
        f"attempts that did not resume from the newest complete set: {len(resumed_wrong)}",
        f"sets on disk: {len(sets)}, torn or unloadable: {len(torn)}",
        f"final parameters equal to the undisturbed run's, bit for bit: {sum(equal)} of {len(equal)} ranks",
    ]
    if rec:
        lines.append(
            f"death -> every rank resumed: median {rec[len(rec) // 2]:.1f} s, range {rec[0]:.1f}-{rec[-1]:.1f} s"
        )
    lines.append(f"run time: {killed_s:.0f} s with the kills, {whole_s:.0f} s undisturbed")
    text = "\n".join(lines) + "\n"
    (ns.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
